"""TP=1 vs 2 vs 4 on 4 gloo processes: logprobs, entropies, loss and every gradient bitwise, for a
small model of each family (and bf16 for qwen3 and qwen3_moe; Qwen3-MoE with dense and sparse layers mixed),
the MoE routing identical everywhere, and the tensor-parallel experts alone over a class of shapes.
One process group for the whole module."""

import pytest

from rlalign.distributed import spawn
from tests.bitwise import assert_bitwise_equal, assert_close_report
from tests.distributed import workers

CASES = workers.CASES
IDS = [f"{f}-{d}" for f, d in CASES]


@pytest.fixture(scope="module")
def ranks():
    """Every rank's results: rank r is in TP group r // t of each degree t."""
    return spawn(workers.tp_suite, 4, CASES, (1, 2, 4))


@pytest.fixture(scope="module")
def matrix(ranks):
    return [r["matrix"] for r in ranks]


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_outputs_bitwise_across_tp(matrix, case, tp):
    res = matrix[0][case]
    for key in ("lp", "ent", "loss"):
        assert_bitwise_equal(res[tp][key], res[1][key], f"{case} {key} TP={tp} vs TP=1")


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_gradients_bitwise_across_tp(matrix, case, tp):
    res = matrix[0][case]
    ref = res[1]["grads"]
    assert set(res[tp]["grads"]) == set(ref)
    for name, grad in res[tp]["grads"].items():
        assert_bitwise_equal(grad, ref[name], f"{case} grad {name} TP={tp} vs TP=1")


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_every_rank_holds_the_same_results(matrix, case):
    for rank in range(1, 4):
        for tp in (2, 4):
            mine, first = matrix[rank][case][tp], matrix[0][case][tp]
            assert_bitwise_equal(mine["lp"], first["lp"], f"rank {rank} TP={tp} lp")
            for name, grad in mine["grads"].items():
                assert_bitwise_equal(grad, first["grads"][name], f"rank {rank} TP={tp} grad {name}")


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_forward_equals_the_unsharded_model(matrix, case):
    """The rollout side runs the unsharded model: its logprobs and entropies are the TP bits."""
    res = matrix[0][case]
    assert_bitwise_equal(res[1]["lp"], res["plain"]["lp"], f"{case} lp")
    assert_bitwise_equal(res[1]["ent"], res["plain"]["ent"], f"{case} entropy")


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_gradients_of_the_unsharded_model_are_close_not_bitwise(matrix, case):
    """The canonical backward partitions (dX over N, dh over vocab segments) change the order of
    some sums: the unsharded model's gradients agree to rounding only (docs/distributed.md)."""
    res = matrix[0][case]
    tol = 2e-2 if case[1] == "bfloat16" else 1e-4
    differ = 0
    for name, grad in res[1]["grads"].items():
        plain = res["plain"]["grads"][name]
        scale = float(plain.abs().max()) or 1.0
        assert_close_report(grad, plain, atol=tol * scale, rtol=tol, what=f"{case} grad {name}")
        differ += not grad.equal(plain)
    assert differ > 0   # if this ever fails the docs' statement is out of date


MOE_CASES = [c for c in CASES if c[0].startswith("qwen3_moe")]
SPARSE_LAYERS = {"qwen3_moe": [0, 2], "qwen3_moe-step2": [1, 3]}   # mlp_only_layers=[1]; decoder_sparse_step=2


@pytest.mark.parametrize("case", MOE_CASES, ids=[f"{f}-{d}" for f, d in MOE_CASES])
def test_moe_routing_is_the_same_on_every_rank_and_degree(matrix, case):
    """The replicated router sees the replicated hidden rows: every rank of every degree routes every token as
    the unsharded model does, and only the sparse layers route."""
    ref = matrix[0][case]["plain"]["routing"]
    assert sorted(ref) == SPARSE_LAYERS[case[0]]
    for rank in range(4):
        for tp in (1, 2, 4):
            routing = matrix[rank][case][tp]["routing"]
            assert sorted(routing) == sorted(ref)
            for layer, experts in routing.items():
                assert_bitwise_equal(experts, ref[layer], f"rank {rank} TP={tp} layer {layer} routing")


@pytest.mark.parametrize("shape", workers.EXPERT_SHAPES, ids=lambda s: "-".join(map(str, s)))
def test_parallel_experts_bitwise_over_shapes(ranks, shape):
    """TensorParallelExperts alone: y equals the unsharded experts' (ops.moe_experts); dx and every expert's
    weight gradient are the same bits at TP 1, 2, 4 on every rank; unused experts get no gradient at any degree."""
    for rank in range(4):
        res = ranks[rank]["experts"][shape]
        ref = ranks[0]["experts"][shape][1]
        assert set(res["plain"]["grads"]) == set(ref["grads"])
        for tp in (1, 2, 4):
            assert_bitwise_equal(res[tp]["y"], res["plain"]["y"], f"rank {rank} {shape} y TP={tp} vs unsharded")
            assert_bitwise_equal(res[tp]["dx"], ref["dx"], f"rank {rank} {shape} dx TP={tp} vs TP=1")
            assert set(res[tp]["grads"]) == set(ref["grads"])
            for name, grad in res[tp]["grads"].items():
                assert_bitwise_equal(grad, ref["grads"][name], f"rank {rank} {shape} grad {name} TP={tp} vs TP=1")
