"""A simple generation loop: prefill every sequence into a paged KV cache, then decode step by step.

Each (prompt, sample) pair is its own sequence with its own pages. Randomness is keyed so a
completion does not depend on what else is generated with it:

    prompt_key   = first 8 bytes of sha256(prompt token ids as int64 little-endian) & (2**63 - 1)
    seq_seed     = ops.derive_seed(seed, prompt_key, sample_index)
    token at p   = ops.sample_and_score(h, W, seeds=seq_seed, positions=p, ...)

where p is the absolute position the sampled token will occupy (= tokens before it) and h the
last context row (the one owner of sample-and-score, which the rollout engine and the vLLM plugin
use too). The prompt's *content* (not its place in the list) is the ``prompt_index`` given to
derive_seed, so the same seed gives the same tokens and logprobs whatever ``n``, the number of
prompts or their order (two identical prompts therefore get identical samples; ask for more with
``n``). The reported logprob of a sampled token is
``ops.logprob_entropy`` of the same hidden row at ``ops.logprob_temperature`` of the sampling
temperature (the sampling temperature; 1 for greedy, temperature 0).
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Sequence

import torch

from rlalign import ops
from rlalign.models.batch import ForwardBatch, KVCache, contiguous_block_tables
from rlalign.models.completion import Completion
from rlalign.models.decoder import CausalLM
from rlalign.ops.sample import derive_seed


@dataclasses.dataclass
class _Seq:
    index: int
    context: list[int]
    seed: int
    pages: list[int]
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None


def prompt_key(token_ids: Sequence[int]) -> int:
    """A 63-bit key of a prompt's token ids (its identity for seeding)."""
    raw = b"".join(int(t).to_bytes(8, "little", signed=True) for t in token_ids)
    return int.from_bytes(hashlib.sha256(raw).digest()[:8], "little") & (2**63 - 1)


@torch.no_grad()
def generate(model: CausalLM, prompts: Sequence[str] | Sequence[Sequence[int]], *, tokenizer=None, n: int = 1,
             max_new_tokens: int = 32, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, seed: int = 0,
             chat: bool = False, stop_token_ids: Sequence[int] | None = None, page_size: int = 16) -> list[Completion]:
    """Sample ``n`` completions per prompt; returned in prompt order, then sample order.

    ``prompts`` are strings (encoded by ``tokenizer``; ``chat=True`` applies its chat template)
    or lists of token ids. Stops at a stop token (default: the tokenizer's and the config's eos
    ids) or after ``max_new_tokens``. Runs under the current profile.
    """
    if n < 1 or max_new_tokens < 1:
        raise ValueError(f"n and max_new_tokens must be >= 1 (got n={n}, max_new_tokens={max_new_tokens})")
    encoded = [encode_prompt(p, tokenizer, chat) for p in prompts]
    stops = set(stop_token_ids if stop_token_ids is not None else _default_stops(model, tokenizer))
    capacities = [len(ids) + max_new_tokens for ids in encoded for _ in range(n)]
    tables = contiguous_block_tables(capacities, page_size)
    cache = KVCache.for_model(model.config, sum(len(t) for t in tables), page_size, model.dtype, model.device)
    seqs = [_Seq(i, list(ids), derive_seed(seed, prompt_key(ids), j), tables[i * n + j])
            for i, ids in enumerate(encoded) for j in range(n)]

    batch = ForwardBatch.prefill([s.context for s in seqs], cache, [s.pages for s in seqs])
    rows = model.forward_hidden(batch)[batch.last_token_rows]
    active = _step(model, seqs, rows, temperature, top_p, top_k, stops, max_new_tokens)
    while active:
        batch = ForwardBatch.decode([s.context[-1] for s in active], [len(s.context) - 1 for s in active],
                                    cache, [s.pages for s in active])
        rows = model.forward_hidden(batch)
        active = _step(model, active, rows, temperature, top_p, top_k, stops, max_new_tokens)

    out = []
    for k, s in enumerate(seqs):
        prompt_index, sample = divmod(k, n)
        text = tokenizer.decode(s.tokens) if tokenizer is not None else ""
        prompt = prompts[prompt_index] if isinstance(prompts[prompt_index], str) else None
        out.append(Completion(request_id=str(prompt_index), prompt_index=prompt_index, sample_index=sample,
                              prompt_tokens=encoded[prompt_index], tokens=s.tokens, logprobs=s.logprobs,
                              finish_reason=s.finish_reason, weights_version=0, seed=s.seed, prompt=prompt,
                              text=text))
    return out


def _step(model: CausalLM, seqs: list[_Seq], rows: torch.Tensor, temperature: float, top_p: float, top_k: int,
          stops: set, max_new_tokens: int) -> list[_Seq]:
    """Sample one token for each sequence from its hidden row; returns the sequences still running."""
    device = rows.device
    seeds = torch.tensor([s.seed for s in seqs], dtype=torch.int64, device=device)
    positions = torch.tensor([len(s.context) for s in seqs], dtype=torch.int64, device=device)
    # model.logits refuses a tensor-parallel model (no full LM head) before anything is sampled
    tokens, logprobs = ops.sample_and_score(rows, model.lm_head_weight, seeds=seeds, positions=positions,
                                            temperature=temperature, top_k=top_k, top_p=top_p,
                                            logits=model.logits(rows))
    still = []
    for s, tok, lp in zip(seqs, tokens.tolist(), logprobs.tolist()):
        s.tokens.append(tok)
        s.logprobs.append(lp)
        s.context.append(tok)
        if tok in stops:
            s.finish_reason = "stop"
        elif len(s.tokens) >= max_new_tokens:
            s.finish_reason = "length"
        else:
            still.append(s)
    return still


def encode_prompt(prompt, tokenizer, chat: bool) -> list[int]:
    """Token ids of a text prompt (through the tokenizer, chat template if asked) or of an id list."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("text prompts need a tokenizer (or pass token id lists)")
        ids = tokenizer.encode(prompt, chat=chat)
    else:
        ids = [int(t) for t in prompt]
    if not ids:
        raise ValueError(f"prompt {prompt!r} encodes to zero tokens")
    return ids


def _default_stops(model: CausalLM, tokenizer) -> set[int]:
    stops = set(model.config.eos_token_ids)
    if tokenizer is not None:
        stops |= set(tokenizer.eos_token_ids)
    return stops
