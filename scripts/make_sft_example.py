"""Write the example SFT data of configs/sft-example.yaml: addition problems with their exact answers.

    python scripts/make_sft_example.py runs/sft-data/arith.jsonl [--rows 1024] [--seed 0]

One JSON object per line, ``{"prompt": "12+34=", "response": "46"}``, drawn from the built-in addition task's
*train* split (operands of 1 to 3 digits; the task's held-out problems never appear). The embedded default
model learned these sums with a stray ``0`` after most answers (docs/default_model.md); fine-tuning it on the
exact answers removes the habit, which the held-out eval loss (``eval/loss``) shows.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rlalign.tasks import ArithmeticTask


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", help="the JSONL file to write (a new file; its folder is created)")
    p.add_argument("--rows", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    out = Path(args.out)
    if out.exists():
        raise SystemExit(f"{out} exists; give a new file")
    task = ArithmeticTask(seed=args.seed, min_digits=1, max_digits=3)
    # train problems from an offset the default model's pretraining did not reach (1200 steps x 128 problems)
    rows = [{"prompt": p.prompt, "response": p.answer} for p in task.train_problems(10**6, args.rows)]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {len(rows)} rows to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
