"""The parts the sharded training state (parallel.shard=grads / params, rlalign.train.sharding and weight_shards) rests
on, in one process:
the ranges cover every element once, AdamW stepped range by range at any offsets gives the whole step's bits, and
the global gradient norm built from per-tensor parts is torch's (and the fixed-order one) bit for bit."""

import math
import re
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlalign.configlib import ConfigError, load_config
from rlalign.contract.errors import RLAlignError
from rlalign.distributed.data_parallel import FlatShards
from rlalign.distributed.launch import Group
from rlalign.reductions import global_norm
from rlalign.models.config import ModelConfig
from rlalign.models.sizes import parameter_shapes
from rlalign.models.batch import ForwardBatch
from rlalign.models.testing import tiny_hf_config, tiny_model
from rlalign.train.budget import memory_budget
from rlalign.train.config import TrainConfig
from rlalign.train.engines import _engine_config, weights_path
from rlalign.train.layer_recompute import recompute_layers
from rlalign.train.master import adamw_groups, step_chunked
from rlalign.train.parallel import norm_from_parts, norm_mode, norm_part, policy_weights, total_norm
from rlalign.train.run.checkpoint_files import (CheckpointCorrupt, load_part, note_pending_parts, part_in_the_way,
                                                read_manifest, save_checkpoint, save_part)
from rlalign.train.run.directory import open_run_dir, previous_run_files
from rlalign.train.sharding import ShardedMaster
from tests.bitwise import assert_bitwise_equal
from tests.distributed.shard_workers import ADAMW, MAX_NORM, _backward, _model


@settings(max_examples=60, deadline=None)
@given(numels=st.lists(st.integers(0, 40), min_size=1, max_size=8), ranks=st.integers(1, 9))
def test_ranges_cover_every_element_once_in_order(numels, ranks):
    """Degenerate sizes included: empty parameters, fewer elements than ranks (empty ranges)."""
    shards = FlatShards(tuple(numels), ranks)
    sizes = [hi - lo for lo, hi in (shards.range(r) for r in range(ranks))]
    assert sum(sizes) == sum(numels) and max(sizes) - min(sizes) <= 1
    seen = []
    for r in range(ranks):
        lo, hi = shards.range(r)
        pieces = shards.pieces(r)
        assert sum(b - a for _, a, b in pieces) == hi - lo
        seen += [shards.offsets[i] + k for i, a, b in pieces for k in range(a, b)]
        assert all(0 <= a < b <= numels[i] for i, a, b in pieces)
    assert seen == list(range(sum(numels)))
    for i, n in enumerate(numels):   # segments: a parameter's owners, in rank order, covering it
        segs = shards.segments(shards.offsets[i], shards.offsets[i] + n)
        assert sum(hi - lo for _, lo, hi in segs) == n and [r for r, _, _ in segs] == sorted({r for r, _, _ in segs})


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 300), cuts=st.lists(st.integers(0, 300), max_size=5), dtype=st.sampled_from(["bf16", "fp32"]),
       steps=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_adamw_on_ranges_equals_the_whole_step(n, cuts, dtype, steps, seed):
    """A master stepped in ranges cut at any offsets (not aligned to any vector width) has the bits of the whole
    tensor's step, the rounded weight too: the elementwise claim the sharded step relies on."""
    gen = torch.Generator().manual_seed(seed)
    model_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    weight = (torch.randn(n, generator=gen) * 0.05).to(model_dtype)
    grads = [(torch.randn(n, generator=gen) * 1e-2).to(model_dtype) for _ in range(steps)]
    bounds = sorted({0, n, *(c % (n + 1) for c in cuts)})
    spans = list(zip(bounds, bounds[1:]))

    def run(ranges):
        w = weight.clone()
        masters = [w[a:b].float().clone() for a, b in ranges]
        opt = torch.optim.AdamW(masters, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, foreach=False)
        groups = adamw_groups(opt, masters)
        for g in grads:
            pieces = [g[a:b].clone() for a, b in ranges]
            for k, (a, b) in enumerate(ranges):
                step_chunked(opt.state[masters[k]], groups[id(masters[k])], masters[k], pieces, k, w[a:b], 7, "w")
        return w, torch.cat(masters), torch.cat([opt.state[m]["exp_avg_sq"] for m in masters])

    whole, ranged = run([(0, n)]), run(spans)
    for a, b, what in zip(whole, ranged, ("weight", "master", "exp_avg_sq")):
        assert_bitwise_equal(b, a, what)


_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@settings(max_examples=60, deadline=None)
@given(tensors=st.lists(st.tuples(st.integers(0, 500), st.sampled_from(list(_DTYPES)), st.floats(1e-3, 1e3)),
                        min_size=1, max_size=10), seed=st.integers(0, 2**16))
def test_norm_from_per_tensor_parts_is_torchs_and_the_fixed_ones(tensors, seed):
    """Mixed dtypes (torch groups them by dtype in its own order), empty tensors, scales spanning 1e6."""
    gen = torch.Generator().manual_seed(seed)
    grads = [(torch.randn(n, generator=gen) * scale).to(_DTYPES[d]) for n, d, scale in tensors]
    want = torch.nn.utils.get_total_norm(grads, foreach=False)
    # total_norm takes the fixed order in the cross-machine mode (CPU tensors), torch's otherwise
    assert_bitwise_equal(total_norm(grads), global_norm(grads) if norm_mode(grads) == "fixed" else want, "total_norm")
    assert_bitwise_equal(norm_from_parts([norm_part(g, "torch") for g in grads], "torch"), want, "torch parts")
    assert_bitwise_equal(norm_from_parts([norm_part(g, "fixed") for g in grads], "fixed"), global_norm(grads), "fixed")


@pytest.mark.parametrize("extra, match", [
    ([], "set parallel.dp >= 2"),
    (["parallel.dp=2", "parallel.tp=1"], "parallel.shard=grads with parallel.tp is not supported yet"),
    (["parallel.dp=2", "optim.offload=true"], "with optim.offload=true is not supported yet"),
    (["parallel.dp=2", "rollout.async_steps=1"], "with rollout.async_steps > 0 is not supported yet"),
    (["parallel.dp=2", "algo.advantage=gae"], "the PPO value model"),
])
def test_unsupported_combinations_are_refused_in_one_line(extra, match):
    with pytest.raises(ConfigError, match=match) as info:
        load_config(TrainConfig, None, ["parallel.shard=grads", *extra])
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("extra, match", [
    ([], "parallel.shard=params splits the training state over the data-parallel ranks: set parallel.dp >= 2"),
    (["parallel.dp=2", "parallel.tp=1"], "parallel.shard=params with parallel.tp is not supported yet"),
    (["parallel.dp=2", "optim.offload=true"], "parallel.shard=params with optim.offload=true"),
    (["parallel.dp=2", "rollout.async_steps=1"], "parallel.shard=params with rollout.async_steps > 0"),
    (["parallel.dp=2", "algo.advantage=gae"], "parallel.shard=params with the PPO value model"),
    (["parallel.dp=2", "model.lora.rank=4"], "parallel.shard=params with model.lora"),
    (["parallel.dp=2", "rollout.decode_graphs=on"], "parallel.shard=params with rollout.decode_graphs=on"),
    (["parallel.dp=2", "run.verify_behaviour=true"], "parallel.shard=params with run.verify_behaviour"),
])
def test_sharded_weights_refuse_what_they_cannot_run_with_in_one_line(extra, match):
    with pytest.raises(ConfigError, match=re.escape(match)) as info:
        load_config(TrainConfig, None, ["parallel.shard=params", *extra])
    assert "\n" not in str(info.value)


def test_sharded_weights_share_the_policys_tensors_with_the_engine_regathered():
    """The engine reads the policy's own tensors, gathered whole for each rollout (their storage moves: no address
    check, no CUDA-graph decode); rollout.share_weights=false keeps a copy synced from the gathered weights."""
    cfg = load_config(TrainConfig, None, ["parallel.dp=2", "parallel.shard=params"])
    path = weights_path(cfg)
    assert path.shared and path.regathered and "gathered whole" in path.describe()
    assert _engine_config(cfg, tiny_model("qwen3", seed=0)).decode_graphs == "off"
    copy = weights_path(load_config(TrainConfig, None, ["parallel.dp=2", "parallel.shard=params",
                                                        "rollout.share_weights=false"]))
    assert not copy.shared and not copy.regathered
    assert not weights_path(load_config(TrainConfig, None, ["parallel.dp=2", "parallel.shard=grads"])).regathered


def test_shard_values():
    assert load_config(TrainConfig, None, ["parallel.dp=2", "parallel.shard=grads"]).parallel.shard == "grads"
    assert load_config(TrainConfig, None, ["parallel.dp=2", "parallel.shard=grads", "model.lora.rank=4"]).model.lora.rank
    assert load_config(TrainConfig, None, []).parallel.shard == "none"
    with pytest.raises(ConfigError, match="parallel.shard"):
        load_config(TrainConfig, None, ["parallel.dp=2", "parallel.shard=optimizer"])


def test_budget_divides_the_sharded_state_by_dp():
    """rlalign.train.budget: with parallel.shard=grads the masters and AdamW rows are this rank's ceil(P / dp)."""
    model = ModelConfig.from_hf_dict(tiny_hf_config("qwen3"))
    rows = {}
    for shard in ("none", "grads"):
        cfg = load_config(TrainConfig, None, ["parallel.dp=4", f"parallel.shard={shard}", "model.dtype=bfloat16"])
        rows[shard] = {r.component: r.nbytes for r in memory_budget(cfg, model)}
    p = rows["none"]["fp32 master weights"] // 4
    assert rows["grads"]["fp32 master weights"] == 4 * -(-p // 4)
    assert rows["grads"]["AdamW m, v (fp32)"] == 8 * -(-p // 4) and rows["none"]["AdamW m, v (fp32)"] == 8 * p
    assert rows["grads"]["policy gradients"] == rows["none"]["policy gradients"]
    files = max(cfg.run.keep_checkpoints, 2)   # the main file also holds the bf16 weights (2 bytes each)
    assert rows["grads"]["checkpoint files"] == rows["none"]["checkpoint files"] + files * 2 * p


@pytest.mark.parametrize("dp", [2, 3, 4, 8])
def test_budget_divides_the_weights_by_dp_with_sharded_weights(dp):
    """parallel.shard=params: the policy weights row is this rank's ceil(P / dp) x 2 B, plus a row of what is
    gathered whole (the rest of the weights for a rollout on the shared tensors; with the engine's own copy, everything
    outside the decoder layers and two of the largest layer); the rest as shard=grads."""
    model = ModelConfig.from_hf_dict(tiny_hf_config("qwen3"))
    rows = {}
    for shard in ("grads", "params"):
        cfg = load_config(TrainConfig, None, [f"parallel.dp={dp}", f"parallel.shard={shard}", "model.dtype=bfloat16"])
        rows[shard] = {r.component: r.nbytes for r in memory_budget(cfg, model)}
    p = rows["grads"]["policy weights"] // 2
    assert rows["params"]["policy weights"] == 2 * -(-p // dp)
    layer = sum(math.prod(shape) for name, shape in parameter_shapes(model) if name.startswith("model.layers.0."))
    outer = sum(math.prod(shape) for name, shape in parameter_shapes(model) if not name.startswith("model.layers."))
    # the engine reads the policy's tensors: the rest of the weights gathered whole for each rollout
    assert rows["params"]["gathered weights"] == max(2 * (p - -(-p // dp)), 2 * (outer + 2 * layer))
    assert rows["params"]["rollout engine weights"] == 0
    cfg = load_config(TrainConfig, None, [f"parallel.dp={dp}", "parallel.shard=params", "model.dtype=bfloat16",
                                          "rollout.share_weights=false"])
    copied = {r.component: r.nbytes for r in memory_budget(cfg, model)}
    assert copied["gathered weights"] == 2 * (outer + 2 * layer) and copied["rollout engine weights"] == 2 * p
    for key in ("fp32 master weights", "AdamW m, v (fp32)", "policy gradients", "checkpoint files"):
        assert rows["params"][key] == rows["grads"][key], key


@pytest.mark.parametrize("recompute", [False, True])
def test_sharded_weights_in_one_process_step_like_the_grads_sharded_state(recompute):
    """In one process (a group of one: each gather copies the rank's own range back) the lifecycle alone -- layer
    hooks, release after forward, gather again for backward (with optim.activation_checkpointing: for the
    recomputed forward too), the embeddings and head for the step -- gives the bits of parallel.shard=grads, and
    between steps no decoder layer, embedding or head is held whole."""

    def run(shard_params: bool):
        model = _model("qwen3", "bfloat16")
        if recompute:
            recompute_layers(model)
        master = ShardedMaster(model, Group.single(), enabled=True, shard_params=shard_params)
        optimizer = torch.optim.AdamW(master.optim_params(), **ADAMW)
        norms = []
        for step in range(2):
            optimizer.zero_grad(set_to_none=True)
            _backward(model, Group.single(), step)
            master.reduce_gradients()
            norms.append(master.clip(MAX_NORM))
            master.step(optimizer)
        return model, master, norms

    plain, _, want = run(False)
    model, master, got = run(True)
    for k, (a, b) in enumerate(zip(got, want)):
        assert_bitwise_equal(a, b, f"grad norm {k}")
    whole = policy_weights(model)
    for name, p in plain.named_parameters():
        assert_bitwise_equal(whole[name], p.detach(), name)
    assert all(p.untyped_storage().size() == 0 for p in model.parameters())   # released between steps
    assert master.weights.held_bytes() == sum(p.numel() * p.element_size() for p in model.parameters())


def _part(run: Path, step: int, rank: int) -> tuple[str, str]:
    """A part file written as a sharded save writes one (pending noted before the rename)."""
    noted = {}
    name, sha = save_part(run, step, rank, {"pieces": [[0, rank, rank + 1]]}, lambda named: noted.update([named]))
    assert noted == {name: sha}
    return name, sha


def test_checkpoint_parts_are_recorded_deleted_and_proved_like_checkpoints(tmp_path):
    """A sharded checkpoint's parts (one per rank) are recorded in latest.json with their main file, deleted with
    it (run.keep_checkpoints), removed by run.overwrite, and never replaced; parts a kill left renamed but
    unrecorded are proved by pending.json's sha256 and removed at the next start, a foreign file never."""
    run = tmp_path / "run"
    ckpt = run / "checkpoints"
    for step in (1, 2, 3):
        parts = dict(_part(run, step, r) for r in range(2))
        note_pending_parts(run, parts)
        save_checkpoint(run, step, {"step": step}, keep=2, parts=parts)
    assert sorted(p.name for p in ckpt.glob("step_*")) == [
        "step_000002.pt", "step_000002.rank0.pt", "step_000002.rank1.pt",
        "step_000003.pt", "step_000003.rank0.pt", "step_000003.rank1.pt"]
    manifest = read_manifest(ckpt / "latest.json")
    assert sorted(manifest["parts"]) == ["step_000002.pt", "step_000003.pt"]
    assert load_part(run, "step_000003.rank1.pt", manifest["parts"]["step_000003.pt"]["step_000003.rank1.pt"])["pieces"]
    with pytest.raises(CheckpointCorrupt, match="sha256"):
        load_part(run, "step_000003.rank1.pt", "0" * 64)
    assert part_in_the_way(run, 3, 2) and part_in_the_way(run, 4, 2) is None
    # killed after the parts of step 4 were renamed into place, before latest.json: proved and removed at start
    parts = dict(_part(run, 4, r) for r in range(2))
    note_pending_parts(run, parts)
    (ckpt / "step_000005.rank0.pt").write_bytes(b"a user's file")   # named like a part, never noted: stays
    (ckpt / ".step_000004.rank1.pt.abc123.tmp").write_bytes(b"half")
    handle = open_run_dir(run, resume=True, overwrite=False, last_step=4)
    handle.release()
    assert sorted(handle.removed) == ["checkpoints/.step_000004.rank1.pt.abc123.tmp",
                                      "checkpoints/step_000004.rank0.pt", "checkpoints/step_000004.rank1.pt"]
    assert (ckpt / "step_000005.rank0.pt").exists()
    (ckpt / "step_000005.rank0.pt").unlink()
    doomed = sorted(p.name for p in previous_run_files(run) if p.parent == ckpt)
    assert doomed == ["latest.json", "step_000002.pt", "step_000002.rank0.pt", "step_000002.rank1.pt",
                      "step_000003.pt", "step_000003.rank0.pt", "step_000003.rank1.pt"]


def test_a_layer_replaced_after_the_weights_were_sharded_is_refused_in_one_line():
    """The hooks sit on the layers found when the weights were sharded; a layer swapped in later would run on
    released weights: the next forward refuses it instead."""

    model = _model("qwen3", "bfloat16")
    ShardedMaster(model, Group.single(), enabled=True, shard_params=True)
    recompute_layers(model)
    with pytest.raises(RLAlignError, match="a decoder layer was replaced after its weights were sharded") as info:
        model.forward_hidden(ForwardBatch.packed([[3, 4, 5]]))
    assert "\n" not in str(info.value)


_FAMILY_EXTRA = {"llama": {}, "qwen2": {}, "qwen3": {},
                 "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)}


@settings(max_examples=8, deadline=None)
@given(family=st.sampled_from(sorted(_FAMILY_EXTRA)), dtype=st.sampled_from(["float32", "bfloat16"]),
       layers=st.integers(1, 3), tied=st.booleans(), recompute=st.booleans(),
       lengths=st.lists(st.integers(1, 12), min_size=1, max_size=3))
def test_sharded_weights_lifecycle_over_families_and_shapes(family, dtype, layers, tied, recompute, lengths):
    """One process, one step over ``lengths`` micro-batches (single tokens included): untied heads, qkv biases (the
    stacked q/k/v no longer adjacent), MoE layers, fp32 weights without masters (the optimizer steps the rank's own
    weight range) and bf16 with masters -- parallel.shard=params gives parallel.shard=grads' bits."""

    def run(shard_params: bool):
        model = tiny_model(family, seed=5, dtype=dtype, init_std=0.1, num_hidden_layers=layers, hidden_size=32,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=64,
                           vocab_size=320, tie_word_embeddings=tied, **_FAMILY_EXTRA[family]).train()
        if recompute:
            recompute_layers(model)
        master = ShardedMaster(model, Group.single(), enabled=True, shard_params=shard_params)
        optimizer = torch.optim.AdamW(master.optim_params(), lr=1e-2, foreach=False)
        gen = torch.Generator().manual_seed(len(lengths))
        for n in lengths:
            ids = torch.randint(3, 320, (n,), generator=gen).tolist()
            lp, ent = model.logprobs(ForwardBatch.packed([ids]), torch.tensor(ids[1:] + [0]), with_entropy=True)
            (-(lp.sum() + 0.1 * ent.sum())).backward()
        master.reduce_gradients()
        norm = master.clip(1.0)
        master.step(optimizer)
        return norm, policy_weights(model)

    (want_norm, want), (got_norm, got) = run(False), run(True)
    assert_bitwise_equal(got_norm, want_norm, "grad norm")
    assert set(got) == set(want)
    for name in want:
        assert_bitwise_equal(got[name], want[name], name)
