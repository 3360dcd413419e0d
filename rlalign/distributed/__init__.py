"""Tensor and data parallelism on torch.distributed with deterministic collectives.

    launch.py       process-group set-up (gloo on CPU, NCCL on GPU), spawning N local processes
    collectives.py  fixed-order collectives: all-gather then an identical local tree merge on every rank
    layers.py       column- / row-parallel linears with the canonical partitions (forward and backward)
    vocab_head.py   the vocab-parallel fused LM head (logprob + entropy, exact cross-rank merge)
    parallelize.py  parallelize(model, tp): shard a CausalLM's modules in place, in a fixed order
    data_parallel.py  deterministic gradient all-reduce for data parallelism

docs/distributed.md states the scheme and exactly what is bitwise across TP and DP degrees.
"""

from rlalign.distributed.collectives import all_reduce_fixed, gather_ranks, merge_ranks
from rlalign.distributed.data_parallel import all_reduce_gradients_
from rlalign.distributed.launch import Group, init_from_env, spawn
from rlalign.distributed.parallelize import full_state, parallelize

__all__ = ["Group", "init_from_env", "spawn", "gather_ranks", "merge_ranks", "all_reduce_fixed",
           "all_reduce_gradients_", "parallelize", "full_state"]
