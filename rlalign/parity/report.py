"""Parity reports: ``parity.json`` (everything), ``parity.md`` (readable) and ``logprob_diff_hist.png``
(histogram of |Δ logprob| per token, log scale, exact zeros counted in the title).

The report folder must be new, empty, or hold only these three files (rlalign.models.ownership):
a folder with anything else in it, or a link there, is refused before the comparison runs."""

from __future__ import annotations

import json
import math
from pathlib import Path

from rlalign.models.ownership import check_output_folder, prepare_output_folder
from rlalign.parity.run import ParityResult

JSON_NAME, MARKDOWN_NAME, HISTOGRAM_NAME = "parity.json", "parity.md", "logprob_diff_hist.png"
REPORT_FILES = (JSON_NAME, MARKDOWN_NAME, HISTOGRAM_NAME)


def is_report_file(path: Path) -> bool:
    return Path(path).name in REPORT_FILES and Path(path).is_file()


def check_report_folder(directory: str | Path) -> None:
    """Refuse a report folder that holds anything but a parity report's files (changes nothing)."""
    check_output_folder(Path(directory), what="--report", owns=is_report_file, overwrite=True)


def write_report(result: ParityResult, directory: str | Path) -> dict[str, Path]:
    out = prepare_output_folder(Path(directory), what="--report", owns=is_report_file)
    paths = {"json": out / JSON_NAME, "markdown": out / MARKDOWN_NAME, "histogram": out / HISTOGRAM_NAME}
    details = result.details()
    details["abs_diffs"] = result.tokens.abs_diffs
    paths["json"].write_text(json.dumps(details, indent=2, default=str) + "\n")
    write_histogram(result.tokens.abs_diffs, paths["histogram"], _title(result), result.tokens.mismatches)
    paths["markdown"].write_text(markdown(result, paths["histogram"].name))
    return paths


def _title(result: ParityResult) -> str:
    o = result.options
    return f"rollout {o.rollout} vs train {o.train} ({o.profile})"


def write_histogram(abs_diffs: list[float], path: Path, title_prefix: str = "", mismatches: int | None = None) -> None:
    """Bars of log10 |Δ| for the tokens whose |Δ| > 0, and one green bar for |Δ| = 0."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    nonzero = [math.log10(d) for d in abs_diffs if d > 0 and math.isfinite(d)]
    zeros = sum(1 for d in abs_diffs if d == 0)
    differ = len(nonzero) if mismatches is None else mismatches
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    lo = math.floor(min(nonzero)) - 1 if nonzero else -1
    ax.bar([lo], [zeros], width=0.4, color="#27ae60", label="|Δ| = 0")
    if nonzero:
        ax.hist(nonzero, bins=min(30, max(5, len(set(nonzero)))), color="#c0392b", label="|Δ| > 0")
    ax.set_xticks([lo] + list(range(lo + 1, math.ceil(max(nonzero, default=lo)) + 1)),
                  ["0"] + [f"1e{e}" for e in range(lo + 1, math.ceil(max(nonzero, default=lo)) + 1)])
    ax.set_xlabel("|Δ logprob| per token (log scale)")
    ax.set_ylabel("tokens")
    ax.legend()
    ax.set_title(f"{title_prefix}\n{len(abs_diffs) - differ} of {len(abs_diffs)} token logprobs bitwise equal, "
                 f"{differ} differ", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def markdown(result: ParityResult, histogram_name: str = HISTOGRAM_NAME) -> str:
    d = result.details()
    t = result.tokens
    status = "**OK**: every compared token's logprob is bitwise identical" if result.ok else (
        f"**NOT COMPARABLE**: {t.not_comparable}" if t.not_comparable else
        f"**MISMATCH**: {t.mismatches} of {t.tokens_compared} token logprobs differ")
    lines = [
        f"# rlalign parity: rollout `{d['rollout']}` vs train `{d['train']}` ({d['profile']} profile)",
        "", status, "",
        "| | |", "|---|---|",
        f"| model | `{d['model']}` |",
        f"| sequences | {d['sequences']} ({d['prompts']} prompts) |",
        f"| sampling | {', '.join(f'{k}={v}' for k, v in d['sampling'].items())} |",
        f"| tokens compared | {t.tokens_compared} |",
        f"| mismatches | {t.mismatches} |",
        f"| max \\|Δ logprob\\| | {t.max_abs_diff:.6g} |",
        f"| mean \\|Δ logprob\\| | {t.mean_abs_diff:.6g} |",
        f"| weights (rollout / train) | `{d['rollout_weights_hash'][:16]}` / `{d['train_weights_hash'][:16]}` |",
        "",
    ]
    first = d["first_divergence"]
    if first:
        lines += ["## First divergence", "",
                  f"Sequence {first['sequence']} (prompt {first['prompt_index']}, sample {first['sample']}), "
                  f"position {first['position']}, token {first['token']}: rollout {first['rollout_logprob']!r} vs "
                  f"train {first['train_logprob']!r} (|Δ| {first['abs_diff']:.3g}).", ""]
        loc = first.get("localized")
        if loc:
            lines += [localized_sentence(loc), ""]
    if result.localization is not None:
        lines += _boundary_table(result)
    lines += [f"![|Δ logprob| histogram]({histogram_name})", ""]
    return "\n".join(lines)


def localized_sentence(loc: dict) -> str:
    if loc.get("layer") is None and loc.get("op") == "logprob":
        return "Localized: every captured boundary up to the final norm is identical; the difference is made " \
               "in the LM head / logprob."
    if loc.get("boundary") is None:
        return f"Localization: {loc.get('verdict')} ({loc.get('reason', '')})."
    where = f"layer {loc['layer']}, `{loc['op']}`" if loc["layer"] is not None else f"`{loc['op']}`"
    return (f"Localized: first divergence at {where} (`{loc['boundary']}`), sequence {loc['sequence']} position "
            f"{loc['position']} (token {loc['token']}), feature {tuple(loc['feature'])}: train {loc['train_value']!r} "
            f"vs rollout {loc['rollout_value']!r} ({loc['ulp']} ulp).")


def _boundary_table(result: ParityResult) -> list[str]:
    loc = result.localization
    lines = ["## Boundaries (forward order)", "", f"Verdict: **{loc.verdict}**. {loc.reason}", ""]
    compared = [b for b in loc.boundaries if b.compared]
    if compared:
        lines += ["| boundary | rows | elements | differ | max ulp |", "|---|---:|---:|---:|---:|"]
        lines += [f"| `{b.name}` | {b.rows} | {b.elements} | {b.mismatches} | {b.max_ulp} |" for b in compared]
        lines.append("")
    for note in sorted({b.note for b in loc.boundaries if b.note}):
        names = [b.name for b in loc.boundaries if b.note == note]
        lines += [f"Not compared ({note}): {', '.join(f'`{n}`' for n in names)}", ""]
    return lines


__all__ = ["write_report", "write_histogram", "markdown"]
