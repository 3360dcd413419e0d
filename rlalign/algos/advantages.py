"""Advantage estimators: GRPO (and Dr.GRPO), RLOO, REINFORCE++ (with/without baseline), GAE.

Shapes follow :mod:`rlalign.algos._segments`: per-sequence ``rewards`` ``[N]``, ``group_ids``
``[N]`` in ``[0, G)``; per-token ``seq_ids`` ``[T]`` in ``[0, N)`` and ``mask`` ``[T]`` bool.
Compute advantages on the whole batch (all groups), before splitting into micro-batches.
Outputs are computed without gradient; masked-out tokens get 0.

Standard deviations are Bessel-corrected (unbiased): ``sqrt(sum (x - mean)^2 / (n - 1))``, the
convention of ``torch.std``; a set of one element has std 0.
"""

from __future__ import annotations

import torch

from rlalign.algos import _portable as P
from rlalign.algos import _segments as S
from rlalign.algos.kl import kl_reward_penalty


def _group_stats(rewards: torch.Tensor, group_ids: torch.Tensor, num_groups: int | None, fn: str
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sequence (group sum, group size, group unbiased std, group is constant), each ``[N]``."""
    S.check_flat(fn, rewards=rewards, group_ids=group_ids)
    S.check_float(fn, rewards=rewards)
    seg = S.segments(group_ids, S.check_ids(fn, group_ids, num_groups, "group_ids"))
    sums = S.seg_sum(rewards, seg)
    sizes = seg.counts.to(rewards.dtype)
    mean = sums / sizes.clamp(min=1)
    centred = rewards - mean[seg.ids]
    sq = S.seg_sum(centred * centred, seg)   # one multiply: the bits of ** 2 (torch squares by x * x)
    var = torch.where(sizes > 1, sq / (sizes - 1).clamp(min=1), torch.zeros_like(sq))
    constant = S.seg_is_constant(rewards, seg)
    return sums[seg.ids], sizes[seg.ids], P.sqrt(var)[seg.ids], constant[seg.ids]


def _zero_where(condition: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    return torch.where(condition, torch.zeros_like(values), values)


@torch.no_grad()
def grpo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, *, scale_by_std: bool = True,
                    eps: float = 1e-6, num_groups: int | None = None) -> torch.Tensor:
    """GRPO group-normalised advantage per sequence, ``[N]``.

    For sequence i in group g of size K: ``mean_g = sum_{j in g} r_j / K``,
    ``std_g = sqrt(sum_{j in g} (r_j - mean_g)^2 / (K - 1))`` (unbiased; 0 when K = 1) and
    ``A_i = (r_i - mean_g) / (std_g + eps)``; with ``scale_by_std=False`` (Dr.GRPO)
    ``A_i = r_i - mean_g``. A group whose rewards are all equal (max == min, which includes
    groups of size 1) gets exactly ``A = 0``, also with ``eps = 0`` (no 0/0, no rounding residue
    of the mean).
    """
    sums, sizes, std, constant = _group_stats(rewards, group_ids, num_groups, "grpo_advantages")
    centered = rewards - sums / sizes
    adv = centered / (std + eps) if scale_by_std else centered
    return _zero_where(constant, adv)


@torch.no_grad()
def rloo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, *,
                    num_groups: int | None = None) -> torch.Tensor:
    """RLOO leave-one-out advantage per sequence, ``[N]``.

    ``A_i = r_i - (sum_{j in g, j != i} r_j) / (K - 1)`` for group g of size K
    (equivalently ``K / (K - 1) * (r_i - mean_g)``); exactly 0 when the group's rewards are all
    equal, which includes K = 1.
    """
    sums, sizes, _, constant = _group_stats(rewards, group_ids, num_groups, "rloo_advantages")
    baseline = (sums - rewards) / (sizes - 1).clamp(min=1)
    return _zero_where(constant, rewards - baseline)


def expand_to_tokens(seq_values: torch.Tensor, seq_ids: torch.Tensor, mask: torch.Tensor | None = None
                     ) -> torch.Tensor:
    """Per-sequence ``[N]`` -> per-token ``[T]``: ``out_t = seq_values[seq_ids_t]`` (0 where mask is False)."""
    S.check_ids("expand_to_tokens", seq_ids, seq_values.shape[0])
    out = seq_values[seq_ids]
    if mask is None:
        return out
    S.check_flat("expand_to_tokens", seq_ids=seq_ids, mask=mask)
    return torch.where(mask, out, torch.zeros_like(out))


@torch.no_grad()
def whiten(values: torch.Tensor, mask: torch.Tensor, *, eps: float = 1e-6) -> torch.Tensor:
    """Batch normalisation over the selected tokens: ``(x - mean) / (std + eps)`` (0 where mask is False).

    mean and unbiased std are taken over all tokens with ``mask`` True; if ``std + eps == 0``
    (all values equal and ``eps = 0``) the output is 0.
    """
    S.check_flat("whiten", values=values, mask=mask)
    S.check_mask("whiten", mask)
    mean, std = S.masked_std(values, mask)
    denom = std + eps
    out = (values - mean) / torch.where(denom > 0, denom, torch.ones_like(denom))
    return torch.where(mask & (denom > 0), out, torch.zeros_like(out))


def turn_groups(group_ids: torch.Tensor, turn_counts: torch.Tensor) -> torch.Tensor:
    """Per-turn baseline groups ``[M]`` (``M = sum(turn_counts)``, the turns sample by sample): turn ``t`` of a
    sequence of prompt group ``g`` is in the group of every turn ``t`` of group ``g``'s sequences (the sequences of
    a prompt that reached turn ``t``), numbered ``0..`` in order of (g, t)."""
    S.check_flat("turn_groups", group_ids=group_ids, turn_counts=turn_counts)
    if bool((turn_counts < 0).any()):
        raise S.fail("turn_groups", "turn_counts must be >= 0")
    turn_index = _turn_index(turn_counts)
    width = int(turn_counts.max()) if turn_counts.numel() else 0
    key = torch.repeat_interleave(group_ids, turn_counts) * max(width, 1) + turn_index
    return torch.unique(key, return_inverse=True)[1]


def _turn_index(turn_counts: torch.Tensor) -> torch.Tensor:
    """``[M]``: each turn's index within its sequence (0, 1, ... per sequence)."""
    starts = torch.cumsum(turn_counts, 0) - turn_counts
    return torch.arange(int(turn_counts.sum()), dtype=torch.int64) - torch.repeat_interleave(starts, turn_counts)


def expand_turns_to_tokens(turn_values: torch.Tensor, turn_counts: torch.Tensor, token_turns: torch.Tensor,
                           seq_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-turn ``[M]`` -> per-token ``[T]``: token ``i`` gets the value of turn ``token_turns[i]`` of its sequence
    ``seq_ids[i]`` (0 where mask is False)."""
    fn = "expand_turns_to_tokens"
    S.check_flat(fn, token_turns=token_turns, seq_ids=seq_ids, mask=mask)
    S.check_ids(fn, seq_ids, turn_counts.shape[0])
    if token_turns.numel() and bool(((token_turns < 0) | (token_turns >= turn_counts[seq_ids])).any()):
        raise S.fail(fn, "a token's turn is outside its sequence's turns")
    starts = torch.cumsum(turn_counts, 0) - turn_counts
    out = turn_values[(starts[seq_ids] + token_turns).to(turn_values.device)]
    return torch.where(mask, out, torch.zeros_like(out))


def _response_segments(seq_ids: torch.Tensor, mask: torch.Tensor, num_seqs: int | None, fn: str
                       ) -> S.Segments:
    """Layout of the masked-in tokens only: a sequence's trajectory skips masked-out tokens."""
    S.check_flat(fn, seq_ids=seq_ids, mask=mask)
    S.check_mask(fn, mask)
    num = S.check_ids(fn, seq_ids, num_seqs)
    return S.segments(seq_ids[mask], num)


def _scatter_masked(flat_selected: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    out = flat_selected.new_zeros(mask.shape[0])
    return out.masked_scatter(mask, flat_selected)


def _reverse_discounted_sum(x: torch.Tensor, discount: float) -> torch.Tensor:
    """``out[:, t] = x[:, t] + discount * out[:, t + 1]`` over ``[N, L]``, with ``out[:, L] = 0``."""
    cols = []
    carry = x.new_zeros(x.shape[0])
    for t in range(x.shape[1] - 1, -1, -1):
        carry = x[:, t] + discount * carry
        cols.append(carry)
    return torch.stack(cols[::-1], dim=1) if cols else x.clone()


@torch.no_grad()
def token_rewards(seq_rewards: torch.Tensor, seq_ids: torch.Tensor, mask: torch.Tensor, *,
                  kl: torch.Tensor | None = None, kl_coef: float = 0.0) -> torch.Tensor:
    """Per-token rewards ``[T]`` from per-sequence scores ``[N]``, optionally KL-penalised.

    ``r_t = -kl_coef * kl_t`` on every masked-in token, plus ``seq_rewards[i]`` on the last
    masked-in token of sequence i; 0 on masked-out tokens. A sequence with no masked-in token
    contributes nothing. ``kl`` is a per-token estimate (e.g. :func:`rlalign.algos.kl.kl_k1` of
    the old policy vs the reference).
    """
    seg = _response_segments(seq_ids, mask, seq_rewards.shape[0], "token_rewards")
    is_last = seg.slot == seg.counts[seg.ids] - 1
    score = torch.where(is_last, seq_rewards[seg.ids], torch.zeros_like(seq_rewards[seg.ids]))
    out = _scatter_masked(score, mask)
    if kl is not None and kl_coef != 0.0:
        S.check_flat("token_rewards", kl=kl, mask=mask)
        out = out + kl_reward_penalty(kl, mask, kl_coef).to(out.dtype)
    return out


@torch.no_grad()
def discounted_returns(rewards: torch.Tensor, seq_ids: torch.Tensor, mask: torch.Tensor, *,
                       gamma: float = 1.0, num_seqs: int | None = None) -> torch.Tensor:
    """Reward-to-go ``G_t = sum_{s >= t} gamma^(s - t) r_s`` per token ``[T]``.

    s and t run over the masked-in tokens of the token's own sequence (masked-out tokens are
    skipped and get 0).
    """
    S.check_flat("discounted_returns", rewards=rewards, mask=mask)
    seg = _response_segments(seq_ids, mask, num_seqs, "discounted_returns")
    padded = S.to_padded(rewards[mask], seg, 0.0)
    return _scatter_masked(S.from_padded(_reverse_discounted_sum(padded, gamma), seg), mask)


@torch.no_grad()
def reinforce_pp_advantages(rewards: torch.Tensor, seq_ids: torch.Tensor, mask: torch.Tensor, *,
                            group_ids: torch.Tensor | None = None, kl: torch.Tensor | None = None,
                            kl_coef: float = 0.0, gamma: float = 1.0, eps: float = 1e-6,
                            num_groups: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu et al., 2025) per-token (advantages, returns), each ``[T]``.

    1. baseline (only when ``group_ids`` is given, "REINFORCE++-baseline"):
       ``r_i <- r_i - mean_{j in group(i)} r_j`` (exactly 0 for a group of equal rewards);
    2. per-token rewards (:func:`token_rewards`): ``-kl_coef * kl_t`` on every masked-in token
       plus ``r_i`` on the last one (the paper folds the k1 KL to the reference into the reward);
    3. returns ``G_t = sum_{s >= t} gamma^(s - t) r_s`` within the sequence;
    4. advantages ``A_t = (G_t - mean) / (std + eps)``, mean and unbiased std over all
       masked-in tokens of the batch (global batch normalisation).
    """
    S.check_flat("reinforce_pp_advantages", rewards=rewards)
    if group_ids is not None:
        sums, sizes, _, constant = _group_stats(rewards, group_ids, num_groups, "reinforce_pp_advantages")
        rewards = _zero_where(constant, rewards - sums / sizes)
    per_token = token_rewards(rewards, seq_ids, mask, kl=kl, kl_coef=kl_coef)
    returns = discounted_returns(per_token, seq_ids, mask, gamma=gamma, num_seqs=rewards.shape[0])
    return whiten(returns, mask, eps=eps), returns


@torch.no_grad()
def gae_advantages(rewards: torch.Tensor, values: torch.Tensor, seq_ids: torch.Tensor, mask: torch.Tensor,
                   *, gamma: float = 1.0, lam: float = 1.0, num_seqs: int | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation for PPO: per-token (advantages, returns), each ``[T]``.

    ``rewards`` and ``values`` are per token (see :func:`token_rewards`). Within each sequence,
    over its masked-in tokens t = 0..L-1 (masked-out tokens are skipped, as if absent):
    ``delta_t = r_t + gamma * V_{t+1} - V_t`` with ``V_L = 0`` (the sequence ends at its last
    masked-in token, truncated or not: no bootstrap), ``A_t = delta_t + gamma * lam * A_{t+1}``
    with ``A_L = 0``, and ``returns_t = A_t + V_t`` (the value-model target). Masked-out tokens get 0.
    Advantages are not whitened here; apply :func:`whiten` if wanted.
    """
    fn = "gae_advantages"
    S.check_flat(fn, rewards=rewards, values=values, mask=mask)
    S.check_float(fn, rewards=rewards, values=values)
    seg = _response_segments(seq_ids, mask, num_seqs, fn)
    r = S.to_padded(rewards[mask], seg, 0.0)
    v = S.to_padded(values[mask].to(r.dtype), seg, 0.0)
    v_next = torch.cat([v[:, 1:], v.new_zeros(v.shape[0], 1)], dim=1)
    delta = r + gamma * v_next - v
    adv = _reverse_discounted_sum(delta, gamma * lam)
    adv_flat, ret_flat = S.from_padded(adv, seg), S.from_padded(adv + v, seg)
    return _scatter_masked(adv_flat, mask), _scatter_masked(ret_flat, mask)


@torch.no_grad()
def vtrace_gae(rewards: torch.Tensor, values: torch.Tensor, log_ratio: torch.Tensor, seq_ids: torch.Tensor,
               mask: torch.Tensor, *, gamma: float = 1.0, lam: float = 1.0, rho_cap: float = 1.0,
               c_cap: float = 1.0, num_seqs: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE on samples of an older (behaviour) policy, with V-trace value targets (Espeholt et al., 2018): per-token
    (advantages, value targets), each ``[T]``.

    ``log_ratio`` ``[T]`` is ``log pi_prox(a_t) - log pi_behav(a_t)`` per token (the exact difference of the
    proximal and behaviour log-probs). Within each sequence, over its masked-in tokens t = 0..L-1 (masked-out
    tokens skipped, as if absent), with ``V_L = 0`` (no bootstrap, as :func:`gae_advantages`)::

        ratio_t = exp(log_ratio_t),   rho_t = min(rho_cap, ratio_t),   c_t = min(c_cap, ratio_t)
        delta_t = r_t + gamma * V_{t+1} - V_t
        v_t - V_t = rho_t * delta_t + gamma * lam * c_t * (v_{t+1} - V_{t+1}),   v_L - V_L = 0     (value targets)
        A_t       = delta_t + gamma * lam * c_{t+1} * A_{t+1},                   A_L = 0           (advantages)

    ``v`` is V-trace's target (its lambda form: traces ``lam * c``) for the value of the proximal policy; the
    advantage of (s_t, a_t) corrects the later actions with the truncated traces ``c_{t+1} .. c_j``, not a_t itself
    (the decoupled policy loss weighs token t by its own ratio). Masked-out tokens get 0. Where every ratio is 1
    (the behaviour policy is the proximal one) both are :func:`gae_advantages`'s, bit for bit: ``rho * delta`` and
    ``(gamma * lam) * c`` are then exact copies of ``delta`` and ``gamma * lam``.
    """
    fn = "vtrace_gae"
    S.check_flat(fn, rewards=rewards, values=values, log_ratio=log_ratio, mask=mask)
    S.check_float(fn, rewards=rewards, values=values, log_ratio=log_ratio)
    if not (rho_cap > 0 and c_cap > 0):
        raise S.fail(fn, f"rho_cap and c_cap must be > 0, got {rho_cap} and {c_cap}")
    seg = _response_segments(seq_ids, mask, num_seqs, fn)
    r = S.to_padded(rewards[mask], seg, 0.0)
    v = S.to_padded(values[mask].to(r.dtype), seg, 0.0)
    ratio = S.to_padded(log_ratio[mask].to(r.dtype), seg, 0.0).exp()   # padding: ratio 1, multiplying a zero carry
    rho, c = ratio.clamp(max=rho_cap), ratio.clamp(max=c_cap)
    v_next = torch.cat([v[:, 1:], v.new_zeros(v.shape[0], 1)], dim=1)
    delta = r + gamma * v_next - v
    trace = (gamma * lam) * c
    trace_next = torch.cat([trace[:, 1:], trace.new_full((trace.shape[0], 1), gamma * lam)], dim=1)
    target_gap = _reverse_traced_sum(rho * delta, trace)
    adv = _reverse_traced_sum(delta, trace_next)
    adv_flat, ret_flat = S.from_padded(adv, seg), S.from_padded(target_gap + v, seg)
    return _scatter_masked(adv_flat, mask), _scatter_masked(ret_flat, mask)


def _reverse_traced_sum(x: torch.Tensor, discount: torch.Tensor) -> torch.Tensor:
    """``out[:, t] = x[:, t] + discount[:, t] * out[:, t + 1]`` over ``[N, L]``, with ``out[:, L] = 0``
    (:func:`_reverse_discounted_sum` with a per-element discount)."""
    cols = []
    carry = x.new_zeros(x.shape[0])
    for t in range(x.shape[1] - 1, -1, -1):
        carry = x[:, t] + discount[:, t] * carry
        cols.append(carry)
    return torch.stack(cols[::-1], dim=1) if cols else x.clone()
