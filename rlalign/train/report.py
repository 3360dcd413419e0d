"""``rlalign report RUN_DIR``: plots of a run's metrics.jsonl and a short Markdown summary."""

from __future__ import annotations

from pathlib import Path

from rlalign.contract.errors import RLAlignError
from rlalign.train.runio import read_metrics

PANELS = (
    ("reward", ["reward/mean"], "mean reward"),
    ("eval accuracy", ["eval/accuracy", "eval/accuracy_greedy"], "held-out accuracy"),
    ("train/rollout mismatch", ["mismatch/count"], "tokens whose logprobs differ"),
    ("KL", ["rollout_corr/kl_k3", "loss/kl"], "k3 KL"),
    ("entropy", ["entropy"], "mean token entropy"),
    ("throughput", ["tokens_per_s/rollout"], "rollout tokens/s"),
)


def _series(records, key):
    pts = [(r["step"], r[key]) for r in records if key in r and r[key] is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def write_report(run_dir: "str | Path", notes: "list[str] | None" = None) -> tuple[Path, Path]:
    """Write report.png and report.md; a torn last line of metrics.jsonl is dropped and described in ``notes``."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    records = read_metrics(run_dir, notes)
    if not records:
        raise RLAlignError(f"{run_dir / 'metrics.jsonl'} holds no records (the run stopped before its first "
                           "evaluation): nothing to report")
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    for ax, (title, keys, ylabel) in zip(axes.flat, PANELS):
        for key in keys:
            xs, ys = _series(records, key)
            if xs:
                ax.plot(xs, ys, marker="o" if len(xs) < 40 else None, ms=3, label=key)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if len(ax.lines) > 1:
            ax.legend(fontsize=8)
    fig.suptitle(f"rlalign run: {run_dir.name}")
    fig.tight_layout()
    png = run_dir / "report.png"
    fig.savefig(png, dpi=110)
    plt.close(fig)
    md = run_dir / "report.md"
    md.write_text(summary_markdown(records, run_dir))
    return png, md


def summary_markdown(records, run_dir: Path) -> str:
    steps = [r for r in records if "reward/mean" in r]
    evals = [r for r in records if r.get("eval/accuracy") is not None]
    mism = sum(int(r.get("mismatch/count", 0)) for r in steps)
    compared = sum(int(r.get("mismatch/tokens", 0)) for r in steps)
    lines = [f"# Run report: {run_dir.name}", "", "![metrics](report.png)", ""]
    if steps:
        lines += [f"- steps: {len(steps)} (last step {steps[-1]['step']})",
                  f"- reward: {steps[0]['reward/mean']:.3f} at the first step, {steps[-1]['reward/mean']:.3f} at the last"]
    if evals:
        lines.append(f"- eval accuracy: {evals[0]['eval/accuracy']:.3f} at step {evals[0]['step']}, "
                     f"{evals[-1]['eval/accuracy']:.3f} at step {evals[-1]['step']} (best {max(e['eval/accuracy'] for e in evals):.3f})")
    lines.append(f"- train/rollout logprob mismatches: {mism} of {compared} tokens compared"
                 + (" (bitwise identical at every step)" if mism == 0 and compared else ""))
    times = [r.get("time/rollout_s", 0) + r.get("time/train_s", 0) for r in steps]
    if times:
        lines.append(f"- time: {sum(times):.1f} s in rollout + training ({sum(times) / len(times):.2f} s/step)")
    return "\n".join(lines) + "\n"
