from pathlib import Path

import pytest

from rlalign.configlib import load_config
from rlalign.train.config import TrainConfig
from rlalign.train.sft.config import SFTConfig

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_example_configs_validate(path):
    load_config(SFTConfig if path.name.startswith("sft-") else TrainConfig, path)   # sft-*.yaml: rlalign sft


def test_default_yaml_is_the_no_argument_default():
    default = [p for p in CONFIGS if p.name == "default.yaml"][0]
    assert load_config(TrainConfig, default) == TrainConfig()


@pytest.mark.parametrize("value", ["auto", "on", "off"])
def test_on_off_values_stay_strings_on_the_command_line_and_in_files(tmp_path, value):
    """YAML 1.1 reads on/off/yes/no as booleans; the documented ``rollout.decode_graphs=off`` failed with
    "must be a string, got False". Config YAML has the 1.2 booleans (true/false only)."""
    cfg = load_config(TrainConfig, None, [f"rollout.decode_graphs={value}", f"rollout.overlap={value}"])
    assert (cfg.rollout.decode_graphs, cfg.rollout.overlap) == (value, value)
    path = tmp_path / "c.yaml"
    path.write_text(f"rollout:\n  decode_graphs: {value}\n  overlap: {value}\n")
    cfg = load_config(TrainConfig, path)
    assert (cfg.rollout.decode_graphs, cfg.rollout.overlap) == (value, value)
    assert load_config(TrainConfig, None, ["run.resume=true"]).run.resume is True


def test_config_yaml_has_only_the_1_2_booleans():
    """Every YAML 1.1 boolean spelling other than true/false stays a string (the class of the on/off bug)."""
    from rlalign.configlib import load_yaml
    for word in ("on", "off", "On", "OFF", "yes", "no", "Yes", "NO", "y", "n", "Y", "N"):
        assert load_yaml(f"k: {word}") == {"k": word}, word
    for word, value in (("true", True), ("True", True), ("TRUE", True), ("false", False), ("False", False),
                        ("FALSE", False)):
        assert load_yaml(f"k: {word}") == {"k": value}, word
