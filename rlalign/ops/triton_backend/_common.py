"""Shared helpers of the Triton backend: device facts, TMA descriptors, the fp32 split dot.

The one matrix primitive every kernel here uses is :func:`mma`: ``tl.dot`` of bf16 operands
with an fp32 accumulator (Hopper: ``wgmma`` when the tile has >= 64 rows and the program a
multiple of 4 warps). fp32 operands are split as ``x = hi + lo`` with ``hi = bf16(x)`` and
``lo = bf16(x - hi)`` and accumulated as ``acc += a_hi.b_lo; acc += a_lo.b_hi; acc += a_hi.b_hi``
("bf16x3", relative error about 1e-5). When the fp32 inputs hold bf16 values, ``lo`` is exactly
zero, the first two dots add exact zeros and the result has the bits of the bf16 path: a
tensor-parallel rank may hand fp32 copies of bf16 shards to the strict ops and still get the
bits of the bf16 call.
"""

from __future__ import annotations

import functools
import os
import threading

import torch
import triton
import triton.language as tl

from rlalign import envvars
from rlalign.contract.errors import fail

try:  # host-side TMA descriptors (Triton >= 3.3)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton: the pointer path is used everywhere
    TensorDescriptor = None

BLOCK_K = 64  # the one K step of every strict GEMM (see docs/design/tile-shapes.md)


# Launch choices (persistent grids, decode splits, which GEMM schedule) read the ARCHITECTURE's reference SM count,
# never the card's: a decode split changes the reduction order over key blocks, so a count read from the card would
# give an H100 PCIe (114 SMs) other bits than an H100 SXM or an H200 (132). A grid sized for 132 programs per wave
# on a card with fewer SMs runs in more waves, with the same tiles and the same bits.
REFERENCE_SMS = {(9, 0): 132}   # Hopper: H100 SXM / PCIe / NVL, H200, GH200


@functools.lru_cache(maxsize=None)
def num_sms(device_index: int) -> int:
    """The SM count launch choices assume on this device: the architecture's reference count (``REFERENCE_SMS``);
    outside the table, the card's own (no cross-card promise there); under the interpreter, 4."""
    if not torch.cuda.is_available():
        return 4  # the interpreter: any small number
    props = torch.cuda.get_device_properties(device_index)
    return REFERENCE_SMS.get((props.major, props.minor), props.multi_processor_count)


def device_sms(t: torch.Tensor) -> int:
    return num_sms(t.device.index if t.device.type == "cuda" and t.device.index is not None else 0)


def tma_ok(t: torch.Tensor) -> bool:
    """A 2-D tensor a TMA descriptor can address: last dim contiguous, 16-byte aligned base and row stride."""
    if TensorDescriptor is None or t.dim() != 2 or t.stride(1) != 1 or t.shape[0] == 0 or t.shape[1] == 0:
        return False
    es = t.element_size()
    return t.data_ptr() % 16 == 0 and (t.stride(0) * es) % 16 == 0


def aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` row-major (last dim contiguous) with a 16-byte aligned base and row stride, as it is when
    possible, else a contiguous copy (cloned again if its base is misaligned): the kernel path chosen
    for a tensor then depends on its shape alone, never on where a view happens to start."""
    if t.dim() == 2 and t.stride(1) == 1 and t.stride(0) >= t.shape[1] and t.data_ptr() % 16 == 0 \
            and (t.stride(0) * t.element_size()) % 16 == 0:
        return t
    t = t.contiguous()
    if t.data_ptr() % 16:
        t = t.clone()
    return t


def forced_tile(env: str) -> "tuple[int, ...] | None":
    """A tile forced through the environment variable ``env`` ("128,128,8,4"; rlalign.envvars checks it), or None."""
    return envvars.read(env)


_THREAD = threading.local()


def bind_cuda_context(t: torch.Tensor) -> None:
    """Make ``t``'s device's primary CUDA context current on this thread, once per thread and device. Triton encodes
    a host-side TMA descriptor with the driver API (cuTensorMapEncodeTiled) at launch, which fails with "invalid
    device context" on a thread that has none -- autograd's backward worker, whose first CUDA call can be one of our
    GEMMs (torch does not call cudaSetDevice there when the device is already the default one). A runtime-API call
    binds the context."""
    if t.device.type != "cuda":
        return
    bound = getattr(_THREAD, "devices", None)
    if bound is None:
        bound = _THREAD.devices = set()
    if t.device.index not in bound:
        # under graph capture the capturing thread has its context (and a stream query would break the capture)
        if not torch.cuda.is_current_stream_capturing():
            torch.cuda.current_stream(t.device).query()
        bound.add(t.device.index)


def descriptor(t: torch.Tensor, block: list[int]):
    bind_cuda_context(t)
    return TensorDescriptor(t, list(t.shape), list(t.stride()), list(block))


def is_interpreter() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


try:
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover
    from triton.language.extra.cuda import libdevice


# Math with torch's CUDA bits: libdevice's expf / logf are the functions torch's CUDA exp / log call, and
# div_rn is IEEE division. LIBDEVICE is False only under the CPU interpreter, which has no libdevice (its
# numpy math is checked against float64 there, not for bits).
@triton.jit
def libm_exp(x, LIBDEVICE: tl.constexpr):
    if LIBDEVICE:
        return libdevice.exp(x)
    else:
        return tl.exp(x)


@triton.jit
def libm_log(x, LIBDEVICE: tl.constexpr):
    if LIBDEVICE:
        return libdevice.log(x)
    else:
        return tl.log(x)


@triton.jit
def div_ieee(a, b, LIBDEVICE: tl.constexpr):
    if LIBDEVICE:
        return tl.math.div_rn(a, b)
    else:
        return a / b


@triton.jit
def split_bf16(x):
    """fp32 x -> (hi, lo) bf16 with hi = bf16(x), lo = bf16(x - hi) (both round to nearest even)."""
    hi = x.to(tl.bfloat16)
    lo = (x - hi.to(tl.float32)).to(tl.bfloat16)
    return hi, lo


@triton.jit
def mma(a, b, acc, SPLIT: tl.constexpr):
    """acc + a @ b with an fp32 accumulator; bf16 operands, or fp32 operands split bf16x3.

    bf16x3 order: acc += a_hi.b_lo, acc += a_lo.b_hi, acc += a_hi.b_hi (small terms first; with
    bf16-valued fp32 inputs the first two add exact zeros, giving the bf16 path's bits).
    """
    if SPLIT:
        a_hi, a_lo = split_bf16(a)
        b_hi, b_lo = split_bf16(b)
        acc = tl.dot(a_hi, b_lo, acc)
        acc = tl.dot(a_lo, b_hi, acc)
        acc = tl.dot(a_hi, b_hi, acc)
    else:
        # bf16 operands; fp32 only under the CPU interpreter (exact fp32, see split_for)
        acc = tl.dot(a, b, acc, input_precision="ieee")
    return acc


def split_for(dtype: torch.dtype) -> bool:
    """Whether fp32 operands take the bf16x3 split. The CPU interpreter mis-rounds bf16, so its
    fp32 kernels use an exact fp32 dot instead (it only checks indexing and masking)."""
    return dtype == torch.float32 and not is_interpreter()


# Arrival counters ("the last program to arrive does the reduction": attention's fused-merge split launch, one
# per item; rope_write_kv's K verdict, one per launch): int32, zero between launches (the last program resets its
# counter). One buffer per (device, capacity: a power of 2 >= 1,024, owner),
# allocated and zeroed on the first launch that needs it and kept for the process (a captured graph holds its
# address), so a launch inside a CUDA-graph capture allocates nothing -- and is refused if no launch of its
# size class ran before the capture (a warm-up call, as graph captures do anyway).
# Streams: a buffer serves one launch at a time. Eager launches from another stream than the buffer's last
# one first wait for that stream (torch stream order), so launches on concurrent streams run one after the
# other; a graph replay is ordered only on the stream that replays it, so replays of graphs holding fused
# launches must not overlap fused launches on other streams of the device (the rollout engine decodes on one
# stream).
_ARRIVAL_COUNTERS: dict[tuple[str, int, str], torch.Tensor] = {}
_COUNTER_STREAMS: dict[tuple[str, int, str], object] = {}
_MIN_COUNTERS = 1024


def arrival_counters(device: torch.device, items: int, op: str = "attention_paged") -> torch.Tensor:
    """The zeroed int32 arrival counters (>= ``items``) of ``op``'s launches on ``device`` (its own buffers)."""
    key = (str(device), max(_MIN_COUNTERS, triton.next_power_of_2(items)), op)
    buf = _ARRIVAL_COUNTERS.get(key)
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    if buf is None:
        if capturing:
            raise fail(op, f"the launch of {items} items has no arrival counters yet; run the decode step once "
                           "before capturing it in a CUDA graph")
        buf = _ARRIVAL_COUNTERS[key] = torch.zeros(key[1], dtype=torch.int32, device=device)
    if device.type == "cuda" and not capturing:
        stream, last = torch.cuda.current_stream(device), _COUNTER_STREAMS.get(key)
        if last is not None and last != stream:
            stream.wait_stream(last)
        _COUNTER_STREAMS[key] = stream
    return buf
