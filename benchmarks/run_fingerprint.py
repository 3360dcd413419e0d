"""The bit fingerprint of a training run's first steps: sha256 of its first ``--steps`` metrics records (every
value but the timings and the process's memory) and of the final policy's weights (raw bytes, by name).

Two runs with equal fingerprints logged the same bits for those steps and ended with the same weights bit for
bit. ``benchmarks/evidence/across-machines/default-3-steps.json`` is this script's output for the embedded
default run stopped after 3 steps; tests/train/test_across_machines.py reruns that run on other code paths
(torch's AVX2 kernels, MKL's Intel AVX2 branch) and compares:

    rlalign train run.dir=RUN run.stop_at_step=3 run.progress=false
    python benchmarks/run_fingerprint.py RUN --steps 3
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

import torch
from safetensors import safe_open

# values that measure the machine's speed or the process's memory, not the run's arithmetic
MACHINE_KEYS = ("time/", "memory/", "tokens_per_s/")


def metrics_digest(run_dir: Path, steps: int) -> tuple[str, int]:
    """(sha256 of the records of steps 0..steps without the machine's values, one canonical JSON line each;
    the number of records hashed)."""
    digest, count = hashlib.sha256(), 0
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record.get("step", 0) > steps:
            continue
        kept = {k: v for k, v in record.items() if not k.startswith(MACHINE_KEYS)}
        digest.update((json.dumps(kept, sort_keys=True) + "\n").encode())
        count += 1
    return digest.hexdigest(), count


def weights_digest(run_dir: Path) -> str:
    """sha256 of the final policy's tensors (name, dtype, shape, raw bytes), in name order."""
    digest = hashlib.sha256()
    with safe_open(str(run_dir / "policy" / "model.safetensors"), framework="pt") as f:
        for name in sorted(f.keys()):
            t = f.get_tensor(name).contiguous()
            digest.update(f"{name} {t.dtype} {tuple(t.shape)}\n".encode())
            digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def fingerprint(run_dir: Path, steps: int) -> dict:
    metrics, records = metrics_digest(run_dir, steps)
    return {"steps": steps, "metrics_records": records, "metrics_sha256": metrics, "weights_sha256": weights_digest(run_dir)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args(argv)
    print(json.dumps(fingerprint(args.run_dir, args.steps), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
