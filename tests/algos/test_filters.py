"""DAPO filters: dynamic sampling, refill count, overlong filtering and punishment, entropy bonus."""

import pytest
import torch

from rlalign.algos import (
    entropy_bonus,
    first_groups,
    groups_to_draw,
    informative_groups,
    overlong_filter,
    soft_overlong_penalty,
)


def b(values):
    return torch.tensor(values, dtype=torch.bool)


def test_informative_groups_drops_zero_variance():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5, 2.0])
    groups = torch.tensor([0, 0, 1, 1, 2, 2, 3])
    # group 0 all 1, group 2 all 0.5, group 3 a single sample: dropped; group 1 varies: kept
    assert informative_groups(rewards, groups).tolist() == [False, False, True, True, False, False, False]


def test_first_groups_in_draw_order():
    keep = b([True, True, False, False, True, True])
    assert first_groups(torch.tensor([0, 0, 1, 1, 2, 2]), keep, 1).tolist() == [True, True] + [False] * 4
    assert first_groups(torch.tensor([2, 2, 0, 0, 1, 1]), b([True] * 6), 2).tolist() == [True] * 4 + [False] * 2
    assert first_groups(torch.tensor([0, 1]), b([True, True]), 5).tolist() == [True, True]


@pytest.mark.parametrize("args, kwargs, expected", [
    ((8, 0, 0), {}, 8),                   # nothing drawn yet: assume everything survives
    ((8, 2, 8), {}, 24),                  # keep rate 2/8: 6 more needed -> 6 / 0.25
    ((8, 2, 8), {"max_draw": 10}, 10),    # capped
    ((8, 0, 8), {}, 80),                  # keep rate 0 floored at 0.1
    ((8, 3, 7), {}, 12),                  # rate 3/7: ceil(5 * 7 / 3) = ceil(11.67)
    ((8, 9, 12), {}, 0),                  # enough already
])
def test_groups_to_draw(args, kwargs, expected):
    assert groups_to_draw(*args, **kwargs) == expected


def test_groups_to_draw_errors():
    with pytest.raises(ValueError, match="kept_groups <= drawn_groups"):
        groups_to_draw(8, 5, 3)
    with pytest.raises(ValueError, match="min_keep_rate"):
        groups_to_draw(8, 0, 0, min_keep_rate=0.0)


def test_overlong_filter():
    mask = b([True, True, False, True])
    out = overlong_filter(mask, torch.tensor([0, 0, 1, 1]), b([False, True]))
    assert out.tolist() == [True, True, False, False]


def test_soft_overlong_penalty():
    # L_max 20, cache 4: free up to 16, then linear to -1 at 20, -1 beyond
    out = soft_overlong_penalty(torch.tensor([10, 16, 17, 18, 20, 21]), max_len=20, cache_len=4)
    assert out.tolist() == [0.0, 0.0, -0.25, -0.5, -1.0, -1.0]
    with pytest.raises(ValueError, match="cache_len"):
        soft_overlong_penalty(torch.tensor([1]), max_len=4, cache_len=5)


def test_entropy_bonus():
    h = torch.tensor([0.5, 1.0], dtype=torch.float64, requires_grad=True)
    term = entropy_bonus(h, b([True, False]), 0.01)
    assert term.tolist() == [-0.005, 0.0]
    term.sum().backward()
    assert h.grad.tolist() == [-0.01, 0.0]
