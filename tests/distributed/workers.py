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
CASES = (("llama", "float32"), ("qwen2", "float32"), ("qwen3", "float32"), ("qwen3", "bfloat16"))


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


def tp_matrix(world: Group, cases, degrees) -> dict:
    """{(family, dtype): {degree: results}} on this rank. Degree 1 is the parallelized model
    without a process group; "plain" is the unparallelized model (the rollout side's ops)."""
    groups = {1: Group.single()}
    for tp in degrees:
        if tp > 1:
            groups[tp] = split(world, tp)[0]
    out = {}
    for family, dtype in cases:
        base = tiny_model(family, seed=3, dtype=dtype, init_std=0.05, norm_jitter=0.1, **SHAPE,
                          **FAMILIES[family]).train()
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


def dp_step(world: Group, repeats: int) -> dict:
    """A DP step repeated ``repeats`` times from the same weights: each rank back-propagates its
    share of the samples in two micro-batches, then the deterministic all-reduce."""
    runs = []
    for _ in range(repeats):
        model = dp_model()
        local = accumulate(model, shard_for_rank(dp_samples(), world), micro_batches=2)
        all_reduce_gradients_(model.parameters(), world)
        runs.append({"local": local, "reduced": {n: p.grad.clone() for n, p in model.named_parameters()}})
    return {"runs": runs}


def native_tp(world: Group) -> dict:
    """The native-profile (Megatron-style, stock all-reduce) TP=2 step and the unsharded native step."""
    from rlalign.contract.profiles import use_profile
    out = {}
    for family in ("llama", "qwen3"):
        base = tiny_model(family, seed=3, init_std=0.05, norm_jitter=0.1, **SHAPE, **FAMILIES[family]).train()
        seqs, targets, weights = _batch(base.config.vocab_size)
        with use_profile("native"):
            out[family] = {"plain": _step(copy.deepcopy(base), seqs, targets, weights),
                           2: _step(parallelize(copy.deepcopy(base), world), seqs, targets, weights)}
    return out


def two_rank_suite(world: Group) -> dict:
    """Everything the 2-process test module checks, from one spawn."""
    return {"collectives": collectives(world), "dp": dp_step(world, repeats=2),
            "tp": tp_matrix(world, [("llama", "float32")], (1, 2)), "native": native_tp(world)}
