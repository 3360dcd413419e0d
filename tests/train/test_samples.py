"""StepSamples, the step's one record of its samples: built from the engine's completions once, as tensors, and
selected / concatenated (DAPO) and renumbered exactly as the per-sample lists they replace."""

import struct

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlalign.models.completion import Completion
from rlalign.train.samples import StepSamples

LAYERS, K = 2, 3


@st.composite
def completions(draw, routed=True):
    n = draw(st.integers(1, 8))
    out = []
    for i in range(n):
        prompt = draw(st.lists(st.integers(0, 50), min_size=1, max_size=5))
        tokens = draw(st.lists(st.integers(0, 50), min_size=1, max_size=6))
        # fp32 values (a Completion's logprobs are fp32 values as Python floats), any bits
        logprobs = [struct.unpack("f", struct.pack("f", x))[0] for x in
                    draw(st.lists(st.floats(-30, 0, width=32), min_size=len(tokens), max_size=len(tokens)))]
        rows = len(prompt) + len(tokens) - 1
        routing = torch.randint(0, 8, (rows, LAYERS, K), dtype=torch.int16) if routed else None
        out.append(Completion(f"r{i}", draw(st.integers(0, 3)), i, prompt, tokens, logprobs,
                              draw(st.sampled_from(["stop", "length"])), 0, 0, routing=routing))
    return out


def as_lists(samples: StepSamples) -> list[tuple]:
    """Per sample: (prompt, completion, logprob bits, truncated, prompt index, routing, reward, group)."""
    seqs = samples.tokens.split(samples.sequence_lens.tolist())
    lps = samples.logprobs.split(samples.completion_lens.tolist())
    routing = (samples.routing.split(samples.routing_rows.tolist()) if samples.routing is not None
               else [None] * len(samples))
    return [(seq[:p].tolist(), seq[p:].tolist(), lp.view(torch.int32).tolist(), bool(t), int(i),
             None if r is None else r.tolist(), None if samples.rewards is None else float(samples.rewards[j]),
             None if samples.group_ids is None else int(samples.group_ids[j]))
            for j, (seq, p, lp, t, i, r) in enumerate(zip(seqs, samples.prompt_lens.tolist(), lps, samples.truncated,
                                                          samples.prompt_index, routing))]


def expected(cs: list[Completion], rewards=None, first_group=None) -> list[tuple]:
    bits = lambda xs: torch.tensor(xs, dtype=torch.float32).view(torch.int32).tolist()  # noqa: E731
    return [(c.prompt_tokens, c.tokens, bits(c.logprobs), c.finish_reason == "length", c.prompt_index,
             c.routing.tolist(), None if rewards is None else float(torch.tensor(rewards[j], dtype=torch.float32)),
             None if first_group is None else first_group + c.prompt_index) for j, c in enumerate(cs)]


@settings(max_examples=40, deadline=None)
@given(completions())
def test_the_record_holds_every_completion_exactly(cs):
    samples = StepSamples.of_completions(cs)
    assert samples.tokens.dtype == samples.prompt_lens.dtype == torch.int64 and samples.logprobs.dtype == torch.float32
    assert samples.routing.dtype == torch.int16 and samples.has_routing
    assert as_lists(samples) == expected(cs)
    assert samples.completion_token_lists() == [c.tokens for c in cs]


@settings(max_examples=40, deadline=None)
@given(completions(), completions(), st.data())
def test_select_and_concat_are_the_per_sample_lists(a, b, data):
    rewards_a = data.draw(st.lists(st.floats(-2, 2), min_size=len(a), max_size=len(a)))
    rewards_b = data.draw(st.lists(st.floats(-2, 2), min_size=len(b), max_size=len(b)))
    both = StepSamples.concat([StepSamples.of_completions(a).scored(rewards_a, 0),
                               StepSamples.of_completions(b).scored(rewards_b, 4)])
    whole = expected(a, rewards_a, 0) + expected(b, rewards_b, 4)
    assert as_lists(both) == whole
    keep = data.draw(st.lists(st.booleans(), min_size=len(whole), max_size=len(whole)))
    assert as_lists(both.select(torch.tensor(keep))) == [x for x, k in zip(whole, keep) if k]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 9), min_size=1, max_size=20))
def test_groups_are_renumbered_in_order_of_first_appearance(ids):
    samples = StepSamples.of_completions([Completion("r", i, 0, [1], [2], [-1.0], "stop", 0, 0) for i in ids])
    order = {g: i for i, g in enumerate(dict.fromkeys(ids))}
    assert samples.scored([0.0] * len(ids), 0).group_tensor().tolist() == [order[g] for g in ids]
    assert samples.scored([0.0] * len(ids), 0).num_groups() == len(order)


def test_a_record_without_routing_for_every_sample_has_none():
    routed = Completion("a", 0, 0, [1, 2], [3], [-1.0], "stop", 0, 0, routing=torch.zeros(2, LAYERS, K,
                                                                                         dtype=torch.int16))
    plain = Completion("b", 0, 1, [1, 2], [3], [-1.0], "stop", 0, 0)
    for cs in ([routed, plain], [plain]):
        samples = StepSamples.of_completions(cs)
        assert samples.routing is None and not samples.has_routing and samples.routing_rows.tolist() == [0] * len(cs)
    mixed = StepSamples.concat([StepSamples.of_completions([routed]), StepSamples.of_completions([plain])])
    assert not mixed.has_routing and mixed.routing_rows.tolist() == [0, 0]
