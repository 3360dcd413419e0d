"""Count the torch kernels (aten ops that launch one) of a strict decode step's sampler, finiteness checks and
per-layer rope + KV-cache write, CPU-side: the Triton sampler runs under the interpreter (TRITON_INTERPRET=1, set by main), its kernel is not an aten
op; every other op of the sampler call and of the boundary checks is one kernel on a GPU (a torch reduction or
elementwise op), counted with a TorchDispatchMode. Sizes do not change the counts (no op loops over rows here).

    PYTHONPATH=$PWD python benchmarks/count_decode_ops.py [--layers 28]

Prints JSON: per part, the number of kernels and their aten names. Run it on two commits to compare."""

from __future__ import annotations

import argparse
import collections
import json
import os

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# aten ops that launch no kernel (views, metadata, allocation without a fill)
NO_KERNEL = {"view", "_unsafe_view", "unbind", "select", "slice", "detach", "alias", "expand", "as_strided", "t",
             "unsqueeze", "squeeze", "empty", "empty_strided", "empty_like", "lift_fresh", "_local_scalar_dense",
             "is_nonzero", "item", "transpose", "permute", "reshape", "contiguous", "_reshape_alias", "view_as",
             "dim", "size", "stride"}


class CountKernels(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in NO_KERNEL:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


class _CountedLaunch:
    """A Triton kernel whose launches count as one kernel each; the interpreter's own tensor copies, which a
    GPU launch does not make, are not counted."""

    def __init__(self, kernel, name: str, mode_ref: list):
        self.kernel, self.name, self.mode_ref = kernel, name, mode_ref

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            from torch.utils._python_dispatch import _disable_current_modes
            if self.mode_ref:
                self.mode_ref[0].ops[f"triton:{self.name}"] += 1
            with _disable_current_modes():
                return self.kernel[grid](*args, **kwargs)
        return launch


_ACTIVE: list = []


def _count(fn):
    mode = CountKernels()
    _ACTIVE[:] = [mode]
    with mode:
        fn()
    _ACTIVE.clear()
    return {"kernels": sum(mode.ops.values()), "ops": dict(sorted(mode.ops.items()))}


def sampler_step(rows: int = 8, vocab: int = 4096):
    """``ops.sample`` in the static form as a CUDA-graph capture records it, on the Triton backend's launcher."""
    from tests.ops.test_triton_interpret import _patch_interpreter
    _patch_interpreter()
    from rlalign.ops import _checks as chk
    from rlalign.ops.sample import sample as sample_op
    from rlalign.ops._registry import IMPLEMENTATIONS
    from rlalign.ops.triton_backend import sample as triton_sample
    IMPLEMENTATIONS[("sample", "torch")] = triton_sample.sample   # CPU tensors: route the op to the Triton launcher
    for name in ("sample_chunk_kernel", "sample_fold_kernel"):
        setattr(triton_sample, name, _CountedLaunch(getattr(triton_sample, name), name, _ACTIVE))
    logits = torch.randn(rows, vocab)
    temperature = torch.full((rows,), 0.7)
    ints = torch.arange(rows)

    def step():   # recorded as the decode graph records it (a graph captured without top-k / top-p rows)
        with chk.capturing_graph(sample_filtered=False):
            sample_op(logits, seeds=ints, seq_ids=ints, positions=ints, temperature=temperature)
    step()   # warm (compile caches, dispatch caches)
    return _count(step)


def boundary_checks(layers: int):
    """The boundary policy's per-layer site (write_kv_cache's k) recorded as a CUDA graph would record it."""
    from rlalign.ops import _checks as chk
    ks = [torch.randn(462, 8, 128, dtype=torch.bfloat16) for _ in range(layers)]

    def step():
        with chk.use_check_policy(chk.BOUNDARY), chk.capturing_graph():
            for k in ks:
                chk.finite("write_kv_cache", "k", k)
    return _count(step)


def rope_kv_write(layers: int, fused: bool, t: int = 8, hq: int = 4, hkv: int = 2, d: int = 16):
    """A paged layer's rope of q and k, KV-cache write and K check (boundary policy), recorded as a CUDA graph
    would record them, on the Triton backend's launchers: ``fused``, ops.rope_write_kv (the paged forward's
    call); else what it replaced, ops.rope twice and ops.write_kv_cache."""
    from rlalign import ops
    from rlalign.ops import _checks as chk, _dispatch
    from rlalign.ops._registry import IMPLEMENTATIONS
    from rlalign.ops.triton_backend import elementwise as E
    IMPLEMENTATIONS[("rope", "torch")] = E.rope                   # CPU tensors: route the ops to the Triton launchers
    IMPLEMENTATIONS[("rope_write_kv", "torch")] = E.rope_write_kv
    _dispatch._resolve_impl.cache_clear()
    for name in ("rope_kernel", "rope_write_kv_kernel"):
        if not isinstance(getattr(E, name), _CountedLaunch):
            setattr(E, name, _CountedLaunch(getattr(E, name), name, _ACTIVE))
    q, k, v = torch.randn(t, hq, d), torch.randn(t, hkv, d), torch.randn(t, hkv, d)
    cos, sin = torch.randn(t, d // 2), torch.randn(t, d // 2)
    caches = [(torch.zeros(4, 4, hkv, d), torch.zeros(4, 4, hkv, d)) for _ in range(layers)]
    slots = torch.randperm(16)[:t]

    def step():
        with chk.use_check_policy(chk.BOUNDARY), chk.capturing_graph():
            for kc, vc in caches:
                if fused:
                    ops.rope_write_kv(q, k, v, cos, sin, kc, vc, slots)
                else:
                    ops.write_kv_cache(ops.rope(k, cos, sin), v, kc, vc, slots)
                    ops.rope(q, cos, sin)
    return _count(step)


def main() -> None:
    os.environ.setdefault("TRITON_INTERPRET", "1")   # before triton is imported (sampler_step imports it)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=28, help="decoder layers (Qwen3-0.6B: 28)")
    args = parser.parse_args()
    print(json.dumps({"sampler (captured static form)": sampler_step(), f"write_kv_cache k checks ({args.layers} layers)":
                      boundary_checks(args.layers),
                      f"rope + KV write + K check, separate ops ({args.layers} layers)": rope_kv_write(args.layers, False),
                      f"rope + KV write + K check, rope_write_kv ({args.layers} layers)": rope_kv_write(args.layers, True)},
                     indent=1))


if __name__ == "__main__":
    main()
