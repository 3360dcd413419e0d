"""``RolloutPool``: the trainer's rollout engine under ``launcher=ray``, served by N rollout worker actors.

A step's prompts are cut into N contiguous shards, one per worker, and every prompt keeps its global
index. The rlalign engine keys each sample's random stream by (seed, prompt index, sample index) and
a token's logits do not depend on the batch (strict profile), so worker i produces exactly the
completions the single engine would have produced for its shard; concatenating the shards in worker
order gives the single engine's prompt-major list, bit for bit.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping

from rlalign.contract.errors import RLAlignError
from rlalign.distributed.data_parallel import shard_range
from rlalign.integrations.ray.errors import ActorDiedError, death_errors, last_checkpoint_note, short_reason
from rlalign.integrations.ray.weight_sync import choose_weight_sync
from rlalign.integrations.ray.worker import RolloutWorker

WORKER_NAME_PREFIX = "rlalign-rollout-"


class RolloutPool:
    """``generate(prompts, sampling)``, ``update_weights(state_dict, version=)`` and ``weights_version``,
    like one engine (rlalign/train/engines.py); must be built inside a Ray job (the trainer actor)."""

    def __init__(self, cfg, policy):
        import ray   # lazy: an optional dependency (the ray extra)

        r = cfg.ray
        self.run_dir = cfg.run.dir
        token = uuid.uuid4().hex[:8]
        # Named so that operators (and the dead-worker test) can find a worker: rlalign-rollout-<i>-<run token>.
        self.names = [f"{WORKER_NAME_PREFIX}{i}-{token}" for i in range(r.num_rollout_workers)]
        actor = ray.remote(RolloutWorker)
        threads = max(1, int(r.cpus_per_actor))
        self.workers = [actor.options(name=name, num_cpus=r.cpus_per_actor, num_gpus=r.gpus_per_actor, max_restarts=0)
                        .remote(cfg, i, threads) for i, name in enumerate(self.names)]
        self._wait([w.ready.remote() for w in self.workers], "start-up")
        self.sync = choose_weight_sync(r.weight_sync, cfg.model.device)
        self.sync.start(self.workers, self._wait)
        self.weights_version = 0
        self.update_weights(policy.state_dict(), version=0)

    def generate(self, prompts, sampling=None, *, prompt_indices=None):
        indices = list(range(len(prompts))) if prompt_indices is None else list(prompt_indices)
        calls = [(i, w.generate.remote(prompts[lo:hi], sampling, indices[lo:hi]))
                 for i, (w, (lo, hi)) in enumerate(zip(self.workers, even_shards(len(prompts), len(self.workers))))
                 if hi > lo]
        parts = self._wait([f for _, f in calls], "generate", [i for i, _ in calls])
        return [c for part in parts for c in part]

    def update_weights(self, state_dict, *, version: int | None = None) -> int:
        weights = state_dict if isinstance(state_dict, Mapping) else dict(state_dict)
        version = self.weights_version + 1 if version is None else int(version)
        self.sync.push(self.workers, weights, version, self._wait)
        self.weights_version = version
        return version

    def _wait(self, futures, what: str, worker_indices=None) -> list:
        """Results in the order of ``futures``; the first worker to fail is reported at once, by name."""
        import ray   # lazy: an optional dependency (the ray extra)
        from ray.exceptions import RayTaskError

        worker_of = dict(zip(futures, range(len(futures)) if worker_indices is None else worker_indices))
        pending, results = list(futures), {}
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            try:
                results[done[0]] = ray.get(done[0])
            except death_errors() as exc:   # killed, crashed, out of memory, node lost
                raise self._died(worker_of[done[0]], what, exc) from None
            except RayTaskError as exc:
                if isinstance(exc.cause, RLAlignError):
                    raise exc.cause from None
                raise
        return [results[f] for f in futures]

    def _died(self, index: int, what: str, exc) -> RLAlignError:
        return ActorDiedError(f"rollout worker {index} of {len(self.workers)} (Ray actor {self.names[index]}) died "
                              f"during {what} at weights version {getattr(self, 'weights_version', 0)} "
                              f"({short_reason(exc)}); the run stopped; {last_checkpoint_note(self.run_dir)}")


def even_shards(count: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous [lo, hi) ranges covering range(count), sizes differing by at most one
    (:func:`rlalign.distributed.data_parallel.shard_range`, the split data-parallel ranks use too)."""
    return [shard_range(count, parts, i) for i in range(parts)]
