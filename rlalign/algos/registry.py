"""The algorithms by name, each with the config keys it reads (its knobs).

Four registries, each chosen by one ``algo.*`` key: advantage estimators (``algo.advantage``),
policy losses (``algo.policy_loss``), KL estimators (``algo.kl_estimator``) and train/rollout
mismatch corrections (``algo.mismatch_correction``). Every entry has one calling convention per
registry (below) and declares its knobs: the ``algo.*`` keys passed to it as keyword arguments,
each with the value it uses while the key is unset (``None`` in the config). ``uses`` names the
keys the trainer reads on the algorithm's behalf (GAE's value model: ``value_lr``, ``value_clip``).

A key that is some entry's knob but not the chosen entry's has no effect, so a config that sets
it (to anything but its default) is refused by :func:`refused_setting`, in one line naming the
key, the chosen algorithm and who reads the key. Keys of the KL term and of dynamic sampling
that only matter when the feature is on are refused the same way (:data:`REQUIRES`).

Calling conventions:

- advantage: ``fn(inputs: AdvantageInputs, **knobs) -> (advantages [T], returns [T] | None)``
  (``returns``: the value-model targets, for estimators with ``value_model=True``);
- policy loss: ``fn(logprobs, old_logprobs, advantages, mask, seq_ids, num_seqs, is_weights, **knobs)
  -> PolicyLossOutput``;
- KL estimator: ``fn(logprobs, ref_logprobs) -> [T]``;
- mismatch correction: ``fn(old_logprobs, rollout_logprobs, mask, seq_ids, **knobs) -> Correction``
  (the entry ``none`` has no function).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch

from rlalign.algos import advantages as A
from rlalign.algos import kl as K
from rlalign.algos import mismatch as M
from rlalign.algos import policy_loss as P


@dataclasses.dataclass(frozen=True)
class Algorithm:
    name: str
    fn: Callable | None
    knobs: Mapping[str, Any] = dataclasses.field(default_factory=dict)   # key -> value while unset (None)
    uses: tuple[str, ...] = ()          # further keys the trainer reads for this algorithm
    value_model: bool = False           # advantage estimators: needs the value model's old values

    @property
    def keys(self) -> frozenset[str]:
        return frozenset(self.knobs) | frozenset(self.uses)

    def knob_values(self, settings: Mapping[str, Any]) -> dict[str, Any]:
        """The keyword arguments for ``fn``: each knob's configured value, or its own default if unset."""
        return {k: default if settings.get(k) is None else settings[k] for k, default in self.knobs.items()}


class Registry:
    def __init__(self, key: str, kind: str):
        self.key, self.kind = key, kind         # the algo.* key that chooses; "policy loss" etc.
        self._entries: dict[str, Algorithm] = {}

    def register(self, name: str, fn: Callable | None, *, knobs: Mapping[str, Any] | None = None,
                 uses: tuple[str, ...] = (), value_model: bool = False) -> Algorithm:
        if name in self._entries:
            raise ValueError(f"rlalign.algos.registry: {self.kind} {name!r} is already registered")
        entry = Algorithm(name, fn, dict(knobs or {}), tuple(uses), value_model)
        self._entries[name] = entry
        return entry

    def __getitem__(self, name: str) -> Algorithm:
        if name not in self._entries:
            raise ValueError(f"rlalign.algos: unknown {self.kind} {name!r}; choose one of {', '.join(self.names())}")
        return self._entries[name]

    def names(self) -> tuple[str, ...]:
        return tuple(self._entries)

    def all_keys(self) -> frozenset[str]:
        return frozenset().union(*(e.keys for e in self._entries.values()))

    def readers_of(self, key: str) -> list[str]:
        return [n for n, e in self._entries.items() if key in e.keys]


# ---- advantage estimators ---------------------------------------------------------------------------

@dataclasses.dataclass
class TurnInputs:
    """Multi-turn episodes' turns: ``returns`` ``[M]`` each turn's return-to-go (sample by sample, ``M`` =
    ``counts.sum()``), ``counts`` ``[N]`` each sequence's turns, ``token_turns`` ``[T]`` each token's turn."""
    returns: torch.Tensor
    counts: torch.Tensor
    token_turns: torch.Tensor


@dataclasses.dataclass
class AdvantageInputs:
    """What every estimator receives: per-sequence ``rewards`` / ``group_ids`` ``[N]``, per-token
    ``seq_ids`` / ``mask`` ``[T]``; ``kl`` ``[T]`` (or None): the per-token KL to the reference folded
    into the reward with ``kl_coef``; ``values`` ``[T]``: the value model's old values (value_model
    estimators only); ``turns``: multi-turn episodes' turns (or None), read by ``turn_advantage=turn``;
    ``log_ratio`` ``[T]`` (or None: the samples are the proximal policy's own): ``prox - behav`` per token for
    samples of an older policy (asynchronous steps), read by ``gae`` (V-trace targets)."""
    rewards: torch.Tensor
    group_ids: torch.Tensor
    seq_ids: torch.Tensor
    mask: torch.Tensor
    kl: torch.Tensor | None = None
    kl_coef: float = 0.0
    values: torch.Tensor | None = None
    turns: TurnInputs | None = None
    log_ratio: torch.Tensor | None = None


def _sequence_rewards(x: AdvantageInputs) -> torch.Tensor:
    """The sequence reward minus ``kl_coef`` times the sequence's summed per-token KL (when given)."""
    if x.kl is None:
        return x.rewards
    summed = torch.zeros_like(x.rewards).index_add_(0, x.seq_ids, torch.where(x.mask, x.kl, 0.0))
    return x.rewards - x.kl_coef * summed


def _per_turn(x: AdvantageInputs, baseline: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``turn_advantage=turn``: every turn's return-to-go against the same turn of its prompt's other episodes
    (``baseline(returns [M], groups [M]) -> [M]`` over :func:`~rlalign.algos.advantages.turn_groups`), each token
    given its turn's advantage."""
    if x.turns is None:
        raise ValueError("rlalign.algos: turn_advantage=turn needs the episodes' turns (AdvantageInputs.turns)")
    if x.kl is not None:
        raise ValueError("rlalign.algos: turn_advantage=turn does not fold a KL penalty into the returns")
    t = x.turns
    adv = baseline(t.returns, A.turn_groups(x.group_ids, t.counts))
    return A.expand_turns_to_tokens(adv, t.counts, t.token_turns, x.seq_ids, x.mask)


def _group_normalised(scale_by_std: bool):
    def estimate(x: AdvantageInputs, *, turn_advantage: str):
        if turn_advantage == "turn":
            return _per_turn(x, lambda r, g: A.grpo_advantages(r, g, scale_by_std=scale_by_std)), None
        adv = A.grpo_advantages(_sequence_rewards(x), x.group_ids, scale_by_std=scale_by_std)
        return A.expand_to_tokens(adv, x.seq_ids, x.mask), None
    return estimate


def _rloo(x: AdvantageInputs, *, turn_advantage: str):
    if turn_advantage == "turn":
        return _per_turn(x, A.rloo_advantages), None
    return A.expand_to_tokens(A.rloo_advantages(_sequence_rewards(x), x.group_ids), x.seq_ids, x.mask), None


def _reinforce_pp(x: AdvantageInputs, *, gamma: float):
    adv, _ = A.reinforce_pp_advantages(x.rewards, x.seq_ids, x.mask, group_ids=x.group_ids, kl=x.kl,
                                       kl_coef=x.kl_coef if x.kl is not None else 0.0, gamma=gamma)
    return adv, None


def _gae(x: AdvantageInputs, *, gamma: float, lam: float, vtrace_rho_cap: float, vtrace_c_cap: float):
    """GAE (:func:`~rlalign.algos.advantages.gae_advantages`); on samples of an older policy (``log_ratio``) its
    off-policy form with V-trace value targets (:func:`~rlalign.algos.advantages.vtrace_gae`). Advantages whitened."""
    if x.values is None:
        raise ValueError("rlalign.algos: the gae estimator needs the value model's old values (AdvantageInputs.values)")
    token_r = A.token_rewards(x.rewards, x.seq_ids, x.mask, kl=x.kl, kl_coef=x.kl_coef if x.kl is not None else 0.0)
    if x.log_ratio is None:
        adv, returns = A.gae_advantages(token_r, x.values, x.seq_ids, x.mask, gamma=gamma, lam=lam)
    else:
        adv, returns = A.vtrace_gae(token_r, x.values, x.log_ratio, x.seq_ids, x.mask, gamma=gamma, lam=lam,
                                    rho_cap=vtrace_rho_cap, c_cap=vtrace_c_cap)
    return A.whiten(adv, x.mask), returns


ADVANTAGES = Registry("advantage", "advantage estimator")
# turn_advantage: episode (every token its episode's advantage) | turn (every turn its return-to-go's, against the
# same turn index of the prompt's episodes; multi-turn episodes only, docs/agents.md)
TURN_ADVANTAGE = {"turn_advantage": "episode"}
ADVANTAGES.register("grpo", _group_normalised(True), knobs=TURN_ADVANTAGE)
ADVANTAGES.register("dr_grpo", _group_normalised(False), knobs=TURN_ADVANTAGE)
ADVANTAGES.register("rloo", _rloo, knobs=TURN_ADVANTAGE)
ADVANTAGES.register("reinforce_pp", _reinforce_pp, knobs={"gamma": 1.0})
# vtrace_rho_cap / vtrace_c_cap: V-trace's truncation of the importance ratios (read with rollout.async_steps > 0)
ADVANTAGES.register("gae", _gae, knobs={"gamma": 1.0, "lam": 0.95, "vtrace_rho_cap": 1.0, "vtrace_c_cap": 1.0},
                    uses=("value_lr", "value_clip"), value_model=True)


# ---- policy losses ------------------------------------------------------------------------------------

def _ppo_clip(lp, old_lp, adv, mask, seq_ids, num_seqs, is_weights, *, clip_low, clip_high, dual_clip):
    return P.ppo_clip_loss(lp, old_lp, adv, mask, clip_low=clip_low, clip_high=clip_high, clip_c=dual_clip,
                           is_weights=is_weights)


def _gspo(lp, old_lp, adv, mask, seq_ids, num_seqs, is_weights, *, clip_low, clip_high):
    return P.gspo_loss(lp, old_lp, adv, mask, seq_ids, clip_low=clip_low, clip_high=clip_high, num_seqs=num_seqs,
                       is_weights=is_weights)


def _cispo(lp, old_lp, adv, mask, seq_ids, num_seqs, is_weights, *, clip_low, clip_high):
    return P.cispo_loss(lp, old_lp, adv, mask, clip_low=clip_low, clip_high=clip_high, is_weights=is_weights)


POLICY_LOSSES = Registry("policy_loss", "policy loss")
# ppo_clip: DAPO clip-higher by default; gspo: the paper's sequence-ratio range; cispo: no lower bound
POLICY_LOSSES.register("ppo_clip", _ppo_clip, knobs={"clip_low": 0.2, "clip_high": 0.28, "dual_clip": None})
POLICY_LOSSES.register("gspo", _gspo, knobs={"clip_low": 3e-4, "clip_high": 4e-4})
POLICY_LOSSES.register("cispo", _cispo, knobs={"clip_low": 1.0, "clip_high": 0.28})


# ---- KL estimators ------------------------------------------------------------------------------------

KL_ESTIMATOR_REGISTRY = Registry("kl_estimator", "KL estimator")
for _name, _fn in K.ESTIMATOR_FUNCTIONS.items():
    KL_ESTIMATOR_REGISTRY.register(_name, _fn)


# ---- mismatch corrections --------------------------------------------------------------------------------

def _token_tis(old, rollout, mask, seq_ids, *, mismatch_cap):
    return M.token_tis(old, rollout, mask, cap=mismatch_cap)


def _seq_tis(old, rollout, mask, seq_ids, *, mismatch_cap):
    return M.sequence_tis(old, rollout, mask, seq_ids, cap=mismatch_cap)


def _token_mis(old, rollout, mask, seq_ids, *, mismatch_cap):
    return M.token_mis(old, rollout, mask, high=mismatch_cap)


def _seq_mis(old, rollout, mask, seq_ids, *, mismatch_cap):
    return M.sequence_mis(old, rollout, mask, seq_ids, high=mismatch_cap)


MISMATCH_CORRECTIONS = Registry("mismatch_correction", "mismatch correction")
MISMATCH_CORRECTIONS.register("none", None)
for _name, _fn in (("token_tis", _token_tis), ("seq_tis", _seq_tis), ("token_mis", _token_mis), ("seq_mis", _seq_mis)):
    MISMATCH_CORRECTIONS.register(_name, _fn, knobs={"mismatch_cap": 2.0})   # TIS cap C / MIS upper bound

REGISTRIES = (ADVANTAGES, POLICY_LOSSES, KL_ESTIMATOR_REGISTRY, MISMATCH_CORRECTIONS)

# keys that only act while a feature is on: key -> (what must hold, the test on the settings)
REQUIRES: dict[str, tuple[str, Callable[[Mapping[str, Any]], bool]]] = {
    "kl_estimator": ("algo.kl_coef > 0", lambda s: s["kl_coef"] > 0),
    "kl_in_reward": ("algo.kl_coef > 0", lambda s: s["kl_coef"] > 0),
    "max_draw_rounds": ("algo.dynamic_sampling=true", lambda s: bool(s["dynamic_sampling"])),
}


def refused_setting(settings: Mapping[str, Any], defaults: Mapping[str, Any]) -> str | None:
    """The first key of ``settings`` (the ``algo`` section) set to a non-default value that has no
    effect with the chosen algorithms, as one line starting with the key; None if every key acts."""
    for key, value in settings.items():
        if key not in defaults or value == defaults[key]:
            continue
        for registry in REGISTRIES:
            if key not in registry.all_keys():
                continue
            chosen = settings.get(registry.key, defaults.get(registry.key))
            if key not in registry[chosen].keys:
                readers = ", ".join(registry.readers_of(key))
                verb = "reads" if "," not in readers else "read"
                return (f"{key}={value!r} has no effect with algo.{registry.key}={chosen} (only {readers} {verb} "
                        f"it): remove algo.{key}, or choose an algo.{registry.key} that reads it")
        if key in REQUIRES:
            condition, holds = REQUIRES[key]
            if not holds(settings):
                return f"{key}={value!r} has no effect unless {condition}: remove algo.{key}, or set {condition}"
    return None


__all__ = ["ADVANTAGES", "AdvantageInputs", "TurnInputs", "Algorithm", "KL_ESTIMATOR_REGISTRY", "MISMATCH_CORRECTIONS",
           "POLICY_LOSSES", "REGISTRIES", "REQUIRES", "Registry", "refused_setting"]
