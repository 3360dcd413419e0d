from pathlib import Path

import pytest

from rlalign.configlib import load_config
from rlalign.train.config import TrainConfig

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_example_configs_validate(path):
    load_config(TrainConfig, path)


def test_default_yaml_is_the_no_argument_default():
    default = [p for p in CONFIGS if p.name == "default.yaml"][0]
    assert load_config(TrainConfig, default) == TrainConfig()
