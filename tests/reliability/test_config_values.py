"""Every config field has a value rule, and every value a rule refuses fails at load with the key named."""

import dataclasses

import pytest

from rlalign.configlib import ConfigError, build, load_config
from rlalign.train.config import TrainConfig


def _fields():
    """(section or '', field name, schema) for every leaf field of TrainConfig."""
    for f in dataclasses.fields(TrainConfig):
        if dataclasses.is_dataclass(f.default_factory if f.default_factory is not dataclasses.MISSING else None):
            section = f.default_factory
            for g in dataclasses.fields(section):
                yield f.name, g.name, section
        else:
            yield "", f.name, TrainConfig


FIELDS = list(_fields())


@pytest.mark.parametrize("section,name,schema", FIELDS, ids=[f"{s}.{n}".lstrip(".") for s, n, _ in FIELDS])
def test_every_field_has_a_rule_and_its_bad_values_fail_with_the_key(section, name, schema):
    rule = getattr(schema, "CHECKS", {}).get(name)
    assert rule is not None, f"{schema.__name__}.CHECKS has no rule for {name}: declare one next to the field"
    assert rule.bad, f"the rule of {name} lists no value it refuses"
    key = f"{section}.{name}" if section else name
    default = getattr(schema(), name)
    assert rule.problem(key, default) is None, f"the default {default!r} of {key} breaks its own rule"
    for value in rule.bad:
        raw = {section: {name: value}} if section else {name: value}
        with pytest.raises(ConfigError) as err:
            build(TrainConfig, raw, prefix="")
        assert key in str(err.value) and "\n" not in str(err.value), (value, str(err.value))


@pytest.mark.parametrize("override,expected", [
    ("run.checkpoint_every=0", "run.checkpoint_every must be an integer >= 1, got 0"),
    ("run.eval_every=0", "run.eval_every must be an integer >= 1"),
    ("optim.lr=-1e-3", "optim.lr must be a finite number > 0"),
    ("optim.lr=.nan", "optim.lr must be a finite number > 0, got nan"),
    ("optim.betas=[0.9,1.0]", "optim.betas must be two numbers in [0, 1)"),
    ("optim.betas=[0.9]", "optim.betas must be two numbers in [0, 1)"),
    ("optim.weight_decay=-0.1", "optim.weight_decay must be a finite number >= 0"),
    ("optim.grad_clip=-1", "optim.grad_clip must be a finite number > 0"),
    ("algo.clip_low=-0.1", "algo.clip_low must be a number in [0, 1)"),
    ("task.min_digits=5", "task.min_digits (5) must be <= max_digits (3)"),
    ("task.eval_fraction=0", "task.eval_fraction must be a number in (0, 1)"),
    ("task.eval_fraction=1.5", "task.eval_fraction must be a number in (0, 1)"),
    ("algo.ppo_epochs=0", "algo.ppo_epochs must be an integer >= 1"),
    ("rollout.samples_per_prompt=1", "rollout.samples_per_prompt=1 every advantage is 0"),
    ("run.steps=0", "run.steps must be an integer >= 1"),
    ("run.steps=-3", "run.steps must be an integer >= 1"),
    ("run.max_minutes=0", "run.max_minutes must be a finite number > 0"),
    ("rollout.prompts_per_step=100000000", "samples_per_prompt (per step) = 800000000 sequences would take about"),
    ("task.eval_size=1000000000", "run.eval_samples (per evaluation) = 2000000000 sequences would take about"),
    ("rollout.max_new_tokens=1000000000", "sequences would take about"),
    ("run.resume=true run.overwrite=true", "choose one"),
])
def test_issue_cases_fail_at_load_with_one_line(override, expected):
    with pytest.raises(ConfigError) as err:
        load_config(TrainConfig, None, override.split())
    assert expected in str(err.value) and "\n" not in str(err.value)


def test_one_sample_per_prompt_is_fine_without_a_group_baseline():
    cfg = load_config(TrainConfig, None, ["rollout.samples_per_prompt=1", "algo.advantage=reinforce_pp"])
    assert cfg.rollout.samples_per_prompt == 1


def test_shipped_configs_pass_the_rules():
    from pathlib import Path
    for path in sorted(Path("configs").glob("*.yaml")):
        load_config(TrainConfig, path, [])
