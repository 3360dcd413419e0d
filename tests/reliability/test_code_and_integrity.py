"""No file we read runs code or is trusted unverified: reward code named only by a run directory, checkpoints
exported without their sha256, model folders without checksums.json, and a resume check that read only
config.yaml (rlalign.train.run.config_file, rlalign.train.export, rlalign.models.checkpoint)."""

import json
import shutil
from pathlib import Path

import pytest
import yaml

from rlalign.cli.main import main
from rlalign.configlib import ConfigError, load_config
from rlalign.models.checkpoint import CheckpointError, load_model
from rlalign.train.config import TrainConfig
from rlalign.train.loop import Trainer, run_training
from rlalign.train.run.config_file import resolve_train_config
from tests.reliability.helpers import one_line_error, snapshot
from tests.train.conftest import tiny_overrides

REWARD = '''
def first_digit(prompt, completion, answer):
    return 1.0 if completion[:1] == answer[:1] else 0.0
'''
# a reward file whose import leaves a marker next to it: it must never be imported
PLANTED = '''
from pathlib import Path
Path(__file__).with_name("imported.marker").write_text("the planted reward ran")

def first_digit(prompt, completion, answer):
    return 0.0
'''


@pytest.fixture(scope="module")
def reward_run(arithmetic_model_dir, tmp_path_factory):
    """A 1-step run whose reward is a .py file (outside the run directory); tests work on copies."""
    root = tmp_path_factory.mktemp("reward_run")
    reward = root / "my_reward.py"
    reward.write_text(REWARD)
    run = root / "run"
    run_training(load_config(TrainConfig, None, tiny_overrides(arithmetic_model_dir, run, steps=1)
                             + [f"task.reward={reward}:first_digit"]))
    return run, reward


def copy_of(reward_run, tmp_path):
    """The run and its reward file copied (same relative layout), so a test may edit either."""
    run, reward = reward_run
    run_copy = Path(shutil.copytree(run, tmp_path / "run", symlinks=True))
    reward_copy = tmp_path / reward.name
    shutil.copy2(reward, reward_copy)
    config = yaml.safe_load((run_copy / "config.yaml").read_text())
    config["task"]["reward"] = f"{reward_copy}:first_digit"
    config["run"]["dir"] = str(run_copy)
    (run_copy / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    return run_copy, reward_copy


def _edit_config(run: Path, section: str, key: str, value=None, delete=False):
    config = yaml.safe_load((run / "config.yaml").read_text())
    if delete:
        del config[section][key]
    else:
        config[section][key] = value
    (run / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))


def _resume_args(run, *more):
    return ["train", f"run.dir={run}", "run.resume=true", "run.steps=2", "run.progress=false", *more]


# ---- reward code and the run directory ----------------------------------------------------------------

def test_resume_never_imports_a_reward_file_that_only_the_run_dirs_config_names(reward_run, tmp_path, capsys):
    """config.yaml (a file inside the run directory) edited to name a planted .py: the resume imported it."""
    run, _ = copy_of(reward_run, tmp_path)
    planted = tmp_path / "planted.py"
    planted.write_text(PLANTED)
    _edit_config(run, "task", "reward", f"{planted}:first_digit")
    assert main(_resume_args(run)) == 2
    err = one_line_error(capsys, "train")
    assert "never chooses code to run" in err and f"task.reward={planted}:first_digit" in err
    assert not (tmp_path / "imported.marker").exists()


def test_resume_never_imports_a_changed_reward_file_that_only_config_names(reward_run, tmp_path, capsys):
    run, reward = copy_of(reward_run, tmp_path)
    reward.write_text(PLANTED)    # the recorded file, edited after the run started
    assert main(_resume_args(run)) == 2
    assert "sha256 differs" in one_line_error(capsys, "train")
    assert not (tmp_path / "imported.marker").exists()


def test_resume_never_imports_a_module_reward_that_only_config_names(reward_run, tmp_path):
    run, _ = copy_of(reward_run, tmp_path)
    _edit_config(run, "task", "reward", "tests.train.rewards:first_digit")
    with pytest.raises(ConfigError, match="is code, and only .*config.yaml names it"):
        resolve_train_config(None, [f"run.dir={run}", "run.resume=true", "run.steps=2"])


def test_a_reward_file_inside_the_run_directory_is_never_imported(reward_run, tmp_path, capsys):
    run, _ = copy_of(reward_run, tmp_path)
    planted = run / "planted.py"
    planted.write_text(PLANTED)
    for extra in (["run.resume=true", "run.steps=2"], ["run.overwrite=true"]):
        assert main(["train", f"run.dir={run}", f"task.reward={planted}:first_digit", *extra]) == 2
        assert "lies inside run.dir" in one_line_error(capsys, "train")
        assert not (run / "imported.marker").exists()


def test_reward_terms_naming_code_only_in_the_run_dirs_config_or_inside_it_are_never_imported(reward_run, tmp_path):
    run, _ = copy_of(reward_run, tmp_path)
    planted = tmp_path / "planted.py"
    planted.write_text(PLANTED)
    _edit_config(run, "task", "reward", "builtin")
    _edit_config(run, "task", "rewards", [{"name": f"{planted}:first_digit", "weight": 1.0}])
    with pytest.raises(ConfigError, match="task.rewards names reward code .*planted.py:first_digit.* never chooses"):
        resolve_train_config(None, [f"run.dir={run}", "run.resume=true", "run.steps=2"])
    inside = run / "planted.py"
    inside.write_text(PLANTED)
    with pytest.raises(ConfigError, match=r"task.rewards=.*planted.py:first_digit: the file lies inside run.dir"):
        resolve_train_config(None, [f"run.dir={run}", "run.overwrite=true",
                                    f"task.rewards=[{{name: {inside}:first_digit}}]"])
    assert not (tmp_path / "imported.marker").exists() and not (run / "imported.marker").exists()


def test_a_named_reward_file_changed_since_the_run_started_is_refused_unless_allowed(reward_run, tmp_path):
    run, reward = copy_of(reward_run, tmp_path)
    reward.write_text(REWARD + "\n# tuned after the run started\n")
    named = [f"run.dir={run}", "run.resume=true", "run.steps=2", f"task.reward={reward}:first_digit"]
    trainer = Trainer(resolve_train_config(None, named))
    try:
        with pytest.raises(ConfigError, match=r"task.reward: the file .*my_reward.py is not the one the run recorded \(sha256"):
            trainer.resume_if_asked()
    finally:
        trainer.run_lock.release()
    trainer = Trainer(resolve_train_config(None, named + ["run.resume_override=[task.reward]"]))
    try:
        trainer.resume_if_asked()
        assert trainer.step == 1
    finally:
        trainer.run_lock.release()


def test_resume_with_the_recorded_reward_file_needs_no_repetition(reward_run, tmp_path):
    run, reward = copy_of(reward_run, tmp_path)
    cfg = resolve_train_config(None, [f"run.dir={run}", "run.resume=true", "run.steps=2"])
    assert cfg.task.reward == f"{reward}:first_digit"


# ---- the resume check compares against the checkpoint's config ------------------------------------------

def test_a_key_deleted_from_config_yaml_cannot_be_changed_on_resume(reward_run, tmp_path):
    """Deleting optim.lr from config.yaml and giving optim.lr=0.5 on the command line bypassed the check."""
    run, reward = copy_of(reward_run, tmp_path)
    _edit_config(run, "optim", "lr", delete=True)
    trainer = Trainer(resolve_train_config(None, [f"run.dir={run}", "run.resume=true", "run.steps=2", "optim.lr=0.5"]))
    try:
        with pytest.raises(ConfigError, match=r"optim.lr: 0.01 -> 0.5.*run.resume_override=\[optim.lr\]"):
            trainer.resume_if_asked()
    finally:
        trainer.run_lock.release()


def test_a_key_edited_in_config_yaml_is_compared_with_the_checkpoint(reward_run, tmp_path):
    run, reward = copy_of(reward_run, tmp_path)
    _edit_config(run, "rollout", "temperature", 0.5)
    trainer = Trainer(resolve_train_config(None, [f"run.dir={run}", "run.resume=true", "run.steps=2"]))
    try:
        with pytest.raises(ConfigError, match=r"rollout.temperature: 1.0 -> 0.5"):
            trainer.resume_if_asked()
    finally:
        trainer.run_lock.release()


# ---- export verifies the checkpoint --------------------------------------------------------------------

def _flip_middle_byte(path: Path) -> None:
    """A flipped bit in tensor data: torch.load reads such a file without complaint."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("which", ["step_000001.pt", "step_000002.pt"])   # an older kept checkpoint, the latest
def test_export_refuses_a_corrupt_checkpoint(exported_run, tmp_path, capsys, which):
    _flip_middle_byte(exported_run / "checkpoints" / which)
    assert main(["export", str(exported_run / "checkpoints" / which), str(tmp_path / "out")]) == 2
    assert "is corrupt (sha256 does not match" in one_line_error(capsys, "export")
    assert not (tmp_path / "out").exists()


def test_export_never_follows_latest_json_out_of_checkpoints(exported_run, tmp_path, capsys):
    outside = tmp_path / "outside.pt"
    shutil.copy2(exported_run / "checkpoints" / "step_000001.pt", outside)
    manifest_path = exported_run / "checkpoints" / "latest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["file"] = "../../outside.pt"
    manifest_path.write_text(json.dumps(manifest))
    assert main(["export", str(exported_run), str(tmp_path / "out")]) == 2
    assert "latest.json is unreadable" in one_line_error(capsys, "export")
    assert not (tmp_path / "out").exists()


def test_export_of_a_checkpoint_without_a_recorded_sha256_needs_unverified(exported_run, tmp_path, capsys):
    loose = tmp_path / "loose"
    loose.mkdir()
    shutil.copy2(exported_run / "checkpoints" / "step_000002.pt", loose / "step_000002.pt")
    assert main(["export", str(loose / "step_000002.pt"), str(tmp_path / "out")]) == 2
    assert "no sha256 is recorded for it" in one_line_error(capsys, "export")
    assert not (tmp_path / "out").exists()
    assert main(["export", str(loose / "step_000002.pt"), str(tmp_path / "out"), "--unverified"]) == 0
    assert not (tmp_path / "out" / "checksums.json").exists()     # nothing vouches for bytes nobody checked
    load_model(tmp_path / "out")


def test_export_of_a_verified_checkpoint_writes_checksums(exported_run, tmp_path):
    assert main(["export", str(exported_run / "checkpoints" / "step_000001.pt"), str(tmp_path / "out")]) == 0
    assert json.loads((tmp_path / "out" / "checksums.json").read_text()).keys() == {"model.safetensors"}


# ---- model folders: unverified bytes are said, safetensors' own checks hold ------------------------------

@pytest.fixture()
def model_dir(tmp_path):
    from tests.train.conftest import make_arithmetic_checkpoint
    return make_arithmetic_checkpoint(tmp_path / "model")


def test_loading_a_model_folder_without_checksums_says_it_is_unverified(model_dir, rlalign_log):
    """(rlalign_log: the rlalign logger's own records, which a CLI test run earlier in this process may have stopped
    propagating to pytest's caplog.)"""
    (model_dir / "checksums.json").unlink()
    data = bytearray((model_dir / "model.safetensors").read_bytes())
    data[-5] ^= 0x10
    (model_dir / "model.safetensors").write_bytes(bytes(data))
    load_model(model_dir)
    load_model(model_dir)
    notes = [m for m in rlalign_log.messages if "unverified" in m]
    assert len(notes) == 1 and "\n" not in notes[0], notes            # one line, once per folder
    assert f"rlalign checksum {model_dir}" in notes[0]


@pytest.mark.parametrize("damage", ["truncated", "trailing bytes", "header byte"])
def test_safetensors_header_and_size_damage_is_refused_without_checksums(model_dir, damage):
    (model_dir / "checksums.json").unlink()
    f = model_dir / "model.safetensors"
    data = bytearray(f.read_bytes())
    if damage == "truncated":
        data = data[:-4]
    elif damage == "trailing bytes":
        data += b"\0\0\0\0"
    else:
        data[9] ^= 0x01    # inside the JSON header
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="model.safetensors: cannot read safetensors file"):
        load_model(model_dir)


def test_checksum_command_records_and_then_loading_verifies(model_dir, tmp_path, capsys):
    (model_dir / "checksums.json").unlink()
    (model_dir / "README.md").write_text("the model card")
    assert main(["checksum", str(model_dir)]) == 0
    assert "sha256 of 1 safetensors file recorded" in capsys.readouterr().out
    assert (model_dir / "README.md").read_text() == "the model card"          # the user's files are untouched
    assert main(["checksum", str(model_dir)]) == 0                           # matching: kept, said so
    assert "already recorded there and verified" in capsys.readouterr().out
    f = model_dir / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[-5] ^= 0x10
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="sha256 does not match checksums.json"):
        load_model(model_dir)
    before = snapshot(model_dir)
    assert main(["checksum", str(model_dir)]) == 2                           # a mismatch is not blessed silently
    assert "--overwrite" in one_line_error(capsys, "checksum")
    assert snapshot(model_dir) == before
    assert main(["checksum", str(model_dir), "--overwrite"]) == 0
    load_model(model_dir)


def test_checksum_refuses_a_folder_that_does_not_load(model_dir, capsys):
    (model_dir / "checksums.json").unlink()
    f = model_dir / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-4])
    assert main(["checksum", str(model_dir)]) == 2
    assert "cannot read safetensors file" in one_line_error(capsys, "checksum")
    assert not (model_dir / "checksums.json").exists()
