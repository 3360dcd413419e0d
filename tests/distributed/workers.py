"""Functions run inside spawned gloo processes (importable by the children); each returns CPU tensors."""

from __future__ import annotations

import copy

import torch

from rlalign.distributed import all_reduce_fixed, full_state, gather_ranks, merge_ranks, parallelize
from rlalign.distributed.collectives import gather_ranks_varlen
from rlalign.distributed.data_parallel import all_reduce_gradients_, shard_for_rank
from rlalign.distributed.launch import Group, split
from rlalign.models import ForwardBatch
from rlalign.models.testing import tiny_model

# one small model per family, with head counts that split over 4 ranks; vocab sizes chosen so
# the canonical vocab segments are uneven and some are empty (320: one block; 5000: five blocks)
FAMILIES = {
    "llama": dict(vocab_size=5000),
    "qwen2": dict(vocab_size=320),                               # qkv biases
    "qwen3": dict(vocab_size=3000, tie_word_embeddings=True),    # qk-norm, tied head
}
SHAPE = dict(num_attention_heads=8, num_key_value_heads=4, head_dim=16, hidden_size=64, intermediate_size=128)
TP_DEGREES = (1, 2, 4)


def _batch(vocab: int):
    gen = torch.Generator().manual_seed(7)
    seqs = [torch.randint(3, min(vocab, 320), (n,), generator=gen).tolist() for n in (9, 30, 17, 70)]
    targets = torch.randint(0, vocab, (sum(map(len, seqs)),), generator=gen)
    weights = torch.randn(targets.shape[0], generator=gen)
    return seqs, targets, weights


def _step(model, seqs, targets, weights):
    """Forward + a loss that uses logprob and entropy + backward; returns what the tests compare."""
    model.zero_grad(set_to_none=True)
    lp, ent = model.logprobs(ForwardBatch.packed(seqs), targets, temperature=0.7, with_entropy=True)
    loss = (weights * lp).sum() + 0.1 * ent.sum()
    loss.backward()
    return {"lp": lp.detach(), "ent": ent.detach(), "loss": loss.detach(), "grads": full_state(model, grads=True)}


def tp_matrix(world: Group, dtype: str) -> dict:
    """{family: {tp: results}} on this rank; tp=1 is the parallelized model without a group,
    "plain" the unparallelized model (the rollout side's ops)."""
    groups = {1: Group.single()}
    for tp in TP_DEGREES[1:]:
        groups[tp] = split(world, tp)[0]
    out = {}
    for family, extra in FAMILIES.items():
        base = tiny_model(family, seed=3, dtype=dtype, init_std=0.05, norm_jitter=0.1, **SHAPE, **extra).train()
        seqs, targets, weights = _batch(base.config.vocab_size)
        out[family] = {"plain": _step(copy.deepcopy(base), seqs, targets, weights)}
        for tp, group in groups.items():
            out[family][tp] = _step(parallelize(copy.deepcopy(base), group), seqs, targets, weights)
    return out


def collectives(world: Group) -> dict:
    """Results of the collectives on fixed inputs, for the parent to check against a local reference."""
    gen = torch.Generator().manual_seed(100 + world.rank)
    x = torch.randn(1001, generator=gen)
    ragged = torch.arange(world.rank + 1, dtype=torch.float32)
    return {"x": x, "gathered": torch.stack(gather_ranks(x, world)), "merged": merge_ranks(x, world),
            "all_reduce": all_reduce_fixed(x, world),
            "ragged": torch.cat(gather_ranks_varlen(ragged, world))}


def dp_step(world: Group, repeats: int) -> dict:
    """A DP training step (each rank its share of the samples), repeated: grads after the all-reduce."""
    base = tiny_model("qwen3", seed=5, init_std=0.05, **SHAPE, vocab_size=700).train()
    gen = torch.Generator().manual_seed(11)
    samples = [torch.randint(3, 700, (n,), generator=gen).tolist() for n in (12, 40, 7, 25, 33, 19, 8, 50)]
    runs = []
    for _ in range(repeats):
        model = copy.deepcopy(base)
        mine = shard_for_rank(samples, world)
        for mb in (mine[:len(mine) // 2], mine[len(mine) // 2:]):   # two micro-batches per rank
            targets = torch.tensor([t for s in mb for t in s[1:] + [0]])
            lp, _ = model.logprobs(ForwardBatch.packed(mb), targets)
            (-lp.sum() / 1000.0).backward()
        local = {n: p.grad.clone() for n, p in model.named_parameters()}
        all_reduce_gradients_(model.parameters(), world)
        runs.append({"local": local, "reduced": {n: p.grad.clone() for n, p in model.named_parameters()}})
    return {"runs": runs}
