"""A step launched on the device whose results are not read yet: what the runner hands the engine.

The runner queues a step's forward and sampling and returns a :class:`LaunchedStep`; the engine completes it
later (the one wait for the device). With overlapped scheduling one such step is in flight while the engine
completes its predecessor, so sequences can finish or be aborted while it runs: their rows are marked dead
and their pages freed once it has run.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from rlalign.rollout.readback import Readback
from rlalign.rollout.scheduler import SchedulerOutput
from rlalign.rollout.sequence import Sequence


@dataclasses.dataclass
class LaunchedStep:
    """A step whose forward and sampling are queued on the device, its results not yet read.

    ``seqs`` / ``slots`` / ``positions``: the sampling sequences (row order of the results), their slots in
    the scheduler's SlotTable and the position each new token takes. A step launched as a continuation
    (overlapped scheduling) is planned before its input tokens are known: its chunks are marked computed
    when its predecessor completes (``marked``). Rows of sequences that finish or are aborted while it is
    in flight are ``dead`` (bool per row; dropped) and their pages are freed once it has run
    (``release``): it writes their K/V slots. (No slot is handed to another sequence while a step is in
    flight: only :meth:`Scheduler.schedule` admits, and it runs with nothing in flight.)"""
    plan: SchedulerOutput
    seqs: list[Sequence]
    slots: np.ndarray
    positions: np.ndarray
    results: Readback | None                     # pack_results of the tokens and logprobs (+ verdicts)
    verdict_messages: list
    routing: tuple[np.ndarray, Readback] | None  # (slots, expert ids) with record_routing
    forward_info: dict                           # engine.last_forward once completed
    device_tokens: torch.Tensor | None = None    # graph-sampled: the tokens on the device (a continuation's ids)
    events: tuple | None = None                  # CUDA events around the graph replay (time_replays)
    graph_replayed: bool = False                 # whether its forward was a decode graph replay
    seconds: float = 0.0
    marked: bool = True
    dead: np.ndarray | None = None
    release: list[Sequence] = dataclasses.field(default_factory=list)

    def mark_dead(self, slots: list[int]) -> None:
        """The rows of the sequences in ``slots`` (finished or aborted) are dropped."""
        hit = member(self.slots, slots)
        self.dead = hit if self.dead is None else self.dead | hit

    @property
    def all_dead(self) -> bool:
        return self.dead is not None and bool(self.dead.all())


def member(values: np.ndarray, members: list[int]) -> np.ndarray:
    """bool [n]: whether each of ``values`` (small non-negative ints: slots) is one of ``members`` (a mask
    lookup; np.isin sorts both)."""
    if not values.size or not members:
        return np.zeros(values.shape, bool)
    mask = np.zeros(max(int(values.max()), max(members)) + 1, bool)
    mask[members] = True
    return mask[values]
