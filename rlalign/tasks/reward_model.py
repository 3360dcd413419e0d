"""A reward model: a Hugging Face ``*ForSequenceClassification`` checkpoint (one label) scored on rlalign's decoder
in the strict profile (:mod:`rlalign.models.scorer`).

What is scored: the conversation the policy saw with its completion as the assistant's reply, rendered with the
**reward model's own** chat template (``add_generation_prompt=False``) and tokenizer; a reward model whose
tokenizer has no chat template scores the policy's prompt text followed by the completion, encoded as plain text.
Sequences are packed into micro-batches of at most ``micro_batch_tokens`` tokens (a longer one alone), in order;
every op is strict, so a sample's reward has the same bits whatever batch, micro-batch or position it is scored
in. The reward is the score head's output (fp32, from the model dtype) as a Python float.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import torch

from rlalign.contract.profiles import use_profile
from rlalign.models.batch import ForwardBatch
from rlalign.models.checkpoint import load_tokenizer
from rlalign.models.scorer import load_scorer, load_scorer_config, score_index
from rlalign.tasks.registry import RewardError, RewardLoadError, sample_label


class RewardModel:
    """The checkpoint in ``directory`` on ``device``; :meth:`score` gives one float per sample."""

    def __init__(self, directory: "str | os.PathLike", *, device: str = "cpu", dtype: "str | None" = None,
                 micro_batch_tokens: int = 8192):
        self.directory = Path(directory).expanduser()
        if not self.directory.is_dir():
            raise RewardLoadError(f"reward_model {str(directory)!r}: not a directory (give a Hugging Face "
                                  "*ForSequenceClassification checkpoint folder)")
        if dtype is None and load_scorer_config(self.directory).dtype == "float16":
            raise RewardLoadError(f"reward_model {str(directory)!r} is a float16 checkpoint, which the strict ops do not "
                                  "run; give the entry dtype: bfloat16 or dtype: float32")
        self.model, self.config = load_scorer(self.directory, dtype=dtype, device=device)
        self.tokenizer = load_tokenizer(self.directory)
        self.micro_batch_tokens = int(micro_batch_tokens)
        self.name = f"reward_model:{self.directory}"

    def encode(self, conversation: "Sequence[dict] | None", prompt_text: str, completion: str) -> list[int]:
        """The tokens the reward model scores for one sample (see the module docstring)."""
        if self.tokenizer.chat_template and conversation is not None:
            messages = [*conversation, {"role": "assistant", "content": completion}]
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=False)
        return self.tokenizer.encode(prompt_text + completion)

    def score(self, prompts: Sequence[str], completions: Sequence[str],
              conversations: "Sequence[Sequence[dict] | None] | None" = None) -> list[float]:
        """Each sample's reward; ``conversations[i]``: the chat messages of sample i's prompt (None: plain text,
        which is then wrapped as one user message for a reward model with a chat template)."""
        conversations = conversations or [None] * len(prompts)
        tokens = [self.encode(conv if conv is not None else [{"role": "user", "content": prompt}], prompt, completion)
                  for prompt, completion, conv in zip(prompts, completions, conversations, strict=True)]
        limit = self.config.max_position_embeddings
        for i, ids in enumerate(tokens):
            if not ids or len(ids) > limit:
                raise RewardError(f"{sample_label(self.name, i, prompts[i])}: {len(ids)} tokens, the reward model "
                                  f"takes 1 to max_position_embeddings={limit}")
        return self.score_tokens(tokens)

    @torch.no_grad()
    def score_tokens(self, token_lists: Sequence[Sequence[int]]) -> list[float]:
        """The score of each token list, in order (strict profile, packed micro-batches)."""
        out: list[float] = []
        for chunk in micro_batches([len(t) for t in token_lists], self.micro_batch_tokens):
            seqs = [token_lists[i] for i in chunk]
            batch = ForwardBatch.packed(seqs, device=self.model.device)
            starts = batch.cu_seqlens[:-1].long().tolist()
            rows = [start + score_index(seq, self.config.pad_token_id) for start, seq in zip(starts, seqs)]
            with use_profile("strict"):
                values = self.model.scores(batch, torch.tensor(rows, dtype=torch.int64, device=self.model.device))
            out.extend(values.cpu().tolist())
        return out


def micro_batches(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Consecutive index groups whose lengths sum to at most ``budget`` (a longer sequence forms a group alone)."""
    groups: list[list[int]] = []
    used = budget
    for i, n in enumerate(lengths):
        if used + n > budget or not groups:
            groups.append([])
            used = 0
        groups[-1].append(i)
        used += n
    return groups


__all__ = ["RewardModel", "micro_batches"]
