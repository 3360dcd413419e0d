"""What a training run says while it works: a start banner and one plain line per step.

Everything goes through Python ``logging`` (logger ``rlalign``; the step lines through
``rlalign.train``), so a user can route, filter or silence it like any library's logs. The CLI
installs one handler on stderr (:func:`install_cli_handler`): plain lines when stderr is not a
terminal (batch jobs, ``nohup``, CI, ``rlalign train > log 2>&1``), rich lines that scroll above the
live progress bar when it is. The bar itself is shown only on a terminal and only with
``run.progress=true``; the plain lines are printed either way, every ``run.log_every`` steps.

The ETA is the mean time of the steps this process ran times the steps left: it does not swing
with one slow step (an eval, a checkpoint) and is never blank after the first step.
"""

from __future__ import annotations

import logging
import sys
import time

LOGGER = logging.getLogger("rlalign")
STEP_LOGGER = logging.getLogger("rlalign.train")
CLI_HANDLER = "rlalign-cli"   # the name of the handler install_cli_handler adds


def install_cli_handler(console=None) -> None:
    """One handler on the ``rlalign`` logger (once): rich on a terminal, plain ``stderr`` lines otherwise."""
    if any(h.get_name() == CLI_HANDLER for h in LOGGER.handlers):
        return
    if console is not None and console.is_terminal:
        from rich.logging import RichHandler
        handler = RichHandler(console=console, show_path=False, show_level=False, markup=False)
        handler.setFormatter(logging.Formatter("%(message)s"))
    else:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", datefmt="%Y-%m-%d %H:%M:%S"))
    handler.set_name(CLI_HANDLER)
    LOGGER.addHandler(handler)
    LOGGER.setLevel(logging.INFO)
    LOGGER.propagate = False


def banner_lines(cfg, run_dir, config_path, model_dir, policy, resumed_step: int, weights: str) -> list[str]:
    """The run's opening lines: what it runs, on which model and weights path, where it writes."""
    start = f"resuming at step {resumed_step + 1}" if resumed_step else "starting"
    num_params = sum(p.numel() for p in policy.parameters())
    dtype = str(next(policy.parameters()).dtype).removeprefix("torch.")
    return [f"rlalign train: {start}; run directory {run_dir}",
            f"  config   {config_path} (resolved, every key; `rlalign train --print-config` shows one before a run)",
            f"  model    {model_dir} ({num_params / 1e6:.2f}M parameters, {dtype}) on {cfg.model.device}",
            f"  profile  {cfg.run.profile}; algorithm {cfg.algo.advantage}/{cfg.algo.policy_loss}; "
            f"task {cfg.task.name} ({_rewards(cfg.task)}); {cfg.run.steps} steps of "
            f"{cfg.rollout.prompts_per_step}x{cfg.rollout.samples_per_prompt} samples",
            f"  loggers  {', '.join(dict.fromkeys(['jsonl', *cfg.run.loggers]))} -> {run_dir}",
            f"  weights  {weights}"]


def _rewards(task) -> str:
    """``reward R``, or ``rewards 1*R1 + 0.1*R2`` for weighted terms (task.rewards)."""
    if not task.rewards:
        return f"reward {task.reward}"
    return "rewards " + " + ".join(f"{t.get('weight', 1.0):g}*{t.get('name') or t.get('reward_model')}"
                                   for t in task.rewards)


def step_line(record: dict, total_steps: int, eta_s: "float | None") -> str:
    """One self-contained line: what a user scanning a batch log needs to judge the step."""
    r = record
    parts = [f"step {r['step']}/{total_steps}",
             f"reward {r['reward/mean']:.3f} ± {r['reward/std']:.3f}"]
    if r.get("eval/accuracy") is not None:
        parts.append(f"acc {r['eval/accuracy']:.3f}")
    parts.append(f"mism {r['mismatch/count']}/{r['mismatch/tokens']}")
    if "moe/routing_tokens" in r:
        parts.append(f"route {r['moe/routing_mismatch']}/{r['moe/routing_tokens']}")
    if r.get("kl/ref") is not None:
        parts.append(f"kl {r['kl/ref']:.4g}")
    parts += [f"ent {r['entropy']:.3f}", f"len {r['completion/mean_len']:.1f}", f"clip {r.get('clip_frac', 0.0):.3f}",
              f"lr {r['lr']:.2e}",
              f"{r['time/rollout_s'] + r['time/train_s']:.2f}s (rollout {r['time/rollout_s']:.2f} + "
              f"train {r['time/train_s']:.2f})"]
    if eta_s is not None:
        parts.append(f"eta {_duration(eta_s)}")
    return " | ".join(parts)


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s" if m else f"{s}s"


class StepReporter:
    """Per-step lines (every ``run.log_every`` steps, and the last) and, on a terminal, a progress bar."""

    def __init__(self, cfg, console, start_step: int):
        self.total, self.log_every, self.start_step = cfg.run.steps, cfg.run.log_every, start_step
        self.started = time.perf_counter()
        self.bar = None
        if cfg.run.progress and console is not None and console.is_terminal:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
            self.bar = Progress(TextColumn("[bold]train[/bold]"), BarColumn(), MofNCompleteColumn(),
                                TextColumn("reward {task.fields[reward]}  mismatches {task.fields[mism]}  "
                                           "eval {task.fields[eval]}  eta {task.fields[eta]}"), console=console)
            self.task = self.bar.add_task("train", total=self.total, completed=start_step, reward="-", mism="-",
                                          eval="-", eta="-")
            self.bar.start()

    def eta(self, step: int) -> "float | None":
        done = step - self.start_step
        if done <= 0:
            return None
        return (time.perf_counter() - self.started) / done * max(self.total - step, 0)

    def update(self, record: dict) -> None:
        step, eta = record["step"], self.eta(record["step"])
        if step % self.log_every == 0 or step == self.total:
            STEP_LOGGER.info(step_line(record, self.total, eta))
        if self.bar is not None:
            fields = {"reward": f"{record['reward/mean']:.3f}", "mism": str(record["mismatch/count"]),
                      "eta": _duration(eta) if eta is not None else "-"}
            if record.get("eval/accuracy") is not None:
                fields["eval"] = f"{record['eval/accuracy']:.3f}"
            self.bar.update(self.task, completed=step, **fields)

    def note(self, text: str) -> None:
        LOGGER.info(text)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None


__all__ = ["LOGGER", "install_cli_handler", "banner_lines", "step_line", "StepReporter"]
