"""A Hugging Face model as the training side of ``rlalign parity`` (``--train transformers``).

:class:`TransformersTrainer` scores a :class:`~rlalign.parity.replay.RolloutRecord` with a Hugging Face
causal LM on a right-padded batch: patched with rlalign ops (:mod:`rlalign.integrations.transformers`) in
the strict profile, or stock transformers -- ``log_softmax`` of the full logits -- as the native baseline.
Importing :mod:`rlalign.integrations` registers it as the ``transformers`` training side.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch

from rlalign.integrations.transformers import checkpoint_parameters, from_pretrained, is_patched, token_logprobs
from rlalign.models.checkpoint import resolve_dtype, weights_hash
from rlalign.models.taps import EMBED, FINAL_NORM, layer_tap
from rlalign.parity.capture import capture, capture_active, note_rows, tap
from rlalign.parity.sides import ChunkedTrainer, completion_rows, register_trainer_side


class TransformersTrainer(ChunkedTrainer):
    """Score with a Hugging Face model on a right-padded batch.

    ``patched`` (strict parity): :func:`rlalign.integrations.transformers.token_logprobs`.
    Stock (the native baseline, what a TRL/verl trainer computes today):
    ``log_softmax(model(input_ids, attention_mask).logits.float() / T).gather(target)``.
    """

    name = "transformers"

    @property
    def patched(self) -> bool:
        return is_patched(self.model)

    @property
    def weights_hash(self) -> str:
        return weights_hash(list(checkpoint_parameters(self.model)))

    def _score_chunk(self, part, temperature):
        ids, mask = padded_batch([s.all_tokens for s in part], self.model.device)
        with torch.no_grad():
            lp = self._logprobs(ids, mask, temperature).cpu()
        return [lp[b, rows].tolist() for b, rows in enumerate(completion_rows(part))]

    def _logprobs(self, ids, mask, temperature: float) -> torch.Tensor:
        if self.patched:
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


def build_trainer(o, model, model_dir: Path) -> TransformersTrainer:
    """The checkpoint loaded by transformers: patched (strict) or stock (native, the baseline a TRL/verl
    trainer runs today), in ``model``'s dtype."""
    from transformers import AutoModelForCausalLM   # lazy: transformers is heavy and only this side needs it
    _quiet_transformers()
    dtype = resolve_dtype(model.dtype)
    if o.profile == "strict":
        hf = from_pretrained(model_dir, dtype=dtype, device=o.device)
    else:
        hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(o.device)
    return TransformersTrainer(hf.eval(), o.train_batch)


def _quiet_transformers() -> None:
    try:
        from transformers.utils import logging as hf_logging   # lazy: heavy, see build_trainer
        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
    except Exception:  # noqa: BLE001 -- cosmetics only
        pass


register_trainer_side("transformers", build_trainer)

__all__ = ["TransformersTrainer", "padded_batch", "build_trainer"]
