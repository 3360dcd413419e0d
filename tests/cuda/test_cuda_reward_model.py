"""A reward model on the GPU (strict, Triton): a sample's score has the same bits whatever batch, order or
micro-batch budget it is scored in, in bf16 and fp32, and agrees with transformers' forward on the same card."""

import random

import pytest
import torch

from rlalign.contract.bits import bits_equal, describe_difference
from rlalign.models.testing import make_tiny_reward_model
from rlalign.tasks.reward_model import RewardModel

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_cuda_reward_model_scores_are_batch_invariant(triton_backend, tmp_path, dtype):
    rm = RewardModel(make_tiny_reward_model(tmp_path / "rm", "qwen3", seed=3), device="cuda", dtype=dtype)
    rng = random.Random(0)
    seqs = [[rng.randrange(1, 320) for _ in range(rng.randrange(1, 200))] for _ in range(64)]
    alone = torch.tensor([rm.score_tokens([s])[0] for s in seqs])
    for budget in (1, 257, 4096):
        order = list(range(len(seqs)))
        rng.shuffle(order)
        rm.micro_batch_tokens = budget
        together = torch.tensor(rm.score_tokens([seqs[i] + [0] * rng.randrange(3) for i in order]))
        back = torch.empty_like(together)
        back[torch.tensor(order)] = together
        assert bits_equal(alone, back), (budget, describe_difference(alone, back))


def test_cuda_reward_model_agrees_with_transformers(triton_backend, tmp_path):
    transformers = pytest.importorskip("transformers")
    directory = make_tiny_reward_model(tmp_path / "rm", "llama", seed=3)
    ref = transformers.AutoModelForSequenceClassification.from_pretrained(directory, dtype=torch.float32).cuda().eval()
    seqs = [[5, 9, 17, 33, 2], [40, 41], [7, 8, 9, 0, 11]]
    width = max(map(len, seqs))
    ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs], device="cuda")
    mask = (torch.arange(width, device="cuda")[None] < torch.tensor([len(s) for s in seqs], device="cuda")[:, None])
    with torch.no_grad():
        expected = ref(input_ids=ids, attention_mask=mask.long()).logits[:, 0].cpu()
    got = torch.tensor(RewardModel(directory, device="cuda").score_tokens(seqs))
    torch.testing.assert_close(got, expected, rtol=1e-3, atol=1e-3)
