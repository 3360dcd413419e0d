"""What a step hands back: one :class:`StepOutput` per sampled token, and a finished sample's :class:`Completion`.

The outputs of the sequences that go on are built from the step's arrays and the slot table's columns
(one object per token, no per-sequence Python beyond that); a sample that ends gets its Completion, the
record every generator returns.
"""

from __future__ import annotations

import itertools

import numpy as np

from rlalign.rollout.sequence import Completion, Sequence, StepOutput
from rlalign.rollout.slots import SlotTable


def running_outputs(table: SlotTable, slots: np.ndarray, tokens: np.ndarray, logprobs: np.ndarray,
                    ended: list[int]) -> list[StepOutput]:
    """One unfinished StepOutput per row of ``slots`` except the rows ``ended`` (indices), from the slot
    table's labels of each sequence (request id, prompt index, sample index)."""
    going = slots
    token_list, logprob_list = tokens.tolist(), logprobs.tolist()
    if ended:
        keep = np.ones(slots.size, bool)
        keep[ended] = False
        going, token_list = slots[keep], list(itertools.compress(token_list, keep.tolist()))
        logprob_list = list(itertools.compress(logprob_list, keep.tolist()))
    return list(map(StepOutput, table.request_id[going].tolist(), table.prompt_index[going].tolist(),
                    table.sample_index[going].tolist(), token_list, logprob_list, itertools.repeat(False)))


def completion_of(seq: Sequence, tokenizer) -> Completion:
    """The record of a finished (or aborted) sample; its text decoded when there is a tokenizer."""
    request = seq.request
    return Completion(
        request_id=request.request_id, prompt_index=request.prompt_index, sample_index=seq.sample_index,
        prompt_tokens=request.prompt_tokens, tokens=seq.output_tokens, logprobs=list(seq.logprobs),
        finish_reason=seq.finish_reason, weights_version=seq.version_marks[0][1], seed=seq.seed,
        stop_reason=seq.stop_reason, prompt=request.prompt_text,
        text=tokenizer.decode(seq.output_tokens) if tokenizer is not None else None,
        num_preemptions=seq.num_preemptions, routing=seq.routing, token_versions=seq.token_versions())
