"""TP=1 vs 2 vs 4 on 4 gloo processes: logprobs, entropies, loss and every gradient bitwise, for a
small model of each family (and bf16 for qwen3). One process group for the whole module."""

import pytest

from rlalign.distributed import spawn
from tests.bitwise import assert_bitwise_equal, assert_close_report
from tests.distributed import workers

CASES = workers.CASES
IDS = [f"{f}-{d}" for f, d in CASES]


@pytest.fixture(scope="module")
def ranks():
    """Every rank's results: rank r is in TP group r // t of each degree t."""
    return spawn(workers.tp_matrix, 4, CASES, (1, 2, 4))


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_outputs_bitwise_across_tp(ranks, case, tp):
    res = ranks[0][case]
    for key in ("lp", "ent", "loss"):
        assert_bitwise_equal(res[tp][key], res[1][key], f"{case} {key} TP={tp} vs TP=1")


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_gradients_bitwise_across_tp(ranks, case, tp):
    res = ranks[0][case]
    ref = res[1]["grads"]
    assert set(res[tp]["grads"]) == set(ref)
    for name, grad in res[tp]["grads"].items():
        assert_bitwise_equal(grad, ref[name], f"{case} grad {name} TP={tp} vs TP=1")


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_every_rank_holds_the_same_results(ranks, case):
    for rank in range(1, 4):
        for tp in (2, 4):
            mine, first = ranks[rank][case][tp], ranks[0][case][tp]
            assert_bitwise_equal(mine["lp"], first["lp"], f"rank {rank} TP={tp} lp")
            for name, grad in mine["grads"].items():
                assert_bitwise_equal(grad, first["grads"][name], f"rank {rank} TP={tp} grad {name}")


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_forward_equals_the_unsharded_model(ranks, case):
    """The rollout side runs the unsharded model: its logprobs and entropies are the TP bits."""
    res = ranks[0][case]
    assert_bitwise_equal(res[1]["lp"], res["plain"]["lp"], f"{case} lp")
    assert_bitwise_equal(res[1]["ent"], res["plain"]["ent"], f"{case} entropy")


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_gradients_of_the_unsharded_model_are_close_not_bitwise(ranks, case):
    """The canonical backward partitions (dX over N, dh over vocab segments) change the order of
    some sums: the unsharded model's gradients agree to rounding only (docs/distributed.md)."""
    res = ranks[0][case]
    tol = 2e-2 if case[1] == "bfloat16" else 1e-4
    differ = 0
    for name, grad in res[1]["grads"].items():
        plain = res["plain"]["grads"][name]
        scale = float(plain.abs().max()) or 1.0
        assert_close_report(grad, plain, atol=tol * scale, rtol=tol, what=f"{case} grad {name}")
        differ += not grad.equal(plain)
    assert differ > 0   # if this ever fails the docs' statement is out of date
