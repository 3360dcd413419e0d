"""Generation: seeded per (prompt content, sample), so a completion does not depend on --n, on the other
prompts or on their order; its logprobs equal the training forward's bit for bit; and the CLI."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest
import torch

from rlalign.cli import generate as cli
from rlalign.models import ForwardBatch, generate, load_model, load_tokenizer
from rlalign.models.batch import next_token_targets
from rlalign.models.testing import make_tiny_checkpoint
from tests.bitwise import assert_bitwise_equal

PROMPTS = ["What is 3 + 4?", "hello world", "Count the letters in the word token."]
SAMPLING = dict(temperature=0.8, top_p=0.9, top_k=40, seed=1234, max_new_tokens=12)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("gen") / "qwen3", "qwen3", seed=7, init_std=0.3,
                                norm_jitter=0.1)


@pytest.fixture(scope="module")
def loaded(ckpt):
    model, _ = load_model(ckpt)
    return model, load_tokenizer(ckpt)


def by_key(completions):
    return {(c.prompt, c.sample_index): (c.tokens, c.logprobs, c.text, c.finish_reason) for c in completions}


def test_invariant_to_n_count_and_order(loaded):
    model, tok = loaded
    full = by_key(generate(model, PROMPTS, tokenizer=tok, n=3, **SAMPLING))
    assert len(full) == 9
    assert len({tuple(v[0]) for v in full.values()}) > 3  # samples do differ
    for prompts, n in [([PROMPTS[2], PROMPTS[0]], 1), ([PROMPTS[1]], 2), (list(reversed(PROMPTS)), 3)]:
        part = by_key(generate(model, prompts, tokenizer=tok, n=n, **SAMPLING))
        assert len(part) == len(prompts) * n
        for key, value in part.items():
            assert value == full[key], f"{key} changed with prompts={prompts}, n={n}"
    other_seed = by_key(generate(model, PROMPTS, tokenizer=tok, n=3, **dict(SAMPLING, seed=1)))
    assert other_seed != full


def test_logprobs_equal_training_forward(loaded):
    """The reported logprob of each sampled token equals the packed (trainer) forward's, bitwise."""
    model, tok = loaded
    completions = generate(model, PROMPTS, tokenizer=tok, n=2, **SAMPLING)
    seqs = [c.prompt_tokens + c.tokens for c in completions]
    with torch.no_grad():
        lp, _ = model.logprobs(ForwardBatch.packed(seqs), next_token_targets(seqs),
                               temperature=SAMPLING["temperature"])
    start = 0
    for c, seq in zip(completions, seqs):
        rows = lp[start + len(c.prompt_tokens) - 1: start + len(seq) - 1]
        assert_bitwise_equal(torch.tensor(c.logprobs, dtype=torch.float32), rows,
                             f"{c.prompt!r} sample {c.sample_index}")
        assert c.text == tok.decode(c.tokens)
        start += len(seq)


def test_greedy_and_stop(loaded):
    model, tok = loaded
    greedy = generate(model, PROMPTS[:1], tokenizer=tok, n=2, temperature=0.0, max_new_tokens=6)
    assert greedy[0].tokens == greedy[1].tokens and greedy[0].finish_reason == "length"
    with torch.no_grad():
        ids = list(greedy[0].prompt_tokens)
        for tok_id in greedy[0].tokens:  # greedy = argmax of the last row, step by step
            logits = model.logits(model.forward_hidden(ForwardBatch.packed([ids]))[-1:])
            assert int(logits.argmax()) == tok_id
            ids.append(tok_id)
    first = greedy[0].tokens[0]
    stopped = generate(model, PROMPTS[:1], tokenizer=tok, temperature=0.0, max_new_tokens=6, stop_token_ids=[first])
    assert stopped[0].tokens == [first] and stopped[0].finish_reason == "stop"


def test_token_id_prompts_and_chat(loaded):
    model, tok = loaded
    ids = tok.encode(PROMPTS[0])
    from_ids = generate(model, [ids], n=1, **SAMPLING)[0]
    from_text = generate(model, [PROMPTS[0]], tokenizer=tok, n=1, **SAMPLING)[0]
    assert (from_ids.tokens, from_ids.logprobs) == (from_text.tokens, from_text.logprobs)
    chat = generate(model, [PROMPTS[0]], tokenizer=tok, chat=True, **SAMPLING)[0]
    assert chat.prompt_tokens == tok.encode(PROMPTS[0], chat=True)
    with pytest.raises(ValueError, match="zero tokens"):
        generate(model, [""], tokenizer=tok)


def run_main(capsys, argv):
    assert cli.main(argv) == 0
    return json.loads(capsys.readouterr().out)


def cli_args(ckpt, prompts, n, seed=5):
    args = ["--model", str(ckpt), "--n", str(n), "--max-new-tokens", "8", "--temperature", "0.9", "--top-p", "0.95",
            "--top-k", "50", "--seed", str(seed), "--json"]
    for p in prompts:
        args += ["--prompt", p]
    return args


def test_cli_json_invariance(ckpt, capsys):
    proc = subprocess.run([sys.executable, "-m", "rlalign.cli.generate", *cli_args(ckpt, PROMPTS, 2)],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr
    full = json.loads(proc.stdout)
    assert set(full) == {"completions"} and len(full["completions"]) == 6
    for c in full["completions"]:
        assert set(c) == {"prompt", "sample", "tokens", "text", "logprobs"}
        assert len(c["tokens"]) == len(c["logprobs"]) >= 1
    index = {(c["prompt"], c["sample"]): c for c in full["completions"]}
    for prompts, n in [([PROMPTS[2], PROMPTS[1]], 1), ([PROMPTS[0]], 2)]:
        for c in run_main(capsys, cli_args(ckpt, prompts, n))["completions"]:
            assert c == index[(c["prompt"], c["sample"])]


def test_cli_text_output_profiles_and_errors(ckpt, capsys, tmp_path):
    argv = ["--model", str(ckpt), "--prompt", "hi", "--max-new-tokens", "3", "--chat"]
    assert cli.main(argv + ["--profile", "native", "--dtype", "bfloat16"]) == 0
    out = capsys.readouterr().out
    assert "prompt 0 sample 0" in out and "tokens (id:piece:logprob)" in out
    assert cli.main(["--model", str(tmp_path / "nope"), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("rlalign generate: error:") and "missing config.json" in err and "\n" not in err


def test_register_adds_subcommand(ckpt):
    parser = argparse.ArgumentParser(prog="rlalign")
    cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["generate", "--model", str(ckpt), "--prompt", "a", "--prompt", "b", "--n", "2",
                              "--profile", "native"])
    assert args.func is cli.run and args.prompt == ["a", "b"] and args.n == 2 and args.profile == "native"
    assert (args.max_new_tokens, args.temperature, args.top_p, args.top_k, args.seed, args.json) == \
        (32, 1.0, 1.0, 0, 0, False)


def test_through_rlalign_main(ckpt, capsys):
    from rlalign.cli.main import main

    assert main(["generate", *cli_args(ckpt, PROMPTS[:1], 1)]) == 0
    via_main = json.loads(capsys.readouterr().out)
    assert via_main == run_main(capsys, cli_args(ckpt, PROMPTS[:1], 1))
