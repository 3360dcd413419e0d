"""The compiled C kernels of the CPU strict path (``csrc/*.c``), built on first use with the system C
compiler and loaded with ctypes.

They are a speed path only: each computes exactly the IEEE operations of the torch formulation it
replaces, in the same order (the tests and ``rlalign doctor`` compare the two bit for bit, ``rlalign.contract.bits``),
so a machine without a compiler -- or ``RLALIGN_CPU_KERNELS=0`` -- runs the torch formulation and gets
the same bits, only slower (one warning says so).

The library is cached under ``$RLALIGN_CACHE_DIR`` (default ``~/.cache/rlalign``), keyed by the
sources, the flags, the compiler and the CPU (``-march=native``), and written atomically (compiled to
a temporary file, then renamed), so concurrent first uses (test workers, Ray actors) are safe.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch

from rlalign import envvars, mklmode

SOURCES = tuple(Path(__file__).with_name("csrc") / name for name in ("attention.c", "norm.c", "elementwise.c", "gemm.c"))
HEADERS = (Path(__file__).with_name("csrc") / "common.h",)
# -ffp-contract=off: no fused multiply-add but the explicit fmaf calls (each a*b+c rounded as written);
# no -ffast-math: no reassociation, so vectorised loops keep every row's order of operations.
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-fast-math", "-std=c11", "-fPIC", "-shared")
# Under MKL's COMPATIBLE branch (the cross-machine mode) the kernels are built to that branch's GEMM arithmetic
# (csrc/common.h, MAC and CHAIN_BLOCK): multiply-then-add chains cut into blocks of 112, not FMA chains.
COMPATIBLE_FLAGS = ("-DRL_MKL_COMPATIBLE",)
# Threads: OpenMP, whose runtime (libgomp.so.1) resolves to the copy torch has loaded, so the kernels run
# on torch's own thread pool. Without OpenMP support the pragmas are ignored (one thread, the same bits).
OPENMP = ("-fopenmp",)


class Layout(ctypes.Structure):
    """csrc/attention.c's ``layout``: where a call's queries, keys and values are."""
    _fields_ = [("k", ctypes.c_void_p), ("v", ctypes.c_void_p), ("kv_bf16", ctypes.c_int64),
                ("q_start", ctypes.c_void_p), ("n_q", ctypes.c_void_p), ("pos0", ctypes.c_void_p),
                ("ctx_len", ctypes.c_void_p), ("block_table", ctypes.c_void_p), ("bt_stride", ctypes.c_int64),
                ("page_size", ctypes.c_int64), ("key_start", ctypes.c_void_p), ("n_seq", ctypes.c_int64),
                ("hq", ctypes.c_int64), ("hkv", ctypes.c_int64), ("d", ctypes.c_int64)]


# largest head_dim / normalised size the kernels take (csrc/attention.c MAX_D, csrc/norm.c MAX_H)
MAX_HEAD_DIM = 256
MAX_NORM_SIZE = 16384


@functools.lru_cache(maxsize=1)
def enabled() -> bool:
    """``RLALIGN_CPU_KERNELS`` (0 or 1, default 1), read once (``rlalign.ops._dispatch.refresh_env`` re-reads it)."""
    return envvars.read("RLALIGN_CPU_KERNELS")


def for_tensors(*tensors):
    """The kernels, when they may run on these tensors: CPU, non-empty, nothing for autograd to record
    (with autograd the differentiable formulation runs: the same bits); else None."""
    first = tensors[0]
    if first.device.type != "cpu" or first.numel() == 0:
        return None
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return None
    return library()


def library() -> ctypes.CDLL | None:
    """The loaded kernels, or None (disabled, or no working compiler: warned once)."""
    if not enabled():
        return None
    return _load()


@functools.lru_cache(maxsize=1)
def compatible() -> bool:
    """Whether the kernels reproduce MKL's COMPATIBLE branch (it runs in this process: the cross-machine mode pins
    it, see :mod:`rlalign.mklmode`) rather than its native branches' FMA chains. Pins first, as the mode asks:
    querying the branch starts MKL."""
    mklmode.pin()
    return mklmode.branch() == mklmode.PINNED


@functools.lru_cache(maxsize=1)
def _load() -> ctypes.CDLL | None:
    try:
        # the cross-machine mode's linear is defined by the COMPATIBLE build whatever branch MKL runs (primitives.
        # kernel_defines); the kernels whose bits must be MKL's are checked against it before they run
        path = _build(COMPATIBLE_FLAGS if mklmode.cross_machine() or compatible() else ())
    except (OSError, subprocess.CalledProcessError, RuntimeError) as e:
        mode = (" and, in the cross-machine mode (RLALIGN_CPU_CROSS_MACHINE=1), the strict linear refuses to run"
                if mklmode.cross_machine() else "")
        warnings.warn(f"rlalign: the CPU strict kernels could not be built ({e}); strict attention on the CPU "
                      f"runs its torch formulation (the same bits, slower){mode}. Install a C compiler (cc/gcc) "
                      "or set RLALIGN_CPU_KERNELS=0 to silence this.", RuntimeWarning, stacklevel=3)
        return None
    lib = ctypes.CDLL(str(path))
    layout_p, f32_p, i64 = ctypes.POINTER(Layout), ctypes.c_void_p, ctypes.c_int64
    # the last argument of each: threads
    lib.rl_attn_scores.argtypes = [layout_p, f32_p, ctypes.c_float, i64, f32_p, f32_p, f32_p, f32_p, i64]
    lib.rl_attn_scores.restype = ctypes.c_int
    lib.rl_attn_update.argtypes = [layout_p, i64, f32_p, f32_p, f32_p, f32_p, f32_p, f32_p, i64]
    lib.rl_attn_update.restype = None
    lib.rl_attn_finish.argtypes = [layout_p, f32_p, f32_p, f32_p, i64]
    lib.rl_attn_finish.restype = ctypes.c_int
    lib.rl_attn_bwd_args.argtypes = [layout_p, f32_p, f32_p, ctypes.c_float, i64, f32_p, i64]
    lib.rl_attn_bwd_args.restype = None
    lib.rl_attn_bwd_grads.argtypes = [layout_p, f32_p, f32_p, f32_p, f32_p, ctypes.c_float, i64, f32_p, f32_p, f32_p,
                                      i64]
    lib.rl_attn_bwd_grads.restype = None
    lib.rl_rms_norm_stats.argtypes = [f32_p, i64, i64, ctypes.c_float, i64, f32_p, i64]
    lib.rl_rms_norm_stats.restype = None
    lib.rl_rms_norm_apply.argtypes = [f32_p, f32_p, f32_p, i64, i64, i64, f32_p, i64]
    lib.rl_rms_norm_apply.restype = None
    lib.rl_any_nonfinite.argtypes = [f32_p, i64, i64]
    lib.rl_any_nonfinite.restype = ctypes.c_int
    lib.rl_rope.argtypes = [f32_p, f32_p, f32_p, i64, i64, i64, i64, f32_p]
    lib.rl_rope.restype = None
    lib.rl_silu_mul.argtypes = [f32_p, f32_p, f32_p, i64, i64, f32_p, i64]
    lib.rl_silu_mul.restype = None
    lib.rl_tree_merge.argtypes = [f32_p, i64, i64, i64, f32_p, i64]
    lib.rl_tree_merge.restype = None
    lib.rl_gemm.argtypes = [f32_p, i64, i64, f32_p, i64, i64, f32_p, i64]
    lib.rl_gemm.restype = None
    return lib


def _compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not cc:
        raise RuntimeError("no C compiler on PATH")
    return cc


def _cpu_id() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    keep = [line for line in info.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(keep)))


def _build(defines: tuple[str, ...] = ()) -> Path:
    cc = _compiler()
    flags = FLAGS + defines
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True).stdout
    digest = hashlib.sha256()
    for part in [*(p.read_bytes() for p in SOURCES + HEADERS), " ".join(flags + OPENMP).encode(), version.encode(),
                 _cpu_id().encode(), platform.machine().encode()]:
        digest.update(part)
    cache = envvars.read("RLALIGN_CACHE_DIR")
    target = cache / f"cpu_kernels_{digest.hexdigest()[:16]}.so"
    if target.exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
    os.close(fd)
    try:
        for extra in (OPENMP, ()):
            result = subprocess.run([cc, *flags, *extra, *map(str, SOURCES), "-o", tmp, "-lm"], capture_output=True,
                                    text=True)
            if not result.returncode:
                break
        if result.returncode:
            raise RuntimeError(f"{cc} failed: {result.stderr.strip()[-500:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


__all__ = ["Layout", "MAX_HEAD_DIM", "MAX_NORM_SIZE", "compatible", "enabled", "for_tensors", "library"]
