"""The vectorized sequence state (rlalign/rollout/slots.py) and the engine steps built on it.

SlotTable: random operation sequences (sequences entering and leaving, bulk token appends, block tables
changing, growth of every dimension from size 1) against a plain per-sequence model of the same state.
Engine: its completions against ``rlalign.models.generate`` -- a plain per-sequence loop over the same op,
no engine state -- bit for bit, over workloads where many samples end at the same step, stop tokens
coincide with the length limit, samples share prefixes, the KV cache is small enough to preempt, and
overlapped scheduling is on or off; the per-token step() outputs built from the slot columns; and the
lines of Python decode steps run in the rollout package: the same for 4 and 48 sequences.
"""

from __future__ import annotations

import collections
import sys

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from rlalign.contract import use_profile
from rlalign.models.generate import generate as simple_generate
from rlalign.models.testing import tiny_model
from rlalign.rollout import RolloutConfig, RolloutEngine, SamplingParams
from rlalign.rollout.block_manager import pages_for
from rlalign.rollout.config import SamplingParams as Params
from rlalign.rollout.sequence import Request, Sequence
from rlalign.rollout.slots import SlotTable
from tests.bitwise import assert_bitwise_equal

# ---- SlotTable against a per-sequence model ------------------------------------------------------

OPS = st.lists(st.tuples(st.sampled_from(["enter", "leave", "append", "table", "push"]),
                         st.integers(0, 2**16), st.lists(st.integers(0, 2**20), max_size=40)),
               min_size=1, max_size=40)


def _sequence(k: int, prompt: list[int]) -> Sequence:
    request = Request(str(k), k, prompt, None, Params(n=1, max_new_tokens=5 + k % 3, temperature=0.5 + k % 2,
                                                      top_k=k % 4, top_p=0.9), 0, frozenset(range(7, 7 + 3 * (k % 4), 3)))
    seq = Sequence(request, 0, 1000 + k, prompt)
    request.seqs = [seq]
    return seq


def _check_table(table: SlotTable, running: dict[int, Sequence], model: dict[int, dict]) -> None:
    """Every running sequence's slot holds what the per-sequence model says; table() pads with zeros."""
    slots = np.fromiter((s.slot for s in running.values()), np.int64, len(running))
    if slots.size:
        got = table.table(slots)
        want = np.zeros((len(running), max(len(m["pages"]) for m in model.values())), np.int32)
        for row, k in enumerate(running):
            want[row, :len(model[k]["pages"])] = model[k]["pages"]
        assert got.dtype == np.int32 and got.shape == want.shape, (got.dtype, got.shape, want.shape)
        diff = np.argwhere(got != want)
        assert diff.size == 0, f"block tables: first difference at {tuple(diff[0])}: {got[tuple(diff[0])]} vs " \
                               f"{want[tuple(diff[0])]}"
    for k, seq in running.items():
        assert table.owner[seq.slot] is seq and seq.num_tokens == len(model[k]["tokens"])
        stops = sorted(seq.request.stop_token_ids)
        assert table.stop_ids[seq.slot].tolist() == stops + [-1] * (table.stop_ids.shape[1] - len(stops))
        probe = np.arange(20, dtype=np.int64)
        hits = table.hits_stop(np.full(20, seq.slot, np.int64), probe)
        assert hits.tolist() == [t in seq.request.stop_token_ids for t in range(20)], f"sequence {k}: stop ids"
        assert seq.tokens == model[k]["tokens"], f"sequence {k}: tokens"
        assert_bitwise_equal(torch.tensor(seq.logprobs, dtype=torch.float32),
                             torch.tensor(model[k]["logprobs"], dtype=torch.float32), f"sequence {k}: logprobs")


@settings(max_examples=80, deadline=None)
@given(OPS)
def test_slot_table_follows_a_per_sequence_model(ops):
    table = SlotTable(capacity=1, token_width=1, page_width=1)   # every dimension grows
    running: dict[int, Sequence] = {}
    model: dict[int, dict] = {}
    left: dict[int, Sequence] = {}
    for step, (op, pick, values) in enumerate(ops):
        if op == "enter" or not running:
            if left and pick % 2:   # one that left comes back (a preempted sequence readmitted)
                k = list(left)[pick % len(left)]
                seq = left.pop(k)
            else:                   # a new sequence (its prompt: >= 1 token)
                k = step
                seq = _sequence(k, [v % 50 for v in values] or [7])
                model[k] = dict(tokens=list(seq.tokens), logprobs=[], pages=[])
            seq.block_table = list(model[k]["pages"])
            table.assign(seq)
            running[k] = seq
            assert table.seed[seq.slot] == seq.seed and table.length_limit[seq.slot] == seq.num_prompt_tokens + \
                seq.request.sampling.max_new_tokens
            assert table.temperature[seq.slot] == seq.request.sampling.temperature   # exact Python float
        elif op == "leave":
            k = list(running)[pick % len(running)]
            seq = running.pop(k)
            table.release(seq)
            assert seq.slot is None and seq.tokens == model[k]["tokens"]
            left[k] = seq
        elif op == "append":   # a step: some of the running sequences get one token each
            ks = [k for i, k in enumerate(running) if (pick >> (i % 16)) & 1] or list(running)[:1]
            tokens = [(values[i % len(values)] if values else i) for i in range(len(ks))]
            logprobs = np.asarray([-(t % 97) / 7 for t in tokens], np.float32)
            slots = np.asarray([running[k].slot for k in ks], np.int64)
            positions = np.asarray([len(model[k]["tokens"]) for k in ks], np.int64)
            table.append(slots, positions, np.asarray(tokens, np.int64), logprobs)
            for k, t, lp in zip(ks, tokens, logprobs.tolist()):
                model[k]["tokens"].append(t)
                model[k]["logprobs"].append(lp)
        elif op == "table":   # the block manager replaced a table (copy-on-write, preemption, prefix hit)
            k = list(running)[pick % len(running)]
            running[k].block_table[:] = values
            table.set_pages(running[k])
            model[k]["pages"] = list(values)
        else:   # "push": decode steps whose tokens start a page
            ks = [k for i, k in enumerate(running) if (pick >> (i % 16)) & 1] or list(running)[:1]
            pages = [(values[i % len(values)] if values else 3 * i) for i in range(len(ks))]
            for k, page in zip(ks, pages):
                running[k].block_table.append(page)
                model[k]["pages"].append(page)
            table.push_pages(np.asarray([running[k].slot for k in ks], np.int64), np.asarray(pages, np.int32))
        _check_table(table, running, {k: model[k] for k in running})
    assert table.num_used == len(running)


def test_appending_to_a_running_sequences_list_fails_loudly():
    table = SlotTable()
    seq = _sequence(0, [1, 2, 3])
    table.assign(seq)
    seq.tokens.append(4)   # bypasses the slot: the next read must not silently drop or keep it
    with pytest.raises(RuntimeError, match="SlotTable.append"):
        seq.tokens


# ---- the engine on the slot table against a plain per-sequence loop ------------------------------


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen3", seed=9, init_std=0.1)


PROMPT = st.lists(st.integers(3, 300), min_size=1, max_size=14)


def _reference(model, prompts, n, max_new, temperature, stops):
    with use_profile("strict"):
        return simple_generate(model, prompts, n=n, max_new_tokens=max_new, temperature=temperature, seed=4,
                               stop_token_ids=sorted(stops))


@settings(max_examples=14, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompts=st.lists(PROMPT, min_size=1, max_size=4), n=st.integers(1, 5), max_new=st.integers(1, 9),
       temperature=st.sampled_from([0.0, 1.0]), stop_picks=st.lists(st.integers(0, 10**6), max_size=4),
       mode=st.sampled_from([("off", "off"), ("padded", "off"), ("padded", "on")]),
       share=st.booleans(), caching=st.booleans(), tight=st.booleans(), seats=st.integers(1, 12))
def test_engine_equals_a_per_sequence_loop_when_samples_end_together(model, prompts, n, max_new, temperature,
                                                                     stop_picks, mode, share, caching, tight, seats):
    """Every sample has the same max_new_tokens, so those that do not stop early all end at the same step;
    stop tokens are drawn from the samples' own tokens (the first from their last ones), so samples stop
    early, several at once, or exactly at the length limit (the stop wins). With ``tight`` the KV cache
    holds one longest sequence (preemption)."""
    plain = _reference(model, prompts, n, max_new, temperature, ())
    last_tokens = [c.tokens[-1] for c in plain]
    any_tokens = [t for c in plain for t in c.tokens]
    stops = {last_tokens[p % len(last_tokens)] for p in stop_picks[:1]} | \
        {any_tokens[p % len(any_tokens)] for p in stop_picks[1:]}
    want = _reference(model, prompts, n, max_new, temperature, stops) if stops else plain
    longest = max(len(p) for p in prompts) + max_new
    page_size = 4
    graphs, overlap = mode
    config = RolloutConfig(page_size=page_size, max_num_seqs=seats, share_prefix=share, enable_prefix_caching=caching,
                           num_pages=pages_for(longest, page_size) * (1 if tight else 4 * n * len(prompts)),
                           decode_graphs=graphs, overlap=overlap, decode_graph_max_batch=16)
    engine = RolloutEngine(model, config)
    got = engine.generate(prompts, SamplingParams(n=n, max_new_tokens=max_new, temperature=temperature, seed=4,
                                                  seed_by="content", stop_token_ids=tuple(sorted(stops)),
                                                  ignore_eos=True))
    assert len(got) == len(want)
    for g, w in zip(got, want):
        where = f"prompt {w.prompt_index} sample {w.sample_index} ({mode}, stops {sorted(stops)})"
        assert (g.tokens, g.finish_reason) == (w.tokens, w.finish_reason), where
        assert_bitwise_equal(torch.tensor(g.logprobs, dtype=torch.float32),
                             torch.tensor(w.logprobs, dtype=torch.float32), where)
        if g.finish_reason == "stop":
            assert g.stop_reason == g.tokens[-1] and type(g.stop_reason) is int, where
    stats = engine.stats()
    assert stats["free_pages"] == stats["num_pages"], "pages leaked"
    assert engine.scheduler.slots.num_used == 0 and not engine.scheduler.running, "slots leaked"


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_step_outputs_are_built_from_the_slot_columns(model, overlap):
    """step() returns one StepOutput per sampled token: request id, prompt index, sample index, token and
    logprob of its row, whatever slot the sample holds (more samples than max_num_seqs: the slot table
    grows; requests arriving mid-run reuse slots of finished ones)."""
    engine = RolloutEngine(model, RolloutConfig(page_size=4, num_pages=400, max_num_seqs=2, decode_graphs="padded",
                                                overlap=overlap, decode_graph_max_batch=8))
    arrivals = {0: ([5, 9, 33], SamplingParams(n=5, max_new_tokens=6, seed=1)),          # 5 samples > 2 seats
                2: ([17] * 7, SamplingParams(n=2, max_new_tokens=3, seed=2, temperature=0.7)),
                5: ([100, 3], SamplingParams(n=1, max_new_tokens=8, seed=3, stop_token_ids=(40, 41)))}
    streams: dict[tuple, list] = {}
    done, call = {}, 0
    while call in arrivals or engine.has_unfinished() or call < max(arrivals):
        if call in arrivals:
            prompt, sampling = arrivals[call]
            engine.add_request(prompt, sampling, request_id=f"r{call}", prompt_index=100 + call)
        for out in engine.step():
            key = (out.request_id, out.prompt_index, out.sample_index)
            streams.setdefault(key, []).append((out.token, out.logprob))
            if out.completion is not None:
                done[key] = out.completion
        call += 1
    assert engine.scheduler.slots.capacity > 2   # grew past max_num_seqs for the group of 5
    assert sorted(done) == sorted(streams) and len(done) == 5 + 2 + 1
    for key, completion in done.items():
        tokens = [t for t, _ in streams[key]]
        assert tokens == completion.tokens, f"{key}: streamed tokens"
        assert_bitwise_equal(torch.tensor([lp for _, lp in streams[key]], dtype=torch.float32),
                             torch.tensor(completion.logprobs, dtype=torch.float32), f"{key}: streamed logprobs")
        assert all(type(t) is int and type(lp) is float for t, lp in streams[key]), key


# ---- a decode step's Python does not grow with the number of sequences ---------------------------


def _rollout_lines_of_decode_steps(model, count: int, graphs: str, overlap: str) -> collections.Counter:
    """Lines of Python executed in rlalign/rollout/, per function, during the 6 decode steps after the
    prefill of ``count`` sequences (no page fills: 64-token pages, 3-token prompts; no prefix caching), as
    generate() runs them; two samples end at their 4th token (the others run on). A loop's body counts
    once per iteration, comprehensions and generators included."""
    engine = RolloutEngine(model, RolloutConfig(page_size=64, num_pages=4 * count, max_num_seqs=count,
                                                enable_prefix_caching=False, decode_graphs=graphs, overlap=overlap,
                                                decode_graph_max_batch=64))
    for i in range(count):
        sampling = SamplingParams(max_new_tokens=4 if i < 2 else 30, seed=1, ignore_eos=True)
        engine.add_request([3 + i % 50, 7, 9], sampling, prompt_index=i)
    lines: collections.Counter = collections.Counter()

    def in_frame(frame, event, arg):
        if event == "line":
            lines[f"{frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_code.co_name}"] += 1
        return in_frame

    def on_call(frame, event, arg):
        code = frame.f_code
        if "rlalign/rollout/" not in code.co_filename:
            return None
        if code.co_filename.endswith("decode_graphs.py") and code.co_name == "<genexpr>":
            return None   # DecodeGraphs.bucket / width walk the bucket lists: O(buckets), not O(sequences)
        return in_frame

    finished = []
    with torch.no_grad():
        finished += engine._step(emit_unfinished=False)   # the prefill
        previous = sys.gettrace()   # e.g. a coverage tracer: put back afterwards
        sys.settrace(on_call)
        try:
            for _ in range(6):
                finished += engine._step(emit_unfinished=False)
                assert engine.last_forward["decode"]
        finally:
            sys.settrace(previous)
    assert sorted(out.prompt_index for out in finished) == [0, 1]
    engine.abort_all()
    return lines


@pytest.mark.parametrize("graphs,overlap", [("off", "off"), ("padded", "off"), ("padded", "on")])
def test_a_decode_steps_python_does_not_grow_with_the_sequences(model, graphs, overlap):
    few = _rollout_lines_of_decode_steps(model, 4, graphs, overlap)
    many = _rollout_lines_of_decode_steps(model, 48, graphs, overlap)
    grown = {name: (few[name], many[name]) for name in set(few) | set(many) if few[name] != many[name]}
    assert not grown, f"rollout Python lines run per step, 4 vs 48 sequences, where they differ: {grown}"
    assert sum(few.values()) > 50   # the step was traced
