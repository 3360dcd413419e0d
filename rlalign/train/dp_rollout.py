"""Rollouts under data parallelism: each DP rank generates a share of the step's prompts, every rank gets all.

The engine keys every sample's random stream by its prompt's index (``SamplingParams.seed_by="index"``) and
the strict engine's bits do not depend on the batch a sequence runs in, so rank r generating prompts
[a, b) with ``prompt_indices=[a, ..., b-1]`` yields exactly the completions one engine generating all the
prompts would (tested against dp=1, bit for bit). An all-gather in rank order then gives every rank the
whole step, prompt by prompt then sample by sample, as ``engine.generate`` returns it: each rank generates about 1/dp of the samples a
replicated rollout would (its wall time not yet measured on GPUs), and the training that follows sees the same
samples on every rank.
"""

from __future__ import annotations

import dataclasses

import torch

from rlalign.distributed.collectives import gather_ranks_varlen
from rlalign.distributed.data_parallel import comm_device, shard_for_rank
from rlalign.distributed.launch import Group

_ROUTING_CODES = {torch.int16: 1, torch.int32: 2}      # a routing record's dtype on the wire (0: no record)
_ROUTING_DTYPES = {code: dtype for dtype, code in _ROUTING_CODES.items()}


@dataclasses.dataclass
class Sampled:
    """What the trainer keeps of one :class:`~rlalign.models.completion.Completion`."""
    prompt_index: int
    prompt_tokens: list[int]
    tokens: list[int]
    logprobs: list[float]          # fp32 values (exact as Python floats)
    truncated: bool                # finish_reason == "length"
    routing: torch.Tensor | None   # MoE expert ids [rows, sparse layers, k] (int16/int32, CPU) or None

    @classmethod
    def of(cls, c) -> "Sampled":
        return cls(c.prompt_index, list(c.prompt_tokens), list(c.tokens), list(c.logprobs),
                   c.finish_reason == "length", c.routing)


def generate_sharded(engine, prompts: list[list[int]], sampling, dp: Group) -> list[Sampled]:
    """Every completion of ``prompts`` on every rank; this rank's engine generates only its contiguous share
    (:func:`shard_for_rank`), keyed by the prompts' global indices."""
    share = shard_for_rank(list(range(len(prompts))), dp)
    mine = [Sampled.of(c) for c in engine.generate([prompts[i] for i in share], sampling, prompt_indices=share)]
    return mine if dp.size == 1 else _all_gather(mine, dp)


def _all_gather(mine: list[Sampled], dp: Group) -> list[Sampled]:
    """Every rank's samples, in rank order, through four variable-length all-gathers (ints, fp32 log-probs,
    per-sample layout, routing ids): exact copies, no pickling."""
    dev = comm_device(dp)
    layout = torch.tensor([_layout(s) for s in mine], dtype=torch.int64).reshape(-1, 8)
    ids = torch.tensor([t for s in mine for t in s.prompt_tokens + s.tokens], dtype=torch.int64)
    lps = torch.tensor([x for s in mine for x in s.logprobs], dtype=torch.float32)
    routing = torch.cat([s.routing.reshape(-1).to(torch.int32) for s in mine if s.routing is not None]
                        + [torch.zeros(0, dtype=torch.int32)])
    parts = [gather_ranks_varlen(t.to(dev), dp) for t in (layout, ids, lps, routing)]
    out = []
    for layout_r, ids_r, lps_r, routing_r in zip(*parts):
        out.extend(_unpack(layout_r.cpu(), ids_r.cpu(), lps_r.cpu(), routing_r.cpu()))
    return out


def _layout(s: Sampled) -> list[int]:
    """prompt index, prompt length, completion length, truncated, routing dtype code, rows, sparse layers, k."""
    if s.routing is None:
        code, rows, layers, k = 0, 0, 0, 0
    else:
        code = _ROUTING_CODES[s.routing.dtype]
        rows, layers, k = s.routing.shape
    return [s.prompt_index, len(s.prompt_tokens), len(s.tokens), int(s.truncated), code, rows, layers, k]


def _unpack(layout: torch.Tensor, ids: torch.Tensor, lps: torch.Tensor, routing: torch.Tensor) -> list[Sampled]:
    out, at_id, at_lp, at_r = [], 0, 0, 0
    for index, n_prompt, n_new, truncated, code, rows, layers, k in layout.tolist():
        seq = ids[at_id:at_id + n_prompt + n_new].tolist()
        expert_ids = None
        if code:
            expert_ids = routing[at_r:at_r + rows * layers * k].reshape(rows, layers, k).to(_ROUTING_DTYPES[code])
        out.append(Sampled(index, seq[:n_prompt], seq[n_prompt:], lps[at_lp:at_lp + n_new].tolist(), bool(truncated),
                           expert_ids))
        at_id, at_lp, at_r = at_id + n_prompt + n_new, at_lp + n_new, at_r + rows * layers * k
    return out


__all__ = ["Sampled", "generate_sharded"]
