"""parallelize obeys the modules' declared TP plans (rlalign.contract.sharding), not attribute names."""

from __future__ import annotations

import pytest
from torch import nn

from rlalign.contract.errors import RLAlignError
from rlalign.distributed.launch import Group
from rlalign.distributed.layers import ColumnParallelLinear, HeadGroupedRMSNorm, RowParallelLinear
from rlalign.distributed.parallelize import parallelize
from rlalign.contract import sharding
from rlalign.models.modules import Linear
from rlalign.models.testing import tiny_model

PARALLEL = {sharding.Shard.COLUMN: ColumnParallelLinear, sharding.Shard.ROW: RowParallelLinear,
            sharding.Shard.HEAD_GROUPED: HeadGroupedRMSNorm}


@pytest.mark.parametrize("family", ["qwen3", "qwen2", "llama"])
def test_every_planned_child_and_only_those_is_sharded(family):
    model = tiny_model(family, tie_word_embeddings=family == "qwen2")
    plans = {path: m.tp_plan() for path, m in model.named_modules() if hasattr(m, "tp_plan")}
    parallelize(model, Group.single())
    sharded = set()
    for path, specs in plans.items():
        owner = model.get_submodule(path) if path else model
        for child, spec in specs.items():
            if spec.kind is sharding.Shard.VOCAB:
                assert model.parallel_head is not None
                continue
            assert isinstance(getattr(owner, child), PARALLEL[spec.kind]), (path, child, spec)
            sharded.add(f"{path}.{child}")
    left = [p for p, m in model.named_modules() if isinstance(m, Linear) and p != "lm_head"]
    assert not left, f"linears no plan mentions were left unsharded: {left}"
    assert len(sharded) == sum(len([s for s in p.values() if s.kind is not sharding.Shard.VOCAB])
                               for p in plans.values())


def test_a_plan_moves_with_its_module_not_its_name():
    """A module under another attribute name, declaring its own plan, is sharded by that plan."""
    model = tiny_model("llama", num_hidden_layers=1)
    layer = model.model.layers[0]
    mlp = layer.mlp
    renamed = nn.Module()
    renamed.w_in, renamed.w_out = mlp.up_proj, mlp.down_proj
    renamed.tp_plan = lambda: {"w_in": sharding.COLUMN, "w_out": sharding.ROW}
    layer.extra = renamed
    parallelize(model, Group.single())
    assert isinstance(layer.extra.w_in, ColumnParallelLinear) and isinstance(layer.extra.w_out, RowParallelLinear)


def test_unknown_shard_kind_is_refused():
    model = tiny_model("llama", num_hidden_layers=1)
    model.model.layers[0].mlp.tp_plan = lambda: {"up_proj": sharding.ShardSpec("diagonal")}
    with pytest.raises(RLAlignError, match="layers.0.mlp.up_proj: shard kind diagonal has no parallel"):
        parallelize(model, Group.single())


def test_check_tp_reads_shard_widths_from_the_plans():
    from rlalign.distributed.parallelize import check_tp
    model = tiny_model("qwen3", num_attention_heads=8, num_key_value_heads=8, head_dim=8)
    check_tp(model.config, 4, model)
    check_tp(model.config, 8)              # without a model only the head counts are checked
    with pytest.raises(RLAlignError, match="layers.0.self_attn.q_proj: tp=8 leaves 8 output features per rank"):
        check_tp(model.config, 8, model)
    with pytest.raises(RLAlignError, match="layers.0.self_attn.q_proj: tp=8 leaves 8"):
        parallelize(model, Group(None, 0, 8))
