"""The agreement checks between the rollout engine and the trainer, and their metrics.

- **Log-probs** (:meth:`Agreement.check_logprobs`): the trainer's old-policy log-prob of every completion token
  against the engine's (raw bits), logged as ``mismatch/*`` and ``rollout_corr/kl_k3``.
- **Routing** (:meth:`Agreement.check_routing`, MoE models): the experts the trainer's forward sent each row to
  against the engine's record (``Completion.routing``) on every row both computed, logged as ``moe/routing_*``;
  a (row, sparse layer) pair mismatches when the top-k expert sets differ (:func:`rlalign.algos.routing_mismatch`).
  Under ``algo.routing_replay`` (native) the trainer routes those rows by the engine's record, so the count is 0 by
  construction, and ``moe/routing_overridden`` counts where the trainer's own router would have chosen otherwise.
  With samples generated ahead (``rollout.async_steps``) only the samples the trainer's current weights drew are
  compared (:func:`whole_samples`): a stale sample's experts were chosen by older weights, and
  ``run.verify_behaviour`` compares them under those (:class:`rlalign.train.offpolicy.BehaviourVerifier`).

In the strict profile a mismatch of either kind is handled by ``run.on_mismatch``: ``stop`` raises
:class:`MismatchError` (the checks run before any optimizer step of the step), ``warn`` logs it. In the native
profile the two sides may differ and the checks only report, the log-prob check also the spread of the differences
(``mismatch/abs_p50`` / ``abs_p90`` / ``abs_p99`` and the importance ratio's ``mismatch/ratio_min`` / ``ratio_max``:
:func:`rlalign.algos.logprob_diff_distribution`).
"""

from __future__ import annotations

import torch

from rlalign import algos
from rlalign.contract.errors import RLAlignError
from rlalign.contract.profiles import bitwise
from rlalign.train.packing import TrainBatch
from rlalign.train.run.logs import LOGGER
from rlalign.train.samples import StepSamples

LOCALIZE_HINT = "run `rlalign parity --localize` on this model to find the first diverging op"


class MismatchError(RLAlignError):
    pass


class Agreement:
    """The checks of one run: its profile and ``run.on_mismatch``, and the model's sparse layers (for messages)."""

    def __init__(self, profile: str, on_mismatch: str, sparse_layers: list[int]):
        self.strict = bitwise(profile)
        self.on_mismatch = on_mismatch
        self.sparse_layers = sparse_layers

    def check_logprobs(self, step: int, old_lp: torch.Tensor, batch: TrainBatch,
                       tokens: "torch.Tensor | None" = None) -> dict:
        """Compare the trainer's old-policy log-probs with the rollout's on every token the model sampled (raw bits;
        a multi-turn episode's observation tokens have no rollout log-prob), or on those of them in the bool [T]
        ``tokens`` (asynchronous steps: the tokens the trainer's current weights sampled); the ``mismatch/*``
        record."""
        compared = batch.generated if tokens is None else batch.generated & tokens.to(batch.generated.device)
        mism = algos.logprob_mismatch_stats(old_lp, batch.rollout_logprobs, compared)
        record = mismatch_record(mism)
        if not self.strict:   # the spread of the differences (strict: all 0, the record stays as it was)
            spread = algos.logprob_diff_distribution(old_lp, batch.rollout_logprobs, compared)
            record.update({f"mismatch/{k}": float(v) for k, v in spread.items()})
        if self.strict and record["mismatch/count"]:
            self._report(f"step {step}: {record['mismatch/count']} of {record['mismatch/tokens']} token logprobs "
                         f"differ between the rollout engine and the trainer (max |diff| "
                         f"{record['mismatch/max_abs']:.3g}) in the strict profile; {LOCALIZE_HINT}")
        return record

    def check_routing(self, step: int, trainer_ids: torch.Tensor | None, samples: StepSamples,
                      keep: "torch.Tensor | None" = None, router_choice: "torch.Tensor | None" = None) -> dict:
        """Compare the trainer's routing (expert ids [rows of the step's packed forwards, sparse layers, k]: the
        samples in order, every token of each) with the rollout's on the rows both computed, of every sample or of
        those where the bool [N] ``keep`` is True; the ``moe/routing_*`` record.

        Under a routing replay (``algo.routing_replay``) the trainer used the rollout's experts on exactly the rows
        both computed, so ``moe/routing_mismatch`` is 0 by construction; ``router_choice`` (the routers' own top-k,
        laid out as ``trainer_ids``) then gives ``moe/routing_replayed`` (the (token, layer) pairs replayed) and
        ``moe/routing_overridden`` (those where the trainer's router would have chosen other experts: the
        mismatch the replay removed)."""
        if keep is not None:
            if not bool(keep.any()):
                return {"moe/routing_tokens": 0, "moe/routing_mismatch": 0, "moe/routing_mismatch_frac": 0.0,
                        **({} if router_choice is None else
                           {"moe/routing_replayed": 0, "moe/routing_overridden": 0,
                            "moe/routing_overridden_frac": 0.0})}
            if router_choice is not None:
                router_choice, _ = kept_rows(router_choice, samples, keep)
            trainer_ids, samples = kept_rows(trainer_ids, samples, keep)
        ours, theirs, rows = rows_both_computed(step, trainer_ids, samples)
        mism = algos.routing_mismatch(ours, theirs)
        replay = {} if router_choice is None else self._replay_record(step, router_choice, samples)
        if mism["count"] and self.strict:
            row, layer = mism["first"]
            sample = int(torch.searchsorted(torch.tensor(rows).cumsum(0), row, right=True))
            self._report(
                f"step {step}: {mism['count']} of {mism['tokens']} (token, sparse layer) routing choices differ between "
                f"the rollout engine and the trainer in the strict profile; first at sample {sample} token position "
                f"{row - sum(rows[:sample])}, layer {self.sparse_layers[layer]}: rollout experts "
                f"{sorted(theirs[row, layer].tolist())}, trainer {sorted(ours[row, layer].tolist())}; {LOCALIZE_HINT}")
        return {"moe/routing_tokens": mism["tokens"], "moe/routing_mismatch": mism["count"],
                "moe/routing_mismatch_frac": mism["count"] / max(mism["tokens"], 1), **replay}

    @staticmethod
    def _replay_record(step: int, router_choice: torch.Tensor, samples: StepSamples) -> dict:
        """``moe/routing_replayed`` / ``moe/routing_overridden(_frac)`` of a replayed forward
        (:meth:`check_routing`): the routers' own choice against the rollout's on the rows both computed."""
        own, theirs, _ = rows_both_computed(step, router_choice, samples)
        overridden = algos.routing_mismatch(own, theirs)
        return {"moe/routing_replayed": overridden["tokens"], "moe/routing_overridden": overridden["count"],
                "moe/routing_overridden_frac": overridden["count"] / max(overridden["tokens"], 1)}

    def _report(self, msg: str) -> None:
        """``run.on_mismatch``: stop raises MismatchError (before any optimizer step of the step), warn logs."""
        if self.on_mismatch == "stop":
            raise MismatchError(msg)
        LOGGER.warning(f"MISMATCH {msg}")


def mismatch_record(mism: dict) -> dict:
    """The logged ``mismatch/*`` values of :func:`rlalign.algos.logprob_mismatch_stats`."""
    return {"mismatch/tokens": int(mism["tokens"]), "mismatch/count": int(mism["count"]),
            "mismatch/max_abs": float(mism["max_abs"]), "mismatch/mean_abs": float(mism["mean_abs"]),
            "rollout_corr/kl_k3": float(mism["kl_k3"])}


def whole_samples(tokens: "torch.Tensor | None", samples: StepSamples) -> "torch.Tensor | None":
    """bool [N]: the samples every completion token of which is in the bool [sum of completion lengths] ``tokens``
    (None: every sample)."""
    if tokens is None:
        return None
    outside = (~tokens.cpu()).to(torch.int64)
    per_sample = torch.zeros(len(samples), dtype=torch.int64).index_add_(
        0, torch.repeat_interleave(torch.arange(len(samples)), samples.completion_lens), outside)
    return per_sample == 0


def kept_rows(trainer_ids: "torch.Tensor | None", samples: StepSamples, keep: torch.Tensor):
    """(the trainer's routing rows of the samples where ``keep`` [N] is True, those samples)."""
    if trainer_ids is None or trainer_ids.shape[0] != int(samples.sequence_lens.sum()):
        return trainer_ids, samples   # rows_both_computed names what does not line up
    rows = torch.repeat_interleave(keep.cpu(), samples.sequence_lens).to(trainer_ids.device)
    return trainer_ids[rows], samples.select(keep)


def rows_both_computed(step: int, trainer_ids: torch.Tensor | None, samples: StepSamples):
    """(trainer ids, rollout ids, rollout rows per sample) on the rows both sides computed: sample i's first
    ``routing_rows[i]`` tokens (all but the last sampled token, which the rollout never feeds) out of the
    trainer's ``sequence_lens[i]`` rows. A record that cannot line up is an error, never a silent skip."""
    lens, count = samples.sequence_lens, samples.routing_rows
    if trainer_ids is None or trainer_ids.shape[0] != int(lens.sum()) or bool((count > lens).any()):
        shape = None if trainer_ids is None else tuple(trainer_ids.shape)
        raise RLAlignError(f"step {step}: the trainer's routing record {shape} does not line up with the step's "
                           f"{int(lens.sum())} rows (rollout records of {int(count.sum())} rows)")
    theirs = samples.routing
    if theirs.shape[1:] != trainer_ids.shape[1:]:
        raise RLAlignError(f"step {step}: the rollout recorded {theirs.shape[1]} sparse layers x top-{theirs.shape[2]} "
                           f"but the policy has {trainer_ids.shape[1]} x top-{trainer_ids.shape[2]}: the rollout "
                           "engine holds a different model")
    # row j of sample i in the trainer's packing: start_i + j, start_i = len_0 + ... + len_{i-1}
    shift = lens.cumsum(0) - count.cumsum(0) - (lens - count)
    picked = torch.arange(int(count.sum()), dtype=torch.int64) + torch.repeat_interleave(shift, count)
    return trainer_ids.index_select(0, picked.to(trainer_ids.device)), theirs, count.tolist()


__all__ = ["Agreement", "MismatchError", "kept_rows", "mismatch_record", "rows_both_computed", "whole_samples"]
