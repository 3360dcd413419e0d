"""Rollouts under data parallelism: each DP rank generates a share of the step's prompts, every rank gets all.

The engine keys every sample's random stream by its prompt's index (``SamplingParams.seed_by="index"``) and
the strict engine's bits do not depend on the batch a sequence runs in, so rank r generating prompts
[a, b) with ``prompt_indices=[a, ..., b-1]`` yields exactly the completions one engine generating all the
prompts would (tested against dp=1, bit for bit). An all-gather in rank order of the ranks'
:class:`~rlalign.train.samples.StepSamples` tensors then gives every rank the whole step, prompt by prompt then
sample by sample, as ``engine.generate`` returns it: each rank generates about 1/dp of the samples a
replicated rollout would (its wall time not yet measured on GPUs), and the training that follows sees the same
samples on every rank.
"""

from __future__ import annotations

import torch

from rlalign.distributed.collectives import gather_ranks_varlen
from rlalign.distributed.data_parallel import comm_device, shard_for_rank
from rlalign.distributed.launch import Group
from rlalign.train.samples import StepSamples

_ROUTING_CODES = {torch.int16: 1, torch.int32: 2}      # a routing record's dtype on the wire (0: no record)
_ROUTING_DTYPES = {code: dtype for dtype, code in _ROUTING_CODES.items()}


def generate_sharded(engine, prompts: list[list[int]], sampling, dp: Group) -> StepSamples:
    """Every completion of ``prompts`` on every rank, as one record; this rank's engine generates only its
    contiguous share (:func:`shard_for_rank`), keyed by the prompts' global indices."""
    share = shard_for_rank(list(range(len(prompts))), dp)
    mine = StepSamples.of_completions(engine.generate([prompts[i] for i in share], sampling, prompt_indices=share))
    return mine if dp.size == 1 else _all_gather(mine, dp)


def _all_gather(mine: StepSamples, dp: Group) -> StepSamples:
    """Every rank's samples, in rank order, through four variable-length all-gathers (per-sample layout, token
    ids, fp32 log-probs, routing ids): exact copies, no pickling."""
    dev = comm_device(dp)
    routing = (mine.routing.reshape(-1).to(torch.int32) if mine.routing is not None
               else torch.zeros(0, dtype=torch.int32))
    parts = [gather_ranks_varlen(t.to(dev), dp) for t in (_layout(mine), mine.tokens, mine.logprobs, routing)]
    return StepSamples.concat([_unpack(layout.cpu(), ids.cpu(), lps.cpu(), expert_ids.cpu())
                               for layout, ids, lps, expert_ids in zip(*parts)])


def _layout(samples: StepSamples) -> torch.Tensor:
    """int64 [N, 8]: prompt index, prompt length, completion length, truncated, routing rows, and the routing
    record's dtype code, sparse layers and k (the same on every row; 0 without a record)."""
    n = len(samples)
    if samples.routing is None:
        record = torch.zeros(n, 3, dtype=torch.int64)
    else:
        _, layers, k = samples.routing.shape
        record = torch.tensor([[_ROUTING_CODES[samples.routing.dtype], layers, k]] * n, dtype=torch.int64)
    columns = [samples.prompt_index, samples.prompt_lens, samples.completion_lens, samples.truncated.to(torch.int64),
               samples.routing_rows]
    return torch.cat([torch.stack(columns, dim=1).reshape(n, 5), record.reshape(n, 3)], dim=1)


def _unpack(layout: torch.Tensor, ids: torch.Tensor, lps: torch.Tensor, routing: torch.Tensor) -> StepSamples:
    index, prompt_lens, completion_lens, truncated, rows, code, layers, k = layout.reshape(-1, 8).unbind(1)
    expert_ids = None
    if len(code) and int(code[0]):
        expert_ids = routing.reshape(-1, int(layers[0]), int(k[0])).to(_ROUTING_DTYPES[int(code[0])])
    return StepSamples(ids, prompt_lens, completion_lens, lps, truncated.to(torch.bool), index, expert_ids,
                       rows if expert_ids is not None else torch.zeros_like(rows))


__all__ = ["generate_sharded"]
