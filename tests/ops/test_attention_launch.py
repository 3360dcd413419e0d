"""The decode launch of paged attention (rlalign/ops/triton_backend/attention.py) under the CPU interpreter.

A decode-tile paged call runs either one program per (sequence, kv head) item walking all its key splits, or
the split launch (several programs per item + a merge kernel). Checked here, as properties over shapes:

* the choice (:func:`use_split_programs`) is a function of the batch's shape only: the same shapes with other
  contexts, other values or inside a CUDA-graph capture take the same launch; it is monotone (more sequences,
  or a wider block table of several splits, never turn the split launch on); never taken for one split;
* both launches, forced, and the op's own choice give bit-identical fp32 outputs at every batch size around
  the threshold (the interpreter's SM count is 4; one kv head, so batch = items), with 1..4 programs per item;
* the fused-merge split launch (no merge kernel: each item's last program folds its partials) gives the bits of
  the two-kernel split launch and the per-item one at batch 1..12, contexts at / around the split boundaries,
  any fold width and unroll, 1 or 2 kv heads, and again on the same arrival counters with other contexts (they
  are reset); with several query tiles per item on a 16-row tile;
* the arrival counters are never allocated inside a CUDA-graph capture (refused with a clear error);
* the streamed launch (whole items in one loop per program, cut at item starts) gives the per-item launch's bits
  at batch 1..14 with 1..3 programs per SM (programs with several items, one, or none), sequences without a
  query, up to a tile of query tokens per sequence; the op takes it by the shapes alone (contexts, values and a
  capture do not change the choice), never for two query tiles per sequence.

The interpreter runs fp32 with a row-wise dot (see attention._dot); the GPU's bits are tests/cuda's. One
subprocess (the interpreter must be on before triton is imported); hypothesis runs inside it, derandomized.
"""

from __future__ import annotations

import pytest

from tests.workers import run_worker

pytest.importorskip("triton")
pytest.importorskip("hypothesis")

CHECK = r'''
import dataclasses, json, os, traceback
os.environ["TRITON_INTERPRET"] = "1"
from tests.ops.test_triton_interpret import _patch_interpreter
_patch_interpreter()
import torch
from hypothesis import Phase, given, settings, strategies as st
from rlalign.contract.bits import bits_equal, describe_difference
from rlalign.contract.spec import ATTN_KV_SPLIT as S
from rlalign.ops import capturing_graph
from rlalign.ops.triton_backend import _common as C, attention as A
from rlalign.ops.triton_backend._common import num_sms

# no shrinking: every example runs interpreted kernels; the assertion messages name the shapes
SETTINGS = dict(deadline=None, derandomize=True, database=None, phases=[Phase.explicit, Phase.generate])
i32 = lambda xs: torch.tensor(xs, dtype=torch.int32)
chosen = []
_forward = A._forward


def recording_forward(*args, **kwargs):
    chosen.append(args[14] if len(args) > 14 else kwargs.get("split_programs", False))
    return _forward(*args, **kwargs)


A._forward = recording_forward


def cache_for(lens, page, hkv, d, g):
    """A NaN-filled cache holding random K/V of every context in shuffled pages -> (kc, vc, table)."""
    per = [max(-(-n // page), 1) for n in lens]
    width = max(per)
    total = sum(per) + 3
    kc = torch.full((total, page, hkv, d), float("nan"))
    vc = torch.full_like(kc, float("nan"))
    order = torch.randperm(total, generator=g).tolist()
    table = torch.zeros(len(lens), width, dtype=torch.int32)
    for s, n in enumerate(lens):
        for j in range(per[s]):
            pid = order.pop()
            table[s, j] = pid
            keys = min(page, n - j * page)
            if keys > 0:
                kc[pid, :keys] = torch.randn(keys, hkv, d, generator=g)
                vc[pid, :keys] = torch.randn(keys, hkv, d, generator=g)
    return kc, vc, table


def launch_of(q, kc, vc, table, lens, capturing=False):
    """The launch the op's paged_forward picks for this call (recorded from its _forward)."""
    chosen.clear()
    cu = i32(list(range(len(lens) + 1)))
    if capturing:
        with capturing_graph(max_query_len=1):
            A.paged_forward(q, kc, vc, table, i32(lens), cu, 0.25)
    else:
        A.paged_forward(q, kc, vc, table, i32(lens), cu, 0.25)
    return chosen[-1]


@settings(max_examples=40, **SETTINGS)
@given(n_seq=st.integers(0, 600), max_q=st.integers(1, 64), hkv=st.sampled_from([1, 2, 8]),
       group=st.sampled_from([1, 3, 4, 8]), table_keys=st.integers(1, 40000), sms=st.sampled_from([1, 4, 132]))
def chooser_monotone(n_seq, max_q, hkv, group, table_keys, sms):
    def split(n, keys):
        return A.use_split_programs(A.decode_items(max_q, n, hkv * group, hkv), keys,
                                    A.split_scratch_bytes(max_q * n, hkv * group, 128, keys), sms)
    here = split(n_seq, table_keys)
    assert here == split(n_seq, table_keys), "the choice is not deterministic"
    if not here:
        assert not split(n_seq + 1, table_keys), f"more sequences turned the split launch on at {n_seq + 1}"
        if table_keys > S:
            assert not split(n_seq, table_keys + S), "a wider table turned the split launch on"
    if table_keys <= S:
        assert not here, f"split launch for a table of {table_keys} keys (one split)"


@settings(max_examples=8, **SETTINGS)
@given(n_seq=st.integers(1, 7), page=st.sampled_from([1, 16, 64]), seed=st.integers(0, 2 ** 16), data=st.data())
def chooser_shape_only(n_seq, page, seed, data):
    g = torch.Generator().manual_seed(seed)
    width_keys = data.draw(st.integers(S + 1, 3 * S), label="table keys")
    lens = [width_keys] + [data.draw(st.integers(1, width_keys), label="context") for _ in range(n_seq - 1)]
    kc, vc, table = cache_for(lens, page, 1, 8, g)
    q = torch.randn(n_seq, 2, 8, generator=g)
    want = A.use_split_programs(A.decode_items(1, n_seq, 2, 1), table.shape[1] * page,
                                A.split_scratch_bytes(n_seq, 2, 8, table.shape[1] * page), num_sms(0))
    got = [launch_of(q, kc, vc, table, lens),
           launch_of(torch.randn(n_seq, 2, 8, generator=g), kc, vc, table, [1] * n_seq),   # other contexts/values
           launch_of(q, kc, vc, table, lens, capturing=True)]
    assert got == [want] * 3, f"launch chosen {got}, the shapes say {want} (batch {n_seq}, page {page})"


@settings(max_examples=6, **SETTINGS)
@given(n_seq=st.integers(1, 6), page=st.sampled_from([1, 16, 64]), group=st.sampled_from([1, 3]),
       d=st.sampled_from([2, 16]), seed=st.integers(0, 2 ** 16), data=st.data())
def launches_same_bits(n_seq, page, group, d, seed, data):
    g = torch.Generator().manual_seed(seed)
    lens = [data.draw(st.integers(1, 2 * S + 70), label="context") for _ in range(n_seq)]
    kc, vc, table = cache_for(lens, page, 1, d, g)
    q = torch.randn(n_seq, group, d, generator=g)
    cu = i32(list(range(n_seq + 1)))
    item = A.paged_forward(q, kc, vc, table, i32(lens), cu, 0.3, split_programs=False)
    outs = {"op's choice": A.paged_forward(q, kc, vc, table, i32(lens), cu, 0.3)}
    for progs in (None, 1, data.draw(st.integers(2, 4), label="programs per item")):
        outs[f"split, {progs or 'default'} programs per item"] = A.paged_forward(
            q, kc, vc, table, i32(lens), cu, 0.3, split_programs=True, progs_per_item=progs)
    for name, out in outs.items():
        assert bits_equal(out, item), (f"batch {n_seq} contexts {lens} page {page} G={group} D={d}: {name} vs "
                                       f"the per-item launch: {describe_difference(out, item)}")
    assert bool(torch.isfinite(item).all()), "non-finite output (a NaN page outside a context was read)"


def counters_zero():
    """Every arrival-counter buffer is back at zero (the last program of each item reset its counter)."""
    return all(int(buf.abs().max()) == 0 for buf in C._ARRIVAL_COUNTERS.values())


# the split launch with attn_merge_kernel (SPLIT_DECODE folds in the item's last program since 2026-12-02)
TWO_KERNEL = A.DecodeLaunch(**{**A.SPLIT_DECODE.__dict__, "fused_merge": False})
CONTEXT = st.one_of(st.sampled_from([1, S - 1, S, S + 1, 2 * S - 1, 2 * S, 2 * S + 1]), st.integers(1, S + 70))


@settings(max_examples=3, **SETTINGS)
@given(n_seq=st.integers(1, 12), page=st.sampled_from([1, 16, 64]), group=st.sampled_from([1, 3]),
       hkv=st.sampled_from([1, 2]), seed=st.integers(0, 2 ** 16), data=st.data())
def fused_merge_same_bits(n_seq, page, group, hkv, seed, data):
    """The fused-merge split launch == the two-kernel split launch == the per-item launch, raw bits, with
    1..4 programs per item; a second launch on the same counter buffer with other contexts (the reset)."""
    import dataclasses
    g = torch.Generator().manual_seed(seed)
    fused = dataclasses.replace(A.SPLIT_DECODE, fused_merge=True,
                                fold_rows=data.draw(st.sampled_from([4, 16, 64]), label="fold rows"),
                                merge_unroll=data.draw(st.sampled_from([1, 4]), label="unroll"))
    lens = [data.draw(CONTEXT, label="context") for _ in range(n_seq)]
    kc, vc, table = cache_for(lens, page, hkv, 8, g)
    cu = i32(list(range(n_seq + 1)))
    progs = data.draw(st.sampled_from([None, 1, 2, 3, 4]), label="programs per item")
    buffers = None
    for launch_no, ctx in enumerate((lens, [max(1, n - data.draw(st.integers(0, 3), label="shorter")) for n in lens])):
        q = torch.randn(n_seq, group * hkv, 8, generator=g)
        item = A.paged_forward(q, kc, vc, table, i32(ctx), cu, 0.3, split_programs=False)
        two = item if launch_no else A.paged_forward(q, kc, vc, table, i32(ctx), cu, 0.3, split_programs=True,
                                                      progs_per_item=progs, launch=TWO_KERNEL)
        one = A.paged_forward(q, kc, vc, table, i32(ctx), cu, 0.3, split_programs=True, progs_per_item=progs,
                              launch=fused)
        where = (f"launch {launch_no}: batch {n_seq} contexts {ctx} page {page} G={group} Hkv={hkv} {progs} "
                 f"programs {fused}")
        assert bits_equal(two, item), f"{where}: two-kernel split vs per-item: {describe_difference(two, item)}"
        assert bits_equal(one, item), f"{where}: fused split vs per-item: {describe_difference(one, item)}"
        assert counters_zero(), f"{where}: arrival counters not reset"
        ids = {k: v.data_ptr() for k, v in C._ARRIVAL_COUNTERS.items()}
        assert buffers is None or ids == buffers, f"{where}: the counter buffer was reallocated"
        buffers = ids


def multi_query_case(n_seq, max_queries, seed, data):
    """1..max_queries query tokens per sequence after a CONTEXT draw, 2 kv heads of 3 query heads, D = 8, page 16
    -> (queries, contexts, paged_forward's positional arguments up to the scale)."""
    g = torch.Generator().manual_seed(seed)
    n_q = [data.draw(st.integers(1, max_queries), label="queries") for _ in range(n_seq)]
    lens = [q_ + data.draw(CONTEXT, label="context before the queries") for q_ in n_q]
    kc, vc, table = cache_for(lens, 16, 2, 8, g)
    q = torch.randn(sum(n_q), 6, 8, generator=g)
    cu = i32([0] + [sum(n_q[:i + 1]) for i in range(n_seq)])
    return n_q, lens, (q, kc, vc, table, i32(lens), cu, 0.3)


@settings(max_examples=3, **SETTINGS)
@given(n_seq=st.integers(1, 3), seed=st.integers(0, 2 ** 16), data=st.data())
def fused_merge_multi_tile(n_seq, seed, data):
    """Several query tokens per sequence on a 16-row tile (G = 3: 5 tokens a tile, so up to 3 tiles an item)
    and 2 kv heads: every (tile, sequence, kv head) item has its own counter; fused == two-kernel == per-item."""
    import dataclasses
    n_q, lens, args = multi_query_case(n_seq, 12, seed, data)
    tile = (16, 4, 3)
    item = A.paged_forward(*args, tile=tile, split_programs=False)
    two = A.paged_forward(*args, tile=tile, split_programs=True, launch=dataclasses.replace(TWO_KERNEL, tile=tile))
    one = A.paged_forward(*args, tile=tile, split_programs=True,
                          launch=dataclasses.replace(A.SPLIT_DECODE, tile=tile, fused_merge=True, fold_rows=4))
    where = f"queries {n_q} contexts {lens}"
    assert bits_equal(two, item), f"{where}: two-kernel split vs per-item: {describe_difference(two, item)}"
    assert bits_equal(one, item), f"{where}: fused split vs per-item: {describe_difference(one, item)}"
    assert counters_zero(), f"{where}: arrival counters not reset"


def counters_refused_in_a_capture():
    """A capture allocates nothing: a fused launch of a size class no eager launch has used fails closed."""
    from rlalign.contract.errors import ContractError
    saved, capturing = dict(C._ARRIVAL_COUNTERS), torch.cuda.is_current_stream_capturing
    C._ARRIVAL_COUNTERS.clear()
    torch.cuda.is_current_stream_capturing = lambda: True
    try:
        A.arrival_counters(torch.device("cuda", 0), 10)
        raise AssertionError("arrival counters allocated inside a capture")
    except ContractError as exc:
        assert "run the decode step once before capturing" in str(exc), str(exc)
    finally:
        torch.cuda.is_current_stream_capturing = capturing
        assert not C._ARRIVAL_COUNTERS, "a counter buffer was allocated inside the capture"
        C._ARRIVAL_COUNTERS.update(saved)


def counters_one_buffer_per_size_class():
    """Zeroed int32, at least the items asked for, the same buffer for every launch of its size class."""
    small, again, big = (A.arrival_counters(torch.device("cpu"), n) for n in (3, 1000, 5000))
    assert small is again and small.dtype == torch.int32 and small.numel() >= 1000, small.shape
    assert big is not small and big.numel() >= 5000 and int(big.abs().max()) == 0, big.shape


def launch_fields_checked():
    """A DecodeLaunch the kernels cannot take is refused where it is made, with one line naming the field."""
    for bad, field in ((dict(fold_rows=3), "fold_rows=3"), (dict(fold_rows=0), "fold_rows=0"),
                       (dict(merge_unroll=0), "merge_unroll=0"), (dict(max_registers=300), "max_registers=300")):
        try:
            A.DecodeLaunch(**bad)
            raise AssertionError(f"DecodeLaunch({bad}) accepted")
        except ValueError as exc:
            assert field in str(exc) and "\n" not in str(exc), str(exc)


@settings(max_examples=6, **SETTINGS)
@given(n_seq=st.integers(1, 14), page=st.sampled_from([1, 16, 64]), group=st.sampled_from([1, 3, 4]),
       hkv=st.sampled_from([1, 2]), per_sm=st.integers(1, 3), seed=st.integers(0, 2 ** 16), data=st.data())
def stream_same_bits(n_seq, page, group, hkv, per_sm, seed, data):
    """The streamed launch (4 x per_sm programs here, so items share programs, split across them at item starts,
    or leave programs empty) == the per-item launch, raw bits; sequences without a query in the batch too."""
    g = torch.Generator().manual_seed(seed)
    lens = [data.draw(CONTEXT, label="context") for _ in range(n_seq)]
    queries = [data.draw(st.sampled_from([0, 1, 1, 1]), label="queries") for _ in range(n_seq)]
    if not any(queries):
        queries[0] = 1
    kc, vc, table = cache_for(lens, page, hkv, 8, g)
    cu = i32([0] + [sum(queries[:i + 1]) for i in range(n_seq)])
    q = torch.randn(sum(queries), group * hkv, 8, generator=g)
    launch = dataclasses.replace(A.STREAM_DECODE, programs_per_sm=per_sm)
    item = A.paged_forward(q, kc, vc, table, i32(lens), cu, 0.3, split_programs=False, stream=False)
    streamed = A.paged_forward(q, kc, vc, table, i32(lens), cu, 0.3, stream=True, launch=launch)
    where = f"batch {n_seq} contexts {lens} queries {queries} page {page} G={group} Hkv={hkv} {per_sm} programs/SM"
    assert bits_equal(streamed, item), f"{where}: streamed vs per-item: {describe_difference(streamed, item)}"


@settings(max_examples=3, **SETTINGS)
@given(n_seq=st.integers(1, 4), seed=st.integers(0, 2 ** 16), data=st.data())
def stream_multi_query(n_seq, seed, data):
    """Up to a tile's worth of query tokens per sequence (a 16-row tile, G = 3: 5 tokens) on the streamed
    launch == the per-item launch on the same tile, raw bits."""
    n_q, lens, args = multi_query_case(n_seq, 5, seed, data)
    tile = (16, 4, 3)
    item = A.paged_forward(*args, tile=tile, split_programs=False, stream=False)
    streamed = A.paged_forward(*args, tile=tile, stream=True)
    assert bits_equal(streamed, item), (f"queries {n_q} contexts {lens}: streamed vs per-item: "
                                        f"{describe_difference(streamed, item)}")


def stream_chosen_by_shape():
    """The op takes the streamed launch from STREAM_MIN_ITEMS_PER_SM items per SM on (the interpreter has 4
    SMs), whatever the contexts or values and inside a capture; the split launch where it applies; never for
    more than one query tile per sequence; use_stream is monotone in the items."""
    streamed = []
    real = A._stream_forward

    def recording(*args, **kwargs):
        streamed.append(True)
        return real(*args, **kwargs)
    A._stream_forward = recording
    try:
        sms = num_sms(0)
        for n_seq, want in ((A.STREAM_MIN_ITEMS_PER_SM * sms - 1, False), (A.STREAM_MIN_ITEMS_PER_SM * sms, True)):
            g = torch.Generator().manual_seed(n_seq)
            lens = [int(x) for x in torch.randint(1, 300, (n_seq,), generator=g)]
            kc, vc, table = cache_for(lens, 16, 1, 8, g)
            cu = i32(list(range(n_seq + 1)))
            kind = A.decode_launch(1, n_seq, n_seq, 2, 1, 8, table.shape[1] * 16, kc.numel(), sms)
            assert (kind == "stream") == want, f"decode_launch says {kind} at batch {n_seq}, want streamed {want}"
            for ctx, capturing in ((lens, False), ([1] * n_seq, False), (lens, True)):
                streamed.clear()
                q = torch.randn(n_seq, 2, 8, generator=g)
                if capturing:
                    with capturing_graph(max_query_len=1):
                        A.paged_forward(q, kc, vc, table, i32(ctx), cu, 0.25)
                else:
                    A.paged_forward(q, kc, vc, table, i32(ctx), cu, 0.25)
                assert bool(streamed) == want, f"batch {n_seq} (contexts {ctx[:3]}..., capture {capturing}): " \
                                               f"streamed {bool(streamed)}, want {want}"
        streamed.clear()   # two query tokens x 40 heads per kv head: two 64-row tiles, never streamed
        n_seq = A.STREAM_MIN_ITEMS_PER_SM * sms
        kc, vc, table = cache_for([300] * n_seq, 16, 1, 8, torch.Generator().manual_seed(0))
        A.paged_forward(torch.randn(2 * n_seq, 40, 8), kc, vc, table, i32([300] * n_seq),
                        i32(list(range(0, 2 * n_seq + 1, 2))), 0.25)
        assert not streamed, "a call of two query tiles per sequence took the streamed launch"
    finally:
        A._stream_forward = real
    for items in range(0, 200, 7):
        if A.use_stream(items, 10 ** 6, 4):
            assert A.use_stream(items + 1, 10 ** 6, 4), f"use_stream not monotone at {items} items"
    assert not A.use_stream(10 ** 6, 2 ** 31, 4), "a cache past int32 offsets taken by the streamed launch"
    wide = A.stream_work_bytes(512, 8, 32768, 64)   # 512 sequences x 8 kv heads at a 32k-key table: 1.1 GB
    assert wide > A.STREAM_WORK_MAX_BYTES and not A.use_stream(4096, 10 ** 6, 4, wide), wide
    bench_workloads_take_the_streamed_launch()


def bench_workloads_take_the_streamed_launch():
    """Every CUDA workload of `rlalign bench rollout` at its decode batch, with the benchmark's max_model_len (the
    block table the engine sizes from it), takes the streamed launch on an H200 (132 SMs): the rule's inputs are
    the table's width, not the contexts (the rule was first checked against a 640-key table while the
    benchmark's was 40,960 keys wide, and the benchmark silently ran the per-item launch)."""
    import argparse
    from rlalign.bench import rollout as R
    from rlalign.rollout.block_manager import pages_for
    for name, w in R.WORKLOADS.items():
        if w["preset"] == "tiny":
            continue
        cfg = R.PRESETS[w["preset"]]
        hq, hkv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
        high = int(w["prompt_len"].split(":")[1])
        work = R.Workload([[0] * high], w["samples"], w["new_tokens"])
        table_keys = pages_for(R.max_model_len(argparse.Namespace(), work, None), 16) * 16
        for n_seq in (w["prompts"] * w["samples"] // 2, w["prompts"] * w["samples"]):   # mid-run and full batch
            elements = n_seq * table_keys * hkv * d   # every sequence's cache at the table's full width
            kind = A.decode_launch(1, n_seq, n_seq, hq, hkv, d, table_keys, elements, 132)
            assert kind == "stream", f"{name}: {n_seq} sequences, a {table_keys}-key table: {kind}"


CHECKS = (chooser_monotone, chooser_shape_only, launches_same_bits, fused_merge_same_bits, fused_merge_multi_tile,
          counters_refused_in_a_capture, counters_one_buffer_per_size_class, launch_fields_checked, stream_same_bits,
          stream_multi_query, stream_chosen_by_shape)
results = {}
for fn in CHECKS:
    try:
        fn()
        results[fn.__name__] = "ok"
    except BaseException:
        results[fn.__name__] = traceback.format_exc()[-3000:]
print("RESULTS " + json.dumps(results))
'''


@pytest.fixture(scope="module")
def results():
    return run_worker(["-c", CHECK], interpret=True, timeout=900)


@pytest.mark.parametrize("check", ["chooser_monotone", "chooser_shape_only", "launches_same_bits",
                                   "fused_merge_same_bits", "fused_merge_multi_tile",
                                   "counters_refused_in_a_capture", "counters_one_buffer_per_size_class",
                                   "launch_fields_checked", "stream_same_bits", "stream_multi_query",
                                   "stream_chosen_by_shape"])
def test_decode_launch(results, check):
    assert results[check] == "ok", results[check]

