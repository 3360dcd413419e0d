"""Weighted reward terms (rule rewards in worker processes, reward models on the device), batched rewards with
TRL's signature, and the task.rewards config: values, order of combination, one-line errors."""

import math

import pytest
from hypothesis import given, strategies as st

from rlalign.configlib import ConfigError, load_config
from rlalign.models.testing import make_tiny_reward_model
from rlalign.tasks import RewardError, RewardLoadError, RewardWorker, load_reward, score
from rlalign.tasks.reward_model import RewardModel
from rlalign.tasks.reward_set import RewardSet
from rlalign.tasks.reward_terms import RewardTerm, combine, parse_terms
from rlalign.train.config import TrainConfig

REWARDS = '''
import time

def length(prompt, completion, answer):
    return float(len(completion))

def batch_match(prompts, completions, answer, level):
    return [float(c == a) + 0.5 * lv for c, a, lv in zip(completions, answer, level)]

def batch_everything(prompts, completions, **columns):
    return [float(len(columns)) for _ in prompts]

def batch_short(prompts, completions, **columns):
    return [1.0]

def batch_hangs(prompts, completions, **columns):
    time.sleep(600)
'''

PROMPTS, COMPLETIONS, ANSWERS = ["1+1=", "2+2=", "3+3="], ["2", "5", "6"], ["2", "4", "6"]
EXTRAS = [{"level": 1}, {"level": 0}, {"level": 2}]


@pytest.fixture(scope="module")
def reward_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("rewards") / "batch_rewards.py"
    path.write_text(REWARDS)
    return path


floats = st.floats(-1e6, 1e6, allow_nan=False)


@given(st.lists(floats, min_size=1, max_size=4).flatmap(
    lambda w: st.tuples(st.just(w), st.lists(st.lists(floats, min_size=3, max_size=3), min_size=len(w),
                                             max_size=len(w)))))
def test_combine_is_the_weighted_sum_in_term_order(case):
    weights, values = case
    expected = []
    for s in range(3):
        total = 0.0
        for w, v in zip(weights, values):
            total += w * v[s]
        expected.append(total)
    got = combine(values, weights)
    assert got == (values[0] if weights == [1.0] else expected)


def test_batched_rewards_get_columns_and_match_in_process_scores(reward_file):
    spec = f"{reward_file}:batch_match"
    in_process = score(load_reward(spec), PROMPTS, COMPLETIONS, ANSWERS, EXTRAS)
    assert in_process == [1.5, 0.0, 2.0]
    with RewardWorker(spec) as worker:
        assert worker.batched and worker.score(PROMPTS, COMPLETIONS, ANSWERS, EXTRAS) == in_process
    assert score(load_reward(f"{reward_file}:batch_everything"), PROMPTS, COMPLETIONS, ANSWERS, EXTRAS) == [2.0] * 3
    with pytest.raises(RewardError, match=r"on a batch of 3 samples \(first prompt '1\+1='\) returned 1 values for 3"):
        score(load_reward(f"{reward_file}:batch_short"), PROMPTS, COMPLETIONS, ANSWERS, EXTRAS)


def test_a_hanging_batched_reward_is_stopped_naming_the_batch(reward_file):
    with RewardWorker(f"{reward_file}:batch_hangs", timeout_s=1.0) as worker:
        with pytest.raises(RewardError, match=r"batch_hangs on a batch of 3 samples .* did not return within "
                                              r"task.reward_timeout_s=1 s"):
            worker.score(PROMPTS, COMPLETIONS, ANSWERS, EXTRAS)


def test_rule_and_model_terms_combine_with_weights(reward_file, tmp_path):
    rm_dir = make_tiny_reward_model(tmp_path / "rm", "qwen3", seed=1)
    terms = parse_terms([{"name": f"{reward_file}:length", "weight": 0.5}, {"reward_model": str(rm_dir), "weight": -2},
                         {"name": f"{reward_file}:batch_match"}])
    conversations = [[{"role": "user", "content": p}] for p in PROMPTS]
    rm_values = RewardModel(rm_dir).score(PROMPTS, COMPLETIONS, conversations)
    rewards = RewardSet(terms, timeout_s=30)
    try:
        assert rewards.take_term_means() == {}
        parts = rewards.components(PROMPTS, COMPLETIONS, ANSWERS, EXTRAS, conversations)
        assert parts == [[1.0, 1.0, 1.0], rm_values, [1.5, 0.0, 2.0]]
        total = rewards.score(PROMPTS, COMPLETIONS, ANSWERS, EXTRAS, conversations)
        assert total == [0.0 + 0.5 * a + -2.0 * b + 1.0 * c for a, b, c in zip(*parts)]
        assert all(math.isfinite(x) for x in total)
        means = rewards.take_term_means()   # components() alone records nothing; score() does
        assert list(means) == ["reward/term0_length", "reward/term1_rm", "reward/term2_batch_match"]
        assert means["reward/term2_batch_match"] == sum(parts[2]) / 3 and rewards.take_term_means() == {}
    finally:
        rewards.close()


@pytest.mark.parametrize("override, message", [
    ("task.rewards=[{name: gsm8k, wieght: 1}]", r"task.rewards\[0\] has unknown key\(s\) wieght"),
    ("task.rewards=[{weight: 1}]", r"task.rewards\[0\] needs exactly one of name .* or reward_model"),
    ("task.rewards=[{name: gsm8k, reward_model: /x}]", r"needs exactly one of name"),
    ("task.rewards=[{name: gsm8k, weight: .nan}]", r"task.rewards\[0\] weight must be a finite number"),
    ("task.rewards=[{name: gsm8k, dtype: float32}]", r"dtype and micro_batch_tokens apply to a reward_model entry"),
    ("task.rewards=[{reward_model: /x, dtype: float16}]", r"dtype must be one of float32, bfloat16"),
    ("task.rewards=[gsm8k]", r"task.rewards must be a list of mappings"),
])
def test_bad_reward_terms_are_one_line(override, message):
    with pytest.raises(ConfigError, match=message) as err:
        load_config(TrainConfig, None, [override])
    assert "\n" not in str(err.value)


def test_task_reward_and_task_rewards_are_exclusive():
    with pytest.raises(ConfigError, match="set task.reward .* or task.rewards .*, not both"):
        load_config(TrainConfig, None, ["task.reward=gsm8k", "task.rewards=[{name: gsm8k}]"])
    cfg = load_config(TrainConfig, None, ["task.rewards=[{name: arithmetic, weight: 2}]"])
    assert parse_terms(cfg.task.rewards) == [RewardTerm(weight=2.0, name="arithmetic")]


def test_an_unloadable_reward_model_fails_before_training(tmp_path):
    with pytest.raises(RewardLoadError, match="not a directory"):
        RewardSet(parse_terms([{"name": "gsm8k"}, {"reward_model": str(tmp_path / "none")}]), timeout_s=5)


def test_a_run_trains_on_a_csv_with_a_rule_reward_and_a_reward_model(tmp_path):
    from rlalign.models.testing import make_tiny_checkpoint
    from rlalign.train.loop import run_training
    from rlalign.train.run.metrics import read_metrics

    policy = make_tiny_checkpoint(tmp_path / "policy", "qwen3", seed=2)
    rm_dir = make_tiny_reward_model(tmp_path / "rm", "llama", seed=4)
    data = tmp_path / "gsm8k_style.csv"
    data.write_text("question,answer,level\n" + "".join(f"What is {a} + {a}?,#### {2 * a},{a % 3}\n" for a in range(8)))
    overrides = [f"model.path={policy}", f"run.dir={tmp_path / 'run'}", "run.steps=1", "run.progress=false",
                 "task.name=dataset", f"task.path={data}", "task.columns={prompt: question}", "task.chat=true",
                 f"task.rewards=[{{name: math, weight: 1.0}}, {{reward_model: {rm_dir}, weight: 0.25}}]",
                 "task.eval_size=1", "task.shuffle=true", "run.eval_samples=1", "rollout.prompts_per_step=2",
                 "rollout.samples_per_prompt=2", "rollout.max_new_tokens=3", "optim.micro_batch_tokens=256"]
    run_dir = run_training(load_config(TrainConfig, None, overrides))
    step = next(r for r in read_metrics(run_dir) if "reward/mean" in r)
    assert step["mismatch/count"] == 0 and step["mismatch/tokens"] > 0
    total = step["reward/mean"] * 4   # four samples: a math reward in {0, 1} plus 0.25 x a reward model's score
    assert math.isfinite(total) and abs(total - round(total)) > 1e-6
    terms = {k: v for k, v in step.items() if k.startswith("reward/term")}
    assert sorted(terms) == ["reward/term0_math", "reward/term1_rm"]
    assert math.isclose(step["reward/mean"], terms["reward/term0_math"] + 0.25 * terms["reward/term1_rm"],
                        rel_tol=1e-5, abs_tol=1e-6)
