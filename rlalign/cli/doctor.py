"""``rlalign doctor [--device cpu|cuda] [--json] [--seed S]``: is the strict contract honoured here?"""

from __future__ import annotations

import json

from rich.console import Console
from rich.table import Table

from rlalign.bench.args import seed_int
from rlalign.cli._device import DeviceUnavailable, require_device
from rlalign.doctor import environment, run_checks


def register(subparsers) -> None:
    p = subparsers.add_parser("doctor", help="check every strict-profile invariance on this machine")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--seed", type=seed_int, default=None, help="seed of the random inputs (default: fresh)")
    p.set_defaults(func=run)


def run(args) -> int:
    try:
        require_device(args.device)
    except DeviceUnavailable as exc:
        if not args.json:
            raise
        print(json.dumps({"ok": False, "device": args.device, "error": str(exc), "checks": []}))
        return 2
    if args.json:
        results, seed = run_checks(args.device, args.seed)
    else:
        console = Console(stderr=True)
        with console.status("checking") as status:
            results, seed = run_checks(args.device, args.seed, progress=lambda m: status.update(f"checking {m}"))
    ok = all(r.holds for r in results)
    if args.json:
        print(json.dumps({"ok": ok, "device": args.device, "seed": seed, "environment": environment(args.device),
                          "checks": [{"op": r.op, "invariance": r.invariance, "holds": r.holds,
                                      "seconds": round(r.seconds, 4), "detail": r.detail} for r in results]}))
        return 0 if ok else 1
    _print_table(results, environment(args.device), seed, ok, args.device)
    return 0 if ok else 1


def _print_table(results, env, seed, ok, device) -> None:
    table = Table(title=f"rlalign doctor --device {device}  (seed {seed})")
    for col in ("op", "invariance", "result", "time"):
        table.add_column(col)
    for r in results:
        verdict = "[green]holds[/green]" if r.holds else f"[red]VIOLATED[/red] {r.detail}"
        table.add_row(r.op, r.invariance, verdict, f"{r.seconds:.2f}s")
    console = Console()
    console.print(table)
    console.print("  ".join(f"{k}: {v}" for k, v in env.items() if v is not None))
    console.print("[green]strict profile: all invariances hold[/green]" if ok
                  else "[red]strict profile: some invariances are violated on this machine; do not rely on strict here[/red]")
