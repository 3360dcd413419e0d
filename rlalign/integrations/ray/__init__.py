"""Ray launcher: ``rlalign train CONFIG launcher=ray`` runs the trainer and ``ray.num_rollout_workers``
rollout workers as Ray actors (a local cluster by default, ``ray.address=...`` joins an existing one).

- :mod:`.launcher`: the driver (``run_training_on_ray``): starts or joins the cluster, places the
  trainer actor, shows progress, turns a dead actor into a one-line error.
- :mod:`.pool`: :class:`RolloutPool`, what the trainer's ``engine`` is under Ray: it splits each
  ``generate`` across the workers with global prompt indices (so sample seeds do not change) and
  pushes weights to them after every optimizer step. Importing this package registers it as the
  engine of ``launcher=ray`` (:func:`rlalign.train.engines.register_launcher_engine`).
- :mod:`.worker`: the rollout worker actor (one rollout engine, ``rollout.engine``).
- :mod:`.weight_sync`: trainer -> workers weights: the object store (CPU default) or a broadcast
  over a process group of trainer + workers (NCCL on cuda, gloo on cpu).

Nothing here imports ``ray`` until it is used (``pip install 'rlalign[ray]'``).
"""

from rlalign.integrations.ray.launcher import run_training_on_ray
from rlalign.integrations.ray.pool import RolloutPool
from rlalign.train.engines import register_launcher_engine

register_launcher_engine("ray", RolloutPool)

__all__ = ["run_training_on_ray", "RolloutPool"]
