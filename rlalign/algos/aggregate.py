"""Loss aggregation over packed per-token losses: ``loss = sum_t w_t * L_t``.

Every mode is a per-token weight ``w_t`` (0 where mask is False). With ``N_tok`` the number of
masked-in tokens, ``N_seq`` the number of sequences having at least one masked-in token, ``L_i``
the number of masked-in tokens of sequence i and ``C`` a constant (``max_len``):

====================  =============================  ======================================
mode                  w_t for token t of sequence i  loss
====================  =============================  ======================================
token-mean            1 / N_tok                      mean over all tokens (DAPO)
seq-mean-token-sum    1 / N_seq                      mean over sequences of the token sum
seq-mean-token-mean   1 / (L_i * N_seq)              mean over sequences of the token mean (GRPO, GSPO)
seq-mean-token-sum-   1 / (C * N_seq)                mean over sequences of token sum / C (Dr.GRPO)
norm
====================  =============================  ======================================

Micro-batches: pass the *global* ``num_tokens`` / ``num_seqs`` of the whole batch (sum
:func:`batch_counts` over its micro-batches). Then each micro-batch's loss is its share and the
sum over micro-batches is the full-batch loss (up to float rounding of the final sums), and
the gradient of each per-token loss, ``dloss/dL_t = w_t``, is exactly the same whatever the split,
because ``w_t`` depends only on the global counts and on ``L_i``. A sequence must not be
split across micro-batches (``L_i`` is counted within the call). Left as ``None``, the counts
are this call's own. The sum runs as a balanced tree (:func:`tree_sum`) in the loss's dtype;
``w_t`` is computed in float64 and rounded once to that dtype.
"""

from __future__ import annotations

import torch

from rlalign.algos import _portable as P
from rlalign.algos import _segments as S

MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def _check_args(fn: str, mask: torch.Tensor, seq_ids: torch.Tensor, mode: str) -> None:
    if mode not in MODES:
        raise S.fail(fn, f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")
    S.check_flat(fn, mask=mask, seq_ids=seq_ids)
    S.check_mask(fn, mask)


def batch_counts(mask: torch.Tensor, seq_ids: torch.Tensor) -> tuple[int, int]:
    """``(num_tokens, num_seqs)`` of one (micro-)batch: masked-in tokens and sequences having one.

    Sum these over the micro-batches of a batch to get its global normalisers (sequences are
    not split across micro-batches, so the sequence counts add up).
    """
    S.check_flat("batch_counts", mask=mask, seq_ids=seq_ids)
    S.check_mask("batch_counts", mask)
    S.check_ids("batch_counts", seq_ids, None)
    return int(mask.sum()), int(torch.unique(seq_ids[mask]).numel())


def loss_weights(mask: torch.Tensor, seq_ids: torch.Tensor, mode: str, *, num_tokens: int | None = None,
                 num_seqs: int | None = None, max_len: int | None = None,
                 dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Per-token weights ``w_t`` ``[T]`` of ``mode`` (table in the module doc); 0 where mask is False."""
    fn = "loss_weights"
    _check_args(fn, mask, seq_ids, mode)
    local_tokens, local_seqs = batch_counts(mask, seq_ids)
    n_tok = local_tokens if num_tokens is None else num_tokens
    n_seq = local_seqs if num_seqs is None else num_seqs
    if mode == "seq-mean-token-sum-norm" and (max_len is None or max_len <= 0):
        raise S.fail(fn, "mode 'seq-mean-token-sum-norm' needs max_len > 0 (the constant length normaliser)")
    if not bool(mask.any()):
        return torch.zeros(mask.shape[0], dtype=dtype, device=mask.device)
    if (n_tok if mode == "token-mean" else n_seq) <= 0:
        raise S.fail(fn, f"global normaliser must be > 0, got num_tokens={n_tok}, num_seqs={n_seq}")
    w = torch.ones(mask.shape[0], dtype=torch.float64, device=mask.device)
    if mode == "token-mean":
        w = P.div(w, n_tok)
    elif mode == "seq-mean-token-sum":
        w = P.div(w, n_seq)
    elif mode == "seq-mean-token-sum-norm":
        w = P.div(w, float(max_len) * n_seq)
    else:
        seg = S.segments(seq_ids[mask], S.check_ids(fn, seq_ids, None))
        lengths = seg.counts[seq_ids].clamp(min=1).double()
        w = P.div(w, lengths * n_seq)
    return torch.where(mask, w, torch.zeros_like(w)).to(dtype)


def aggregate_loss(token_loss: torch.Tensor, mask: torch.Tensor, seq_ids: torch.Tensor, mode: str, *,
                   num_tokens: int | None = None, num_seqs: int | None = None,
                   max_len: int | None = None) -> torch.Tensor:
    """Scalar loss ``sum_t w_t * L_t`` (masked-out tokens excluded via ``torch.where``).

    ``token_loss`` ``[T]`` float; ``w_t`` from :func:`loss_weights` (see the module doc for
    the modes and the micro-batch normalisers).
    """
    S.check_flat("aggregate_loss", token_loss=token_loss, mask=mask, seq_ids=seq_ids)
    S.check_float("aggregate_loss", token_loss=token_loss)
    w = loss_weights(mask, seq_ids, mode, num_tokens=num_tokens, num_seqs=num_seqs, max_len=max_len,
                     dtype=token_loss.dtype)
    weighted = torch.where(mask, token_loss * w, torch.zeros_like(token_loss))
    return S.flat_sum(weighted)
