"""Tensor-parallel plans: each module declares how its weights shard; the distributed layer obeys.

This vocabulary sits in contract/ because models/ (which declares plans) and distributed/ (which
carries them out) are sibling layers: neither imports the other.

A module that owns shardable children defines ``tp_plan() -> {child attribute: ShardSpec}`` and,
when its own shape fields count the sharded dimension (heads), ``tp_localize(tp)`` to make them
rank-local. :func:`rlalign.distributed.parallelize.parallelize` walks the modules, replaces each
planned child by its parallel version and calls ``tp_localize``; it never looks at attribute names.
Children not in any plan (norms, embeddings) stay replicated.
"""

from __future__ import annotations

import dataclasses
import enum


class Shard(enum.Enum):
    COLUMN = "column"              # linear: output features (weight rows, bias) split in contiguous rank groups
    ROW = "row"                    # linear without bias: input features split; the ranks' partial sums are
                                   # merged by the canonical K partition (the TP=1 bits at any degree)
    HEAD_GROUPED = "head_grouped"  # RMSNorm over head_dim shared by ``heads`` heads split over ranks (weight
                                   # replicated; its gradient merged by the fixed tree over head groups)
    VOCAB = "vocab"                # LM head: vocab rows split (fused vocab-parallel logprob)
    EXPERTS = "experts"            # a mixture-of-experts layer's stacked experts (gate/up [E, I, H], down
                                   # [E, H, I]), called (x, experts) -> [T, k, H]: gate/up sharded along I as
                                   # COLUMN, down along I as ROW; one cross-rank merge per projection


@dataclasses.dataclass(frozen=True)
class ShardSpec:
    kind: Shard
    heads: int | None = None       # HEAD_GROUPED: how many heads share the norm (before sharding)


COLUMN, ROW, VOCAB = ShardSpec(Shard.COLUMN), ShardSpec(Shard.ROW), ShardSpec(Shard.VOCAB)
EXPERTS = ShardSpec(Shard.EXPERTS)


def head_grouped(heads: int) -> ShardSpec:
    return ShardSpec(Shard.HEAD_GROUPED, heads)


__all__ = ["Shard", "ShardSpec", "COLUMN", "ROW", "VOCAB", "EXPERTS", "head_grouped"]
