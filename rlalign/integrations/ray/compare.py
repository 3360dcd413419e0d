"""``python -m rlalign.integrations.ray.compare RUN_A RUN_B``: are two runs the same bits?

Compares every ``metrics.jsonl`` field except wall-clock timings and the process's peak memory
(``time/*``, ``tokens_per_s/*``, ``memory/*``), and every tensor of the final ``policy/`` (raw bits).
Prints one line per difference (at most 20) and a summary; exit code 0 when identical, 1 otherwise.
"""

from __future__ import annotations

import sys
from pathlib import Path

from safetensors.torch import load_file

from rlalign.contract.bits import first_difference
from rlalign.contract.errors import RLAlignError
from rlalign.train.run.metrics import read_metrics

VOLATILE = ("time/", "tokens_per_s/", "memory/")


def metric_differences(run_a: Path, run_b: Path) -> list[str]:
    a, b = read_metrics(run_a), read_metrics(run_b)
    out = [] if len(a) == len(b) else [f"metrics.jsonl: {len(a)} records vs {len(b)}"]
    for ra, rb in zip(a, b):
        for key in sorted(set(ra) | set(rb)):
            if not key.startswith(VOLATILE) and ra.get(key) != rb.get(key):
                out.append(f"step {ra.get('step')} {key}: {ra.get(key)!r} vs {rb.get(key)!r}")
    return out


def _policy_tensors(run: Path) -> dict:
    """Every tensor of the run's exported policy: one model.safetensors or its shards (exports over 5 GiB)."""
    files = sorted((Path(run) / "policy").glob("*.safetensors"))
    if not files:
        raise RLAlignError(f"{Path(run) / 'policy'} holds no *.safetensors: did the run finish?")
    out = {}
    for file in files:
        out.update(load_file(file))
    return out


def weight_differences(run_a: Path, run_b: Path) -> list[str]:
    a, b = (_policy_tensors(r) for r in (run_a, run_b))
    out = [f"policy: tensor {name} only in one run" for name in sorted(set(a) ^ set(b))]
    for name in sorted(set(a) & set(b)):
        x, y = a[name], b[name]
        if x.shape != y.shape or x.dtype != y.dtype:
            out.append(f"policy {name}: {tuple(x.shape)} {x.dtype} vs {tuple(y.shape)} {y.dtype}")
        elif (first := first_difference(x.flatten(), y.flatten())) is not None:
            out.append(f"policy {name}: first differing element {first.index[0]}: {first.value_a!r} vs "
                       f"{first.value_b!r}")
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m rlalign.integrations.ray.compare RUN_A RUN_B", file=sys.stderr)
        return 2
    a, b = (Path(x) for x in argv)
    diffs = metric_differences(a, b) + weight_differences(a, b)
    for line in diffs[:20]:
        print(line)
    print(f"{a} vs {b}: {len(read_metrics(a))} metric records, {len(diffs)} differences "
          f"({'bitwise identical' if not diffs else 'NOT identical'}; timings and peak memory not compared)")
    return 0 if not diffs else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
