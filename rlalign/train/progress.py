"""The training progress bar, shared by the single-process loop and the Ray launcher's driver (which feeds it
the records it reads from metrics.jsonl)."""

from __future__ import annotations

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from rlalign.train.config import TrainConfig


class TrainProgress:
    """A rich progress bar of a training run: step, reward, mismatch count, eval accuracy, ETA. Fed one
    metrics record per step (``update``); does nothing when ``run.progress`` is off or there is no console."""

    def __init__(self, cfg: TrainConfig, console, start_step: int):
        self.bar = None
        if not cfg.run.progress or console is None:
            return
        self.bar = Progress(TextColumn("[bold]train[/bold]"), BarColumn(), MofNCompleteColumn(),
                            TextColumn("reward {task.fields[reward]}  mismatches {task.fields[mism]}  "
                                       "eval {task.fields[eval]}"), TimeRemainingColumn(), console=console)
        self.task = self.bar.add_task("train", total=cfg.run.steps, completed=start_step, reward="-", mism="-",
                                      eval="-")
        self.bar.start()

    def update(self, record: dict) -> None:
        if self.bar is None:
            return
        fields = {"reward": f"{record['reward/mean']:.3f}", "mism": str(record["mismatch/count"])}
        if "eval/accuracy" in record:
            fields["eval"] = f"{record['eval/accuracy']:.3f}"
        self.bar.update(self.task, completed=record["step"], **fields)

    def note(self, text: str) -> None:
        if self.bar is not None:
            self.bar.console.print(text)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


__all__ = ["TrainProgress"]
