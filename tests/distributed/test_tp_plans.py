"""parallelize obeys the modules' declared TP plans (rlalign.contract.sharding), not attribute names."""

from __future__ import annotations

import pytest
from torch import nn

from rlalign.contract.errors import RLAlignError
from rlalign.distributed.experts import TensorParallelExperts
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


def test_moe_experts_are_sharded_by_their_plans_and_keep_their_names():
    """Sparse layers: the stacked experts become the tensor-parallel experts, gate/up sharded along I as
    columns (dim 1) and down along I as rows (dim 2), one parameter each; the router stays replicated; the
    dense layer keeps the dense plan; names do not change."""
    model = tiny_model("qwen3_moe", num_hidden_layers=2, num_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=64, mlp_only_layers=[1])
    names = [n for n, _ in model.named_parameters()]
    parallelize(model, Group.single())
    assert [n for n, _ in model.named_parameters()] == names
    sparse, dense = model.model.layers[0].mlp, model.model.layers[1].mlp
    assert isinstance(sparse.experts, TensorParallelExperts) and isinstance(sparse.gate, Linear)
    experts = sparse.experts
    assert (experts.gate_proj.tp_dim, experts.up_proj.tp_dim, experts.down_proj.tp_dim) == (1, 1, 2)
    assert tuple(experts.gate_proj.shape) == (4, 64, 64) and tuple(experts.down_proj.shape) == (4, 64, 64)
    assert len(list(experts.parameters())) == 3
    assert isinstance(dense.up_proj, ColumnParallelLinear) and isinstance(dense.down_proj, RowParallelLinear)


def test_tensor_parallel_experts_refuse_experts_that_are_not_stacked():
    model = tiny_model("qwen3_moe", num_hidden_layers=1, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64)
    with pytest.raises(RLAlignError, match="layers.0.mlp: the EXPERTS plan shards stacked experts"):
        TensorParallelExperts(model.model.layers[0].mlp.gate, Group.single(), "layers.0.mlp")


def test_moe_tp8_is_refused_by_the_experts_down_partition():
    """The experts' down_proj uses spec.MOE_K_SEGMENTS = 4 canonical segments: 8 ranks cannot share them."""
    from rlalign.distributed.parallelize import check_tp
    model = tiny_model("qwen3_moe", num_attention_heads=8, num_key_value_heads=8, head_dim=16, num_hidden_layers=1,
                       num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128)
    check_tp(model.config, 4, model)
    with pytest.raises(RLAlignError, match=r"layers.0.mlp.experts.down_proj: 128 features split into 4 canonical "
                                           r"segments cannot be shared by tp=8 ranks \(tp must divide 4\)"):
        check_tp(model.config, 8, model)
