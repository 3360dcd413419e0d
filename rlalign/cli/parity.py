"""rlalign parity: generate with the rollout side, score the same tokens with the training side,
compare every token's logprob bitwise; exit 0 iff zero mismatches (1 otherwise, 2 on errors)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from rich.console import Console
from rich.table import Table

import rlalign.integrations  # noqa: F401  (registers the parity sides --rollout vllm, --train transformers)
from rlalign.bench.args import non_negative_int, positive_int, seed_int
from rlalign.cli._device import require_device
from rlalign.models.checkpoint import CheckpointError
from rlalign.parity.replay import check_record_target
from rlalign.parity.report import check_report_folder, localized_sentence, write_report
from rlalign.parity.run import ParityError, ParityOptions, run_parity
from rlalign.parity.sides import ROLLOUT_SIDES, TRAINER_SIDES
from rlalign.parity.tp import parse_degrees


def register(subparsers) -> None:
    p = subparsers.add_parser("parity", help="compare rollout and training logprobs bit for bit",
                              description=__doc__)
    p.add_argument("--model", default="default", help="checkpoint directory, or 'default' (the embedded model)")
    p.add_argument("--rollout", default="rlalign", choices=sorted(ROLLOUT_SIDES),
                   help="rollout side: rlalign's engine, or vLLM (needs the vllm extra; docs/vllm.md)")
    p.add_argument("--vllm-plugin", default="on", choices=["on", "off"],
                   help="--rollout vllm: run vLLM with rlalign's plugin (strict ops) or stock (the baseline)")
    p.add_argument("--train", default="rlalign", choices=sorted(TRAINER_SIDES),
                   help="training side: rlalign's trainer forward, or a Hugging Face model (patched in strict, "
                        "stock transformers in native)")
    p.add_argument("--prompts", type=positive_int, default=4, help="number of prompts")
    p.add_argument("--samples", type=positive_int, default=2, help="samples per prompt")
    p.add_argument("--max-new-tokens", type=positive_int, default=16)
    p.add_argument("--profile", default="strict", choices=["strict", "native", "portable"],
                   help="portable: the same bits on the CPU and on a CUDA GPU (slow; docs/portable.md)")
    p.add_argument("--localize", action="store_true", help="on a mismatch, find the first op/layer/token that differs")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--report", metavar="DIR", help="write parity.json, parity.md and logprob_diff_hist.png here")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=non_negative_int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=seed_int, default=0)
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"], help="default: the checkpoint's")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--train-batch", type=positive_int, default=None, help="sequences per training forward (default: all)")
    p.add_argument("--record", metavar="FILE", help="write the rollout (tokens, seeds, logprobs) to this JSONL file")
    p.add_argument("--replay", metavar="FILE", help="score a recorded rollout instead of generating")
    p.add_argument("--tp", metavar="DEGREES", default=None,
                   help="also score with the training side sharded over these tensor-parallel degrees, e.g. 1,2,4 "
                        "(gloo processes on CPU, NCCL on GPU); mismatches are counted against TP=1 and the rollout, "
                        "and for MoE models the rows routed differently from TP=1")
    p.set_defaults(func=run)


def options_from_args(args):
    return ParityOptions(model=args.model, rollout=args.rollout, train=args.train, prompts=args.prompts,
                         samples=args.samples, max_new_tokens=args.max_new_tokens, profile=args.profile,
                         localize=args.localize, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                         seed=args.seed, dtype=args.dtype, device=args.device, train_batch=args.train_batch,
                         record=args.record, replay=args.replay, tp=_tp_degrees(args.tp),
                         vllm_plugin=args.vllm_plugin == "on")


def _require_writable(folder: str) -> None:
    """Fail before the comparison runs, not after, when --report cannot be written (or holds files that are
    not a parity report's)."""
    path = Path(folder)
    check_report_folder(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ParityError(f"--report {folder}: cannot create it ({exc.strerror})") from None
    if not path.is_dir() or not os.access(path, os.W_OK | os.X_OK):
        raise ParityError(f"--report {folder}: not a writable directory; choose another --report")


def _tp_degrees(text: str | None) -> tuple[int, ...]:
    if text is None:
        return ()
    return parse_degrees(text)


def run(args) -> int:
    require_device(args.device)
    if args.report:
        _require_writable(args.report)
    if args.record:
        check_record_target(Path(args.record))   # before the comparison runs, not after
    try:
        result = run_parity(options_from_args(args))
    except CheckpointError as exc:
        raise ParityError(str(exc)) from None
    if args.report:
        write_report(result, args.report)
    if args.json:
        print(json.dumps(result.summary()))
    else:
        _print(result, args.report)
    return 0 if result.ok else 1


def _print(result, report_dir) -> None:
    console = Console(soft_wrap=True)
    d, t = result.details(), result.tokens
    plugin = (d["environment"] or {}).get("vllm_plugin")
    rollout = f"{d['rollout']} (plugin {plugin})" if plugin else d["rollout"]
    console.print(f"[bold]rlalign parity[/bold]: rollout {rollout} vs train {d['train']}, profile {d['profile']}, "
                  f"model {d['model']}")
    console.print(f"  {d['sequences']} sequences ({d['prompts']} prompts), {t.tokens_compared} tokens compared: "
                  f"{t.mismatches} mismatches, max |Δ| {t.max_abs_diff:.3g}, mean |Δ| {t.mean_abs_diff:.3g}")
    first = d["first_divergence"]
    if first:
        console.print(f"  first divergence: sequence {first['sequence']} position {first['position']} token "
                      f"{first['token']}: rollout {first['rollout_logprob']!r} vs train {first['train_logprob']!r}")
        if first.get("localized"):
            console.print("  " + localized_sentence(first["localized"]))
    if result.localization is not None:
        table = Table(title=f"boundaries ({result.localization.verdict})")
        for col in ("boundary", "rows", "differ", "max ulp", "note"):
            table.add_column(col)
        for b in result.localization.boundaries:
            if b.compared:
                table.add_row(b.name, str(b.rows), str(b.mismatches), str(b.max_ulp), "")
        skipped = [b for b in result.localization.boundaries if not b.compared]
        if skipped:
            table.add_row(f"({len(skipped)} more)", "", "", "", f"not compared: {skipped[0].note}, ...")
        console.print(table)
    for degree, r in (result.tp or {}).get("tp", {}).items():
        routing = "" if r.get("routing_mismatches") is None else \
            f", {r['routing_mismatches']} rows routed differently from TP=1"
        console.print(f"  TP={degree}: {r['tokens_compared']} tokens, {r['mismatches']} mismatches vs TP=1, "
                      f"{r['rollout_mismatches']} vs the rollout{routing}")
    if report_dir:
        console.print(f"  report: {report_dir}/parity.md")
    if result.ok:
        console.print("[green]OK: every token's logprob is bitwise identical[/green]")
    elif t.not_comparable:
        console.print(f"[red]NOT COMPARABLE: {t.not_comparable}[/red]")
    elif t.mismatches:
        console.print(f"[red]MISMATCH: {t.mismatches} of {t.tokens_compared} token logprobs differ[/red]")
    else:   # rollout and training side agree; a tensor-parallel degree does not
        console.print("[red]MISMATCH across tensor-parallel degrees: see the TP lines above[/red]")
