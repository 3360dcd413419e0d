"""``rlalign sft``'s config: the model and optimizer sections of ``rlalign train`` plus ``data`` and ``run``.

``model`` and ``optim`` are :class:`~rlalign.train.config.ModelSection` and
:class:`~rlalign.train.config.OptimSection` (one way to name a model and an AdamW setup, for RL and SFT alike);
``data`` says which JSONL files hold the examples and how they read; ``run`` holds the run directory, the
length of the run (epochs or steps), the batch and the cadence of eval, logs and checkpoints.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Literal

from rlalign.configlib import Rule, at_least, checked_by_type, non_empty, within
from rlalign.train.config import ModelSection, OptimSection


@dataclasses.dataclass
class DataSection:
    CHECKS: ClassVar[dict[str, Rule]] = {
        "path": non_empty("a JSONL file of examples"),
        "eval_path": non_empty("a JSONL file of held-out examples", optional=True),
        "eval_fraction": within(0, 1, high_open=True),
        "format": checked_by_type("auto, prompt_response or messages"),
        "prompt_field": non_empty(),
        "response_field": non_empty(),
        "messages_field": non_empty(),
        "chat": checked_by_type("true or false"),
        "max_length": at_least(2, optional=True),
    }
    path: str = ""                     # JSONL: {"prompt": ..., "response": ...} or {"messages": [...]} per line
    eval_path: str | None = None       # held-out JSONL; None: data.eval_fraction of data.path is held out
    eval_fraction: float = 0.05        # share of data.path's rows held out for eval/loss (without data.eval_path; 0: none)
    format: Literal["auto", "prompt_response", "messages"] = "auto"   # auto: messages when the rows have data.messages_field
    prompt_field: str = "prompt"       # prompt_response: the field holding the prompt text
    response_field: str = "response"   # prompt_response: the field holding the response text
    messages_field: str = "messages"   # messages: the field holding the chat messages
    chat: bool = False                 # prompt_response: render each row as a user + assistant turn of the chat template
    max_length: int | None = None      # most tokens per example (longer rows are refused); None: the model's positions

    def validate(self):
        if self.eval_path is not None and self.eval_fraction:
            return "eval_path and eval_fraction both choose the held-out rows: give one (data.eval_fraction=0)"


@dataclasses.dataclass
class SFTRunSection:
    CHECKS: ClassVar[dict[str, Rule]] = {
        "dir": non_empty("a directory path", optional=True),
        "epochs": at_least(1),
        "steps": at_least(1, optional=True),
        "batch_size": at_least(1),
        "seed": within(0, 2**63 - 1),
        "shuffle": checked_by_type("true or false"),
        "profile": checked_by_type("strict or native"),
        "eval_every": at_least(1),
        "checkpoint_every": at_least(1),
        "keep_checkpoints": at_least(1),
        "log_every": at_least(1),
        "stop_at_step": at_least(1, optional=True),
        **{k: checked_by_type("true or false") for k in ("resume", "overwrite")},
    }
    dir: str | None = None             # default: runs/sft-<timestamp>
    epochs: int = 1                    # passes over the training rows (run.steps unset)
    steps: int | None = None           # optimizer steps; None: run.epochs x ceil(rows / run.batch_size)
    batch_size: int = 16               # examples per optimizer step (packed into micro-batches of optim.micro_batch_tokens)
    seed: int = 0                      # the order of the rows (a new permutation each epoch) and the held-out split
    shuffle: bool = True               # false: rows in file order every epoch
    profile: Literal["strict", "native"] = "strict"   # strict: the bitwise ops (as rlalign train)
    eval_every: int = 10               # eval/loss on the held-out rows every N steps (and at step 0 and the last)
    checkpoint_every: int = 50         # checkpoint every N steps (and at the last)
    keep_checkpoints: int = 2          # newest checkpoints kept in run.dir/checkpoints
    log_every: int = 1                 # one plain log line every N steps
    stop_at_step: int | None = None    # stop (after a checkpoint) after this step; the lr schedule still spans the run
    resume: bool = False               # continue the run in run.dir from its latest checkpoint and saved config.yaml
    overwrite: bool = False            # a fresh run may replace the files of a previous run in run.dir


@dataclasses.dataclass
class SFTConfig:
    model: ModelSection = dataclasses.field(default_factory=ModelSection)
    data: DataSection = dataclasses.field(default_factory=DataSection)
    optim: OptimSection = dataclasses.field(default_factory=OptimSection)
    run: SFTRunSection = dataclasses.field(default_factory=SFTRunSection)

    def validate(self):
        if not self.data.path:
            return "data.path is required: the JSONL file of examples (data.path=train.jsonl; docs/sft.md)"
        if self.run.resume and self.run.overwrite:
            return "run.resume=true continues the run in run.dir and run.overwrite=true replaces it: choose one"


# Keys a resume may change: how the run is executed, watched or how long it goes. Any other change is refused.
RESUME_FREE = frozenset({"run.dir", "run.epochs", "run.steps", "run.resume", "run.overwrite", "run.eval_every",
                         "run.checkpoint_every", "run.keep_checkpoints", "run.log_every", "run.stop_at_step",
                         "optim.activation_checkpointing", "optim.offload", "optim.step_chunk_elements"})


__all__ = ["DataSection", "SFTRunSection", "SFTConfig", "RESUME_FREE"]
