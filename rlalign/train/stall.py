"""Stalled runs: steps in which the policy gradient had no signal at all.

GRPO-family advantages are rewards centred (and scaled) within each prompt's group, so a step in which
every group's samples earned equal rewards gives every token an advantage of exactly 0 -- and a collapsed
policy (entropy ~0: every prompt's samples identical) stays in that state for good, since no gradient can
move it out. A 200-step run of the Qwen3-8B shape on an H200 (2026-12-02) spent 186 of its steps frozen like that.
The trainer warns once a stall has lasted :data:`WARN_AFTER` steps and, with ``run.stop_when_stalled=N``,
ends the run after N stalled steps in a row (a checkpoint first, as any early stop).
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


__all__ = ["StallWatch", "stalled", "WARN_AFTER"]
