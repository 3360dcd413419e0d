"""Which rollout engine a training run talks to (``rollout.engine``, and ``launcher``).

The trainer needs three things of an engine: ``generate(prompts, sampling) -> list[Completion]``
(completions in prompt-major order, each with ``prompt_index``, ``prompt_tokens``, ``tokens``,
``logprobs``, ``finish_reason``, ``weights_version``), ``update_weights(state_dict, version=)`` and the
``weights_version`` attribute. Every registered builder returns an object with exactly that surface,
holding its own copy of the policy's weights (the trainer updates it after each optimizer step); the
shared engine below is the exception.

Shared weights (``rollout.share_weights``, :func:`weights_path`): rlalign's engine colocated with the
trainer (``launcher=local``, no ``parallel.tp``) can step the policy's own parameter tensors instead of a
copy -- same device, same dtype, either profile. Its model is a second module tree over the very same
``Parameter`` objects (and buffers), so the optimizer step's in-place updates are what the engine reads
next: no copy of the weights and no per-step copy into it; :class:`WeightSync` then only bumps the
engine's weights version and empties its prefix cache. The invariant it relies on -- a parameter's
storage is never reallocated (the engine's captured CUDA graphs hold its address) -- is checked at every
sync, and a broken one stops the run. Every other case keeps the copy: a TP-sharded policy (the engine
holds the unsharded weights), another engine (vLLM), Ray workers (another process).

Two registries, filled from above: rlalign's own engine is registered here; the integrations register
theirs when ``rlalign.integrations`` is imported (the ``rlalign`` CLI and the Ray workers do that):
``rollout.engine=vllm`` (:mod:`rlalign.integrations.vllm`) and, for ``launcher=ray``, the pool of Ray
rollout workers (:mod:`rlalign.integrations.ray`).
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Callable

import torch

from rlalign.contract.errors import RLAlignError
from rlalign.models.moe import sparse_layer_indices
from rlalign.models.sizes import kv_bytes_per_token
from rlalign.rollout.config import RolloutConfig
from rlalign.rollout.engine import RolloutEngine

# rollout.engine name -> builder(cfg, policy, tokenizer, model_dir) of one engine in this process
ENGINES: dict[str, Callable] = {}
# launcher name -> builder(cfg, policy) of the engine the trainer talks to under that launcher (e.g. a pool of
# remote workers, each holding an ENGINES engine); "local" is not here: it builds ENGINES[rollout.engine] directly
LAUNCHER_ENGINES: dict[str, Callable] = {}

INTEGRATIONS_HINT = "the integrations register theirs when rlalign.integrations is imported (the rlalign CLI does)"


class EngineNotRegisteredError(RLAlignError, ValueError):
    """``rollout.engine`` or ``launcher`` names an engine nobody registered in this process."""


def register_engine(name: str, builder: Callable) -> None:
    """Make ``rollout.engine=name`` build its engine with ``builder(cfg, policy, tokenizer, model_dir)``."""
    ENGINES[name] = builder


def register_launcher_engine(launcher: str, builder: Callable) -> None:
    """Make ``launcher=name`` give the trainer ``builder(cfg, policy)`` as its engine."""
    LAUNCHER_ENGINES[launcher] = builder


class WeightsSharingError(RLAlignError):
    """``rollout.share_weights=true`` where the engine cannot share the policy's tensors, or a shared tensor
    that was reallocated under the engine."""


@dataclasses.dataclass(frozen=True)
class WeightsPath:
    """How the policy's weights reach the rollout engine: ``shared`` (the engine steps the policy's own
    tensors) or a copy synced after every optimizer step; ``reason`` says why, for the log."""
    shared: bool
    reason: str
    # parallel.shard=params: the shared tensors are released after each rollout and gathered whole again for the
    # next one (rlalign.train.weight_shards), so their storage moves: no address check, no CUDA-graph decode
    regathered: bool = False

    def describe(self) -> str:
        how = ("shares the policy's weight tensors (no copy, no per-step sync)" if self.shared
               else "holds its own copy of the weights, synced after each optimizer step")
        if self.regathered:
            how += ", gathered whole from the ranks' ranges for each rollout and released after it"
        return f"the rollout engine {how}: {self.reason}"


def weights_path(cfg) -> WeightsPath:
    """The one decision of shared vs copied engine weights, from the config (``rollout.share_weights``:
    null shares where possible; true requires it and refuses where impossible; false copies)."""
    setting = cfg.rollout.share_weights
    if setting is False:
        return WeightsPath(False, "rollout.share_weights=false")
    blocker = _sharing_blocker(cfg)
    if blocker is None:
        return WeightsPath(True, "rlalign's engine in the trainer's process, same device and dtype",
                           regathered=getattr(cfg.parallel, "shard", "none") == "params")
    if setting is True:
        raise WeightsSharingError(f"rollout.share_weights=true, but {blocker}; leave rollout.share_weights unset "
                                  "(it copies there) or set it to false")
    return WeightsPath(False, blocker)


def _sharing_blocker(cfg) -> "str | None":
    if getattr(cfg.rollout, "async_steps", 0) > 0:
        return (f"rollout.async_steps={cfg.rollout.async_steps} samples from an older weights version than the one "
                "the trainer steps")
    if cfg.launcher != "local":
        return f"launcher={cfg.launcher} runs the engines in other processes"
    if cfg.rollout.engine != "rlalign":
        return f"rollout.engine={cfg.rollout.engine} keeps its weights in its own format"
    if cfg.parallel.tp is not None:
        return "parallel.tp shards the policy, and the engine needs the unsharded weights"
    return None


def shared_module(policy: torch.nn.Module) -> torch.nn.Module:
    """A second module tree over the same parameter and buffer tensors (their ``Parameter`` objects, not
    copies): its own modules and train/eval flags, nothing of the weights' memory."""
    memo = {id(t): t for t in (*policy.parameters(), *policy.buffers())}
    return copy.deepcopy(policy, memo)


PROMPT_TOKENS_ESTIMATE = 64   # prompt tokens per sequence assumed by the step-sized KV cache (arithmetic: ~10)


def step_kv_cache_bytes(cfg, model_config, elem_bytes: int) -> int:
    """The KV cache of the trainer's engine on a GPU when ``rollout.kv_cache_bytes`` is unset: one step's sequences
    (``prompts_per_step x samples_per_prompt``) of ``PROMPT_TOKENS_ESTIMATE`` prompt tokens plus their longest
    continuation (``max_new_tokens``; with ``task.env`` the episode's ``max_episode_tokens``), at least one page.

    Not the engine's own default (``gpu_memory_fraction`` of the memory free when it is built): the trainer builds
    its engine before the gradients, the AdamW state and the activations exist, so that fraction would take the
    memory they need a step later. Longer prompts still run (fewer sequences at a time); a sequence larger than
    the whole cache is refused in one line by the engine."""
    r = cfg.rollout
    tokens = max(r.prompts_per_step * r.samples_per_prompt * (PROMPT_TOKENS_ESTIMATE + kv_continuation(cfg)),
                 r.page_size)
    return tokens * kv_bytes_per_token(model_config, elem_bytes)


def kv_continuation(cfg) -> int:
    """The most tokens a sequence of a step holds after its prompt: ``max_new_tokens``, or with ``task.env`` the
    episode's ``max_episode_tokens`` (its turns and observations)."""
    return cfg.task.max_episode_tokens if cfg.task.env else cfg.rollout.max_new_tokens


def _engine_config(cfg, policy) -> RolloutConfig:
    r = cfg.rollout
    kv_bytes, param = r.kv_cache_bytes, next(policy.parameters())
    if kv_bytes is None and param.device.type == "cuda":
        kv_bytes = step_kv_cache_bytes(cfg, policy.config, param.element_size())
    # a CUDA graph holds the weights' addresses; parallel.shard=params re-gathers them into new storage each rollout
    graphs = "off" if getattr(cfg.parallel, "shard", "none") == "params" else r.decode_graphs
    return RolloutConfig(profile=cfg.run.profile, page_size=r.page_size, max_num_seqs=r.max_num_seqs,
                         max_num_batched_tokens=r.max_num_batched_tokens, kv_cache_bytes=kv_bytes,
                         decode_graphs=graphs, overlap=r.overlap,
                         record_routing=r.record_routing and bool(sparse_layer_indices(policy.config)))


def rlalign_engine(cfg, policy, tokenizer, model_dir: Path) -> RolloutEngine:
    """rlalign's continuous-batching engine on a deep copy of the policy (``rollout.engine=rlalign``); it records
    MoE routing (``Completion.routing``) when the policy has sparse layers and ``rollout.record_routing``."""
    return RolloutEngine(copy.deepcopy(policy).eval(), _engine_config(cfg, policy), tokenizer=tokenizer)


def shared_rlalign_engine(cfg, policy, tokenizer) -> RolloutEngine:
    """rlalign's engine on :func:`shared_module` of the policy: it reads the policy's own tensors."""
    return RolloutEngine(shared_module(policy).eval(), _engine_config(cfg, policy), tokenizer=tokenizer)


register_engine("rlalign", rlalign_engine)


class WeightSync:
    """The trainer's side of the engine's weights: :meth:`push` after every optimizer step (and a resume).

    Copy path: ``engine.update_weights`` with the policy's full weights. Shared path: nothing to copy
    (the optimizer step updated the engine's tensors in place); ``update_weights({}, version=)`` records the
    version and empties the prefix cache, after :meth:`check` confirms that every parameter is still the
    engine's and still at the address the engine (and its CUDA graphs) were built on."""

    def __init__(self, engine, policy, path: WeightsPath):
        self.engine, self.path = engine, path
        self._addresses = None
        # bytes of the engine's own weights (each engine's, for a pool): 0 when shared
        held = engine.model if isinstance(engine, RolloutEngine) else policy
        self.copy_bytes = 0 if path.shared else sum(p.numel() * p.element_size() for p in held.parameters())
        if path.shared:
            engine_params = dict(engine.model.named_parameters())
            named = list(policy.named_parameters())
            foreign = [name for name, p in named if engine_params.get(name) is not p]
            if foreign or len(engine_params) != len(named):
                raise WeightsSharingError(f"the rollout engine does not hold the policy's tensor {(foreign or ['?'])[0]}")
            if not path.regathered:   # re-gathered storage moves by design (no CUDA graphs then: _engine_config)
                self._addresses = [(name, p, p.data_ptr()) for name, p in named]

    @property
    def shared(self) -> bool:
        return self.path.shared

    def check(self) -> None:
        """Raise when a shared parameter's storage moved (anything that rebinds ``p.data`` or loads with
        ``assign=True`` breaks the engine's view, and its captured graphs would read freed memory)."""
        for name, p, address in self._addresses or ():
            if p.data_ptr() != address:
                raise WeightsSharingError(f"the policy's parameter {name} was reallocated, but the rollout engine "
                                          "shares it (and its CUDA graphs hold the old address); update parameters "
                                          "in place, or run with rollout.share_weights=false")

    def push(self, weights: Callable[[], dict], version: int) -> None:
        """The engine at ``version``: ``weights()`` (the policy's full weights) copied in, or, shared, checked."""
        if self.shared:
            self.check()
            self.engine.update_weights({}, version=version)
        else:
            self.engine.update_weights(weights(), version=version)


def build_rollout_engine(cfg, policy, tokenizer, model_dir, *, share_weights: bool = False):
    """The engine the trainer talks to. ``share_weights`` (the trainer passes :func:`weights_path`'s verdict):
    rlalign's engine over the policy's own tensors, else the registered builder's copy."""
    if share_weights:
        if _sharing_blocker(cfg) is not None:
            raise WeightsSharingError(f"cannot share the policy's weights: {_sharing_blocker(cfg)}")
        return shared_rlalign_engine(cfg, policy, tokenizer)
    if cfg.launcher != "local":   # e.g. ray: a pool of actors, each holding one engine built here with launcher=local
        if cfg.launcher not in LAUNCHER_ENGINES:
            raise EngineNotRegisteredError(f"launcher={cfg.launcher} has no registered engine ({INTEGRATIONS_HINT})")
        return LAUNCHER_ENGINES[cfg.launcher](cfg, policy)
    if cfg.rollout.engine not in ENGINES:
        raise EngineNotRegisteredError(f"rollout.engine={cfg.rollout.engine} is not registered in this process "
                                       f"(registered: {', '.join(sorted(ENGINES))}; {INTEGRATIONS_HINT})")
    return ENGINES[cfg.rollout.engine](cfg, policy, tokenizer, Path(model_dir))


__all__ = ["ENGINES", "LAUNCHER_ENGINES", "EngineNotRegisteredError", "WeightSync", "WeightsPath",
           "WeightsSharingError", "register_engine", "register_launcher_engine", "rlalign_engine",
           "shared_rlalign_engine", "shared_module", "weights_path", "build_rollout_engine"]
