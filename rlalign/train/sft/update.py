"""One SFT optimizer step, the held-out loss, and the order the examples are visited in.

The step (:meth:`SFTUpdate.step`) is the RL update's machinery on the SFT objective
(:mod:`rlalign.train.sft.objective`): the batch is cut into micro-batches of at most ``optim.micro_batch_tokens``
tokens (whole examples, in order: :func:`rlalign.train.packing.micro_batches`), each one packed forward and
backward with the loss weight ``1 / N`` of the step's ``N`` scored tokens; then the gradient norm is clipped to
``optim.grad_clip`` over the checkpoint's tensors (:func:`rlalign.train.parallel.clip_grad_norm_`) and AdamW steps
through the fp32 masters (:class:`~rlalign.train.master.MasterWeights`) with the learning rate of
:class:`~rlalign.train.update.LearningRate` (linear warmup, cosine to ``optim.min_lr_ratio``).

Order (:func:`batch_indices`): epoch ``e`` visits the rows in ``torch.randperm`` order drawn from a generator seeded
with ``derive_seed(seed, e, 0)`` (file order with ``shuffle=False``), cut into ``ceil(rows / batch_size)``
consecutive batches (the last one shorter when ``batch_size`` does not divide the rows). Step ``s`` (1-based)
is batch ``(s - 1) % batches_per_epoch`` of epoch ``(s - 1) // batches_per_epoch``: a function of the step alone,
so a resumed run visits what the uninterrupted one would.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from rlalign.contract.errors import RLAlignError
from rlalign.ops.sample import derive_seed
from rlalign.train import parallel as par
from rlalign.train.layer_recompute import recompute_layers
from rlalign.train.master import MasterWeights
from rlalign.train.packing import micro_batches
from rlalign.train.sft.objective import Example, micro_batch_loss, pack, token_logprobs
from rlalign.train.update import LearningRate


def batches_per_epoch(rows: int, batch_size: int) -> int:
    return math.ceil(rows / batch_size)


def batch_indices(rows: int, batch_size: int, step: int, *, seed: int, shuffle: bool) -> list[int]:
    """The row indices of step ``step`` (1-based); see the module doc."""
    per_epoch = batches_per_epoch(rows, batch_size)
    epoch, k = divmod(step - 1, per_epoch)
    if shuffle:
        generator = torch.Generator().manual_seed(derive_seed(seed, epoch, 0))
        order = torch.randperm(rows, generator=generator)[k * batch_size:(k + 1) * batch_size].tolist()
    else:
        order = list(range(k * batch_size, min((k + 1) * batch_size, rows)))
    return order


def build_update(model, optim, total_steps: int) -> "SFTUpdate":
    """The training setup ``rlalign sft`` gives the policy ``model``: each decoder layer recomputed in backward
    when ``optim.activation_checkpointing``, then its masters, AdamW and learning rate (:class:`SFTUpdate`)."""
    if optim.activation_checkpointing:
        recompute_layers(model)
    return SFTUpdate(model, optim, total_steps)


class SFTUpdate:
    """The policy's masters, AdamW and learning rate; :meth:`step` takes one optimizer step on a batch."""

    def __init__(self, model, optim, total_steps: int):
        self.model, self.optim = model, optim
        self.master = MasterWeights(model, optim.master_weights, optim.offload, optim.step_chunk_elements)
        self.optimizer = torch.optim.AdamW(self.master.optim_params(), lr=optim.lr, betas=tuple(optim.betas),
                                           weight_decay=optim.weight_decay, foreach=False)
        self.lr = LearningRate(self.optimizer, optim, total_steps)

    def step(self, examples: Sequence[Example], step: int) -> dict:
        """One optimizer step on ``examples``: ``loss/sft`` (the step's mean NLL of its scored tokens, before the
        update), ``grad_norm`` (before clipping), ``lr`` (the one this step used), ``tokens`` (scored)."""
        n = sum(ex.num_scored for ex in examples)
        if n == 0:
            raise RLAlignError(f"step {step}: its examples have no scored token")
        lr, loss = self.lr.current, 0.0
        self.optimizer.zero_grad(set_to_none=True)
        for part in micro_batches([len(ex.tokens) for ex in examples], self.optim.micro_batch_tokens):
            mb_loss = micro_batch_loss(token_logprobs(self.model, pack([examples[i] for i in part],
                                                                         self.model.device)), n)
            mb_loss.backward()
            loss += float(mb_loss.detach())
        grad_norm = par.clip_grad_norm_(self.model, self.optim.grad_clip)
        if not torch.isfinite(grad_norm):
            raise RLAlignError(f"gradient norm is {float(grad_norm)} at step {step}: lower optim.lr or check the data; "
                               "the last checkpoint is intact")
        self.master.step(self.optimizer)   # parameter by parameter; a plain optimizer.step() without masters
        self.lr.step()
        return {"loss/sft": loss, "grad_norm": float(grad_norm), "lr": lr, "tokens": n}

    @torch.no_grad()
    def eval_loss(self, examples: Sequence[Example]) -> float:
        """Mean NLL of the scored tokens of ``examples`` (micro-batch by micro-batch, summed in float64)."""
        total, count = 0.0, 0
        for part in micro_batches([len(ex.tokens) for ex in examples], self.optim.micro_batch_tokens):
            lp = token_logprobs(self.model, pack([examples[i] for i in part], self.model.device))
            total -= float(lp.double().sum())
            count += lp.numel()
        return total / max(count, 1)


__all__ = ["SFTUpdate", "build_update", "batch_indices", "batches_per_epoch"]
