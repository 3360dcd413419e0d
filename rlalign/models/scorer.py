"""Sequence scorers: a Hugging Face ``*ForSequenceClassification`` checkpoint with one label (a reward model) on
rlalign's decoder.

Such a checkpoint is a decoder (``model.*``, the same tensors as the family's ``*ForCausalLM`` without an LM head)
and a ``score`` head (``score.weight`` [1, hidden], no bias). transformers computes ``score(hidden)`` at every
position and reads it at the rightmost token that is not ``pad_token_id`` (position 0 when every token is the pad
token; the last token when the config has no pad token). :meth:`SequenceScorer.scores` reads the same row of a
packed forward: each sequence is scored alone, unpadded, so with the strict ops a sequence's score has the same
bits whatever else shares the batch, its position in it, or how many pad tokens follow it.

Accepted: the ``*ForSequenceClassification`` of a registered family (``architectures`` names exactly one) and one
label (``num_labels`` / ``id2label``); anything else is a one-line :class:`CheckpointError` naming the key.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

import torch

from rlalign.models import architectures
from rlalign.models.batch import ForwardBatch
from rlalign.models.checkpoint import CheckpointError, load_weights, read_config_json, resolve_dtype
from rlalign.models.config import ModelConfig, ModelConfigError
from rlalign.models.decoder import CausalLM
from rlalign.models.modules import Linear

SUFFIX = "ForSequenceClassification"


def supported_architectures() -> tuple[str, ...]:
    """The ``*ForSequenceClassification`` class names of the registered families."""
    return tuple(a.removesuffix("ForCausalLM") + SUFFIX for a in architectures.architectures())


class SequenceScorer(CausalLM):
    """The decoder and a one-output ``score`` head (Hugging Face's names); no LM head."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        # tie_word_embeddings=True: CausalLM then holds no lm_head (a classifier's checkpoint has none)
        super().__init__(dataclasses.replace(config, tie_word_embeddings=True), dtype, device)
        self.score = Linear(config.hidden_size, 1, False, dtype, device)

    def scores(self, batch: ForwardBatch, rows: torch.Tensor) -> torch.Tensor:
        """fp32 [len(rows)]: the score head at the given rows of ``batch``'s final hidden states (rounded to the
        model dtype first, as transformers' ``score`` output is)."""
        hidden = self.forward_hidden(batch).index_select(0, rows)
        return self.score(hidden)[:, 0].float()


def score_index(tokens: Sequence[int], pad_token_id: "int | None") -> int:
    """The position transformers reads a sequence's score at: the last token that is not ``pad_token_id`` (0 when
    every token is; the last token when there is no pad token)."""
    if pad_token_id is None:
        return len(tokens) - 1
    for i in range(len(tokens) - 1, -1, -1):
        if tokens[i] != pad_token_id:
            return i
    return 0


def load_scorer_config(directory: str | os.PathLike) -> ModelConfig:
    """The decoder's :class:`ModelConfig` of a one-label ``*ForSequenceClassification`` checkpoint."""
    path, raw = read_config_json(directory)
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: config.json must hold a JSON object")
    archs = raw.get("architectures")
    supported = supported_architectures()
    if not (isinstance(archs, list) and len(archs) == 1 and archs[0] in supported):
        raise CheckpointError(f"{path}: architectures {archs!r} is not a supported reward model; a reward model is "
                              f"one of {', '.join(supported)} (a decoder with a one-output score head)")
    labels = raw.get("num_labels", len(raw["id2label"]) if isinstance(raw.get("id2label"), dict) else 1)
    if labels != 1:
        raise CheckpointError(f"{path}: num_labels={labels}; a reward model has one score (num_labels 1)")
    causal = archs[0].removesuffix(SUFFIX) + "ForCausalLM"
    try:
        return ModelConfig.from_hf_dict({**raw, "architectures": [causal]})
    except ModelConfigError as exc:
        raise CheckpointError(f"{path}: {exc}") from None


def load_scorer(directory: str | os.PathLike, dtype: "str | torch.dtype | None" = None,
                device: "str | torch.device" = "cpu") -> tuple[SequenceScorer, ModelConfig]:
    """Build a :class:`SequenceScorer` from a ``*ForSequenceClassification`` directory (config.json + safetensors),
    every tensor checked as :func:`rlalign.models.checkpoint.load_model` checks it."""
    config = load_scorer_config(directory)
    model = SequenceScorer(config, dtype=resolve_dtype(dtype or config.dtype), device=device)
    load_weights(model, directory, device)
    return model, config


__all__ = ["SequenceScorer", "load_scorer", "load_scorer_config", "score_index", "supported_architectures", "SUFFIX"]
