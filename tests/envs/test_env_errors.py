"""A broken env is one EnvError line; task.env loads built-ins, modules and files; refused combinations."""

from __future__ import annotations

import math

import pytest

from rlalign.configlib import ConfigError, load_config
from rlalign.envs import Env, EnvError, EpisodeLimits, RetryArithmeticEnv, StepResult, env_class, load_env, run_episodes
from rlalign.models.testing import tiny_model
from rlalign.rollout import RolloutConfig, RolloutEngine, SamplingParams
from rlalign.train.config import TrainConfig


@pytest.fixture(scope="module")
def engine():
    return RolloutEngine(tiny_model("qwen3", seed=1), RolloutConfig(page_size=4, num_pages=64))


class Answers(Env):
    def __init__(self, answer):
        self.answer = answer

    def step(self, turn):
        return self.answer() if callable(self.answer) else self.answer


def _raise():
    raise KeyError("boom")


@pytest.mark.parametrize("answer, message", [
    (_raise, "Answers.step raised KeyError: 'boom'"),
    ({"done": True}, "Answers.step returned dict, expected a StepResult"),
    (StepResult(None, math.nan, True), "Answers.step gave the reward nan, expected a finite float"),
    (StepResult(None, "high", True), "Answers.step gave a reward of type str, expected a float"),
    (StepResult([5, 320], 0.0, False), "Answers.step returned observation token id 320, outside the vocabulary"),
    (StepResult(3.5, 0.0, False), "Answers.step returned an observation of type float"),
    (StepResult("text", 0.0, False), "Answers.step returned a text observation but the episodes run without a "
                                     "tokenizer"),
])
def test_a_broken_env_is_one_line(engine, answer, message):
    with pytest.raises(EnvError) as info:
        run_episodes(engine, None, [[5, 6, 7]], [None], lambda: Answers(answer), SamplingParams(n=2, seed=1),
                     EpisodeLimits(3, 20, 4))
    assert str(info.value).startswith(message) and "\n" not in str(info.value)
    assert not engine.has_unfinished()   # the engine is left idle


def test_an_engine_that_cannot_continue_is_refused():
    class OtherEngine:   # no generate(prompts, sampling, prompt_indices=) and no model_config
        def complete(self, prompts):
            raise AssertionError("not reached")
    with pytest.raises(EnvError, match="multi-turn episodes run on rlalign's RolloutEngine or the vLLM engine; "
                                       "OtherEngine cannot"):
        run_episodes(OtherEngine(), None, [[1]], [None], Env, SamplingParams(), EpisodeLimits(1, 1, 1))


def test_limits_are_checked():
    with pytest.raises(ValueError, match="max_turns must be >= 1"):
        EpisodeLimits(0, 5, 5)


ENV_FILE = '''
from rlalign.envs import Env, StepResult

class Echo(Env):
    def __init__(self, reward=1.0):
        self.reward = reward

    def step(self, turn):
        return StepResult(None, self.reward, True)

class NoStep:
    def __init__(self):
        pass
'''


def test_load_env_from_names_modules_and_files(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_env.py").write_text(ENV_FILE)
    assert env_class("retry_arithmetic") is RetryArithmeticEnv
    assert load_env("my_env.py:Echo", {"reward": 2.0})().reward == 2.0
    assert type(load_env("rlalign.envs.builtin:CalculatorEnv", {"tool_timeout_s": 2})()).__name__ == "CalculatorEnv"
    for spec, args, message in [
            ("nope", {}, "env 'nope': not a built-in name (retry_arithmetic, calculator) and not of the form"),
            ("missing.py:Echo", {}, "env 'missing.py:Echo': file 'missing.py' not found"),
            ("my_env.py:Nope", {}, "env 'my_env.py:Nope': 'my_env.py' has no attribute 'Nope'"),
            ("my_env.py:Echo", {"rewrd": 1}, "env 'my_env.py:Echo': Echo(**{'rewrd': 1}) raised TypeError"),
            ("my_env.py:NoStep", {}, "env 'my_env.py:NoStep': NoStep has no reset, step, final_reward method"),
            ("no_such_module_xyz:Env", {}, "env 'no_such_module_xyz:Env': module 'no_such_module_xyz' not found")]:
        with pytest.raises(EnvError) as info:
            load_env(spec, args)
        assert str(info.value).startswith(message), str(info.value)


@pytest.mark.parametrize("overrides, message", [
    (["task.env=retry_arithmetic", "task.reward=gsm8k"], "task.reward and rewards are not read with task.env"),
    (["task.env=retry_arithmetic", "parallel.dp=2"], "task.env runs with launcher=local and parallel.dp=1"),
    (["algo.turn_advantage=turn"], r"algo.turn_advantage=turn needs multi-turn episodes \(task.env\)"),
    (["task.env=retry_arithmetic", "algo.turn_advantage=turn", "algo.kl_coef=0.1", "algo.kl_in_reward=true"],
     "algo.turn_advantage=turn does not fold the KL penalty into the turns' returns yet"),
    (["task.env=retry_arithmetic", "algo.turn_advantage=turn", "algo.advantage=reinforce_pp"],
     "turn_advantage='turn' has no effect with algo.advantage=reinforce_pp \\(only grpo, dr_grpo, rloo read it\\)"),
    (["task.env=retry_arithmetic", "task.max_turns=0"], "task.max_turns must be"),
    (["task.env=retry_arithmetic", "task.env_args=3"], "task.env_args must be a mapping"),
])
def test_config_refusals(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(TrainConfig, None, overrides)


def test_the_vllm_engine_is_refused_for_episodes():
    """rollout.engine=vllm (registered by rlalign.integrations) with task.env: the config's one line."""
    cfg = load_config(TrainConfig, None, ["task.env=retry_arithmetic"])
    cfg.rollout.engine = "vllm"
    assert cfg.validate() == ("task.env in rlalign train needs rollout.engine=rlalign (got vllm); the vLLM engine runs "
                              "episodes from Python through rlalign.envs.run_episodes")


def test_a_run_directory_never_chooses_an_env_to_run(tmp_path, monkeypatch):
    from rlalign.train.run.config_file import resolve_train_config, run_inputs, write_run_config

    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_env.py").write_text(ENV_FILE)
    run = tmp_path / "run"
    run.mkdir()
    cfg = load_config(TrainConfig, None, ["task.env=my_env.py:Echo", f"run.dir={run}"])
    assert (tmp_path / "my_env.py").name in {p.name for p in run_inputs(cfg)}
    write_run_config(run, cfg)
    with pytest.raises(ConfigError, match=r"task.env=my_env.py:Echo is code, and only .*config.yaml names it"):
        resolve_train_config(None, [f"run.dir={run}", "run.resume=true"])
    again = resolve_train_config(None, [f"run.dir={run}", "run.resume=true", "task.env=my_env.py:Echo"])
    assert again.task.env == "my_env.py:Echo"
    assert resolve_train_config(None, [f"run.dir={run}", "run.resume=true", "task.env=retry_arithmetic"]).task.env \
        == "retry_arithmetic"
    (run / "inside.py").write_text(ENV_FILE)
    with pytest.raises(ConfigError, match="the file lies inside run.dir .* keep the env file outside it"):
        resolve_train_config(None, [f"run.dir={run}", f"task.env={run / 'inside.py'}:Echo"])
