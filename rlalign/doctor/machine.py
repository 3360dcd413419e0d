"""This machine's numerical fingerprint: which CPU and code paths it runs, and whether a fixed probe through every
strict op gives the committed reference bits (``strict_fingerprint.json``).

The probe's inputs come from Python's own generator (``random.Random``, the same integers on every machine),
never from torch's samplers, whose vectorised fills may follow the CPU. Each op's outputs are hashed (sha256 of
the raw bytes); a hash equal to the reference means this machine computes that op's bits the way the
reference machine did -- so a strict run here reproduces a run recorded there (docs/cpu.md, "Across machines").
The probe runs on one thread: the reference is per thread count, and one thread is the count every machine has.
The reference was recorded in the cross-machine mode (``RLALIGN_CPU_CROSS_MACHINE=1``: MKL pinned); without it
the checks only report (MKL's own branch for this CPU gives other bits for the ops that use MKL).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import platform
import random
from pathlib import Path

import torch
from torch.optim.adam import adam as adam_arithmetic

from rlalign import mklmode, ops
from rlalign.contract import spec
from rlalign.doctor.base import Check
from rlalign.reductions import fixed_mean_std, global_norm

REFERENCE = Path(__file__).with_name("strict_fingerprint.json")


def _values(rng: random.Random, *shape: int, scale: float = 1.0) -> torch.Tensor:
    """Uniform values in [-scale, scale) with 20 random bits each (exact in fp32 and bf16-free of rounding
    surprises): the same tensor on every machine."""
    n = 1
    for s in shape:
        n *= s
    ints = [rng.getrandbits(21) - (1 << 20) for _ in range(n)]
    return (torch.tensor(ints, dtype=torch.float64) * (scale / (1 << 20))).to(torch.float32).reshape(shape)


@contextlib.contextmanager
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _linear(rng):
    outs = []
    for n, k, segments, m in ((384, 128, None, 70), (128, 384, spec.K_SEGMENTS, 70), (1, 128, None, 9),
                              (7, 1000, spec.K_SEGMENTS, 5), (48, 128, None, 130)):
        x, w = _values(rng, m, k), _values(rng, n, k, scale=0.1)
        outs += [ops.linear(x, w, k_segments=segments, profile="strict"),
                 ops.linear(x.bfloat16(), w.bfloat16(), k_segments=segments, profile="strict")]
    return outs


def _linear_backward(rng):
    x, w = _values(rng, 150, 128).requires_grad_(), _values(rng, 96, 128, scale=0.1).requires_grad_()
    ops.linear(x, w, profile="strict").sum().backward()
    return [x.grad, w.grad]


def _rms_norm(rng):
    x, w = _values(rng, 70, 128, scale=3.0), _values(rng, 128)
    return [ops.rms_norm(x, w, 1e-6, profile="strict")]


def _rope(rng):
    x = _values(rng, 40, 4, 32)
    positions = torch.tensor([rng.randrange(4096) for _ in range(40)])
    cos, sin = ops.rope_cos_sin(positions, ops.rope_inv_freq(32, 10000.0))
    return [ops.rope(x, cos, sin, profile="strict")]


def _silu_mul(rng):
    return [ops.silu_mul(_values(rng, 70, 384, scale=4.0), _values(rng, 70, 384), profile="strict")]


def _attention(rng):
    lens = [5, 33, 70]
    t = sum(lens)
    q, k, v = _values(rng, t, 4, 32), _values(rng, t, 2, 32), _values(rng, t, 2, 32)
    cu = torch.tensor([0, 5, 38, 108], dtype=torch.int32)
    return [ops.attention_varlen(q, k, v, cu, profile="strict")]


def _logprob(rng):
    h, w = _values(rng, 70, 128), _values(rng, 300, 128, scale=0.2)
    targets = torch.tensor([rng.randrange(300) for _ in range(70)])
    lp, ent = ops.logprob_entropy(h, w, targets, profile="strict")
    return [lp, ent]


def _reductions(rng):
    x = _values(rng, 5001, scale=2.0)
    mean, std = fixed_mean_std(x)
    return [torch.tensor([mean, std]), global_norm([x, x[:77] * 3])]


def _adamw(rng):
    """One step of torch's AdamW arithmetic (foreach=False: what the trainer's MasterWeights.step runs)."""
    p, g = _values(rng, 4001), _values(rng, 4001, scale=0.01)
    m, v = _values(rng, 4001, scale=0.001), _values(rng, 4001, scale=1e-6).abs()
    adam_arithmetic([p], [g], [m], [v], [], [torch.tensor(3.0)], foreach=False, capturable=False,
                    differentiable=False, fused=None, has_complex=False, decoupled_weight_decay=True, amsgrad=False,
                    beta1=0.9, beta2=0.99, lr=2e-4, weight_decay=0.01, eps=1e-8, maximize=False)
    return [p, m, v]


PROBES = {"linear": _linear, "linear backward": _linear_backward, "rms_norm": _rms_norm, "rope": _rope,
          "silu_mul": _silu_mul, "attention": _attention, "logprob_entropy": _logprob,
          "fixed-order reductions": _reductions, "AdamW step": _adamw}


def fingerprint() -> dict[str, str]:
    """op -> sha256 (16 hex digits) of the probe's outputs through that op, strict profile, CPU, one thread."""
    out = {}
    with _one_thread():
        for i, (name, probe) in enumerate(PROBES.items()):
            digest = hashlib.sha256()
            for t in probe(random.Random(1000 + i)):
                digest.update(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
            out[name] = digest.hexdigest()[:16]
    return out


def reference() -> dict:
    return json.loads(REFERENCE.read_text())


def compare() -> tuple[bool, str]:
    """(this machine's fingerprint equals the committed reference, one line naming the ops that differ)."""
    ref, here = reference(), fingerprint()
    differ = [name for name, h in here.items() if ref["ops"].get(name) != h]
    if not differ:
        return True, f"every probe equals the reference of {ref['recorded_on']}"
    return False, f"differs from the reference of {ref['recorded_on']} in: {', '.join(differ)}"


_OFF = "cross-machine mode off (RLALIGN_CPU_CROSS_MACHINE=0): not relied on; bits reproduce on this machine"


def _mkl_check(device, gen):
    pinned, detail = mklmode.status()
    return (pinned, detail) if mklmode.cross_machine() else (True, f"{_OFF}; {detail.split(':')[0]}")


def _probe_check(device, gen):
    same, detail = compare()
    return (same, detail) if mklmode.cross_machine() else (True, f"{_OFF}; the probe {detail}")


CHECKS: tuple[Check, ...] = (
    Check("MKL (library)", "its machine-independent branch (the same bits on every x86-64 CPU)", _mkl_check,
          devices=("cpu",), torch_backend_only=True),
    Check("across machines", "a fixed probe through every strict op == the committed reference bits", _probe_check,
          devices=("cpu",), torch_backend_only=True),
)


def identity() -> dict:
    """What decides this machine's bits: the CPU, torch's vector capability, MKL's branch."""
    pinned, _ = mklmode.status()
    return {"cpu": cpu_name(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "mkl_branch": mklmode.branch(), "mkl_machine_independent": pinned}


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


__all__ = ["CHECKS", "PROBES", "REFERENCE", "compare", "cpu_name", "fingerprint", "identity", "reference"]
