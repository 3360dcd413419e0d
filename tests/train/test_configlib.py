import dataclasses
from typing import Literal

import pytest

from rlalign.configlib import ConfigError, load_config


@dataclasses.dataclass
class Algo:
    kl_coef: float = 0.0
    loss_agg: Literal["token-mean", "seq-mean-token-sum"] = "token-mean"
    clip_high: float | None = None


@dataclasses.dataclass
class Run:
    dir: str = "runs/x"
    steps: int = 10
    resume: bool = False


@dataclasses.dataclass
class Cfg:
    algo: Algo = dataclasses.field(default_factory=Algo)
    run: Run = dataclasses.field(default_factory=Run)


def test_yaml_and_overrides(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("algo:\n  kl_coef: 0.1\nrun:\n  steps: 3\n")
    cfg = load_config(Cfg, f, ["algo.kl_coef=0.01", "run.dir=somewhere", "algo.clip_high=0.28", "run.resume=true"])
    assert cfg.algo.kl_coef == 0.01 and cfg.run.steps == 3 and cfg.run.dir == "somewhere"
    assert cfg.algo.clip_high == 0.28 and cfg.run.resume is True


@pytest.mark.parametrize("override, message", [
    (["algo.kl_coeff=0.1"], "unknown config key algo.kl_coeff; did you mean algo.kl_coef"),
    (["rn.steps=3"], "unknown config key rn; did you mean run"),
    (["run.steps=three"], "run.steps must be an integer, got 'three'"),
    (["run.resume=1"], "run.resume must be true or false"),
    (["algo.loss_agg=token_mean"], "algo.loss_agg must be one of ['token-mean', 'seq-mean-token-sum'], got 'token_mean' (did you mean 'token-mean'?)"),
    (["steps"], "is not of the form section.key=value"),
])
def test_bad_keys_and_values_name_the_field(override, message):
    with pytest.raises(ConfigError) as err:
        load_config(Cfg, None, override)
    assert message in str(err.value)


def test_missing_and_invalid_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(Cfg, tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("algo: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(Cfg, bad)
