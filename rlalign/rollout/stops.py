"""When a sample ends: a stop token, a stop string in its decoded tail, ``max_new_tokens``, or the model length.

After a step, one array test over its rows (:meth:`Stops.candidates`: the slots' own stop ids and length
limits, which requests may set differently) picks the few sequences that may end with the tokens just
sampled; :meth:`Stops.check` decides for those and records why (``finish_reason``, ``stop_reason``). While a
request with stop strings is in flight every sequence is a candidate: only decoding tells.
"""

from __future__ import annotations

import numpy as np

from rlalign.rollout.sequence import Sequence
from rlalign.rollout.slots import SlotTable

# a token decodes to at least one byte: a stop string just completed lies in the last (its length + this) tokens
STOP_STRING_SLACK_TOKENS = 8


class Stops:
    """The stop rules of one engine (its tokenizer decodes for stop strings; ``max_model_len`` ends every
    sample)."""

    def __init__(self, tokenizer, max_model_len: int):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len

    def candidates(self, table: SlotTable, slots: np.ndarray, new_len: np.ndarray, tokens: np.ndarray,
                   stop_strings: bool) -> list[int]:
        """Indices (ascending) of the sequences (in ``slots``) that may end with this step's ``tokens``
        (appended after this call, bringing them to ``new_len`` tokens): :meth:`check` decides for
        these, every other one goes on. One array test on the slots' own stop ids and length limits
        (requests may differ in both); every sequence while a request with stop strings is in flight
        (``stop_strings``)."""
        if stop_strings:
            return list(range(slots.size))
        may = new_len >= np.minimum(table.length_limit[slots], self.max_model_len)
        may |= table.hits_stop(slots, tokens)
        return may.nonzero()[0].tolist()

    def check(self, seq: Sequence, token: int) -> bool:
        """Whether ``seq`` ends with ``token`` (already appended); records the reason on it."""
        request = seq.request
        if token in request.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", int(token)
        elif request.sampling.stop and (hit := self.stop_string(seq)) is not None:
            seq.finish_reason, seq.stop_reason = "stop", hit
        elif seq.num_output_tokens >= request.sampling.max_new_tokens or seq.num_tokens >= self.max_model_len:
            seq.finish_reason = "length"
        return seq.finish_reason is not None

    def stop_string(self, seq: Sequence) -> str | None:
        """The first stop string in the decoded text of the last (longest stop string + 8) generated tokens
        (a token decodes to at least one byte, so a stop string just completed lies in that window)."""
        stops = seq.request.sampling.stop
        window = max(len(s) for s in stops) + STOP_STRING_SLACK_TOKENS
        text = self.tokenizer.decode(seq.tokens[max(seq.num_prompt_tokens, seq.num_tokens - window):])
        return next((s for s in stops if s in text), None)
