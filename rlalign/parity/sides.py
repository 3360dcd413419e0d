"""The two sides a parity run compares: a rollout side that generates, a training side that scores.

Rollout: :class:`RLAlignRollout` (rlalign's :class:`~rlalign.rollout.RolloutEngine`).
Training: :class:`RLAlignTrainer` (rlalign's model, packed forward, ``CausalLM.logprobs``) or
:class:`TransformersTrainer` (a Hugging Face model: patched with rlalign ops in the strict profile,
or stock transformers -- ``log_softmax`` of the full logits -- as the native baseline).

A training side scores the completions of a :class:`~rlalign.parity.replay.RolloutRecord`: the
logprob of generated token i of a sequence with P prompt tokens is read from the row at position
P - 1 + i of the full sequence (prompt + completion), at the record's logprob temperature.
"""

from __future__ import annotations

import datetime
import platform
from typing import Sequence

import torch

from rlalign.contract.profiles import as_profile, use_profile
from rlalign.models.taps import EMBED, FINAL_NORM, layer_tap
from rlalign.parity.capture import capture, capture_active, note_rows, tap
from rlalign.parity.replay import RecordedSequence, RolloutRecord


def environment(device: torch.device | str) -> dict:
    import rlalign
    return {"rlalign": rlalign.__version__, "torch": torch.__version__, "python": platform.python_version(),
            "device": str(device), "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


class RLAlignRollout:
    """Generate with rlalign's rollout engine (continuous batching, paged KV, chunked prefill)."""

    name = "rlalign"

    def __init__(self, model, profile: str = "strict", engine_config: dict | None = None):
        self.model = model
        self.profile = as_profile(profile).value
        self.engine_config = dict(engine_config or {})

    def generate(self, prompts: Sequence[Sequence[int]], *, n: int = 1, max_new_tokens: int = 16,
                 temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0) -> RolloutRecord:
        from rlalign.models.checkpoint import weights_hash
        from rlalign.rollout import RolloutConfig, RolloutEngine, SamplingParams

        engine = RolloutEngine(self.model, RolloutConfig(profile=self.profile, **self.engine_config))
        sampling = SamplingParams(n=n, temperature=temperature, top_k=top_k, top_p=top_p,
                                  max_new_tokens=max_new_tokens, seed=seed)
        completions = engine.generate([list(p) for p in prompts], sampling)
        sequences = [RecordedSequence(c.prompt_index, c.sample_index, list(c.prompt_tokens), list(c.tokens),
                                      list(c.logprobs), c.seed, c.finish_reason) for c in completions]
        return RolloutRecord(
            sequences, weights_hash(self.model),
            {"n": n, "temperature": temperature, "top_k": top_k, "top_p": top_p, "max_new_tokens": max_new_tokens,
             "seed": seed, "logprob_temperature": sampling.logprob_temperature},
            engine=self.name, profile=self.profile, model=model_info(self.model),
            environment=environment(self.model.device))

    def capture(self, **kwargs):
        return capture(model=self.model, **kwargs)


def model_info(model) -> dict:
    cfg = model.config
    return {"family": cfg.family, "dtype": str(model.dtype).removeprefix("torch."), "num_layers": cfg.num_layers,
            "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size}


def _completion_rows(seqs: Sequence[RecordedSequence]) -> list[list[int]]:
    """Per sequence: the rows (positions) whose logprob scores each generated token."""
    return [list(range(len(s.prompt_tokens) - 1, len(s.prompt_tokens) - 1 + len(s.tokens))) for s in seqs]


def _micro_batches(n: int, size: int | None) -> list[range]:
    size = n if not size else size
    return [range(i, min(n, i + size)) for i in range(0, n, size)]


class _ChunkedTrainer:
    """A training side: scores a record's sequences ``micro_batch`` at a time (all at once by default);
    each subclass computes the completion-token logprobs of one chunk."""

    def __init__(self, model, micro_batch: int | None = None):
        self.model = model
        self.micro_batch = micro_batch

    @property
    def weights_hash(self) -> str:
        from rlalign.models.checkpoint import weights_hash
        return weights_hash(self.model)

    def score(self, record: RolloutRecord) -> list[list[float]]:
        out: list[list[float]] = []
        seqs = record.sequences
        for chunk in _micro_batches(len(seqs), self.micro_batch):
            out += self._score_chunk([seqs[i] for i in chunk], record.logprob_temperature)
        return out

    def _score_chunk(self, part: list[RecordedSequence], temperature: float) -> list[list[float]]:
        raise NotImplementedError


class RLAlignTrainer(_ChunkedTrainer):
    """Score with rlalign's model: packed forward (``ForwardBatch.packed``) + fused ``CausalLM.logprobs``."""

    name = "rlalign"

    def __init__(self, model, profile: str = "strict", micro_batch: int | None = None):
        super().__init__(model, micro_batch)
        self.profile = as_profile(profile).value

    def _score_chunk(self, part, temperature):
        from rlalign.models.batch import ForwardBatch, next_token_targets

        tokens = [s.all_tokens for s in part]
        batch = ForwardBatch.packed(tokens, device=self.model.device)
        targets = next_token_targets(tokens).to(self.model.device)
        with torch.no_grad(), use_profile(self.profile):
            lp, _ = self.model.logprobs(batch, targets, temperature=temperature, with_entropy=False)
        lp = lp.cpu()
        offsets = batch.cu_seqlens.tolist()
        return [lp[[start + r for r in rows]].tolist() for start, rows in zip(offsets, _completion_rows(part))]

    def capture(self, **kwargs):
        return capture(model=self.model, **kwargs)


class TransformersTrainer(_ChunkedTrainer):
    """Score with a Hugging Face model on a right-padded batch.

    ``patched`` (strict parity): :func:`rlalign.integrations.transformers.token_logprobs`.
    Stock (the native baseline, what a TRL/verl trainer computes today):
    ``log_softmax(model(input_ids, attention_mask).logits.float() / T).gather(target)``.
    """

    name = "transformers"

    @property
    def patched(self) -> bool:
        from rlalign.integrations.transformers import is_patched
        return is_patched(self.model)

    def _score_chunk(self, part, temperature):
        ids, mask = padded_batch([s.all_tokens for s in part], self.model.device)
        with torch.no_grad():
            lp = self._logprobs(ids, mask, temperature).cpu()
        return [lp[b, rows].tolist() for b, rows in enumerate(_completion_rows(part))]

    def _logprobs(self, ids, mask, temperature: float) -> torch.Tensor:
        if self.patched:
            from rlalign.integrations.transformers import token_logprobs
            return token_logprobs(self.model, ids, mask, temperature=temperature).logprobs
        self._valid = mask.bool()
        if capture_active():
            note_rows([row[m].tolist() for row, m in zip(ids, self._valid)])
        logits = self.model(input_ids=ids, attention_mask=mask, use_cache=False).logits.float()
        logp = torch.log_softmax(logits / temperature, dim=-1)
        targets = torch.cat([ids[:, 1:], ids.new_zeros((ids.shape[0], 1))], dim=1)
        return logp.gather(2, targets.unsqueeze(-1)).squeeze(-1)

    def capture(self, **kwargs):
        """The patched model taps and announces its rows itself; a stock model is tapped by forward hooks."""
        if self.patched:
            return capture(**kwargs)
        return _hooked(capture(**kwargs), self._stock_hooks())

    def _stock_hooks(self) -> list:
        """Forward hooks giving a stock transformers model the boundaries hooks can see (no q/k after rope):
        embed, input_norm, v (v_proj, no rope), attn (o_proj input), o_proj, residual (post-attention norm
        input), post_norm, mlp, final_norm."""
        backbone = self.model.model

        def rows(x):
            return x.reshape(-1, *x.shape[2:])[self._valid.reshape(-1)]

        def out_hook(name):
            def hook(mod, args, out):
                tap(name, rows(out[0] if isinstance(out, tuple) else out))
            return hook

        def in_hook(name):
            def hook(mod, args):
                tap(name, rows(args[0]))
            return hook

        hooks = [backbone.embed_tokens.register_forward_hook(out_hook(EMBED)),
                 backbone.norm.register_forward_hook(out_hook(FINAL_NORM))]
        for i, layer in enumerate(backbone.layers):
            attn = layer.self_attn
            hooks += [layer.input_layernorm.register_forward_hook(out_hook(layer_tap(i, "input_norm"))),
                      attn.v_proj.register_forward_hook(out_hook(layer_tap(i, "v"))),
                      attn.o_proj.register_forward_pre_hook(in_hook(layer_tap(i, "attn"))),
                      attn.o_proj.register_forward_hook(out_hook(layer_tap(i, "o_proj"))),
                      layer.post_attention_layernorm.register_forward_pre_hook(in_hook(layer_tap(i, "residual"))),
                      layer.post_attention_layernorm.register_forward_hook(out_hook(layer_tap(i, "post_norm"))),
                      layer.mlp.register_forward_hook(out_hook(layer_tap(i, "mlp")))]
        return hooks


class _hooked:
    """A capture that removes ``hooks`` when it ends."""

    def __init__(self, cap, hooks):
        self.cap, self.hooks = cap, hooks

    def __enter__(self):
        return self.cap.__enter__()

    def __exit__(self, *exc):
        for h in self.hooks:
            h.remove()
        return self.cap.__exit__(*exc)


def padded_batch(token_lists: Sequence[Sequence[int]], device, pad_id: int = 0):
    """Right-padded int64 input_ids [B, S] and attention_mask [B, S]."""
    width = max(len(t) for t in token_lists)
    ids = torch.full((len(token_lists), width), pad_id, dtype=torch.int64)
    mask = torch.zeros((len(token_lists), width), dtype=torch.int64)
    for i, t in enumerate(token_lists):
        ids[i, :len(t)] = torch.tensor(list(t), dtype=torch.int64)
        mask[i, :len(t)] = 1
    return ids.to(device), mask.to(device)


__all__ = ["RLAlignRollout", "RLAlignTrainer", "TransformersTrainer", "padded_batch", "model_info", "environment"]
