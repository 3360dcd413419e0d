"""Functions run inside spawned gloo processes (importable by the children); each returns CPU tensors."""

from __future__ import annotations

import copy

import torch

from rlalign.distributed import all_reduce_fixed, full_state, gather_ranks, merge_ranks, parallelize
from rlalign.distributed.collectives import gather_ranks_varlen
from rlalign.distributed.data_parallel import all_reduce_gradients_, shard_for_rank
from rlalign.distributed.launch import Group, split
from rlalign.models import ForwardBatch
from rlalign.models.moe import record_routing
from rlalign.models.testing import tiny_model

# one small model per family, with head counts that split over 4 ranks; vocab sizes chosen so
# the canonical vocab segments are uneven and some are empty (320: one block; 5000: five blocks)
FAMILIES = {
    "llama": dict(vocab_size=5000),
    "qwen2": dict(vocab_size=320),                               # qkv biases
    "qwen3": dict(vocab_size=3000, tie_word_embeddings=True),    # qk-norm, tied head
    # Qwen3-MoE, dense and sparse layers mixed both ways Qwen3-MoE allows; moe_intermediate_size 64 is the
    # smallest that splits over 4 ranks (16 columns per rank, 8 canonical down segments)
    "qwen3_moe": dict(vocab_size=700, num_hidden_layers=3, num_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=64, norm_topk_prob=True, mlp_only_layers=[1]),
    "qwen3_moe-step2": dict(vocab_size=700, num_hidden_layers=4, num_experts=4, num_experts_per_tok=3,
                            moe_intermediate_size=128, norm_topk_prob=False, decoder_sparse_step=2),
}
SHAPE = dict(num_attention_heads=8, num_key_value_heads=4, head_dim=16, hidden_size=64, intermediate_size=128)
CASES = (("llama", "float32"), ("qwen2", "float32"), ("qwen3", "float32"), ("qwen3", "bfloat16"),
         ("qwen3_moe", "float32"), ("qwen3_moe", "bfloat16"), ("qwen3_moe-step2", "float32"))


def _family_model(family: str, dtype: str):
    """The tiny model of a FAMILIES entry ("qwen3_moe-step2" is a second qwen3_moe layout)."""
    return tiny_model(family.split("-")[0], seed=3, dtype=dtype, init_std=0.05, norm_jitter=0.1, **SHAPE,
                      **FAMILIES[family])


def _batch(vocab: int):
    gen = torch.Generator().manual_seed(7)
    seqs = [torch.randint(3, min(vocab, 320), (n,), generator=gen).tolist() for n in (9, 30, 17, 70)]
    targets = torch.randint(0, vocab, (sum(map(len, seqs)),), generator=gen)
    weights = torch.randn(targets.shape[0], generator=gen)
    return seqs, targets, weights


def _step(model, seqs, targets, weights):
    """Forward + a loss that uses logprob and entropy + backward; returns what the tests compare (with each
    sparse layer's routing: {layer: experts [T, k]})."""
    model.zero_grad(set_to_none=True)
    with record_routing() as record:
        lp, ent = model.logprobs(ForwardBatch.packed(seqs), targets, temperature=0.7, with_entropy=True)
    loss = (weights * lp).sum() + 0.1 * ent.sum()
    loss.backward()
    routing = {layer: torch.cat([experts for _, experts in entries]) for layer, entries in record.layers.items()}
    return {"lp": lp.detach(), "ent": ent.detach(), "loss": loss.detach(), "grads": full_state(model, grads=True),
            "routing": routing}


def tp_matrix(world: Group, cases, degrees) -> dict:
    """{(family, dtype): {degree: results}} on this rank. Degree 1 is the parallelized model
    without a process group; "plain" is the unparallelized model (the rollout side's ops)."""
    groups = {1: Group.single()}
    for tp in degrees:
        if tp > 1:
            groups[tp] = split(world, tp)[0]
    out = {}
    for family, dtype in cases:
        base = _family_model(family, dtype).train()
        seqs, targets, weights = _batch(base.config.vocab_size)
        res = out[(family, dtype)] = {"plain": _step(copy.deepcopy(base), seqs, targets, weights)}
        for tp, group in groups.items():
            res[tp] = _step(parallelize(copy.deepcopy(base), group), seqs, targets, weights)
    return out


def collectives(world: Group) -> dict:
    """Results of the collectives on fixed inputs, for the parent to check against a local reference."""
    gen = torch.Generator().manual_seed(100 + world.rank)
    x = torch.randn(1001, generator=gen)
    ragged = torch.arange(world.rank + 1, dtype=torch.float32)
    return {"x": x, "gathered": torch.stack(gather_ranks(x, world)), "merged": merge_ranks(x, world),
            "all_reduce": all_reduce_fixed(x, world),
            "ragged": torch.cat(gather_ranks_varlen(ragged, world))}


DP_SAMPLES = 8


def dp_model():
    return tiny_model("qwen3", seed=5, init_std=0.05, **SHAPE, vocab_size=700).train()


def dp_samples() -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(3, 700, (n,), generator=gen).tolist() for n in (12, 40, 7, 25, 33, 19, 8, 50)]


def accumulate(model, samples, micro_batches: int) -> dict[str, torch.Tensor]:
    """Backward over ``samples`` in ``micro_batches`` consecutive micro-batches, accumulating .grad."""
    per = -(-len(samples) // micro_batches)
    for i in range(0, len(samples), per):
        mb = samples[i:i + per]
        targets = torch.tensor([t for s in mb for t in s[1:] + [0]])
        lp, _ = model.logprobs(ForwardBatch.packed(mb), targets)
        (-lp.sum() / 1000.0).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


# gradient buckets: every parameter alone (1), a few small parameters together (300), several mixed (5000)
DP_BUCKETS = (1, 300, 5000)


def dp_step(world: Group, repeats: int) -> dict:
    """A DP step repeated ``repeats`` times from the same weights: each rank back-propagates its
    share of the samples in two micro-batches, then the deterministic all-reduce (one bucket); and the
    same local gradients all-reduced in the buckets of DP_BUCKETS."""
    runs = []
    for _ in range(repeats):
        model = dp_model()
        local = accumulate(model, shard_for_rank(dp_samples(), world), micro_batches=2)
        all_reduce_gradients_(model.parameters(), world, bucket_elements=10 ** 9)
        runs.append({"local": local, "reduced": {n: p.grad.clone() for n, p in model.named_parameters()}})
    bucketed = {}
    for size in DP_BUCKETS:
        model = dp_model()
        for name, p in model.named_parameters():
            p.grad = runs[0]["local"][name].clone()
        all_reduce_gradients_(model.parameters(), world, bucket_elements=size)
        bucketed[size] = {n: p.grad.clone() for n, p in model.named_parameters()}
    return {"runs": runs, "bucketed": bucketed}


def native_tp(world: Group) -> dict:
    """The native-profile (Megatron-style, stock all-reduce) TP=2 step and the unsharded native step."""
    from rlalign.contract.profiles import use_profile
    out = {}
    for family in ("llama", "qwen3", "qwen3_moe"):
        base = _family_model(family, "float32").train()
        seqs, targets, weights = _batch(base.config.vocab_size)
        with use_profile("native"):
            out[family] = {"plain": _step(copy.deepcopy(base), seqs, targets, weights),
                           2: _step(parallelize(copy.deepcopy(base), world), seqs, targets, weights)}
    return out


def two_rank_suite(world: Group) -> dict:
    """Everything the 2-process test module checks, from one spawn."""
    return {"collectives": collectives(world), "dp": dp_step(world, repeats=2),
            "tp": tp_matrix(world, [("llama", "float32")], (1, 2)), "native": native_tp(world)}


# TensorParallelExperts on its own, over a class of shapes (degenerate ones included):
# (tokens, experts, top_k, moe_intermediate_size, dtype, routing) -- "random": k distinct experts per token,
# "one": every token's first choice is the last expert (the others unused but for the extra slots)
EXPERT_SHAPES = (
    (37, 8, 2, 64, "float32", "random"),
    (1, 8, 2, 64, "float32", "random"),      # one token: most experts get no rows (and no gradient)
    (20, 4, 4, 128, "bfloat16", "random"),   # k = E: every token visits every expert
    (16, 6, 1, 64, "float32", "one"),        # all rows on one expert
    (0, 4, 2, 64, "float32", "random"),      # an empty batch
)


def _experts_case(tokens, n_experts, top_k, inter, dtype, routing):
    from rlalign.models.moe import StackedExperts
    gen = torch.Generator().manual_seed(tokens * 31 + n_experts * 7 + top_k)
    dt = getattr(torch, dtype)
    hidden = SHAPE["hidden_size"]
    experts = StackedExperts(n_experts, hidden, inter, dt, "cpu")
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    x = torch.randn(tokens, hidden, generator=gen).to(dt)
    ids = torch.stack([torch.randperm(n_experts, generator=gen)[:top_k] for _ in range(tokens)]) if tokens \
        else torch.zeros((0, top_k), dtype=torch.long)
    if routing == "one" and tokens:
        ids[:, 0] = n_experts - 1
    g = torch.randn(tokens, top_k, hidden, generator=gen)
    return experts, x, ids.long(), g


def _experts_grads(experts, x, ids, g, group):
    from rlalign.distributed.experts import TensorParallelExperts
    holder = torch.nn.Module()
    if group is not None:
        experts = TensorParallelExperts(experts, group, "experts")
        holder.tp_group = group
    holder.experts = experts
    x = x.clone().requires_grad_(True)
    y = experts(x, ids)
    if y.requires_grad:   # the unsharded op returns a constant for an empty batch
        (y.float() * g).sum().backward()
    dx = x.grad if x.grad is not None else torch.zeros_like(x)
    return {"y": y.detach(), "dx": dx, "grads": full_state(holder, grads=True)}


def expert_shapes(world: Group, degrees) -> dict:
    """{shape: {"plain" | degree: {"y", "dx", "grads"}}} of TensorParallelExperts vs the unsharded StackedExperts."""
    groups = {1: Group.single(), **{tp: split(world, tp)[0] for tp in degrees if tp > 1}}
    out = {}
    for shape in EXPERT_SHAPES:
        experts, x, ids, g = _experts_case(*shape)
        res = out[shape] = {"plain": _experts_grads(copy.deepcopy(experts), x, ids, g, None)}
        for tp, group in groups.items():
            res[tp] = _experts_grads(copy.deepcopy(experts), x, ids, g, group)
    return out


def tp_suite(world: Group, cases, degrees) -> dict:
    """Everything test_tp.py checks, from one 4-process spawn."""
    return {"matrix": tp_matrix(world, cases, degrees), "experts": expert_shapes(world, degrees)}


def abort_at_teardown(world: Group, which: int) -> int:
    """Rank ``which`` aborts in the interpreter's teardown (as a communication library's thread can, after the
    work is done); returns the rank."""
    import atexit
    import os
    if world.rank == which:
        atexit.register(os.abort)
    return world.rank
