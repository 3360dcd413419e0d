"""The MoE dispatch kernel (rlalign.ops.triton_backend.dispatch) under the CPU interpreter (TRITON_INTERPRET=1).

The dispatch is integer bookkeeping, which the interpreter computes exactly, so here it is checked for raw
equality with the reference it replaces: ``torch.sort(stable=True).indices``, its inverse, ``grouped.
expert_offsets`` and ``grouped._slots``' row-tile tables, over token counts (0, 1, odd, large), k (1..8),
E (1..256) and loads (uniform, everything on one expert, few experts, empty experts), plus the id verdict for
out-of-range ids. Then ops.moe_experts on the triton path end to end: the same bits as the torch.sort path
over the same grouped kernels (forward, dx, stacked dW), and a bound on the launches of one strict forward.

The interpreter must be on before triton is imported, so the tests run in a child pytest on this file
(``test_dispatch_under_the_interpreter``); the child sees TRITON_INTERPRET=1 and collects the real tests.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"
ROOT = Path(__file__).resolve().parents[2]


if not INTERPRETING:
    def test_dispatch_under_the_interpreter():
        env = {**os.environ, "TRITON_INTERPRET": "1",
               "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
                             cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
        assert run.returncode == 0, f"interpreter tests failed:\n{run.stdout[-8000:]}\n{run.stderr[-2000:]}"
        assert " passed" in run.stdout and " failed" not in run.stdout, run.stdout[-2000:]

else:
    from hypothesis import given, settings, strategies as st

    from tests.bitwise import assert_bitwise_equal
    from tests.ops.test_triton_interpret import _patch_interpreter

    _patch_interpreter()

    import triton.runtime.interpreter as interpreter  # noqa: E402
    from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

    from rlalign import ops  # noqa: E402
    from rlalign.contract.errors import ContractError  # noqa: E402
    from rlalign.ops import _dispatch  # noqa: E402
    from rlalign.ops._registry import register  # noqa: E402
    from rlalign.ops.moe import sorted_experts  # noqa: E402
    from rlalign.ops.triton_backend import IMPLEMENTATIONS as TRITON_OPS  # noqa: E402
    from rlalign.ops.triton_backend import dispatch as D, grouped as G  # noqa: E402

    HEIGHTS = (64, 128)    # the grouped GEMMs' two row-tile heights

    @pytest.fixture(scope="module", autouse=True)
    def triton_moe_on_cpu():
        """The triton backend's MoE ops for CPU tensors (the interpreter runs them), as on a GPU."""
        for op, fn in TRITON_OPS.items():
            if op.startswith("moe_"):
                register(op, "triton")(fn)
        before = os.environ.get("RLALIGN_BACKEND")
        os.environ["RLALIGN_BACKEND"] = "triton"
        _dispatch.refresh_env()
        _dispatch._resolve_impl.cache_clear()
        yield
        if before is None:
            os.environ.pop("RLALIGN_BACKEND")
        else:
            os.environ["RLALIGN_BACKEND"] = before
        _dispatch.refresh_env()
        _dispatch._resolve_impl.cache_clear()

    def _assert_same_ints(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
        assert got.dtype == want.dtype and got.shape == want.shape, \
            f"{what}: {got.dtype}{tuple(got.shape)} vs {want.dtype}{tuple(want.shape)}"
        diff = (got != want).nonzero()
        if diff.numel():
            i = diff[0, 0].item()
            raise AssertionError(f"{what}: {diff.shape[0]} of {got.numel()} differ, first at index {i}: "
                                 f"{got[i].item()} vs reference {want[i].item()}")

    def _reference(ids: torch.Tensor, n_experts: int):
        flat = ids.reshape(-1)
        order = torch.sort(flat, stable=True).indices
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel())
        return order, inverse, G.expert_offsets(flat.index_select(0, order), n_experts)

    def _ids(tokens, k, n_experts, load, seed):
        g = torch.Generator().manual_seed(seed)
        if load == "uniform":
            return torch.randint(0, n_experts, (tokens, k), generator=g)
        if load == "one":
            return torch.full((tokens, k), int(torch.randint(0, n_experts, (1,), generator=g)))
        if load == "few":      # most experts empty
            pool = torch.randint(0, n_experts, (3,), generator=g)
            return pool[torch.randint(0, 3, (tokens, k), generator=g)]
        skew = torch.randint(0, n_experts, (tokens, k), generator=g)   # half the slots on expert E-1
        return torch.where(torch.rand(tokens, k, generator=g) < 0.5, n_experts - 1, skew)

    @settings(max_examples=30, deadline=None)
    @given(tokens=st.sampled_from([0, 1, 2, 3, 17, 63, 64, 65, 127, 129, 255, 301]), k=st.integers(1, 8),
           n_experts=st.sampled_from([1, 2, 3, 7, 8, 63, 128, 256]),
           load=st.sampled_from(["uniform", "one", "few", "skewed"]), seed=st.integers(0, 2 ** 16))
    def test_dispatch_equals_the_sort_and_the_tables_it_replaces(tokens, k, n_experts, load, seed):
        ids = _ids(tokens, k, n_experts, load, seed)
        plan = D.dispatch(ids, n_experts, HEIGHTS)
        order, inverse, offsets = _reference(ids, n_experts)
        _assert_same_ints(plan.order, order, "order vs torch.sort(stable=True)")
        _assert_same_ints(plan.token, order // k, "token")
        _assert_same_ints(plan.inverse, inverse, "inverse")
        _assert_same_ints(plan.offsets, offsets, "offsets")
        assert bool(plan.ok), "valid ids got a failing verdict"
        if not tokens:
            return
        for height in HEIGHTS:
            want = G._slots(offsets, tokens * k, height)
            got = plan.slots[height]
            assert got[3] == want[3], f"height {height}: {got[3]} slots vs {want[3]}"
            for name, a, b in zip(("slot expert", "slot row", "slot end"), got[:3], want[:3]):
                _assert_same_ints(a, b, f"height {height}: {name}")

    def test_one_height_gives_one_table():
        ids = _ids(40, 2, 5, "uniform", 0)
        plan = D.dispatch(ids, 5, (64, 64))
        assert list(plan.slots) == [64]
        _, _, offsets = _reference(ids, 5)
        for a, b in zip(plan.slots[64][:3], G._slots(offsets, 80, 64)[:3]):
            _assert_same_ints(a, b, "single-height table")

    @settings(max_examples=15, deadline=None)
    @given(tokens=st.integers(1, 150), k=st.integers(1, 8), n_experts=st.sampled_from([1, 4, 64]),
           bad=st.sampled_from([-1, -7, 0, 1, 1000]), seed=st.integers(0, 2 ** 16))
    def test_out_of_range_ids_fail_the_verdict_and_stay_outside_every_expert(tokens, k, n_experts, bad, seed):
        """An id outside [0, E) (bad is relative: 0 -> E, 1 -> E + 1): the verdict is False, order is still a
        permutation, the valid slots keep their stable grouping and every invalid one lies past offsets[E]."""
        ids = _ids(tokens, k, n_experts, "uniform", seed)
        g = torch.Generator().manual_seed(seed + 1)
        n_bad = int(torch.randint(1, tokens * k + 1, (1,), generator=g))
        where = torch.randperm(tokens * k, generator=g)[:n_bad]
        value = bad if bad < 0 or bad >= n_experts else n_experts + bad
        ids.view(-1)[where] = value
        plan = D.dispatch(ids, n_experts, HEIGHTS)
        assert not bool(plan.ok), "an out-of-range id passed the verdict"
        _assert_same_ints(plan.order.sort().values, torch.arange(tokens * k), "order is a permutation")
        _assert_same_ints(plan.inverse[plan.order], torch.arange(tokens * k), "inverse")
        flat = ids.reshape(-1)
        valid = (flat >= 0) & (flat < n_experts)
        n_valid = int(valid.sum())
        assert int(plan.offsets[-1]) == n_valid
        keyed = torch.where(valid, flat, n_experts)          # the reference: invalid ids as one bucket after E
        _assert_same_ints(plan.order, torch.sort(keyed, stable=True).indices, "order with invalid ids")

    # ---- ops.moe_experts on the triton path ---------------------------------------------------------------

    def _weights(n_experts, inter, hidden, seed):
        g = torch.Generator().manual_seed(seed)
        return tuple((torch.randn(n_experts, *shape, generator=g) * shape[1] ** -0.5).requires_grad_()
                     for shape in ((inter, hidden), (inter, hidden), (hidden, inter)))

    @settings(max_examples=6, deadline=None)
    @given(tokens=st.sampled_from([1, 5, 33]), k=st.integers(1, 3), n_experts=st.sampled_from([1, 4, 6]),
           load=st.sampled_from(["uniform", "one", "few"]), seed=st.integers(0, 2 ** 16))
    def test_moe_experts_triton_path_has_the_sort_paths_bits(tokens, k, n_experts, load, seed):
        """The same rows through the same grouped kernels: y, dx and each stacked dW bit for bit."""
        hidden, inter = 64, 64
        g = torch.Generator().manual_seed(seed)
        ids = _ids(tokens, k, n_experts, load, seed)
        x = torch.randn(tokens, hidden, generator=g).requires_grad_()
        w = _weights(n_experts, inter, hidden, seed + 1)
        grad_y = torch.randn(tokens, k, hidden, generator=g)
        results = []
        for fn in (lambda *a: ops.moe_experts(*a, down_segments=4),
                   lambda *a: sorted_experts(*a, 4)):
            y = fn(x, ids, *w)
            results.append((y, torch.autograd.grad(y, (x, *w), grad_y)))
        (y, grads), (y_ref, grads_ref) = results
        assert_bitwise_equal(y, y_ref, "y: dispatch kernel vs torch.sort path")
        for name, a, b in zip(("dx", "d gate", "d up", "d down"), grads, grads_ref):
            assert_bitwise_equal(a, b, name)

    @pytest.mark.parametrize("k", [1, 2])
    def test_dx_keeps_the_sort_paths_sign_of_zero(k):
        """Output gradients holding -0.0 (a token's every slot included): dx's bits, zero signs included, are
        the torch.sort path's. There index_select's backward adds into zeros (-0.0 -> +0.0); the dispatch's
        gathers copy, which agrees because the grouped GEMMs' backward never produces a -0.0."""
        hidden, tokens, n_experts = 64, 6, 3
        x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(1)).requires_grad_()
        w = _weights(n_experts, 64, hidden, 2)
        ids = _ids(tokens, k, n_experts, "uniform", 3)
        grad_y = torch.randn(tokens, k, hidden, generator=torch.Generator().manual_seed(4))
        grad_y[0] = -0.0
        grad_y[1:, :, :7] = -0.0
        dx = torch.autograd.grad(ops.moe_experts(x, ids, *w), x, grad_y)[0]
        ref = torch.autograd.grad(sorted_experts(x, ids, *w, None), x, grad_y)[0]
        assert_bitwise_equal(dx, ref, "dx with -0.0 gradients")

    def test_moe_experts_triton_path_refuses_an_out_of_range_id():
        w = _weights(4, 64, 64, 0)
        with pytest.raises(ContractError, match=r"expert id is outside \[0, 4\)"):
            ops.moe_experts(torch.randn(3, 64), torch.tensor([[0, 1], [2, 4], [3, 3]]), *w)

    # Aten ops that launch no kernel (views, allocations, metadata).
    _NO_KERNEL = {"view", "_unsafe_view", "reshape", "expand", "as_strided", "slice", "select", "unsqueeze",
                  "squeeze", "t", "transpose", "permute", "detach", "alias", "empty", "empty_strided", "empty_like",
                  "lift_fresh", "_to_copy_noop"}

    class _CountOps(TorchDispatchMode):
        """Counts the aten ops that launch kernels, outside Triton launches (the interpreter copies the
        launch's tensors with aten ops of its own: not the op's)."""

        def __init__(self):
            super().__init__()
            self.ops: list[str] = []
            self.paused = False

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not self.paused and func.__name__.split(".")[0] not in _NO_KERNEL:
                self.ops.append(func.__name__)
            return func(*args, **(kwargs or {}))

    def _count_launches(fn):
        launches: list[str] = []
        original = interpreter.InterpretedFunction.run
        mode = _CountOps()

        def counted(self, *args, **kwargs):
            launches.append(self.fn.__name__)
            mode.paused = True
            try:
                return original(self, *args, **kwargs)
            finally:
                mode.paused = False

        interpreter.InterpretedFunction.run = counted
        try:
            with mode:
                fn()
        finally:
            interpreter.InterpretedFunction.run = original
        return mode.ops, launches

    def test_one_strict_forward_launches_a_handful_of_kernels():
        """The strict triton forward of ops.moe_experts: the dispatch's 3 launches, 2 gathers, 3 grouped GEMMs
        and silu_mul -- no sort, no per-tile torch bookkeeping (the torch.sort path: 59 at Qwen3-30B-A3B routing).
        The count depends on the shapes only (one or two row-tile heights: the tables come from one launch)."""
        hidden, inter, n_experts, k, tokens = 64, 64, 8, 4, 40
        w = tuple(t.detach() for t in _weights(n_experts, inter, hidden, 1))
        x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(2))
        ids = _ids(tokens, k, n_experts, "uniform", 3)
        ops.moe_experts(x, ids, *w, down_segments=4)        # first call: the weight table is built once
        aten, launches = _count_launches(lambda: ops.moe_experts(x, ids, *w, down_segments=4))
        total = len(aten) + len(launches)
        assert total <= 12, f"{total} kernels per strict forward (aten: {aten}; triton: {launches})"
        assert launches.count("grouped_rows_kernel") == 3
        assert "sort" not in aten and "searchsorted" not in aten
