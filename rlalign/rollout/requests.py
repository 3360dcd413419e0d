"""The requests in flight: a new request's intake and the registry of those running, with the settings they share.

Intake (:func:`read_prompt`, :func:`check_prompt`, :func:`new_request`): a prompt given as text or token ids
becomes token ids, is checked against the vocabulary and the model length, and the request gets one
:class:`Sequence` per sample, each with its seed (:func:`ops.derive_seed` of the request's seed, its prompt key
and the sample index).

:class:`RequestsInFlight` keeps the requests by id and the distinct values of their settings
(:class:`SharedSettings`, one element each in the usual case), so that the per-step code reads one value
instead of one per sequence when the requests agree.
"""

from __future__ import annotations

import collections
import dataclasses

from rlalign import ops
from rlalign.models.generate import prompt_key
from rlalign.ops.sample import derive_seed
from rlalign.rollout.config import SamplingParams
from rlalign.rollout.errors import RequestError, WeightsUpdateError
from rlalign.rollout.sequence import Request, Sequence, SeqStatus


@dataclasses.dataclass(frozen=True)
class SharedSettings:
    """The distinct values the requests in flight hold (one element each in the usual case)."""
    weights_versions: set[int]
    sampling: set[tuple[float, int, float, float, str]]   # (temperature, top_k, top_p, min_p, logprobs)
    limits: set[tuple[int, bool]]                # (max_new_tokens, has stop strings)
    score_temperatures: set[float]               # logprob temperatures (a decode graph samples with one)
    filtered: bool                               # whether a request filters (top-k < V or top-p < 1, T > 0)
    eager_sampling: bool = False                 # a request the decode graphs do not sample (min-p, sampled logprobs)

    @property
    def stop_strings(self) -> bool:
        """Whether a request in flight has stop strings (then only decoding tells whether a sample stops)."""
        return any(has_strings for _, has_strings in self.limits)


class RequestsInFlight:
    """The requests in flight by id, and what they set (:meth:`shared`)."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.by_id: dict[str, Request] = {}
        self._shared: SharedSettings | None = None                  # None: recompute
        self._settings_in_flight: collections.Counter = collections.Counter()   # settings combination -> requests

    def __len__(self) -> int:
        return len(self.by_id)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.by_id

    def get(self, request_id: str) -> Request | None:
        return self.by_id.get(request_id)

    def ids(self) -> list[str]:
        return list(self.by_id)

    def add(self, request: Request) -> None:
        self.by_id[request.request_id] = request
        self._count_settings(request, +1)

    def discard(self, request: Request) -> None:
        """The request leaves (finished or aborted); nothing happens if it already left."""
        if self.by_id.pop(request.request_id, None) is not None:
            self._count_settings(request, -1)

    def shared(self) -> SharedSettings:
        """What the requests in flight set (distinct values), recomputed only when a combination of settings
        appears or disappears (:meth:`_count_settings`), from those combinations: the per-step code reads
        one value instead of one per sequence when they agree, and a request entering or leaving costs
        O(1), not a pass over the requests in flight."""
        if self._shared is None:
            combos = list(self._settings_in_flight)
            sampling = {combo[1] for combo in combos}
            vocab = self.vocab_size
            self._shared = SharedSettings(
                weights_versions={combo[0] for combo in combos},
                sampling=sampling,
                limits={combo[2] for combo in combos},
                score_temperatures={ops.logprob_temperature(t) for t, *_ in sampling},
                filtered=any(t > 0 and (0 < k < vocab or p < 1) for t, k, p, *_ in sampling),
                eager_sampling=any(min_p > 0 or mode != "full" for *_, min_p, mode in sampling))
        return self._shared

    def check_weights_version(self, version: int) -> None:
        """Refuse a step while a request in flight started with other weights than ``version``."""
        if self.shared().weights_versions != {version}:
            stale = next(r for r in self.by_id.values() if r.weights_version != version)
            raise WeightsUpdateError(f"request {stale.request_id!r} started with weights version "
                                     f"{stale.weights_version} but the engine now has {version}")

    def switch_version(self, version: int) -> None:
        """Every request in flight continues under weights ``version`` (a weight update mid-generation): each
        unfinished sample records the switch (:meth:`Sequence.switch_version`)."""
        for request in self.by_id.values():
            self._count_settings(request, -1)
            request.weights_version = version
            self._count_settings(request, +1)
            for seq in request.seqs:
                if seq.status is not SeqStatus.FINISHED:
                    seq.switch_version(version)

    def _count_settings(self, request: Request, change: int) -> None:
        """A request enters (+1) or leaves (-1) the requests in flight; the shared view is recomputed when
        its combination of settings appears or disappears."""
        sampling = request.sampling
        combo = (request.weights_version,
                 (sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p, sampling.logprobs),
                 (sampling.max_new_tokens, bool(sampling.stop)))
        counts = self._settings_in_flight
        counts[combo] += change
        if counts[combo] == 0:
            del counts[combo]
            self._shared = None
        elif counts[combo] == change:   # first of its kind
            self._shared = None


# ---- intake ------------------------------------------------------------------------------------

def read_prompt(prompt, tokenizer) -> tuple[list[int], str | None]:
    """(token ids, the text or None) of a prompt given as text (encoded by ``tokenizer``) or as token ids."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise RequestError("text prompts need a tokenizer: RolloutEngine(model, config, tokenizer=...) "
                               "or pass token id lists")
        return list(tokenizer.encode(prompt)), prompt
    try:
        return [int(t) for t in prompt], None
    except (TypeError, ValueError):
        raise RequestError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}") from None


def check_prompt(ids: list[int], sampling: SamplingParams, *, vocab_size: int, max_model_len: int,
                 tokenizer) -> None:
    """A prompt the model can continue: tokens in the vocabulary, room left to generate, and a tokenizer
    for stop strings."""
    if not ids:
        raise RequestError("the prompt has no tokens")
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise RequestError(f"prompt token id {bad} is outside the vocabulary [0, {vocab_size})")
    if len(ids) >= max_model_len:
        raise RequestError(f"the prompt has {len(ids)} tokens; max_model_len={max_model_len} leaves no room "
                           "to generate (raise RolloutConfig.max_model_len or shorten the prompt)")
    if sampling.stop and tokenizer is None:
        raise RequestError("stop strings need a tokenizer (RolloutEngine(..., tokenizer=...)); "
                           "use stop_token_ids otherwise")


def new_request(request_id: str, prompt_index: int, ids: list[int], text: str | None, sampling: SamplingParams,
                weights_version: int, eos_token_ids: frozenset[int]) -> Request:
    """The request and its ``sampling.n`` sequences, each seeded by (the request's seed, the prompt's key:
    ``prompt_index`` with ``seed_by="index"``, else the key of its token ids, the sample index)."""
    request = Request(request_id, prompt_index, ids, text, sampling, weights_version,
                      frozenset(sampling.stop_token_ids) | (frozenset() if sampling.ignore_eos else eos_token_ids))
    key = prompt_index if sampling.seed_by == "index" else prompt_key(ids)
    request.seqs = [Sequence(request, j, derive_seed(sampling.seed, key, j), ids) for j in range(sampling.n)]
    return request
