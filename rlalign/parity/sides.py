"""The two sides a parity run compares: a rollout side that generates, a training side that scores.

Rollout: :class:`RLAlignRollout` (rlalign's :class:`~rlalign.rollout.RolloutEngine`).
Training: :class:`RLAlignTrainer` (rlalign's model, packed forward, ``CausalLM.logprobs``).
Other sides are registered by the integrations (``ROLLOUT_SIDES`` / ``TRAINER_SIDES``, filled when
``rlalign.integrations`` is imported): vLLM as a rollout side (:mod:`rlalign.integrations.vllm.parity`) and
a Hugging Face model as a training side (:mod:`rlalign.integrations.transformers_parity`).

A training side scores the completions of a :class:`~rlalign.parity.replay.RolloutRecord`: the
logprob of generated token i of a sequence with P prompt tokens is read from the row at position
P - 1 + i of the full sequence (prompt + completion), at the record's logprob temperature.
"""

from __future__ import annotations

import dataclasses
import datetime
import platform
from typing import Callable, Sequence

import torch

from rlalign.contract.profiles import as_profile, use_profile
from rlalign.models.batch import ForwardBatch, next_token_targets
from rlalign.models.checkpoint import weights_hash
from rlalign.parity.capture import capture
from rlalign.parity.replay import RecordedSequence, RolloutRecord
from rlalign.rollout import RolloutConfig, RolloutEngine, SamplingParams
from rlalign.version import __version__


def environment(device: torch.device | str) -> dict:
    return {"rlalign": __version__, "torch": torch.__version__, "python": platform.python_version(),
            "device": str(device), "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


class RLAlignRollout:
    """Generate with rlalign's rollout engine (continuous batching, paged KV, chunked prefill)."""

    name = "rlalign"

    def __init__(self, model, profile: str = "strict", engine_config: dict | None = None):
        self.model = model
        self.profile = as_profile(profile).value
        self.engine_config = dict(engine_config or {})

    def generate(self, prompts: Sequence[Sequence[int]], *, n: int = 1, max_new_tokens: int = 16,
                 temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0) -> RolloutRecord:
        engine = RolloutEngine(self.model, RolloutConfig(profile=self.profile, **self.engine_config))
        sampling = SamplingParams(n=n, temperature=temperature, top_k=top_k, top_p=top_p,
                                  max_new_tokens=max_new_tokens, seed=seed)
        completions = engine.generate([list(p) for p in prompts], sampling)
        sequences = [RecordedSequence(c.prompt_index, c.sample_index, list(c.prompt_tokens), list(c.tokens),
                                      list(c.logprobs), c.seed, c.finish_reason) for c in completions]
        return RolloutRecord(
            sequences, weights_hash(self.model),
            {"n": n, "temperature": temperature, "top_k": top_k, "top_p": top_p, "max_new_tokens": max_new_tokens,
             "seed": seed, "logprob_temperature": sampling.logprob_temperature},
            engine=self.name, profile=self.profile, model=model_info(self.model),
            environment=environment(self.model.device))

    def capture(self, **kwargs):
        return capture(model=self.model, **kwargs)


def model_info(model) -> dict:
    cfg = model.config
    return {"family": cfg.family, "dtype": str(model.dtype).removeprefix("torch."), "num_layers": cfg.num_layers,
            "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size}


def completion_rows(seqs: Sequence[RecordedSequence]) -> list[list[int]]:
    """Per sequence: the rows (positions) whose logprob scores each generated token."""
    return [list(range(len(s.prompt_tokens) - 1, len(s.prompt_tokens) - 1 + len(s.tokens))) for s in seqs]


def _micro_batches(n: int, size: int | None) -> list[range]:
    size = n if not size else size
    return [range(i, min(n, i + size)) for i in range(0, n, size)]


class ChunkedTrainer:
    """A training side: scores a record's sequences ``micro_batch`` at a time (all at once by default);
    each subclass computes the completion-token logprobs of one chunk."""

    def __init__(self, model, micro_batch: int | None = None):
        self.model = model
        self.micro_batch = micro_batch

    @property
    def weights_hash(self) -> str:
        return weights_hash(self.model)

    def score(self, record: RolloutRecord) -> list[list[float]]:
        out: list[list[float]] = []
        seqs = record.sequences
        for chunk in _micro_batches(len(seqs), self.micro_batch):
            out += self._score_chunk([seqs[i] for i in chunk], record.logprob_temperature)
        return out

    def _score_chunk(self, part: list[RecordedSequence], temperature: float) -> list[list[float]]:
        raise NotImplementedError


class RLAlignTrainer(ChunkedTrainer):
    """Score with rlalign's model: packed forward (``ForwardBatch.packed``) + fused ``CausalLM.logprobs``."""

    name = "rlalign"

    def __init__(self, model, profile: str = "strict", micro_batch: int | None = None):
        super().__init__(model, micro_batch)
        self.profile = as_profile(profile).value

    def _score_chunk(self, part, temperature):
        tokens = [s.all_tokens for s in part]
        batch = ForwardBatch.packed(tokens, device=self.model.device)
        targets = next_token_targets(tokens).to(self.model.device)
        with torch.no_grad(), use_profile(self.profile):
            lp, _ = self.model.logprobs(batch, targets, temperature=temperature, with_entropy=False)
        lp = lp.cpu()
        offsets = batch.cu_seqlens.tolist()
        return [lp[[start + r for r in rows]].tolist() for start, rows in zip(offsets, completion_rows(part))]

    def capture(self, **kwargs):
        return capture(model=self.model, **kwargs)


# ---- the registries: name -> side, filled by rlalign (here) and by the integrations -----------------------------

@dataclasses.dataclass(frozen=True)
class SideBuilder:
    """How ``rlalign parity`` makes one side from its options: ``build(options, model, model_dir)`` (``model``:
    rlalign's CausalLM of the checkpoint); ``check(options)`` runs first, before any model is loaded, and raises
    with the fix when the side cannot run here (a missing optional dependency, an option it does not support)."""
    build: Callable
    check: Callable | None = None


ROLLOUT_SIDES: dict[str, SideBuilder] = {}
TRAINER_SIDES: dict[str, SideBuilder] = {}


def register_rollout_side(name: str, build: Callable, check: Callable | None = None) -> None:
    ROLLOUT_SIDES[name] = SideBuilder(build, check)


def register_trainer_side(name: str, build: Callable, check: Callable | None = None) -> None:
    TRAINER_SIDES[name] = SideBuilder(build, check)


register_rollout_side("rlalign", lambda o, model, model_dir: RLAlignRollout(model, o.profile))
register_trainer_side("rlalign", lambda o, model, model_dir: RLAlignTrainer(model, o.profile, o.train_batch))


__all__ = ["RLAlignRollout", "RLAlignTrainer", "ChunkedTrainer", "completion_rows", "model_info", "environment",
           "SideBuilder", "ROLLOUT_SIDES", "TRAINER_SIDES", "register_rollout_side", "register_trainer_side"]
