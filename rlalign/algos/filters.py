"""DAPO (Yu et al., 2025) sample filters and shaping: dynamic sampling, overlong filtering,
soft overlong punishment, and the entropy bonus term.

Shapes follow :mod:`rlalign.algos._segments` (per-sequence ``[N]``, per-token ``[T]``).
"""

from __future__ import annotations

import math

import torch

from rlalign.algos import _segments as S


def informative_groups(rewards: torch.Tensor, group_ids: torch.Tensor, *,
                       num_groups: int | None = None) -> torch.Tensor:
    """Dynamic sampling: bool ``[N]``, True for sequences whose group's rewards are not all equal.

    A group is dropped when ``max_g r == min_g r`` (zero variance: every advantage would be 0,
    e.g. all correct or all wrong); groups of one sequence are therefore dropped too.
    """
    fn = "informative_groups"
    S.check_flat(fn, rewards=rewards, group_ids=group_ids)
    seg = S.segments(group_ids, S.check_ids(fn, group_ids, num_groups, "group_ids"))
    return ~S.seg_is_constant(rewards, seg)[seg.ids]


def first_groups(group_ids: torch.Tensor, keep: torch.Tensor, max_groups: int) -> torch.Tensor:
    """Bool ``[N]``: ``keep`` restricted to the first ``max_groups`` kept groups.

    Groups are ranked by the position of their first kept sequence (the order they were drawn),
    so a sampler that over-draws can trim the batch back to its target size.
    """
    S.check_flat("first_groups", group_ids=group_ids, keep=keep)
    S.check_mask("first_groups", keep, "keep")
    S.check_ids("first_groups", group_ids, None, "group_ids")
    chosen: list[int] = []
    for g in group_ids[keep].tolist():
        if g not in chosen:
            if len(chosen) == max_groups:
                break
            chosen.append(g)
    allowed = torch.tensor(chosen, dtype=group_ids.dtype, device=group_ids.device)
    return keep & torch.isin(group_ids, allowed)


def groups_to_draw(target_groups: int, kept_groups: int, drawn_groups: int, *,
                   min_keep_rate: float = 0.1, max_draw: int | None = None) -> int:
    """How many more prompt groups to sample so that about ``target_groups`` survive the filter.

    ``need = target_groups - kept_groups`` (0 if <= 0); the keep rate observed so far is
    ``kept_groups / drawn_groups`` (1.0 before anything was drawn), floored at
    ``min_keep_rate``; the answer is ``ceil(need / rate)``, capped at ``max_draw`` if given.
    Call it again after each draw until it returns 0 (DAPO then trims to the target with
    :func:`first_groups`).
    """
    if target_groups < 0 or kept_groups < 0 or drawn_groups < kept_groups:
        raise S.fail("groups_to_draw", f"need 0 <= kept_groups <= drawn_groups and target_groups >= 0, got "
                                       f"target={target_groups} kept={kept_groups} drawn={drawn_groups}")
    if not 0.0 < min_keep_rate <= 1.0:
        raise S.fail("groups_to_draw", f"min_keep_rate must be in (0, 1], got {min_keep_rate}")
    need = target_groups - kept_groups
    if need <= 0:
        return 0
    rate = kept_groups / drawn_groups if drawn_groups else 1.0
    count = math.ceil(need / max(rate, min_keep_rate))
    return count if max_draw is None else min(count, max_draw)


def overlong_filter(mask: torch.Tensor, seq_ids: torch.Tensor, truncated: torch.Tensor) -> torch.Tensor:
    """Overlong filtering: bool ``[T]``, ``mask`` with every token of a truncated sequence removed.

    ``truncated`` ``[N]`` bool: the sequence hit the length limit before its end token.
    """
    S.check_flat("overlong_filter", mask=mask, seq_ids=seq_ids)
    S.check_mask("overlong_filter", mask)
    S.check_mask("overlong_filter", truncated, "truncated")
    S.check_ids("overlong_filter", seq_ids, truncated.shape[0])
    return mask & ~truncated[seq_ids]


def soft_overlong_penalty(lengths: torch.Tensor, max_len: int, cache_len: int) -> torch.Tensor:
    """DAPO soft overlong punishment per sequence ``[N]`` (float32), added to the reward.

    With ``L = lengths`` (response tokens), ``L_max = max_len`` and ``L_c = cache_len``:
    0 if ``L <= L_max - L_c``; ``((L_max - L_c) - L) / L_c`` if ``L_max - L_c < L <= L_max``
    (linear from 0 down to -1); -1 if ``L > L_max``.
    """
    if not 0 < cache_len <= max_len:
        raise S.fail("soft_overlong_penalty", f"need 0 < cache_len <= max_len, got cache_len={cache_len}, "
                                              f"max_len={max_len}")
    length = lengths.to(torch.float64)
    start = float(max_len - cache_len)
    ramp = (start - length) / cache_len
    out = torch.where(length <= start, torch.zeros_like(length), ramp)
    return torch.where(length > max_len, torch.full_like(length, -1.0), out).to(torch.float32)


def entropy_bonus(entropy: torch.Tensor, mask: torch.Tensor, coef: float) -> torch.Tensor:
    """Per-token loss term ``-coef * H_t`` (0 where mask is False), to add to the policy loss
    before aggregation; minimising it raises the entropy ``H_t`` of the token distributions."""
    S.check_flat("entropy_bonus", entropy=entropy, mask=mask)
    S.check_mask("entropy_bonus", mask)
    term = -coef * entropy
    return torch.where(mask, term, torch.zeros_like(term))
