"""Where strict forwards look for NaN/inf (rlalign.ops._checks: PER_OP on the CPU, BOUNDARY on GPUs).

BOUNDARY checks a forward's final hidden rows, the keys written to the KV cache / attended in a packed
forward, and router logits; every other non-finite value must propagate to the final hidden rows. These
tests force BOUNDARY on the CPU (what CUDA runs by default), plant NaN/inf in weights, the KV cache and
op inputs, and require an error that says how to localize; PER_OP (RLALIGN_CHECKS=per-op) names the op and
the decoder layer. The CPU's strict attention also checks its scores itself, so the attention-specific
propagation argument is exercised on CUDA (tests/cuda/test_cuda_check_policy.py).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from rlalign import ops
from rlalign.contract.errors import ContractError
from rlalign.envvars import EnvVarError
from rlalign.ops import _checks as chk
from rlalign.models.layout import checkpoint_tensors
from rlalign.models.testing import tiny_model
from rlalign.rollout import RolloutConfig, RolloutEngine, SamplingParams
from tests.rollout.test_engine_bitwise import make_prompts

LOCALIZE = r"RLALIGN_CHECKS=per-op"


def test_policy_defaults_env_and_override(monkeypatch):
    monkeypatch.delenv(chk.CHECKS_ENV, raising=False)
    assert chk.check_policy("cpu") == chk.PER_OP
    assert chk.check_policy(torch.device("cuda")) == chk.BOUNDARY
    monkeypatch.setenv(chk.CHECKS_ENV, "boundary")
    assert chk.check_policy("cpu") == chk.BOUNDARY
    monkeypatch.setenv(chk.CHECKS_ENV, "per-op")
    assert chk.check_policy("cuda") == chk.PER_OP
    with ops.use_check_policy("boundary"):
        assert chk.check_policy("cpu") == chk.BOUNDARY
    assert chk.check_policy("cpu") == chk.PER_OP
    monkeypatch.setenv(chk.CHECKS_ENV, "sometimes")
    with pytest.raises(EnvVarError, match="RLALIGN_CHECKS='sometimes' is not allowed: it must be per-op, boundary or auto"):
        chk.check_policy("cpu")
    with pytest.raises(ContractError, match="check policy must be"):
        with ops.use_check_policy("never"):
            pass


def test_boundary_policy_skips_propagating_sites_and_keeps_the_boundary():
    x = torch.randn(4, 8)
    x[1, 2] = float("nan")
    w = torch.randn(3, 8)
    with ops.use_check_policy("boundary"):
        out = ops.linear(x, w)                       # not a boundary site: no check, NaN propagates
        assert not bool(torch.isfinite(out).all())
        with pytest.raises(ContractError, match=rf"logprob_entropy: hidden contains NaN or inf .*{LOCALIZE}"):
            ops.logprob_entropy(out, torch.randn(5, 3), torch.zeros(4, dtype=torch.int64))
        with pytest.raises(ContractError, match=rf"lm_logits: hidden contains NaN or inf .*{LOCALIZE}"):
            ops.lm_logits(out, torch.randn(5, 3))
    with pytest.raises(ContractError, match=r"linear: x contains NaN or inf \(first at index \[1, 2\].*outside"):
        ops.linear(x, w)                             # per-op (the CPU default)


@pytest.mark.parametrize("policy", ["per-op", "boundary"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_keys_written_to_the_cache_are_checked_under_every_policy(policy, value):
    """A key with an inf element can score -inf, which softmax turns into an exact 0: it would vanish."""
    k, v = torch.randn(3, 2, 4), torch.randn(3, 2, 4)
    k[2, 1, 3] = value
    kc, vc = torch.zeros(4, 2, 2, 4), torch.zeros(4, 2, 2, 4)
    slots = torch.tensor([0, 3, 5])
    with ops.use_check_policy(policy):
        with pytest.raises(ContractError, match="write_kv_cache: k contains NaN or inf"):
            ops.write_kv_cache(k, v, kc, vc, slots)
        assert not kc.any(), "the check runs before the copy"
        ops.write_kv_cache(k, v, kc, vc, slots, profile="native")   # native: no guarantee, no check
        q = torch.randn(6, 4, 4)
        with pytest.raises(ContractError, match="attention_varlen: k contains NaN or inf"):
            ops.attention_varlen(q, torch.cat([k, k]), torch.cat([v, v]), torch.tensor([0, 6], dtype=torch.int32))


def _generate(model, **config):
    engine = RolloutEngine(model, RolloutConfig(num_pages=64, **config))
    return engine.generate(make_prompts(1, count=3), SamplingParams(n=2, max_new_tokens=6, seed=3))


PLANTABLE = ["model.layers.{i}.input_layernorm.weight", "model.layers.{i}.self_attn.q_proj.weight",
             "model.layers.{i}.self_attn.k_proj.weight", "model.layers.{i}.self_attn.v_proj.weight",
             "model.layers.{i}.self_attn.q_norm.weight", "model.layers.{i}.self_attn.k_norm.weight",
             "model.layers.{i}.self_attn.o_proj.weight", "model.layers.{i}.post_attention_layernorm.weight",
             "model.layers.{i}.mlp.gate_proj.weight", "model.layers.{i}.mlp.up_proj.weight",
             "model.layers.{i}.mlp.down_proj.weight", "model.norm.weight"]


@pytest.fixture(scope="module")
def clean_model():
    return tiny_model("qwen3", seed=4, init_std=0.1)


@pytest.mark.parametrize("graphs", ["off", "padded"])
def test_a_clean_model_generates_under_the_boundary_policy(clean_model, graphs):
    with ops.use_check_policy("boundary"):
        got = _generate(clean_model, decode_graphs=graphs)
    assert len(got) == 6 and all(len(c.tokens) == 6 for c in got)


@settings(max_examples=30, deadline=None)
@given(name=st.sampled_from(PLANTABLE), layer=st.integers(0, 1), where=st.floats(0, 1, exclude_max=True),
       value=st.sampled_from([float("nan"), float("inf"), float("-inf")]),
       graphs=st.sampled_from(["off", "padded"]))
def test_a_value_planted_in_any_weight_stops_generation_under_the_boundary_policy(name, layer, where, value, graphs):
    model = tiny_model("qwen3", seed=4, init_std=0.1)
    param = dict(model.named_parameters())[name.format(i=layer)]
    flat = param.data.view(-1)
    with torch.no_grad():
        flat[int(where * flat.numel())] = value
    with ops.use_check_policy("boundary"), pytest.raises(ContractError, match="NaN or inf"):
        _generate(model, decode_graphs=graphs)


def test_a_value_planted_mid_generation_raises_at_the_next_decode_step():
    model = tiny_model("qwen3", seed=4, init_std=0.1)
    engine = RolloutEngine(model, RolloutConfig(num_pages=64, decode_graphs="padded"))
    for i, p in enumerate(make_prompts(2, count=3)):
        engine.add_request(p, SamplingParams(n=2, max_new_tokens=12, seed=1), prompt_index=i)
    with ops.use_check_policy("boundary"):
        while engine.counters["graph_steps"] == 0:
            engine.step()
        with torch.no_grad():
            model.model.layers[1].mlp.down_proj.weight[3, 7] = float("nan")
        with pytest.raises(ContractError, match=rf"hidden contains NaN or inf .*{LOCALIZE}"):
            engine.step()
    engine.abort_all()


def test_an_embedding_row_in_use_and_the_kv_cache_are_covered():
    model = tiny_model("qwen3", seed=4, init_std=0.1)
    prompts = make_prompts(1, count=3)
    with torch.no_grad():
        model.model.embed_tokens.weight[prompts[1][0], 5] = float("inf")
    with ops.use_check_policy("boundary"), pytest.raises(ContractError, match="NaN or inf"):
        RolloutEngine(model, RolloutConfig(num_pages=64)).generate(prompts, SamplingParams(max_new_tokens=3))
    model = tiny_model("qwen3", seed=4, init_std=0.1)
    engine = RolloutEngine(model, RolloutConfig(num_pages=64))
    engine.add_request(prompts[0], SamplingParams(max_new_tokens=8))
    with ops.use_check_policy("boundary"):
        engine.step()                                            # prefill: the prompt's K/V are cached
        engine.kv_cache.v[0][:, 0] = float("nan")                # first slot of every page: inside the context
        with pytest.raises(ContractError, match="NaN or inf"):
            engine.step()


def test_per_op_policy_names_the_op_and_the_layer():
    model = tiny_model("qwen3", seed=4, init_std=0.1)
    with torch.no_grad():
        model.model.layers[1].self_attn.q_proj.weight[2, 1] = float("nan")
    with ops.use_check_policy("per-op"), pytest.raises(ContractError, match=r"rms_norm: x contains NaN .*in layers\.1\)"):
        _generate(model)     # q_norm (an rms_norm over head_dim) is the first op whose input holds the NaN


@pytest.mark.parametrize("where", ["router", "experts"])
def test_moe_router_and_expert_values_stop_generation_under_the_boundary_policy(where):
    """Top-k routing may not select a NaN logit (the router logits are a boundary site); an expert's value
    reaches the rows routed to it (planted in every expert, so some row is)."""
    model = tiny_model("qwen3_moe", seed=4, init_std=0.1, num_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=24)
    params = dict(checkpoint_tensors(model))     # per-expert views of the stacked experts
    with torch.no_grad():
        if where == "router":
            params["model.layers.0.mlp.gate.weight"][1, 3] = float("nan")
        else:
            for e in range(4):
                params[f"model.layers.1.mlp.experts.{e}.down_proj.weight"][2, 5] = float("inf")
    with ops.use_check_policy("boundary"), pytest.raises(ContractError, match="NaN or inf"):
        _generate(model)
