"""parallel.shard=grads (rlalign.train.sharding): each data-parallel rank holds the masters and AdamW state of its
range and reduces, clips and steps only that range; the result is the unsharded data-parallel step's bits.

One spawn of 4 gloo processes (tests/distributed/shard_workers.py): dp = 2 and 4, a dense bf16 model with fp32
masters and a bf16 Qwen3-MoE; weights, grad norms, masters and the AdamW state (in the unsharded
format a checkpoint stores) compared in raw bits; the dp=2 sharded state resumed at dp=4."""

import pytest
import torch

from rlalign.distributed import spawn
from tests.bitwise import assert_bitwise_equal
from tests.distributed import shard_workers


@pytest.fixture(scope="module")
def ranks():
    return spawn(shard_workers.shard_suite, 4)


def _assert_state_equal(got: dict, want: dict, what: str) -> None:
    assert len(got["norms"]) == len(want["norms"])
    for k, (a, b) in enumerate(zip(got["norms"], want["norms"])):
        assert_bitwise_equal(a, b, f"{what}: grad norm of step {k}")
    for name, w in want["weights"].items():
        assert_bitwise_equal(got["weights"][name], w, f"{what}: weight {name}")
    assert set(got["master"]) == set(want["master"])
    for name, m in want["master"].items():
        assert_bitwise_equal(got["master"][name], m, f"{what}: master {name}")
    g, w = got["optimizer"], want["optimizer"]
    assert g["param_groups"] == w["param_groups"], what
    assert set(g["state"]) == set(w["state"]), what
    for i, s in w["state"].items():
        assert list(g["state"][i]) == list(s), what
        for key, value in s.items():
            assert_bitwise_equal(g["state"][i][key], value, f"{what}: AdamW {key} of parameter {i}")


@pytest.mark.parametrize("case", shard_workers.CASES, ids=["-".join(c) for c in shard_workers.CASES])
def test_sharded_steps_equal_the_unsharded_steps_bitwise(ranks, case):
    for rank, r in enumerate(ranks):
        res = r[case]
        for dp in (2, 4):
            _assert_state_equal(res[("sharded", dp)], res[("plain", dp)], f"rank {rank} dp={dp}")
        assert res[("plain", 2)]["norms"][0] > shard_workers.MAX_NORM   # the clip did scale


@pytest.mark.parametrize("case", shard_workers.CASES, ids=["-".join(c) for c in shard_workers.CASES])
def test_a_sharded_state_resumes_at_another_degree(ranks, case):
    """The dp=2 sharded state (the unsharded format) continues at dp=4 sharded with the bits of the unsharded dp=4
    continuation (a dp=2 sharded checkpoint resumed at dp=1 and dp=2: test_train_parallel.py)."""
    for rank, r in enumerate(ranks):
        _assert_state_equal(r[case][("resumed-sharded", 4)], r[case][("resumed-plain", 4)], f"rank {rank} resumed dp=4")


def test_optimizer_state_per_rank_is_a_1_over_n_share(ranks):
    """Bytes of masters + AdamW state a rank holds: about 1/dp of the unsharded run's (ranges differ by one
    element at most)."""
    for case in shard_workers.CASES:
        for dp in (2, 4):
            full = ranks[0][case][("plain", dp)]["state_bytes"]
            held = [r[case][("sharded", dp)]["state_bytes"] for r in (ranks[:dp] if dp == 2 else ranks)]
            assert sum(held) == full, (case, dp, held, full)
            assert max(held) - min(held) <= 12, (case, dp, held)


@pytest.mark.parametrize("case", shard_workers.PARAMS_CASES, ids=["-".join(c) for c in shard_workers.PARAMS_CASES])
def test_sharded_weights_steps_equal_the_grads_sharded_and_unsharded_steps_bitwise(ranks, case):
    """parallel.shard=params (each decoder layer gathered for its forward and again for its backward, several
    micro-batches per rank) == parallel.shard=grads == the unsharded run, at dp = 2 and 4: every weight, master,
    AdamW moment and grad norm; and its dp=2 state resumed at dp=4, weights sharded and not."""
    for rank, r in enumerate(ranks):
        res = r[case]
        for dp in (2, 4):
            _assert_state_equal(res[("params", dp)], res[("sharded", dp)], f"rank {rank} dp={dp} params vs grads")
            _assert_state_equal(res[("params", dp)], res[("plain", dp)], f"rank {rank} dp={dp} params vs none")
        _assert_state_equal(res[("resumed-params", 4)], res[("resumed-plain", 4)], f"rank {rank} resumed dp=4")
        _assert_state_equal(res[("resumed-params-plain", 4)], res[("resumed-plain", 4)],
                            f"rank {rank} params parts resumed unsharded at dp=4")


def test_sharded_weights_per_rank_are_a_1_over_n_share_between_steps(ranks):
    """Bytes of weights a rank holds: its 1/dp range between steps (the ranges sum to the whole weights); during
    the step at most the embeddings/head/final norm and two decoder layers more (measured after every gather)."""
    for case in shard_workers.PARAMS_CASES:
        for dp in (2, 4):
            runs = [r[case][("params", dp)] for r in (ranks[:dp] if dp == 2 else ranks)]
            whole = runs[0]["weight_bytes"]
            held = [run["held_between_steps"] for run in runs]
            assert sum(held) == whole and max(held) - min(held) <= 2, (case, dp, held, whole)
            model = shard_workers._model(*case)
            layer = max(sum(p.numel() * p.element_size() for p in layer.parameters()) for layer in model.model.layers)
            outer = whole - sum(p.numel() * p.element_size() for p in model.model.layers.parameters())
            for run in runs:   # (a tiny model: its tied embedding is most of its weights)
                assert max(held) + outer <= run["held_peak"] <= max(held) + outer + 2 * layer, (case, dp, run["held_peak"])
