"""Does bitwise agreement pay? One GRPO experiment in several arms that differ only in the profile / correction.

    python benchmarks/proof.py --out runs/proof                       # CPU: pretrain + 3 arms + the overlay report
    python benchmarks/proof.py --out runs/proof-gpu --size gpu --device cuda
    python benchmarks/proof.py --out runs/proof --arms strict,native  # a subset (arms of a folder add up)

Stages, each written under ``--out`` (docs/proof.md has the method and the measured result):

1. **base model** (``base/``): ``rlalign pretrain``'s recipe (rlalign.train.pretrain: a random-init Qwen3-shaped
   model with a character tokenizer, next-token loss on the answers of the built-in addition task's train split,
   no format habit) until its sampled held-out accuracy first reaches ``--base-accuracy`` (checked every few
   steps), so it knows some addition but leaves RL room; ``base-moe/`` (MoE arms only): that model upcycled to a Qwen3-MoE (every expert a copy of the
   dense MLP, a seeded random router: rlalign.models.upcycle).
2. **arms** (``runs/ARM``): ``rlalign train`` on the built-in addition task from that model with one config
   (``train.yaml``): the same seed, prompts, hyper-parameters and step count in every arm; only ``run.profile``,
   ``algo.mismatch_correction`` and ``algo.routing_replay`` differ (:data:`ARMS`). ``native`` uses the vendor
   kernels, whose rollout and trainer log-probs differ (the native profile only reports the difference; nothing
   stops the run); ``moe-native-replay`` has the trainer reuse the rollout's recorded experts (R3).
3. **report**: ``rlalign report`` of the arms overlaid (``report/compare.png``, ``report/compare.md``) and a
   per-arm summary (``summary.md``, ``summary.json``).

Resumable: run the same command again after an interruption; a finished stage is kept, an arm with a checkpoint
continues from it bit for bit (``run.resume=true``). The folder records its settings (``proof.json``); another
size, dtype, device, seed or step count in the same folder is refused. The arms run one after another in this process,
through ``rlalign train``'s own entry point.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:   # run as a file from anywhere: this tree's rlalign
    sys.path.insert(0, str(ROOT))

from rlalign.contract.errors import RLAlignError  # noqa: E402

# arm -> (model: dense | moe, run.profile, algo.mismatch_correction, algo.routing_replay)
ARMS = {
    "strict": ("dense", "strict", "none", False),
    "native": ("dense", "native", "none", False),
    "native-tis": ("dense", "native", "token_tis", False),
    "native-mis": ("dense", "native", "token_mis", False),
    "moe-strict": ("moe", "strict", "none", False),
    "moe-native": ("moe", "native", "none", False),
    "moe-native-tis": ("moe", "native", "token_tis", False),
    "moe-native-replay": ("moe", "native", "none", True),
}
DEFAULT_ARMS = "strict,native,native-tis"


@dataclasses.dataclass(frozen=True)
class Size:
    """One scale of the experiment: the base model, its pretraining and the GRPO run of every arm."""
    model: dict                 # PretrainConfig's shape fields
    digits: tuple[int, int]     # operand digits of the task (pretraining and RL)
    pretrain_steps: int         # at most; pretraining ends at the first evaluation that reaches base_accuracy
    pretrain_batch: int
    pretrain_lr: float
    pretrain_eval_every: int
    base_accuracy: float        # sampled (T=1) held-out accuracy that ends pretraining (0: run every step)
    steps: int                  # GRPO steps per arm
    prompts: int                # prompts per step
    samples: int                # samples per prompt (the group)
    lr: float
    eval_size: int
    eval_every: int
    checkpoint_every: int
    experts: int = 4            # MoE arms: experts per layer (top-2), upcycled from the base model


SIZES = {
    # the fast test's: seconds, nothing learned
    "tiny": Size(dict(hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8, intermediate_size=32),
                 (1, 2), 2, 8, 3e-3, 1, 0.0, 2, 2, 2, 2e-4, 4, 1, 1),
    # the embedded default model's shape (0.8 M parameters), 1-2 digit addition: minutes on 2 CPU cores
    "cpu": Size(dict(hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32, intermediate_size=384),
                (1, 2), 600, 128, 3e-3, 25, 0.25, 100, 32, 8, 2e-4, 500, 10, 20),
    # the same model on 4-digit operands: 11-token prompts, where the native CPU kernels of rollout and trainer
    # disagree (docs/proof.md)
    "cpu-long": Size(dict(hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32,
                          intermediate_size=384),
                     (4, 4), 1500, 128, 3e-3, 50, 0.25, 100, 32, 8, 2e-4, 500, 10, 20),
    # Qwen3-shaped, 16 layers x hidden 1024 (about 200 M parameters with the 15-token vocabulary), 1-3 digits
    "gpu": Size(dict(hidden_size=1024, num_layers=16, num_heads=16, num_kv_heads=8, head_dim=64,
                     intermediate_size=3072),
                (1, 3), 5000, 256, 3e-4, 100, 0.25, 200, 64, 8, 1e-5, 500, 10, 50),
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--out", default="runs/proof", help="the experiment's folder (new, or one this script wrote)")
    p.add_argument("--size", choices=sorted(SIZES), default="cpu")
    p.add_argument("--arms", default=DEFAULT_ARMS, help=f"comma-separated, of {', '.join(ARMS)}")
    p.add_argument("--steps", type=int, help="GRPO steps per arm (default: the size's)")
    p.add_argument("--pretrain-steps", type=int, help="base-model pretraining steps at most (default: the size's)")
    p.add_argument("--base-accuracy", type=float,
                   help="pretraining ends at the first evaluation whose sampled held-out accuracy reaches this "
                        "(0: every step; default: the size's)")
    p.add_argument("--device", default="cpu", help="cpu | cuda")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                   help="the policy's dtype in the arms (the base model is pretrained in float32)")
    p.add_argument("--seed", type=int, default=0, help="seed of the base model, the task split and every arm")
    p.add_argument("--minutes", type=float,
                   help="time budget of this invocation: an arm running at the deadline stops after a checkpoint "
                        "(run.max_minutes), later arms wait; the same command again continues (e.g. under a "
                        "10-minute limit per command)")
    p.add_argument("--report-only", action="store_true", help="redraw the report of the arms already run")
    return p.parse_args(argv)


def settings(args) -> dict:
    """What the folder's runs depend on (proof.json): changing any of it needs a new folder."""
    size = SIZES[args.size]
    wanted = {"size": args.size, "device": args.device, "dtype": args.dtype, "seed": args.seed,
              "steps": args.steps or size.steps, "pretrain_steps": args.pretrain_steps or size.pretrain_steps,
              "base_accuracy": size.base_accuracy if args.base_accuracy is None else args.base_accuracy,
              "size_values": dataclasses.asdict(size)}   # a size redefined in this file is another experiment
    return json.loads(json.dumps(wanted))   # as proof.json holds it (tuples as lists)


def claim_folder(out: Path, wanted: dict) -> None:
    """``out`` is new, empty, or this script's with the same settings; anything else is refused in one line."""
    marker = out / "proof.json"
    if marker.is_file():
        found = json.loads(marker.read_text())
        if found != wanted:
            diff = ", ".join(f"{k} {found.get(k)!r} -> {v!r}" if k != "size_values" else "the size's values"
                             for k, v in wanted.items() if found.get(k) != v)
            raise RLAlignError(f"{out} holds an experiment with other settings ({diff}): use a new --out")
        return
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise RLAlignError(f"{out} exists and is not an experiment folder of this script (no proof.json): "
                           "use a new --out")
    out.mkdir(parents=True, exist_ok=True)
    marker.write_text(json.dumps(wanted, indent=1) + "\n")


# ---- stage 1: the base model ----------------------------------------------------------------------------------

def pretrain_config(out: Path, s: dict):
    from rlalign.train.pretrain import PretrainConfig
    size = SIZES[s["size"]]
    return PretrainConfig(out=str(out / "base"), seed=s["seed"], **size.model, min_digits=size.digits[0],
                          max_digits=size.digits[1], batch_size=size.pretrain_batch, lr=size.pretrain_lr,
                          steps=s["pretrain_steps"], habit_prob=0.0, eval_every=size.pretrain_eval_every,
                          eval_size=size.eval_size, max_new_tokens=size.digits[1] + 2, device=s["device"],
                          stop_at_accuracy=s["base_accuracy"])


def base_model(out: Path, s: dict, log) -> dict:
    """Pretrain ``out/base`` unless a finished one with this config is there; its pretrain.json record."""
    from rlalign.train.pretrain import pretrain
    cfg = pretrain_config(out, s)
    record = out / "base" / "pretrain.json"
    if record.is_file() and json.loads(record.read_text())["pretrain_config"] == dataclasses.asdict(cfg):
        log(f"base model: kept {cfg.out}")
    else:
        started = time.perf_counter()
        pretrain(cfg, log=lambda line: log(f"pretrain: {line}"))
        log(f"base model: {time.perf_counter() - started:.0f} s")
    return json.loads(record.read_text())


def moe_model(out: Path, s: dict, log) -> Path:
    """``out/base-moe``: the base model upcycled (every expert a copy of the dense MLP, top-2), unless there."""
    from rlalign.models import load_model, save_model
    from rlalign.models.upcycle import upcycle
    from rlalign.train.pretrain import write_char_tokenizer
    target = out / "base-moe"
    if (target / "tokenizer.json").is_file():   # written last
        return target
    dense, _ = load_model(out / "base")
    save_model(upcycle(dense, SIZES[s["size"]].experts, 2, seed=s["seed"]), target)
    write_char_tokenizer(target)
    log(f"base model (MoE): {target}, {SIZES[s['size']].experts} experts top-2, upcycled")
    return target


# ---- stage 2: the arms ----------------------------------------------------------------------------------------

def train_config(s: dict) -> dict:
    """The one GRPO config every arm runs (the arms add model.path, run.profile, algo.mismatch_correction,
    algo.routing_replay, run.dir). The embedded default run's algorithm: GRPO advantages, PPO-clip, token-mean, no KL."""
    size = SIZES[s["size"]]
    return {
        "model": {"device": s["device"], "dtype": s["dtype"]},
        "task": {"name": "arithmetic", "min_digits": size.digits[0], "max_digits": size.digits[1],
                 "eval_size": size.eval_size},
        "rollout": {"prompts_per_step": size.prompts, "samples_per_prompt": size.samples,
                    "max_new_tokens": size.digits[1] + 3, "temperature": 1.0},
        "algo": {"advantage": "grpo", "policy_loss": "ppo_clip", "loss_agg": "token-mean", "kl_coef": 0.0},
        "optim": {"lr": size.lr, "warmup_steps": 5, "grad_clip": 1.0, "micro_batch_tokens": 4096},
        "run": {"steps": s["steps"], "seed": s["seed"], "eval_every": size.eval_every, "eval_samples": 2,
                "checkpoint_every": size.checkpoint_every, "on_mismatch": "warn", "progress": False},
    }


def arm_argv(out: Path, arm: str, model_path: Path, resume: bool, minutes: "float | None" = None) -> list[str]:
    """``rlalign train``'s arguments for ``arm``: the shared train.yaml and the arm's own keys (``minutes``: the
    run stops after a checkpoint once it has run that long, ``run.max_minutes``)."""
    _, profile, correction, replay = ARMS[arm]
    argv = ["train", str(out / "train.yaml"), f"model.path={model_path}", f"run.profile={profile}",
            f"run.dir={out / 'runs' / arm}"]
    if correction != "none":
        argv.append(f"algo.mismatch_correction={correction}")
    if replay:
        argv.append("algo.routing_replay=true")
    if minutes is not None:
        argv.append(f"run.max_minutes={minutes:.2f}")
    return argv + (["run.resume=true"] if resume else ["run.overwrite=true"])


def arm_state(run_dir: Path, steps: int) -> str:
    """done (the last step logged and the policy saved) | resume (a checkpoint to continue from) | fresh."""
    metrics = run_dir / "metrics.jsonl"
    if (run_dir / "policy" / "config.json").is_file() and metrics.is_file():
        last = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        if last and last[-1].get("step") == steps:
            return "done"
    ckpts = run_dir / "checkpoints"
    return "resume" if ckpts.is_dir() and any(ckpts.iterdir()) else "fresh"


def run_arm(out: Path, arm: str, s: dict, log, minutes: "float | None" = None) -> bool:
    """``rlalign train`` for one arm, in this process (the CLI's own entry point: its checks, run directory,
    per-run report), fresh, resumed from the arm's latest checkpoint, or skipped when finished; whether the arm
    has now run all its steps."""
    from rlalign.cli.main import main as rlalign_main
    model_path = moe_model(out, s, log) if ARMS[arm][0] == "moe" else out / "base"
    run_dir = out / "runs" / arm
    state = arm_state(run_dir, s["steps"])
    if state == "done":
        log(f"arm {arm}: kept {run_dir}")
        return True
    argv = arm_argv(out, arm, model_path, resume=state == "resume", minutes=minutes)
    log(f"arm {arm}: {'resuming' if state == 'resume' else 'running'}: rlalign {' '.join(argv)}")
    started = time.perf_counter()
    code = rlalign_main(argv)
    if code != 0:
        raise RLAlignError(f"arm {arm}: rlalign train exited {code} (its message is above)")
    log(f"arm {arm}: {time.perf_counter() - started:.0f} s")
    return arm_state(run_dir, s["steps"]) == "done"


# ---- stage 3: the report --------------------------------------------------------------------------------------

def arm_summary(run_dir: Path) -> dict:
    """One arm's numbers from its metrics.jsonl: held-out accuracy, reward, the train/rollout differences and
    the importance ratio, the clip fraction, the gradient norm, and the time per step."""
    from rlalign.train.run.metrics import read_metrics
    records = read_metrics(run_dir, [])
    steps = [r for r in records if "reward/mean" in r]
    evals = [(r["step"], r["eval/accuracy"]) for r in records if r.get("eval/accuracy") is not None]

    def values(key):
        return [r[key] for r in steps if r.get(key) is not None]

    def mean(key):
        v = values(key)
        return sum(v) / len(v) if v else None

    def extreme(key, f):
        v = values(key)
        return f(v) if v else None

    tail = steps[-max(len(steps) // 4, 1):]
    return {
        "steps": len(steps),
        "eval_accuracy": evals,
        "eval_accuracy_first": evals[0][1] if evals else None,
        "eval_accuracy_last": evals[-1][1] if evals else None,
        "eval_accuracy_best": max(a for _, a in evals) if evals else None,
        "reward_first": steps[0]["reward/mean"] if steps else None,
        "reward_last_quarter_mean": sum(r["reward/mean"] for r in tail) / len(tail) if steps else None,
        "logprobs_compared": sum(int(r.get("mismatch/tokens", 0)) for r in steps),
        "logprobs_differing": sum(int(r.get("mismatch/count", 0)) for r in steps),
        "routing_compared": sum(int(r.get("moe/routing_tokens", 0)) for r in steps),
        "routing_differing": sum(int(r.get("moe/routing_mismatch", 0)) for r in steps),
        # routing replay: the (token, layer) pairs taken from the rollout, and those the trainer's router would
        # have chosen otherwise (the routing mismatch the replay removed)
        "routing_replayed": sum(int(r.get("moe/routing_replayed", 0)) for r in steps),
        "routing_overridden": sum(int(r.get("moe/routing_overridden", 0)) for r in steps),
        "abs_diff_max": extreme("mismatch/max_abs", max),
        "abs_diff_mean": mean("mismatch/mean_abs"),
        "abs_diff_p50_mean": mean("mismatch/abs_p50"),
        "abs_diff_p99_mean": mean("mismatch/abs_p99"),
        "ratio_min": extreme("mismatch/ratio_min", min),
        "ratio_max": extreme("mismatch/ratio_max", max),
        "truncated_frac_mean": mean("rollout_corr/truncated_frac"),
        "masked_frac_mean": mean("rollout_corr/masked_frac"),
        "clip_frac_mean": mean("clip_frac"),
        "grad_norm_mean": mean("grad_norm"),
        "s_per_step": (sum(r.get("time/rollout_s", 0) + r.get("time/train_s", 0) for r in steps) / len(steps)
                       if steps else None),
        # the median resists the stalls of a shared machine (another job's burst inflates a few steps)
        "s_per_step_median": (statistics.median(r.get("time/rollout_s", 0) + r.get("time/train_s", 0) for r in steps)
                              if steps else None),
    }


def _fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def summary_markdown(summaries: dict, s: dict, base: dict) -> str:
    acc = base.get("eval_accuracy", {})
    lines = [f"# Proof run: {', '.join(summaries)}", "",
             f"settings: {json.dumps({k: v for k, v in s.items() if k != 'size_values'})}; base model after "
             f"{base.get('steps_run', s['pretrain_steps'])} pretraining steps: held-out "
             f"accuracy greedy {_fmt(acc.get('greedy'), '.3f')}, sampled {_fmt(acc.get('sampled'), '.3f')}", "",
             "![arms overlaid](report/compare.png)", "",
             "| arm | held-out acc. first -> last (best) | reward first -> last quarter | logprobs (MoE: routes) differing "
             "| abs diff p50 / p99 (step means) / max | ratio min / max | truncated / masked | clip frac "
             "| grad norm | s/step (median) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for arm, m in summaries.items():
        lines.append(
            f"| {arm} | {_fmt(m['eval_accuracy_first'], '.3f')} -> {_fmt(m['eval_accuracy_last'], '.3f')} "
            f"({_fmt(m['eval_accuracy_best'], '.3f')}) | {_fmt(m['reward_first'], '.3f')} -> "
            f"{_fmt(m['reward_last_quarter_mean'], '.3f')} | {m['logprobs_differing']} of {m['logprobs_compared']}"
            + (f"; routing {m['routing_differing']} of {m['routing_compared']}" if m["routing_compared"] else "")
            + (f" (replayed; {m['routing_overridden']} overridden)" if m.get("routing_replayed") else "") +
            f" "
            f"| {_fmt(m['abs_diff_p50_mean'], '.2g')} / {_fmt(m['abs_diff_p99_mean'], '.2g')} / "
            f"{_fmt(m['abs_diff_max'], '.2g')} | {_fmt(m['ratio_min'], '.4f')} / {_fmt(m['ratio_max'], '.4f')} "
            f"| {_fmt(m['truncated_frac_mean'], '.2g')} / {_fmt(m['masked_frac_mean'], '.2g')} "
            f"| {_fmt(m['clip_frac_mean'], '.4f')} | {_fmt(m['grad_norm_mean'], '.3f')} "
            f"| {_fmt(m['s_per_step'], '.2f')} ({_fmt(m['s_per_step_median'], '.2f')}) |")
    return "\n".join(lines) + "\n"


def report(out: Path, arms: list[str], s: dict, log) -> dict:
    from rlalign.train.run.report import write_report
    dirs = [out / "runs" / a for a in arms if (out / "runs" / a / "metrics.jsonl").is_file()]
    if not dirs:
        raise RLAlignError(f"no arm of {', '.join(arms)} has run in {out}")
    summaries = {d.name: arm_summary(d) for d in dirs}
    base = json.loads((out / "base" / "pretrain.json").read_text())
    (out / "summary.json").write_text(json.dumps({"settings": s, "base": base, "arms": summaries}, indent=1) + "\n")
    (out / "summary.md").write_text(summary_markdown(summaries, s, base))
    if len(dirs) > 1:
        png, _ = write_report(dirs, out / "report")
    else:
        png, _ = write_report(dirs)
    log(f"report: {png}, {out / 'summary.md'}")
    return summaries


def main(argv=None) -> int:
    args = parse_args(argv)
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = [a for a in arms if a not in ARMS]
    if unknown or not arms:
        print(f"proof.py: error: unknown arm(s) {', '.join(unknown) or '(none given)'}; choose from "
              f"{', '.join(ARMS)}", file=sys.stderr)
        return 2
    s = settings(args)
    out = Path(args.out).resolve()
    started = time.monotonic()

    def log(line):
        print(f"[proof {time.strftime('%H:%M:%S')}] {line}", flush=True)

    try:
        if args.steps is not None and args.steps < 1 or args.pretrain_steps is not None and args.pretrain_steps < 1:
            raise RLAlignError("--steps and --pretrain-steps must be >= 1")
        if args.device != "cpu" and not args.device.startswith("cuda"):
            raise RLAlignError(f"--device must be cpu, cuda or cuda:N, got {args.device!r}")
        if args.minutes is not None and not args.minutes > 0:
            raise RLAlignError(f"--minutes must be > 0, got {args.minutes}")
        claim_folder(out, s)
        if not args.report_only:
            log(f"base model: pretraining {s['pretrain_steps']} steps ({args.size} size, {args.device})")
            base = base_model(out, s, log)
            log(f"base model: held-out accuracy {base['eval_accuracy']}")
            import yaml
            (out / "train.yaml").write_text(yaml.safe_dump(train_config(s), sort_keys=False))
            for arm in arms:
                left = None if args.minutes is None else args.minutes - (time.monotonic() - started) / 60
                if left is not None and left < 0.5 and arm_state(out / "runs" / arm, s["steps"]) != "done":
                    log(f"time budget (--minutes {args.minutes:g}) used before arm {arm}: run the same command "
                        "again to continue")
                    break
                if not run_arm(out, arm, s, log, left):
                    log(f"arm {arm} stopped at its time budget: run the same command again to continue")
                    break
        report(out, arms, s, log)
    except RLAlignError as e:
        print(f"proof.py: error: {e}", file=sys.stderr)
        return 2
    print((out / "summary.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
