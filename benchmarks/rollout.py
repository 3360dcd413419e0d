"""Rollout throughput: rlalign engine (strict, native) vs transformers generate.

    python benchmarks/rollout.py [--device cpu|cuda] [--preset cpu-small|qwen3-0.6b|tiny] [--json] ...

The same as ``rlalign bench rollout``; see :mod:`rlalign.bench.rollout` for the method.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlalign.bench.rollout import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
