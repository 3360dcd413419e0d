"""Fixtures shared by the engine's bitwise tests (a module may define its own ``model``)."""

import pytest

from rlalign.models.testing import tiny_model
from tests.rollout.test_engine_bitwise import make_prompts


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen3", seed=3, init_std=0.1)


@pytest.fixture(scope="module")
def prompts():
    return make_prompts(0)
