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


# keys that other rules refuse unless the algorithm reads them
GUARD_CONTEXT = {"algo.value_lr": ["algo.advantage=gae"]}


def test_optim_lr_has_a_usual_range_and_a_documented_way_past_it():
    with pytest.raises(ConfigError) as err:
        load_config(TrainConfig, None, ["optim.lr=1e9"])
    assert str(err.value) == ("optim.lr=1000000000.0 is outside its usual range, a number in (0, 1]: a typo? If it is "
                              "meant, allow it with run.allow_unusual=[optim.lr]")
    assert load_config(TrainConfig, None, ["optim.lr=1e9", "run.allow_unusual=[optim.lr]"]).optim.lr == 1e9


def test_every_usual_range_refuses_its_examples_unless_allowed():
    """Each GUARDS rule: the default is usual; each example value is legal (CHECKS) but refused as unusual, naming
    the key and run.allow_unusual, and accepted once run.allow_unusual lists the key."""
    from rlalign.configlib import guarded_keys
    keys = guarded_keys(TrainConfig)
    assert len(keys) >= 7
    for key in keys:
        section, name = key.split(".")
        schema = type(getattr(TrainConfig(), section))
        rule = schema.GUARDS[name]
        assert rule.bad and rule.problem(key, getattr(schema(), name)) is None, f"the default of {key} must be usual"
        context = GUARD_CONTEXT.get(key, [])
        for value in rule.bad:
            assert schema.CHECKS[name].problem(key, value) is None, f"{key}={value!r} must be legal (CHECKS)"
            with pytest.raises(ConfigError) as err:
                load_config(TrainConfig, None, [*context, f"{key}={value!r}"])
            assert str(err.value).startswith(f"{key}={value!r} is outside its usual range") and \
                f"run.allow_unusual=[{key}]" in str(err.value)
            load_config(TrainConfig, None, [*context, f"{key}={value!r}", f"run.allow_unusual=[{key}]"])


def test_allow_unusual_names_only_keys_with_a_usual_range():
    with pytest.raises(ConfigError, match=r"run.allow_unusual names optim.lrr, which has no usual range; the keys "
                                          r"with one: .*optim.lr"):
        load_config(TrainConfig, None, ["run.allow_unusual=[optim.lrr]"])


@pytest.mark.parametrize("text,key,lines", [
    ("optim:\n  lr: 1e-3\n  warmup_steps: 2\n  lr: 1e-2\n", "lr", (2, 4)),
    ("optim:\n  lr: 1e-3\nrun:\n  steps: 3\noptim:\n  warmup_steps: 2\n", "optim", (1, 5)),
    ("run:\n  loggers: [jsonl]\n  steps: 3\n  steps: 4\n", "steps", (3, 4)),
])
def test_a_key_given_twice_is_an_error_naming_the_key_and_both_lines(tmp_path, text, key, lines):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(TrainConfig, path, [])
    assert str(err.value) == (f"config file {path}: key {key!r} appears twice in one mapping (lines {lines[0]} and "
                              f"{lines[1]}); keep one")


def test_yaml_merge_keys_may_still_override(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("base: &b {steps: 3, seed: 1}\nrun:\n  <<: *b\n  steps: 5\n")
    from rlalign.configlib import load_raw
    assert load_raw(path)["run"] == {"steps": 5, "seed": 1}


def test_a_yaml_syntax_error_is_one_line(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("optim:\n  lr: [1e-3\n")
    with pytest.raises(ConfigError) as err:
        load_config(TrainConfig, path, [])
    assert "\n" not in str(err.value) and str(err.value).startswith(f"config file {path} is not valid YAML: ")
    assert "at line 3, column 1" in str(err.value)


def test_the_cli_prints_a_duplicate_key_in_one_line(tmp_path, capsys):
    from rlalign.cli.main import main
    path = tmp_path / "c.yaml"
    path.write_text("optim:\n  lr: 1e-3\n  lr: 1e-2\n")
    assert main(["train", str(path), "--dry-run"]) == 2
    assert capsys.readouterr().err.strip() == (f"rlalign train: error: config file {path}: key 'lr' appears twice in "
                                               "one mapping (lines 2 and 3); keep one")
