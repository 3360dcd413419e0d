"""``rlalign report RUN_DIR [RUN_DIR ...]``: plots of runs' metrics.jsonl and a short Markdown summary.

One run: ``RUN_DIR/report.png`` and ``RUN_DIR/report.md``. Several runs: one figure with the runs
overlaid (one colour per run) and a summary table, written to ``--out`` (default: the first run's
directory, as ``compare.png`` / ``compare.md``). Noisy per-step series are drawn raw (faint) and
smoothed (an exponential moving average with weight ``smooth`` on the past, 0 = raw only); the
reward panel shades mean ± std. A panel whose series are all zero, or absent from the run, says so
in the panel instead of showing a flat line without comment.

Where it writes (rlalign.models.ownership): a run directory (one holding metrics.jsonl) takes its
``report.*`` / ``compare.*`` files; any other ``--out`` folder must be new, empty, or hold only those
two files. Each file is written atomically and never through a link (a link there is refused).
"""

from __future__ import annotations

import io
from pathlib import Path

from rlalign.contract.errors import RLAlignError
from rlalign.models.ownership import prepare_output_folder, refuse_link
from rlalign.models.atomic import atomic_write
from rlalign.train.run.metrics import read_metrics

# (title, keys, y label, note when every value is 0, note when the run has none of the keys)
PANELS = (
    ("reward", ["reward/mean"], "mean reward ± std (band), min/max (dotted)", None, None),
    ("eval accuracy", ["eval/accuracy", "eval/accuracy_greedy"], "held-out accuracy", None, "no eval ran"),
    ("train/rollout mismatch", ["mismatch/count", "moe/routing_mismatch"],
     "differing token logprobs; MoE: (token, layer) routes",
     "0 at every step: bitwise identical (MoE: the same experts for every token)", None),
    ("KL", ["kl/ref", "rollout_corr/kl_k3", "kl/ppo", "kl/policy_step"], "k3 KL",
     "all 0 at every step (kl/ref is absent without a reference model, algo.kl_coef=0; "
     "rollout_corr is 0 when rollout == trainer bitwise; kl/ppo is 0 with one update per rollout)", None),
    ("entropy", ["entropy"], "mean token entropy", None, None),
    ("clip fraction", ["clip_frac"], "tokens with a clipped ratio",
     "0 at every step: no token's ratio left the clip range (with ppo_epochs=1 and bitwise-equal "
     "logprobs the ratio is exactly 1)", None),
    ("completion length", ["completion/mean_len", "completion/min_len", "completion/max_len"], "tokens", None, None),
    ("losses", ["loss/policy", "loss/kl", "loss/value"], "loss", None, None),
    ("grad norm", ["grad_norm"], "before clipping", None, None),
    ("learning rate", ["lr"], "lr of the step's update", None, None),
    ("step time", ["time/rollout_s", "time/train_s", "time/eval_s"], "seconds", None, None),
    ("throughput", ["tokens_per_s/rollout"], "rollout tokens/s", None, None),
    ("train/rollout |logprob difference|", ["mismatch/max_abs", "mismatch/abs_p99", "mismatch/abs_p50"],
     "|trainer - rollout| per token: max, p99, p50",
     "0 at every step: bitwise identical (the quantiles are logged in the native profile)", None),
    ("importance ratio trainer/rollout", ["mismatch/ratio_max", "mismatch/ratio_min"],
     "exp(trainer - rollout): max and min over the step's tokens", None,
     "logged in the native profile (strict: exactly 1 on every token)"),
    ("mismatch correction", ["rollout_corr/truncated_frac", "rollout_corr/masked_frac"],
     "tokens truncated (TIS) / masked (MIS)", "0 at every step: no token's ratio reached the bound",
     "no correction (algo.mismatch_correction=none)"),
)
# An SFT run's panels (rlalign sft: metrics with loss/sft)
SFT_PANELS = (
    ("loss", ["loss/sft", "eval/loss"], "mean NLL of the scored tokens (loss/sft: the step's batch; eval: held out)",
     None, None),
    ("grad norm", ["grad_norm"], "before clipping", None, None),
    ("learning rate", ["lr"], "lr of the step's update", None, None),
    ("throughput", ["tokens_per_s/train"], "train tokens/s", None, None),
)
SMOOTHED = {"loss/sft", "reward/mean", "entropy", "clip_frac", "completion/mean_len", "loss/policy", "grad_norm",
            "tokens_per_s/rollout", "kl/ref", "rollout_corr/kl_k3"}


def _series(records, key):
    pts = [(r["step"], r[key]) for r in records if key in r and r[key] is not None]
    if key.startswith("time/") or key in ("reward/mean", "loss/policy", "loss/sft", "grad_norm", "lr", "clip_frac"):
        pts = [p for p in pts if p[0] > 0]   # step 0 is the initial eval, not an update
    return [p[0] for p in pts], [p[1] for p in pts]


def ema(values: list[float], smooth: float) -> list[float]:
    """``s_t = smooth * s_{t-1} + (1 - smooth) * v_t``, debiased like TensorBoard's (starts at v_0)."""
    out, acc, weight = [], 0.0, 0.0
    for v in values:
        acc = smooth * acc + (1 - smooth) * v
        weight = smooth * weight + (1 - smooth)
        out.append(acc / weight)
    return out


def _draw_panel(ax, runs, panel, smooth: float) -> None:
    title, keys, ylabel, zero_note, missing_note = panel
    import matplotlib.pyplot as plt
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    styles = ["-", "--", ":", "-."]
    for ri, (name, records) in enumerate(runs):
        colour = colours[ri % len(colours)]
        for ki, key in enumerate(keys):
            xs, ys = _series(records, key)
            if not xs:
                continue
            label = key if len(runs) == 1 else f"{name}: {key}"
            c = colour if len(runs) > 1 else colours[ki % len(colours)]
            if key == "reward/mean":
                _draw_reward(ax, records, xs, ys, c, label, smooth)
                continue
            if key in SMOOTHED and smooth > 0 and len(ys) > 3:
                ax.plot(xs, ys, color=c, alpha=0.25, lw=1)
                ax.plot(xs, ema(ys, smooth), color=c, ls=styles[ki % len(styles)] if len(runs) > 1 else "-", lw=1.6, label=label)
            else:
                ax.plot(xs, ys, color=c, ls=styles[ki % len(styles)] if len(runs) > 1 else "-",
                        marker="o" if len(xs) < 40 else None, ms=3, label=label)
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel, fontsize=8)
    ax.grid(alpha=0.3)
    note = panel_note(runs, panel)
    if note:
        import textwrap
        ax.text(0.5, 0.5, textwrap.fill(note, 44), transform=ax.transAxes, ha="center", va="center", fontsize=8,
                bbox=dict(boxstyle="round", fc="lightyellow", alpha=0.9))
    if len(ax.lines) > 1 or len(runs) > 1:
        handles = [h for h in ax.get_legend_handles_labels()[0]]
        if handles:
            ax.legend(fontsize=7)


def panel_note(runs, panel) -> "str | None":
    """What a panel says about itself: its keys are absent from every run, or all zero where that
    has a meaning worth stating (None: the curves speak for themselves)."""
    _, keys, _, zero_note, missing_note = panel
    values = [v for _, records in runs for key in keys for v in _series(records, key)[1]]
    if not values:
        return missing_note or "not logged in this run"
    if zero_note and all(v == 0 for v in values):
        return zero_note
    return None


def _draw_reward(ax, records, xs, ys, colour, label, smooth: float) -> None:
    _, std = _series(records, "reward/std")
    if len(std) == len(ys):
        lo = [m - s for m, s in zip(ys, std)]
        hi = [m + s for m, s in zip(ys, std)]
        ax.fill_between(xs, lo, hi, color=colour, alpha=0.12, lw=0)
    for key in ("reward/min", "reward/max"):
        mx, my = _series(records, key)
        if mx:
            ax.plot(mx, my, color=colour, ls=":", lw=0.8, alpha=0.6)
    if smooth > 0 and len(ys) > 3:
        ax.plot(xs, ys, color=colour, alpha=0.3, lw=1)
        ax.plot(xs, ema(ys, smooth), color=colour, lw=1.8, label=label)
    else:
        ax.plot(xs, ys, color=colour, marker="o" if len(xs) < 40 else None, ms=3, label=label)


def write_report(run_dirs: "str | Path | list", out_dir: "str | Path | None" = None,
                 smooth: float = 0.6, notes: "list[str] | None" = None) -> tuple[Path, Path]:
    """Plot one run (``report.png`` / ``report.md`` in its directory) or several overlaid
    (``compare.png`` / ``compare.md`` in ``out_dir``, default the first run's directory). A torn
    last line of a metrics.jsonl is dropped and described in ``notes``."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dirs = [Path(d) for d in (run_dirs if isinstance(run_dirs, (list, tuple)) else [run_dirs])]
    runs = [(d.name, read_metrics(d, notes)) for d in dirs]
    for d, (_, records) in zip(dirs, runs):
        if not records:
            raise RLAlignError(f"{d / 'metrics.jsonl'} holds no records (the run stopped before its first "
                               "evaluation): nothing to report")
    stem = "report" if len(dirs) == 1 else "compare"
    out = _report_folder(Path(out_dir) if out_dir is not None else dirs[0], stem)
    sft = all(is_sft_run(records) for _, records in runs)
    panels = SFT_PANELS if sft else PANELS
    cols = 2 if sft else 4
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 4 * rows) if sft else (5 * cols, 4 * rows))
    for ax, panel in zip(axes.flat, panels):
        _draw_panel(ax, runs, panel, smooth)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    names = ", ".join(n for n, _ in runs)
    fig.suptitle(f"rlalign run{'s' if len(runs) > 1 else ''}: {names}"
                 + (f"  (faint: raw; solid: EMA {smooth})" if smooth > 0 else ""))
    fig.tight_layout()
    png, md = out / f"{stem}.png", out / f"{stem}.md"
    image = io.BytesIO()
    fig.savefig(image, format="png", dpi=100)
    plt.close(fig)
    atomic_write(png, image.getvalue())
    summary = sft_summary_markdown if sft else summary_markdown
    atomic_write(md, (summary(runs[0][1], dirs[0], png.name) if len(runs) == 1
                      else compare_markdown(runs, png.name)).encode())
    return png, md


def _report_folder(out: Path, stem: str) -> Path:
    """``out`` checked as the report's folder: a run directory, or a folder holding only this report's files."""
    names = (f"{stem}.png", f"{stem}.md")
    if (out / "metrics.jsonl").is_file() and not out.is_symlink():
        for name in names:
            refuse_link(out / name, "report file")
        return out
    return prepare_output_folder(out, what="report folder", owns=lambda p: p.name in names)


def summary_markdown(records, run_dir: Path, png_name: str = "report.png") -> str:
    steps = [r for r in records if "reward/mean" in r]
    evals = [r for r in records if r.get("eval/accuracy") is not None]
    mism = sum(int(r.get("mismatch/count", 0)) for r in steps)
    compared = sum(int(r.get("mismatch/tokens", 0)) for r in steps)
    lines = [f"# Run report: {run_dir.name}", "", f"![metrics]({png_name})", ""]
    if steps:
        lines += [f"- steps: {len(steps)} (last step {steps[-1]['step']})",
                  f"- reward: {steps[0]['reward/mean']:.3f} at the first step, {steps[-1]['reward/mean']:.3f} at the last"]
    if evals:
        lines.append(f"- eval accuracy: {evals[0]['eval/accuracy']:.3f} at step {evals[0]['step']}, "
                     f"{evals[-1]['eval/accuracy']:.3f} at step {evals[-1]['step']} (best {max(e['eval/accuracy'] for e in evals):.3f})")
    lines.append(f"- train/rollout logprob mismatches: {mism} of {compared} tokens compared"
                 + (" (bitwise identical at every step)" if mism == 0 and compared else ""))
    routing = _routing_totals(steps)
    if routing is not None:
        lines.append(f"- train/rollout MoE routing mismatches: {routing[0]} of {routing[1]} (token, sparse layer) pairs "
                     "compared (top-k expert sets" + ("; the same experts at every step)" if routing[0] == 0 else ")"))
    if steps:
        t_roll = sum(r.get("time/rollout_s", 0) for r in steps)
        t_train = sum(r.get("time/train_s", 0) for r in steps)
        t_eval = sum(r.get("time/eval_s", 0) for r in records)
        total = t_roll + t_train + t_eval
        lines.append(f"- time: {total:.1f} s = rollout {t_roll:.1f} + train {t_train:.1f} + eval {t_eval:.1f} "
                     f"({(t_roll + t_train) / len(steps):.2f} s per step without eval)")
        clip = [r["clip_frac"] for r in steps if "clip_frac" in r]
        if clip:
            lines.append(f"- clip fraction: mean {sum(clip) / len(clip):.4f}, max {max(clip):.4f}")
    return "\n".join(lines) + "\n"


def is_sft_run(records) -> bool:
    return any("loss/sft" in r for r in records)


def sft_summary_markdown(records, run_dir: Path, png_name: str = "report.png") -> str:
    steps = [r for r in records if "loss/sft" in r]
    evals = [r for r in records if r.get("eval/loss") is not None]
    lines = [f"# SFT run report: {run_dir.name}", "", f"![metrics]({png_name})", "",
             f"- steps: {len(steps)} (last step {steps[-1]['step']}, epoch {steps[-1].get('epoch')})",
             f"- train loss (the step's batch): {steps[0]['loss/sft']:.4f} at the first step, "
             f"{steps[-1]['loss/sft']:.4f} at the last"]
    if evals:
        lines.append(f"- eval loss (held out): " + ", ".join(f"{e['eval/loss']:.4f} (step {e['step']})" for e in evals))
    t_train = sum(r.get("time/train_s", 0) for r in steps)
    t_eval = sum(r.get("time/eval_s", 0) for r in records)
    tokens = sum(r.get("tokens", 0) for r in steps)
    lines.append(f"- time: train {t_train:.1f} s + eval {t_eval:.1f} s; {tokens} scored tokens")
    return "\n".join(lines) + "\n"


def compare_markdown(runs, png_name: str) -> str:
    lines = ["# Runs compared", "", f"![metrics]({png_name})", "",
             "| run | steps | reward first -> last | eval accuracy first -> last (best) | mismatches | s/step "
             "| max abs logprob diff | clip fraction (mean) | grad norm (mean) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, records in runs:
        steps = [r for r in records if "reward/mean" in r]
        evals = [r["eval/accuracy"] for r in records if r.get("eval/accuracy") is not None]
        mism = sum(int(r.get("mismatch/count", 0)) for r in steps)
        compared = sum(int(r.get("mismatch/tokens", 0)) for r in steps)
        per_step = sum(r.get("time/rollout_s", 0) + r.get("time/train_s", 0) for r in steps) / max(len(steps), 1)
        reward = f"{steps[0]['reward/mean']:.3f} -> {steps[-1]['reward/mean']:.3f}" if steps else "-"
        acc = f"{evals[0]:.3f} -> {evals[-1]:.3f} ({max(evals):.3f})" if evals else "-"
        routing = _routing_totals(steps)
        routed = "" if routing is None else f"; routing {routing[0]} of {routing[1]}"
        lines.append(f"| {name} | {len(steps)} | {reward} | {acc} | {mism} of {compared}{routed} | {per_step:.2f} "
                     f"| {_stat(steps, 'mismatch/max_abs', max, '.3g')} | {_stat(steps, 'clip_frac', _mean, '.4f')} "
                     f"| {_stat(steps, 'grad_norm', _mean, '.3f')} |")
    return "\n".join(lines) + "\n"


def _mean(values: list) -> float:
    return sum(values) / len(values)


def _stat(steps, key: str, reduce, fmt: str) -> str:
    """``reduce`` of ``key`` over the steps that logged it, formatted; ``-`` when none did."""
    values = [r[key] for r in steps if r.get(key) is not None]
    return format(reduce(values), fmt) if values else "-"


def _routing_totals(steps) -> "tuple[int, int] | None":
    """(differing, compared) MoE routing pairs over the steps, or None when the run logged no routing metric
    (a dense model, or an engine that does not record routing)."""
    logged = [r for r in steps if "moe/routing_tokens" in r]
    if not logged:
        return None
    return sum(int(r["moe/routing_mismatch"]) for r in logged), sum(int(r["moe/routing_tokens"]) for r in logged)
