"""benchmarks/grpo_lr_proxy.py: the prompt-blind first-token values, two-step runs on a toy checkpoint and on the
built eager body, and the built body's pieces (init scale, packed rows, the sampling filter, the sampler)."""

import importlib.util
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

REPO = Path(__file__).resolve().parents[2]


def _load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


proxy = _load("grpo_lr_proxy", REPO / "benchmarks" / "grpo_lr_proxy.py")
kit = _load("make_qwen3_8b", REPO / "scripts" / "make_qwen3_8b.py")


def test_first_token_values():
    texts = proxy.token_texts(400)
    assert texts[2] == "" and texts[3] == "0" and texts[15] == "10" and texts[399] == "394"
    values = proxy.first_token_values(400, ["357"])
    assert values[2] == 0.0                                     # <eos>: the empty completion
    assert values[texts.index("357")] == pytest.approx(0.9)     # the answer, then more digits: -0.1
    assert values[texts.index("35")] == pytest.approx(2 / 3 + 0.1 / 3 - 0.1)   # the third place by chance


def test_two_steps_write_one_record_each(tmp_path, capsys):
    assert kit.main([str(tmp_path / "m"), "--test-body", "--layers", "1", "--vocab", "600", "--device", "cpu"]) == 0
    out = tmp_path / "proxy.jsonl"
    assert proxy.main([str(tmp_path / "m"), "--lr", "1e-3", "--steps", "2", "--new", "3", "--prompts", "2",
                       "--samples", "4", "--reward", "match_then_stop", "--out", str(out)]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2] and records[0]["lr"] == pytest.approx(1e-4)
    assert all(-1.0 <= r["reward"] <= 1.0 and 0 < r["mean_len"] <= 3 for r in records)
    # step 1's tokens with positive advantage gained log-prob, those with negative advantage lost it
    assert records[0]["gain_pos"] > 0 > records[0]["gain_neg"]


def test_built_body_starts_with_the_8b_logit_scale():
    """The 8B-equivalent init (std 0.02 x sqrt(4096 / hidden)) gives logits of std ~1.28 over the vocabulary
    at any width, as the 8B's std 0.02 at 4096 (its step-0 entropy 11.11 = ln 151,936 - 1.28^2 / 2)."""
    import torch
    for hidden in (32, 64):
        model = proxy.ToyQwen3(hidden, 2, 3000, 0.02 * (4096 / hidden) ** 0.5, seed=0)
        with torch.no_grad():
            last = proxy.final_hidden(model, [[3, 4, 5], [6, 7, 8, 9, 10]])
        assert (last @ model.lm_head.T).std(-1).sub(1.28).abs().max() < 0.1, hidden


def test_packed_rows_pick_the_same_states_as_one_sequence_at_a_time():
    """hidden_rows maps completion_rows' packed numbering onto the left-padded batch: each row's state is
    the state of that token run alone (no leak across padding), for sequences of different lengths."""
    import torch
    model = proxy.ToyQwen3(32, 2, 500, 0.1, seed=1)
    seqs, prompt_lens = [[3, 4, 5, 20, 21], [6, 7, 30], [8, 9, 10, 11, 40, 41, 42]], [3, 2, 4]
    rows, targets, owner = proxy.completion_rows(seqs, prompt_lens)
    with torch.no_grad():
        together = proxy.hidden_rows(model, seqs, rows)[0]
        alone = torch.cat([proxy.hidden_rows(model, [s], proxy.completion_rows([s], [p])[0])[0]
                           for s, p in zip(seqs, prompt_lens)])
    assert len(together) == len(targets) == sum(len(s) - p for s, p in zip(seqs, prompt_lens))
    torch.testing.assert_close(together, alone, rtol=1e-5, atol=1e-5)


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 4), vocab=st.integers(1, 40), top_k=st.integers(0, 45),
       top_p=st.sampled_from([0.3, 0.9, 0.95, 1.0]), seed=st.integers(0, 1000))
def test_truncate_keeps_the_top_k_then_the_smallest_top_p_set(rows, vocab, top_k, top_p, seed):
    """Against a sort-based reference: the kept ids are the top-k (0: all), then the most likely ids up to
    and including the first whose cumulative mass reaches top_p of the kept mass; kept values unchanged."""
    import torch
    probs = torch.rand(rows, vocab, generator=torch.Generator().manual_seed(seed)).softmax(-1)
    kept = proxy.truncate(probs, top_p, top_k, candidates=vocab)
    for row, out in zip(probs, kept):
        order = row.argsort(descending=True).tolist()
        allowed = order[:top_k] if top_k else order
        mass, total, expect = 0.0, float(row[allowed].sum()), set()
        for i in allowed:
            if top_p < 1.0 and mass >= top_p * total - 1e-6:
                break
            expect.add(i)
            mass += float(row[i])
        got = set(out.nonzero().squeeze(1).tolist())
        assert got == expect or (top_p < 1.0 and len(got ^ expect) == 1), (got, expect)   # a tie at the cut
        assert all(out[i] == row[i] for i in got)


def test_sample_draws_only_ids_with_mass():
    import torch
    probs = torch.zeros(3, 50)
    probs[0, 7], probs[1, [0, 49]], probs[2, 20:23] = 1.0, 0.5, 0.2
    torch.manual_seed(0)
    for _ in range(20):
        ids = proxy.sample(probs)
        assert ids[0] == 7 and ids[1] in (0, 49) and 20 <= ids[2] <= 22


def test_built_body_two_steps_with_entropy_bonus(tmp_path):
    out = tmp_path / "built.jsonl"
    assert proxy.main(["--hidden", "32", "--layers", "1", "--vocab", "300", "--lr", "1e-3", "--steps", "2",
                       "--new", "3", "--prompts", "2", "--samples", "4", "--top-p", "0.95", "--top-k", "50",
                       "--entropy-coef", "0.01", "--ignore-eos", "--reward", "match_then_steep",
                       "--out", str(out)]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2] and all(r["mean_len"] == 3 for r in records)
    assert all(r["resid_rms"] > 0 and 0 < r["entropy"] <= 5.71 for r in records)   # ln 300 = 5.70


@settings(max_examples=20, deadline=None)
@given(hidden=st.sampled_from([32, 64, 128]), std_8b=st.sampled_from([0.0, 0.002, 0.02]))
def test_built_head_matches_the_8b_lead_or_its_random_logits(hidden, std_8b):
    """--head-match gap: a final-norm state aligned with one head row gives that row the 8B's lead of
    std_8b x 4096 nats (82 at 0.02) over the random logits; signal: the random logits' std is the 8B's
    std_8b x 64. The head std changes no other tensor's draw (0 = zeros)."""
    import torch
    gap = proxy.built_head_std(std_8b, hidden, "gap")
    signal = proxy.built_head_std(std_8b, hidden, "signal")
    model = proxy.ToyQwen3(hidden, 1, 2000, 0.1, seed=3, head_std=gap)
    plain = proxy.ToyQwen3(hidden, 1, 2000, 0.1, seed=3, head_std=signal)
    row = model.lm_head.detach()[7]
    lead = float(row @ (row / row.norm().clamp(min=1e-30) * hidden ** 0.5))      # aligned, |h| = sqrt(H)
    assert lead == pytest.approx(std_8b * 4096, rel=0.25, abs=1e-6), (lead, std_8b * 4096)
    h = torch.randn(200, hidden, generator=torch.Generator().manual_seed(0))
    h = h / h.pow(2).mean(-1, keepdim=True).sqrt()                                           # RMS 1, as after the norm
    random_std = float((h @ plain.lm_head.detach().T).std())
    assert random_std == pytest.approx(std_8b * 64, rel=0.1, abs=1e-6), (random_std, std_8b * 64)
    for (name, a), b in zip(model.named_parameters(), plain.parameters()):
        assert name == "lm_head" or torch.equal(a, b), name
    assert std_8b or not model.lm_head.any()


@pytest.mark.parametrize("reward", ["match_then_stop", "match_then_steep"])
def test_extra_char_cost_sets_the_chosen_rewards_cost(tmp_path, reward):
    """Step 1's mean reward equals the reward recomputed at the overridden cost (the two rewards read
    different constants; the override once reached only match_then_stop's)."""
    out = tmp_path / "r.jsonl"
    args = ["--hidden", "32", "--layers", "1", "--vocab", "300", "--lr", "1e-3", "--steps", "1", "--new", "3",
            "--prompts", "2", "--samples", "4", "--ignore-eos", "--reward", reward, "--out", str(out)]
    assert proxy.main(args + ["--extra-char-cost", "0"]) == 0
    free = json.loads(out.read_text())
    assert proxy.main(args + ["--extra-char-cost", "1.0"]) == 0
    costly = json.loads(out.read_text())
    assert free["chars"] == costly["chars"] > 0                      # same seed: the same completions
    # 3 tokens of mostly 3-character ids run past the 2-5 digit answers: at cost 1 the overrun costs
    assert free["reward"] > costly["reward"] + 1.0


def test_extra_char_cost_refuses_a_reward_without_one():
    with pytest.raises(SystemExit):
        proxy.main(["--hidden", "32", "--layers", "1", "--vocab", "300", "--lr", "1e-3", "--steps", "1",
                    "--reward", "positional_match", "--extra-char-cost", "0.1"])
