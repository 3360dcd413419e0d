"""The Gated-DeltaNet ops (rlalign.ops.gated_delta): accuracy and gradients against transformers' pure-torch
recurrent rule in float64, the row invariance the chunking contract rests on (a row's bits do not depend on the rows
after it nor on the other chunks of the batch), and the one-line refusals."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

from rlalign.contract import spec
from rlalign.contract.errors import RLAlignError
from rlalign.contract.profiles import use_profile
from rlalign.ops import gated_delta as gd
from tests.bitwise import assert_bitwise_equal

qwen3_next = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")

C = spec.GDN_CHUNK


def _chunks(x: torch.Tensor, length: int) -> torch.Tensor:
    """[T, H, ...] -> [J, 1, H, C, ...] zero-padded to whole chunks."""
    j = -(-length // C)
    x = torch.cat([x, x.new_zeros((j * C - length,) + tuple(x.shape[1:]))])
    x = x.view(j, C, *x.shape[1:]).unsqueeze(1)
    return x.transpose(2, 3)


def _rule(q, k, v, g, beta):
    """Our rule over one sequence [T, H, ...] from a zero state -> [T, H, Dv] fp32."""
    t, h = q.shape[:2]
    q_hat = gd.l2_normalize(q) * q.shape[-1] ** -0.5
    k_hat = gd.l2_normalize(k)
    valid = (torch.arange(-(-t // C) * C) < t).view(-1, 1, C)
    out, *_ = gd.delta_chunks(_chunks(q_hat, t), _chunks(k_hat, t), _chunks(v, t), _chunks(g, t), _chunks(beta, t),
                             valid, torch.zeros(1, h, q.shape[-1], v.shape[-1]))
    return out.transpose(2, 3).reshape(-1, h, v.shape[-1])[:t]


def _inputs(t: int, seed: int, h: int = 2, dk: int = 8, dv: int = 6):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(t, h, dk, generator=gen), torch.randn(t, h, dk, generator=gen),
            torch.randn(t, h, dv, generator=gen), -torch.rand(t, h, generator=gen), torch.rand(t, h, generator=gen))


def _reference(q, k, v, g, beta):
    out, _ = qwen3_next.torch_recurrent_gated_delta_rule(*(x.double().unsqueeze(0) for x in (q, k, v, g, beta)),
                                                         use_qk_l2norm_in_kernel=True)
    return out[0]


@pytest.mark.parametrize("t", [1, C, C + 1, 2 * C + 9])
def test_rule_matches_transformers_recurrent_rule(t):
    inputs = _inputs(t, seed=t)
    ref = _reference(*inputs)
    err = (_rule(*inputs).double() - ref).abs().max().item()
    assert err <= 1e-5 * ref.abs().max().item()


def test_gradients_match_float64_autograd_of_the_reference():
    inputs = [x.requires_grad_() for x in _inputs(C + 11, seed=1, dk=4, dv=3)]
    weights = torch.randn(C + 11, 2, 3, generator=torch.Generator().manual_seed(2))
    ours = torch.autograd.grad((_rule(*inputs) * weights).sum(), inputs)
    ref_inputs = [x.detach().double().requires_grad_() for x in inputs]
    ref = torch.autograd.grad((_reference(*ref_inputs) * weights.double()).sum(), ref_inputs)
    for name, a, b in zip("q k v g beta".split(), ours, ref):
        err = (a.double() - b).abs().max().item()
        assert err <= 1e-4 * b.abs().max().item(), f"d{name}: max |diff| {err:.3g} vs {b.abs().max().item():.3g}"


@settings(max_examples=25, deadline=None)
@given(rows=st.lists(st.integers(1, C), min_size=1, max_size=3), seed=st.integers(0, 2**16), data=st.data())
def test_a_row_does_not_depend_on_later_rows_or_the_batch(rows, seed, data):
    """Items with n valid rows (the rest padded with zeros) give rows < n the bits of the same chunk computed with
    all C rows present, batched with other items or alone, from the same state -- and so do rows first..n-1 computed
    from the earlier rows' Gamma and U handed back (``known``, a decode step's path)."""
    b, h, dk, dv = len(rows), 2, 4, 5
    gen = torch.Generator().manual_seed(seed)
    q, k = gd.l2_normalize(torch.randn(1, b, h, C, dk, generator=gen)), gd.l2_normalize(torch.randn(1, b, h, C, dk,
                                                                                                      generator=gen))
    v, g, beta = torch.randn(1, b, h, C, dv, generator=gen), -torch.rand(1, b, h, C, generator=gen), \
        torch.rand(1, b, h, C, generator=gen)
    state = torch.randn(b, h, dk, dv, generator=gen)
    full, _, gamma, u = gd.delta_chunks(q, k, v, g, beta, torch.ones(1, b, C, dtype=torch.bool), state)
    valid = torch.arange(C).view(1, 1, C) < torch.tensor(rows).view(1, b, 1)

    def pad(x):
        mask = valid.view(1, b, 1, C, *([1] * (x.dim() - 4)))
        return torch.where(mask, x, 0.0)

    part, _, part_gamma, part_u = gd.delta_chunks(pad(q), pad(k), pad(v), pad(g), pad(beta), valid, state)
    first = data.draw(st.integers(0, min(rows) - 1), label="first")
    resumed, *_ = gd.delta_chunks(pad(q), pad(k), pad(v), pad(g), pad(beta), valid, state,
                                  known=(first, part_gamma, part_u))
    for i, n in enumerate(rows):
        assert_bitwise_equal(part[0, i, :, :n], full[0, i, :, :n], f"item {i}, {n} rows vs all rows")
        assert_bitwise_equal(part_u[0, i, :, :n], u[0, i, :, :n], f"item {i}: U rows")
        assert_bitwise_equal(resumed[0, i, :, first:n], full[0, i, :, first:n], f"item {i}: rows from {first} on")
        alone, *_ = gd.delta_chunks(*(pad(x)[:, i:i + 1] for x in (q, k, v, g, beta)), valid[:, i:i + 1],
                                    state[i:i + 1])
        assert_bitwise_equal(alone[0, 0, :, :n], full[0, i, :, :n], f"item {i} alone vs batched")


def test_short_conv_matches_conv1d():
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(1, 6, 20, generator=gen), torch.randn(6, 1, 4, generator=gen)
    ref = F.silu(F.conv1d(x.double(), w.double(), padding=3, groups=6)[..., :20])[0].t()
    # tap t of token p: the input at p - 3 + t (zeros before the start)
    taps = torch.stack([F.pad(x[0], (3 - t, 0))[:, :20] for t in range(4)], dim=0).permute(2, 0, 1)
    got = gd.short_conv(taps, w.squeeze(1))
    assert (got.double() - ref).abs().max().item() <= 1e-6 * ref.abs().max().item()


def test_refusals_are_one_line():
    x = torch.zeros(2, 4, 3)
    with use_profile("native"), pytest.raises(RLAlignError, match="native profile has no Gated-DeltaNet route"):
        gd.short_conv(x, torch.zeros(3, 4))
    with pytest.raises(RLAlignError, match="run on the CPU or CUDA"):
        gd.short_conv(x.to("meta"), torch.zeros(3, 4, device="meta"))
    with pytest.raises(RLAlignError, match=f"chunks must have spec.GDN_CHUNK={C} rows"):
        z = torch.zeros(1, 1, 1, 8, 2)
        gd.delta_chunks(z, z, z, z[..., 0], z[..., 0], torch.ones(1, 1, 8, dtype=torch.bool), torch.zeros(1, 1, 2, 2))
