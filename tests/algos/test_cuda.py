"""On CUDA: every algorithm gives the CPU result (to rounding) and the same bits run to run."""

import pytest
import torch

import rlalign.algos as A
from tests.bitwise import assert_bitwise_equal, assert_close_report

pytestmark = pytest.mark.cuda


def _inputs(device):
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 40, (24,), generator=gen)
    seq = A.seq_ids_from_lengths(lengths)
    t = seq.numel()
    mask = torch.rand(t, generator=gen) < 0.8
    lp = -torch.rand(t, generator=gen) * 3
    old = lp + 0.1 * torch.randn(t, generator=gen)
    rollout = old + 0.05 * torch.randn(t, generator=gen)
    rewards = (torch.rand(24, generator=gen) < 0.5).float()
    groups = torch.arange(24) // 4
    values = torch.randn(t, generator=gen)
    cpu = dict(seq=seq, mask=mask, lp=lp, old=old, rollout=rollout, rewards=rewards, groups=groups,
               values=values)
    return {k: v.to(device) for k, v in cpu.items()}


def _run_all(x):
    adv_seq = A.grpo_advantages(x["rewards"], x["groups"])
    adv = A.expand_to_tokens(adv_seq, x["seq"], x["mask"])
    tok_r = A.token_rewards(x["rewards"], x["seq"], x["mask"], kl=A.kl_k1(x["old"], x["lp"]), kl_coef=0.1)
    gae, ret = A.gae_advantages(tok_r, x["values"], x["seq"], x["mask"], gamma=0.99, lam=0.95)
    rpp, _ = A.reinforce_pp_advantages(x["rewards"], x["seq"], x["mask"], group_ids=x["groups"])
    lp = x["lp"].clone().requires_grad_()
    ppo = A.ppo_clip_loss(lp, x["old"], adv, x["mask"], clip_high=0.28, clip_c=3.0)
    gspo = A.gspo_loss(lp, x["old"], adv, x["mask"], x["seq"])
    cispo = A.cispo_loss(lp, x["old"], adv, x["mask"])
    tis = A.sequence_tis(x["old"], x["rollout"], x["mask"], x["seq"])
    total = sum(A.aggregate_loss(o.loss, x["mask"], x["seq"], mode, max_len=64)
                for o, mode in ((ppo, "token-mean"), (gspo, "seq-mean-token-mean"), (cispo, "seq-mean-token-sum")))
    total.backward()
    return {"grpo": adv_seq, "rloo": A.rloo_advantages(x["rewards"], x["groups"]), "gae": gae, "ret": ret,
            "rpp": rpp, "ppo": ppo.loss.detach(), "gspo": gspo.loss.detach(), "cispo": cispo.loss.detach(),
            "total": total.detach(), "grad": lp.grad, "tis": tis.weights,
            "kl": A.logprob_mismatch_stats(x["old"], x["rollout"], x["mask"])["kl_k3"]}


def test_cuda_matches_cpu_and_is_deterministic():
    cpu = _run_all(_inputs("cpu"))
    first, second = _run_all(_inputs("cuda")), _run_all(_inputs("cuda"))
    for name in cpu:
        assert_bitwise_equal(first[name], second[name], what=f"{name} run to run")
        assert_close_report(first[name].cpu(), cpu[name], atol=1e-5, rtol=1e-5, what=f"{name} cuda vs cpu")
