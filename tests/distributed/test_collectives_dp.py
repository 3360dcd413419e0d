"""Deterministic collectives and data-parallel gradients on 2 gloo processes (one spawn per module)."""

import pytest
import torch

from rlalign.distributed import spawn
from rlalign.distributed.collectives import tree_reduce
from rlalign.distributed.data_parallel import shard_for_rank
from rlalign.distributed.launch import Group
from tests.bitwise import assert_bitwise_equal, assert_close_report
from tests.distributed import workers


@pytest.fixture(scope="module")
def ranks():
    return spawn(workers.two_rank_suite, 2)


def test_all_gather_is_rank_ordered_copies(ranks):
    xs = [r["collectives"]["x"] for r in ranks]
    for r in ranks:
        assert_bitwise_equal(r["collectives"]["gathered"], torch.stack(xs))
        assert_bitwise_equal(r["collectives"]["ragged"], torch.tensor([0.0, 0.0, 1.0]))


def test_merge_and_all_reduce_are_the_fixed_tree_on_every_rank(ranks):
    expected = tree_reduce([r["collectives"]["x"] for r in ranks])
    for r in ranks:
        assert_bitwise_equal(r["collectives"]["merged"], expected, "merge_ranks")
        assert_bitwise_equal(r["collectives"]["all_reduce"], expected, "all_reduce_fixed")


def test_tree_reduce_order():
    a, b, c = torch.tensor([1e8]), torch.tensor([1.0]), torch.tensor([-1e8])
    assert_bitwise_equal(tree_reduce([a, b, c]), (a + b) + c)          # odd element carried up
    assert_bitwise_equal(tree_reduce([a, b, c, b]), (a + b) + (c + b))


def test_tp2_on_two_processes(ranks):
    res = ranks[0]["tp"][("llama", "float32")]
    assert_bitwise_equal(res[2]["lp"], res[1]["lp"], "lp")
    for name, grad in res[2]["grads"].items():
        assert_bitwise_equal(grad, res[1]["grads"][name], name)


def test_dp_gradients_run_to_run_and_rank_to_rank(ranks):
    first = ranks[0]["dp"]["runs"][0]["reduced"]
    for r in ranks:
        for run in r["dp"]["runs"]:
            for name, grad in run["reduced"].items():
                assert_bitwise_equal(grad, first[name], f"DP grad {name}")


def test_dp_gradient_buckets_change_no_bit(ranks):
    """Each element is the tree of its ranks' values wherever it sits: any bucket size gives the one-buffer bits."""
    whole = ranks[0]["dp"]["runs"][0]["reduced"]
    sizes = sorted(p.numel() for p in workers.dp_model().parameters())
    assert sizes[0] < 300 < sizes[-1] and sum(sizes) > 5000   # the buckets split the model three ways
    for r in ranks:
        for size, grads in r["dp"]["bucketed"].items():
            for name, grad in grads.items():
                assert_bitwise_equal(grad, whole[name], f"bucket {size}: {name}")


def test_dp2_equals_one_process_accumulating_the_same_shards_in_the_same_tree(ranks):
    """DP=1 reproduces DP=2 when it accumulates each rank's micro-batches in a separate buffer and
    merges the buffers by the same tree (fp32, one rounding)."""
    samples = workers.dp_samples()
    shards = [workers.accumulate(workers.dp_model(), shard_for_rank(samples, Group(None, r, 2)), micro_batches=2)
              for r in range(2)]
    reduced = ranks[0]["dp"]["runs"][0]["reduced"]
    for name, grad in reduced.items():
        assert_bitwise_equal(shards[0][name], ranks[0]["dp"]["runs"][0]["local"][name], f"local {name}")
        merged = tree_reduce([shards[0][name].float(), shards[1][name].float()]).to(grad.dtype)
        assert_bitwise_equal(grad, merged, f"tree of shards {name}")


def test_dp2_vs_plain_accumulation_close_not_bitwise(ranks):
    """One buffer accumulating all 4 micro-batches in order sums in another order: equal to rounding."""
    plain = workers.accumulate(workers.dp_model(), workers.dp_samples(), micro_batches=4)
    reduced = ranks[0]["dp"]["runs"][0]["reduced"]
    for name, grad in reduced.items():
        assert_close_report(grad, plain[name], atol=1e-6 * (float(plain[name].abs().max()) or 1.0), rtol=1e-5,
                            what=name)


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_moe"])
def test_native_profile_tp2_agrees_with_the_unsharded_native_model_to_rounding(ranks, family):
    """The native baseline (vendor GEMMs, stock all-reduce) is correct but promises no bits."""
    res = ranks[0]["native"][family]
    assert_close_report(res[2]["lp"], res["plain"]["lp"], atol=1e-4, rtol=1e-5, what="logprob")
    assert_close_report(res[2]["ent"], res["plain"]["ent"], atol=1e-4, rtol=1e-5, what="entropy")
    for name, grad in res[2]["grads"].items():
        plain = res["plain"]["grads"][name]
        assert_close_report(grad, plain, atol=1e-4 * (float(plain.abs().max()) or 1.0), rtol=1e-4, what=name)


@pytest.mark.parametrize("which", [0, 1])
def test_a_rank_aborting_in_teardown_after_its_work_does_not_fail_the_job(which):
    """A finished job's ranks leave once their results are saved: an abort in the interpreter's teardown (gloo's
    threads did, at random, on a loaded machine) cannot turn it into a failure, whichever rank it hits."""
    assert spawn(workers.abort_at_teardown, 2, which) == [0, 1]
