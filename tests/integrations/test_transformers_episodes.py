"""The transformers patch on multi-turn episodes: a patched Hugging Face model's log-probs of every token the
rollout engine generated in an episode equal the engine's (and so the trainer's) bit for bit -- what a TRL user's
trainer computes on the episodes rlalign's engine played."""

from __future__ import annotations

import hashlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlalign.contract import use_profile
from rlalign.envs import Env, EpisodeLimits, StepResult, run_episodes
from rlalign.models import load_model
from rlalign.models.testing import make_tiny_checkpoint
from rlalign.rollout import RolloutConfig, RolloutEngine, SamplingParams
from tests.bitwise import assert_bitwise_equal

transformers = pytest.importorskip("transformers")

from rlalign.integrations.transformers import from_pretrained, token_logprobs  # noqa: E402


class Feedback(Env):
    """Answers each turn with ``obs_len`` ids derived from it, for ``turns`` turns."""

    def __init__(self, turns, obs_len):
        self.turns, self.obs_len = turns, obs_len

    def step(self, turn):
        if turn.index + 1 >= self.turns:
            return StepResult(None, 1.0, True)
        digest = hashlib.blake2b(str(turn.token_ids).encode(), digest_size=32).digest()
        return StepResult([3 + b for b in digest[:self.obs_len]], 0.0, False)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    transformers.utils.logging.set_verbosity_error()
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("episodes") / "qwen3", family="qwen3", norm_jitter=0.1)
    return load_model(path)[0], from_pretrained(path)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(turns=st.integers(1, 4), obs_len=st.integers(0, 9), n=st.integers(1, 3), page_size=st.sampled_from([1, 4, 16]),
       seed=st.integers(0, 2**16), left=st.booleans())
def test_patched_forward_equals_the_engine_on_episodes(models, turns, obs_len, n, page_size, seed, left):
    rl, hf = models
    engine = RolloutEngine(rl, RolloutConfig(page_size=page_size, num_pages=512))
    prompts = [[5 + (seed + i * 7) % 300 for i in range(3 + k * 5)] for k in range(2)]
    with use_profile("strict"):
        episodes = run_episodes(engine, None, prompts, [None, None], lambda: Feedback(turns, obs_len),
                                SamplingParams(n=n, temperature=1.0, seed=seed, stop_token_ids=range(40, 60)),
                                EpisodeLimits(turns, 40, 6))
    seqs = [e.prompt_tokens + e.tokens for e in episodes]
    width = max(map(len, seqs))
    ids = torch.zeros((len(seqs), width), dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):   # padded as a Hugging Face trainer's collator does, left or right
        cols = slice(width - len(s), width) if left else slice(0, len(s))
        ids[i, cols], mask[i, cols] = torch.tensor(s), 1
    with torch.no_grad():
        out = token_logprobs(hf, ids, mask)
    for i, e in enumerate(episodes):
        start = (width - len(seqs[i]) if left else 0) + len(e.prompt_tokens) - 1   # the row predicting tokens[0]
        rows = out.logprobs[i, start:start + len(e.tokens)]
        generated = torch.tensor(e.generated, dtype=torch.bool)
        assert_bitwise_equal(rows[generated], torch.tensor(e.logprobs, dtype=torch.float32)[generated],
                             f"episode {i}: patched transformers vs engine")
