"""Why a run ends before ``run.steps``: stalled steps, or the end of this invocation's segment.

Stalled runs are steps in which the policy gradient had no signal at all.

GRPO-family advantages are rewards centred (and scaled) within each prompt's group, so a step in which
every group's samples earned equal rewards gives every token an advantage of exactly 0 -- and a collapsed
policy (entropy ~0: every prompt's samples identical) stays in that state for good, since no gradient can
move it out. A 200-step run of the Qwen3-8B shape on an H200 (2026-12-02) spent 186 of its steps frozen like that.
The trainer warns once a stall has lasted :data:`WARN_AFTER` steps and, with ``run.stop_when_stalled=N``,
ends the run after N stalled steps in a row (a checkpoint first, as any early stop). A segment ends at
``run.stop_at_step`` or ``run.max_minutes`` (:func:`segment_end`); a resume continues the run.
"""

from __future__ import annotations

WARN_AFTER = 5   # consecutive stalled steps before the warning line


def stalled(record: dict) -> bool:
    """No policy-gradient signal in this step: every completion token's advantage is exactly 0."""
    return record.get("advantage/std") == 0.0 and record.get("advantage/mean") == 0.0


class StallWatch:
    """Counts consecutive stalled steps; says when to warn (once per stall) and when to stop."""

    def __init__(self, stop_after: int | None):
        self.stop_after = stop_after
        self.streak = 0

    def update(self, record: dict) -> str | None:
        """The warning line to log after this step's ``record``, or None."""
        self.streak = self.streak + 1 if stalled(record) else 0
        if self.streak != WARN_AFTER:
            return None
        entropy = record.get("entropy")
        collapsed = entropy is not None and entropy < 0.01
        why = (f"the policy has collapsed (entropy {entropy:.4f}: each prompt's samples are identical)" if collapsed
               else "every prompt's samples earned the same reward (a constant or saturated reward)")
        stop = (f"; run.stop_when_stalled={self.stop_after} ends the run after {self.stop_after} such steps"
                if self.stop_after else "; set run.stop_when_stalled=N to end such a run early")
        return (f"no learning signal for {self.streak} steps in a row: every completion token's advantage is 0 because "
                f"{why}. Lower optim.lr or raise rollout.temperature (a collapse), or check the reward{stop}")

    def stop_reason(self) -> str | None:
        """Why the run ends now (run.stop_when_stalled reached), or None."""
        if self.stop_after and self.streak >= self.stop_after:
            return f"run.stop_when_stalled={self.stop_after}: {self.streak} steps in a row without a learning signal"
        return None


def segment_end(run, step: int, elapsed_s: float, step_s: float = 0.0) -> "str | None":
    """Why this invocation ends after ``step`` before run.steps (a checkpoint is saved first), or None:
    ``run.stop_at_step`` reached (the schedule still spans run.steps: a resume continues the same run), or
    ``run.max_minutes`` reached -- or about to be: the next step, estimated to take as long as this one
    (``step_s``, its eval included), would end past it (a GPU job's wall-clock limit must not cut a step)."""
    if run.stop_at_step is not None and step >= run.stop_at_step:
        return f"run.stop_at_step={run.stop_at_step} reached"
    if run.max_minutes and elapsed_s / 60 > run.max_minutes:
        return f"run.max_minutes={run.max_minutes} reached"
    if run.max_minutes and (elapsed_s + step_s) / 60 > run.max_minutes:
        return (f"run.max_minutes={run.max_minutes}: another step (~{step_s:.0f} s, as long as the last) "
                f"would end past it")
    return None


__all__ = ["StallWatch", "segment_end", "stalled", "WARN_AFTER"]
