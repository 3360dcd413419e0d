"""Scheduler without a model: token budget, chunked prefill, max_num_seqs, preemption, prefix cache, forks.

A fake step stands in for the forward: it marks the chunks computed and appends to every
sequence that reached its last token a token that depends only on (seed, position), as the
real sampler does. Whatever the schedule, every sequence must end with the same tokens.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from rlalign.rollout.block_manager import BlockManager, pages_for
from rlalign.rollout.config import RolloutConfig, SamplingParams
from rlalign.rollout.scheduler import Scheduler
from rlalign.rollout.sequence import Request, Sequence, SeqStatus


def make_request(rid: int, prompt: list[int], n: int, share: bool, max_new: int) -> Request:
    request = Request(str(rid), rid, prompt, None, SamplingParams(n=n, max_new_tokens=max_new), 0, frozenset())
    request.seqs = [Sequence(request, j, 1000 * rid + j, prompt) for j in range(n)]
    if share and n > 1:
        request.pending_forks = request.seqs[1:]
        for seq in request.pending_forks:
            seq.status = SeqStatus.FORK_PENDING
    return request


def fake_token(seq: Sequence) -> int:
    return (seq.seed * 31 + seq.num_tokens * 7) % 97


def append_tokens(sched: Scheduler, seqs: list[Sequence], tokens: list[int]) -> None:
    """What the engine does after a step: the running sequences' new tokens go into their slots."""
    slots = np.array([s.slot for s in seqs], np.int64)
    positions = np.array([s.num_tokens for s in seqs], np.int64)
    sched.slots.append(slots, positions, np.array(tokens, np.int64), np.zeros(len(seqs), np.float32))


def fake_step(sched: Scheduler, config: RolloutConfig, group_size: int = 1) -> list[Sequence]:
    """One step; checks the plan's invariants; returns the sequences that finished."""
    plan = sched.schedule()
    assert len(sched.running) <= max(config.max_num_seqs, group_size)
    assert plan.chunks, "nothing scheduled with work left"
    assert plan.num_tokens <= config.max_num_batched_tokens
    assert len({id(c.seq) for c in plan.chunks}) == len(plan.chunks), "a sequence scheduled twice"
    for c in plan.chunks:
        assert c.start == c.seq.num_computed and c.length >= 1
        assert config.max_prefill_chunk is None or c.length <= config.max_prefill_chunk
        assert len(c.seq.block_table) >= pages_for(c.start + c.length, config.page_size)
        for b in range(c.start // config.page_size, pages_for(c.start + c.length, config.page_size)):
            assert sched.blocks.ref_count(c.seq.block_table[b]) == 1, "writing into a shared page"
    sched.mark_computed(plan)
    sampled = []
    for c in plan.chunks:
        if c.samples:
            sampled.append(c.seq)
            if c.seq.request.pending_forks and c.seq is c.seq.request.seqs[0]:
                sampled += sched.fork(c.seq)
    append_tokens(sched, sampled, [fake_token(seq) for seq in sampled])
    finished = [seq for seq in sampled if seq.num_output_tokens >= seq.request.sampling.max_new_tokens]
    sched.finish(finished)
    running_tables = [s.block_table for s in sched.running]
    sched.blocks.check_consistency(running_tables)
    return finished


def expected_tokens(seq: Sequence, prompt: list[int], max_new: int) -> list[int]:
    ref = Sequence(seq.request, seq.sample_index, seq.seed, prompt)
    while ref.num_output_tokens < max_new:
        ref.tokens.append(fake_token(ref))
    return ref.tokens


def run_all(config: RolloutConfig, prompts: list[list[int]], n: int, max_new: int):
    bm = BlockManager(config.num_pages, config.page_size, config.enable_prefix_caching)
    sched = Scheduler(config, bm)
    requests = [make_request(i, p, n, config.share_prefix, max_new) for i, p in enumerate(prompts)]
    for r in requests:
        for seq in (r.seqs[:1] if r.pending_forks else r.seqs):
            sched.add(seq)
    steps = 0
    while sched.has_unfinished():
        fake_step(sched, config, n)
        steps += 1
        assert steps < 10_000
    assert bm.num_free == bm.num_pages
    return requests, sched


@pytest.mark.parametrize("seed", range(12))
def test_every_schedule_gives_the_same_tokens_and_consistent_pages(seed):
    rng = random.Random(seed)
    n, max_new = rng.choice([1, 3]), rng.randint(1, 12)
    prompts = [[rng.randrange(50) for _ in range(rng.randint(1, 20))] for _ in range(rng.randint(1, 6))]
    page_size = rng.choice([1, 2, 4, 16])
    longest = max(len(p) for p in prompts) + max_new
    config = RolloutConfig(page_size=page_size, max_num_seqs=rng.randint(1, 8),
                           max_num_batched_tokens=rng.randint(1, 40), max_prefill_chunk=rng.choice([None, 1, 3, 8]),
                           share_prefix=rng.random() < 0.5, enable_prefix_caching=rng.random() < 0.5,
                           num_pages=pages_for(longest, page_size) + rng.randint(0, 12))
    requests, _ = run_all(config, prompts, n, max_new)
    for r in requests:
        for seq in r.seqs:
            assert seq.tokens == expected_tokens(seq, r.prompt_tokens, max_new)


def test_token_budget_is_shared_by_decodes_then_a_prefill_chunk():
    config = RolloutConfig(page_size=4, num_pages=64, max_num_batched_tokens=8)
    bm = BlockManager(64, 4)
    sched = Scheduler(config, bm)
    decoders = [make_request(i, [1, 2], 1, True, 10).seqs[0] for i in range(5)]
    for seq in decoders:
        sched.add(seq)
    plan = sched.schedule()
    assert [c.length for c in plan.chunks] == [2, 2, 2, 2]    # budget 8: four prompts of 2, the fifth waits
    sched.mark_computed(plan)
    append_tokens(sched, [c.seq for c in plan.chunks], [0] * len(plan.chunks))
    long_prompt = make_request(9, list(range(20)), 1, True, 4).seqs[0]
    sched.add(long_prompt)
    plan = sched.schedule()
    assert [(c.seq, c.length) for c in plan.chunks] == [(s, 1) for s in decoders[:4]] + [(decoders[4], 2),
                                                                                        (long_prompt, 2)]


def test_out_of_pages_preempts_the_newest_sequence_which_is_recomputed_later():
    config = RolloutConfig(page_size=2, num_pages=6, max_num_batched_tokens=64, admission_watermark=0.0)
    bm = BlockManager(6, 2)
    sched = Scheduler(config, bm)
    seqs = [make_request(i, [1, 2, 3, 4], 1, True, 8).seqs[0] for i in range(3)]
    for seq in seqs:
        sched.add(seq)
    plan = sched.schedule()
    assert [c.seq for c in plan.chunks] == seqs and bm.num_free == 0
    sched.mark_computed(plan)
    append_tokens(sched, seqs, [7] * len(seqs))
    plan = sched.schedule()     # every sequence needs a third page: the newest is preempted
    assert [c.seq for c in plan.chunks] == seqs[:2] and plan.preempted == [seqs[2]]
    assert seqs[2].status is SeqStatus.WAITING and seqs[2].num_computed == 0 and seqs[2].block_table == []
    assert sched.waiting[0] is seqs[2] and sched.num_preemptions == 1
    sched.mark_computed(plan)
    sched.finish(seqs[:2])
    plan = sched.schedule()     # recomputed: prompt and the token sampled before preemption, in one chunk
    assert [(c.seq, c.start, c.length) for c in plan.chunks] == [(seqs[2], 0, 5)]


def test_prefix_cache_hit_never_covers_the_last_prompt_token():
    config = RolloutConfig(page_size=2, num_pages=16, enable_prefix_caching=True)
    bm = BlockManager(16, 2, enable_prefix_caching=True)
    sched = Scheduler(config, bm)
    first = make_request(0, [1, 2, 3, 4, 5, 6], 1, True, 1).seqs[0]
    sched.add(first)
    plan = sched.schedule()
    sched.mark_computed(plan)
    sched.finish([first])
    second = make_request(1, [1, 2, 3, 4, 5, 6], 1, True, 1).seqs[0]
    third = make_request(2, [1, 2, 3, 4, 9], 1, True, 1).seqs[0]
    sched.add(second)
    sched.add(third)
    plan = sched.schedule()
    assert [(c.start, c.length) for c in plan.chunks] == [(4, 2), (4, 1)]
    assert bm.prefix_hits == 4


def test_max_num_seqs_counts_the_samples_a_leader_will_fork():
    config = RolloutConfig(page_size=4, num_pages=64, max_num_seqs=4)
    sched = Scheduler(config, BlockManager(64, 4))
    a = make_request(0, [1, 2, 3], 3, True, 5)
    b = make_request(1, [1, 2, 3], 3, True, 5)
    sched.add(a.seqs[0])
    sched.add(b.seqs[0])
    plan = sched.schedule()
    assert [c.seq for c in plan.chunks] == [a.seqs[0]]   # b's group of 3 would exceed 4 running
