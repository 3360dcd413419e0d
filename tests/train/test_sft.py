"""rlalign sft: the response-only loss mask, chat rendering, packing invariance, resume, the output model, bad input."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from rlalign.cli.main import main
from rlalign.configlib import load_config
from rlalign.contract import use_profile
from rlalign.models.checkpoint import load_model
from rlalign.models.config import ModelConfig
from rlalign.models.decoder import CausalLM
from rlalign.tasks import ArithmeticTask
from rlalign.models.testing import make_tiny_checkpoint, tiny_model, write_tiny_tokenizer
from rlalign.models.tokenizer import load_tokenizer
from rlalign.train.layer_recompute import RecomputedLayer
from rlalign.train.packing import score_completions, scored_rows
from rlalign.train.parallel import clip_params_, norm_mode
from rlalign.train.pretrain import HabitCorpus, PretrainConfig, hf_config, pretrain
from rlalign.train.run.metrics import read_metrics
from rlalign.train.sft.config import DataSection, SFTConfig
from rlalign.train.sft.data import SFTDataError, chat_example, held_out_split, prompt_response_example, to_example
from rlalign.train.sft.loop import run_sft
from rlalign.train.sft.objective import Example, micro_batch_loss, pack, response_mask, token_logprobs
from rlalign.train.sft.update import batch_indices, build_update
from tests.bitwise import assert_bitwise_equal
from tests.train.conftest import make_arithmetic_checkpoint, tiny_overrides

FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def char_dir(tmp_path_factory):
    """The default model's character tokenizer (adds <bos>), on a small random model."""
    return make_arithmetic_checkpoint(tmp_path_factory.mktemp("sft_char") / "model")


@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory):
    """The tests' byte-level BPE tokenizer with its ChatML template (no BOS; eos <|im_end|>)."""
    d = tmp_path_factory.mktemp("sft_chat_tok")
    write_tiny_tokenizer(d)
    return load_tokenizer(d)


# ---- the loss mask -----------------------------------------------------------------------------------------------

@FAST
@given(prompt_len=st.integers(0, 12), response_len=st.integers(1, 12))
def test_response_mask_scores_every_response_token_with_a_predecessor(prompt_len, response_len):
    mask = response_mask(prompt_len, response_len)
    assert len(mask) == prompt_len + response_len
    assert [t for t, s in enumerate(mask) if s] == list(range(max(prompt_len, 1), prompt_len + response_len))


@FAST
@given(prompt=st.text("0123456789+=", max_size=8), response=st.text("0123456789", max_size=5))
def test_prompt_response_rows_score_the_response_and_eos_and_pack_as_the_trainer(char_dir, prompt, response):
    tok = load_tokenizer(char_dir)
    ex = prompt_response_example(tok, prompt, response, "row")
    scored = [t for t, s in zip(ex.tokens, ex.scored) if s]
    assert tok.decode(ex.tokens[:-len(scored)], skip_special_tokens=False) == "<bos>" + prompt   # BOS: never empty
    assert tok.decode(scored, skip_special_tokens=False) == response + "<eos>"                   # 1 token when empty
    # the rows and targets of the trainer's prompt/completion scoring, in a pack with another example
    other = prompt_response_example(tok, "1+2=", "3", "row 2")
    samples = [(list(e.tokens), len(e.tokens) - e.num_scored) for e in (other, ex)]
    p, (rows, targets) = pack([other, ex], "cpu"), scored_rows(samples, "cpu")
    assert torch.equal(p.rows, rows) and torch.equal(p.targets, targets)


def test_empty_prompt_without_bos_leaves_the_first_token_unscored(chat_tokenizer):
    ex = prompt_response_example(chat_tokenizer, "", "hello world", "row")
    assert not ex.scored[0] and all(ex.scored[1:]) and ex.tokens[-1] == chat_tokenizer.eos_token_ids[0]
    data = DataSection(path="x.jsonl")
    with pytest.raises(SFTDataError, match="row 3: no token to learn"):
        to_example(chat_tokenizer, {"prompt": "", "response": ""}, "prompt_response", data, "x.jsonl: row 3", 64)


# ---- chat messages ----------------------------------------------------------------------------------------------

WORDS = st.lists(st.sampled_from(["the", "sum", "is", "12", "+", "good", "answer", "?", "yes", "\n", " "]),
                 min_size=0, max_size=6).map("".join)


@FAST
@given(turns=st.lists(st.tuples(WORDS, WORDS), min_size=1, max_size=3), system=st.none() | WORDS)
def test_chat_mask_is_exactly_each_assistant_content_and_end_of_turn(chat_tokenizer, turns, system):
    """Rule: for each assistant turn, the tokens overlapping its content and the end-of-turn token <|im_end|>;
    nothing else (not the role header, not the newline ChatML writes after <|im_end|>, no system or user token).
    Only a content that starts with whitespace can share its first token with the header's newline."""
    messages = ([{"role": "system", "content": system}] if system is not None else []) + [
        m for user, answer in turns for m in ({"role": "user", "content": user}, {"role": "assistant", "content": answer})]
    ex = chat_example(chat_tokenizer, messages, "row")
    assert list(ex.tokens) == chat_tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    spans, current = [], []
    for token, scored in zip(ex.tokens, ex.scored):
        if scored:
            current.append(token)
        elif current:
            spans.append(current)
            current = []
    spans += [current] if current else []
    turns_at = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    assert len(spans) == len(turns_at)
    for span, i in zip(spans, turns_at):
        text, want = chat_tokenizer.decode(span, skip_special_tokens=False), messages[i]["content"] + "<|im_end|>"
        assert text.endswith(want), (text, want)
        merged = text[:len(text) - len(want)]
        head = chat_tokenizer.apply_chat_template(messages[:i], add_generation_prompt=True, tokenize=False)
        assert merged == "" or (head.endswith(merged) and messages[i]["content"][:1].isspace()), (merged, text)


# ---- packing invariance -----------------------------------------------------------------------------------------

@settings(max_examples=15, deadline=None)
@given(lengths=st.lists(st.tuples(st.integers(0, 6), st.integers(1, 6)), min_size=1, max_size=5), seed=st.integers(0, 99))
def test_packed_batch_equals_sequences_one_by_one(lengths, seed):
    """Per-token log-probs and the loss: bitwise (the strict ops do not depend on what else is packed). Gradients:
    a parameter's gradient sums over tokens, so the pack changes how the sum is grouped: equal to fp32 rounding."""
    model = _small_model()
    g = torch.Generator().manual_seed(seed)
    examples = []
    for p, r in lengths:
        p = max(p, 1)
        tokens = torch.randint(0, 300, (p + r,), generator=g).tolist()
        examples.append(Example(tuple(tokens), response_mask(p, r)))
    n = sum(e.num_scored for e in examples)
    packed = token_logprobs(model, pack(examples, "cpu"))
    single = torch.cat([token_logprobs(model, pack([e], "cpu")) for e in examples])
    assert_bitwise_equal(packed, single, "per-token log-probs, packed vs one by one")
    assert_bitwise_equal(micro_batch_loss(packed, n), micro_batch_loss(single, n), "loss")
    grads = []
    for parts in ([examples], [[e] for e in examples]):
        model.zero_grad(set_to_none=True)
        for part in parts:
            micro_batch_loss(token_logprobs(model, pack(part, "cpu")), n).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


_MODEL = {}


def _small_model():
    if "m" not in _MODEL:
        _MODEL["m"] = tiny_model("qwen3", seed=1, init_std=0.1, num_hidden_layers=1).train()
    return _MODEL["m"]


def test_batch_order_is_a_permutation_per_epoch_and_a_function_of_the_step():
    rows, batch = 10, 4   # 3 batches per epoch, the last one of 2 rows
    epoch = [batch_indices(rows, batch, s, seed=7, shuffle=True) for s in (1, 2, 3)]
    assert [len(b) for b in epoch] == [4, 4, 2] and sorted(sum(epoch, [])) == list(range(rows))
    assert batch_indices(rows, batch, 4, seed=7, shuffle=True) != epoch[0]   # a new order in epoch 2
    assert batch_indices(rows, batch, 2, seed=7, shuffle=True) == epoch[1]
    assert batch_indices(rows, batch, 3, seed=0, shuffle=False) == [8, 9]


# ---- runs -------------------------------------------------------------------------------------------------------

def _arith_rows(path, count=24):
    rows = [{"prompt": f"{a}+{b}=", "response": str(a + b)} for a, b in ((i * 7 % 50, i * 13 % 40) for i in range(count))]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _cfg(model_dir, data, run_dir, *extra):
    return load_config(SFTConfig, None, [f"model.path={model_dir}", f"data.path={data}", f"run.dir={run_dir}",
                                         "data.eval_fraction=0.25", "run.batch_size=6", "run.epochs=2",
                                         "run.eval_every=2", "run.checkpoint_every=100", "optim.lr=1e-2",
                                         "optim.warmup_steps=1", "optim.micro_batch_tokens=40", *extra])


VOLATILE = ("time/", "tokens_per_s/")


def _stable(records):
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in records]


def test_resume_is_bitwise_and_the_output_trains_with_rlalign_train(char_dir, tmp_path):
    data = _arith_rows(tmp_path / "arith.jsonl")
    full = run_sft(_cfg(char_dir, data, tmp_path / "full"))          # 18 train rows / 6 = 3 steps x 2 epochs
    cut = tmp_path / "cut"
    run_sft(_cfg(char_dir, data, cut, "run.stop_at_step=4"))
    assert [r["step"] for r in read_metrics(cut)] == [0, 1, 2, 3, 4]
    run_sft(_cfg(char_dir, data, cut, "run.resume=true"))
    records = read_metrics(full)
    assert _stable(read_metrics(cut)) == _stable(records)
    assert [r["step"] for r in records] == list(range(7)) and records[-1]["epoch"] == 2
    assert records[-1]["eval/loss"] < records[0]["eval/loss"]
    assert (full / "policy" / "model.safetensors").read_bytes() == (cut / "policy" / "model.safetensors").read_bytes()
    # the output is a Hugging Face folder with the tokenizer, and the RL trainer starts from it
    model, _ = load_model(full / "policy")
    assert {"config.json", "model.safetensors", "tokenizer.json", "checksums.json"} <= {p.name for p in (full / "policy").iterdir()}
    assert main(["train", *tiny_overrides(full / "policy", tmp_path / "rl", steps=1), "run.eval_every=1"]) == 0
    assert read_metrics(tmp_path / "rl")[-1]["mismatch/count"] == 0


def test_cli_run_writes_metrics_report_and_refuses_a_changed_resume(char_dir, tmp_path, capsys):
    data = _arith_rows(tmp_path / "arith.jsonl", count=8)
    run = tmp_path / "run"
    args = ["sft", f"model.path={char_dir}", f"data.path={data}", f"run.dir={run}", "data.eval_fraction=0.25",
            "run.batch_size=3"]
    assert main(args) == 0
    assert {"metrics.jsonl", "report.png", "report.md", "config.yaml", "policy", "checkpoints"} <= {p.name for p in run.iterdir()}
    assert "SFT run report" in (run / "report.md").read_text()
    capsys.readouterr()
    assert main(args + ["run.resume=true", "optim.lr=0.5"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("rlalign sft: error: run.resume=true would change what the run optimises (optim.lr")
    assert main(args) == 2 and "is not empty" in capsys.readouterr().err   # never over a previous run


def test_a_config_without_data_is_one_line(capsys):
    assert main(["sft", "run.steps=3"]) == 2
    assert capsys.readouterr().err == ("rlalign sft: error: data.path is required: the JSONL file of examples "
                                       "(data.path=train.jsonl; docs/sft.md)\n")


@pytest.mark.parametrize("content, message", [
    ('{"prompt": "1+1="}\n{"prompt": "2+2=", "response": "4"}\n', "bad.jsonl:1: missing field 'response'"),
    ("", "is empty: it holds no rows"),
    ('{"messages": [{"role": "user", "content": "hi"}]}\n', "bad.jsonl:1: the conversation has no assistant turn"),
    ('{"prompt": "1+1=", "response": 2}\n', "bad.jsonl:1: field 'response' must be a string"),
    ('{"prompt": "1+1=", "response": "2"\n', "bad.jsonl:1: invalid JSON"),
    ('[1, 2]\n', "bad.jsonl:1: a row must be a JSON object, got list"),
])
def test_bad_input_is_one_line(tmp_path, capsys, content, message):
    model = make_tiny_checkpoint(tmp_path / "m", num_hidden_layers=1)
    data = tmp_path / "bad.jsonl"
    data.write_text(content)
    assert main(["sft", f"model.path={model}", f"data.path={data}", f"run.dir={tmp_path / 'run'}",
                 "data.eval_fraction=0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("rlalign sft: error: ") and message in err, err
    assert not (tmp_path / "run").exists()   # refused before the run directory was made


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activation_checkpointing_recomputes_every_layer_and_steps_the_same_bits(dtype):
    """build_update (what run_sft sets the policy up with): optim.activation_checkpointing=true puts every decoder
    layer under recomputation, and two optimizer steps give the metrics and weights of the run without it, bit for
    bit (bf16: through the fp32 masters)."""
    g = torch.Generator().manual_seed(3)
    examples = [Example(tuple(torch.randint(0, 300, (p + r,), generator=g).tolist()), response_mask(p, r))
                for p, r in ((2, 5), (1, 1), (4, 3))]
    runs = []
    for checkpointing in (False, True):
        model = tiny_model("qwen3", seed=1, init_std=0.1, num_hidden_layers=2).to(dtype).train()
        cfg = SFTConfig()
        cfg.optim.activation_checkpointing = checkpointing
        update = build_update(model, cfg.optim, total_steps=2)
        assert all(isinstance(layer, RecomputedLayer) for layer in model.model.layers) == checkpointing
        with use_profile(cfg.run.profile):
            records = [update.step(examples, step) for step in (1, 2)]
        runs.append((records, dict(model.named_parameters())))
    assert runs[0][0] == runs[1][0]
    for name, weight in runs[0][1].items():
        assert_bitwise_equal(weight, runs[1][1][name], name)


def test_pretrain_on_the_sft_step_equals_its_standalone_loop(tmp_path):
    """rlalign pretrain takes its steps with SFTUpdate; the loop it had before (score_completions, -mean, torch's
    clip_grad_norm_ and AdamW) gives the same weights bit for bit (the embedded model's sha256 is unchanged)."""
    cfg = PretrainConfig(out=str(tmp_path / "out"), steps=4, batch_size=16, hidden_size=32, num_layers=2, num_heads=2,
                         num_kv_heads=1, head_dim=16, intermediate_size=64, eval_every=100, eval_size=4)
    new, _ = load_model(pretrain(cfg, log=lambda _: None))
    tok = load_tokenizer(cfg.out)
    corpus = HabitCorpus(ArithmeticTask(seed=0, eval_size=4), tok, cfg)
    torch.manual_seed(cfg.seed)
    old = CausalLM(ModelConfig.from_hf_dict(hf_config(cfg))).init_random_(seed=cfg.seed, std=0.05)
    opt = torch.optim.AdamW(old.parameters(), lr=cfg.lr, betas=(0.9, 0.98), weight_decay=0.0, foreach=False)
    for step in range(cfg.steps):
        batch = [corpus[i] for i in range(step * cfg.batch_size, (step + 1) * cfg.batch_size)]
        lp, _ = score_completions(old, [(list(e.tokens), len(e.tokens) - e.num_scored) for e in batch])
        opt.zero_grad(set_to_none=True)
        (-lp.mean()).backward()
        params = list(old.parameters())
        if norm_mode([p.grad for p in params]) == "fixed":   # the cross-machine mode: the fixed-order norm clips
            clip_params_(params, 1.0)
        else:
            torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=False)
        opt.step()
    for (name, a), b in zip(old.named_parameters(), new.parameters()):
        assert_bitwise_equal(a, b, name)


def test_chat_messages_run_end_to_end(tmp_path):
    model = make_tiny_checkpoint(tmp_path / "m", num_hidden_layers=1)
    rows = [{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"What is {i} + 1?"},
                          {"role": "assistant", "content": f"The answer is {i + 1}."},
                          {"role": "user", "content": "Good?"}, {"role": "assistant", "content": "yes"}]}
            for i in range(6)]
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = run_sft(load_config(SFTConfig, None, [f"model.path={model}", f"data.path={data}", f"run.dir={tmp_path / 'run'}",
                                                "data.eval_fraction=0.34", "run.batch_size=2", "optim.lr=1e-2"]))
    records = read_metrics(run)
    tok = load_tokenizer(model)
    train, _ = held_out_split(len(rows), 0.34, seed=0)   # 4 train rows, 2 per step: one epoch covers them once
    assert sum(r["tokens"] for r in records[1:]) == sum(chat_example(tok, rows[i]["messages"], "").num_scored
                                                        for i in train)
    assert len(records) == 3
    assert records[-1]["eval/loss"] < records[0]["eval/loss"]
