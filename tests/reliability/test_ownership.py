"""Nothing a user owns is destroyed: every command writes only into a folder it creates or one holding only
its own files, deletes only what it wrote, never writes through a link, and refuses an existing target in one
line with nothing changed (rlalign.models.ownership, rlalign.train.run.directory)."""

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlalign.cli.main import main
from rlalign.configlib import load_config
from rlalign.models.checkpoint import CheckpointError, load_model, save_model
from rlalign.models.testing import tiny_model
from rlalign.train.config import TrainConfig
from rlalign.train.loop import run_training
from rlalign.train.run.directory import RunDirError, open_run_dir
from rlalign.train.run.checkpoint_files import CheckpointCorrupt, load_latest_checkpoint, save_checkpoint
from tests.reliability.helpers import checkpoint_state, one_line_error, snapshot
from tests.train.conftest import tiny_overrides


# ---- export: the target is refused, nothing is changed ------------------------------------------------

EXPORT_TARGETS = {
    "the run directory holding the checkpoint": lambda run, tmp: run,
    "the checkpoints folder": lambda run, tmp: run / "checkpoints",
    "a parent of the run directory": lambda run, tmp: tmp,
    "an existing file": lambda run, tmp: _file(tmp / "out.bin"),
    "a non-empty folder of the user's": lambda run, tmp: _folder(tmp / "mine", {"thesis.tex": "chapter 1"}),
    "a symbolic link to a folder": lambda run, tmp: _link(tmp / "link", _folder(tmp / "real", {"a.txt": "a"})),
    "a symbolic link to a new folder": lambda run, tmp: _link(tmp / "dangling", tmp / "not-yet"),
    "an existing model folder (no --overwrite)": lambda run, tmp: _model_folder(tmp / "old_export"),
}


def _file(path):
    path.write_bytes(b"precious bytes")
    return path


def _folder(path, files):
    path.mkdir()
    for name, text in files.items():
        (path / name).write_text(text)
    return path


def _link(path, target):
    path.symlink_to(target)
    return path


def _model_folder(path):
    save_model(tiny_model("qwen3", num_hidden_layers=1), path)
    return path


@pytest.mark.parametrize("target", sorted(EXPORT_TARGETS))
def test_export_refuses_a_target_it_does_not_own_and_changes_nothing(exported_run, tmp_path, capsys, target):
    out = EXPORT_TARGETS[target](exported_run, tmp_path)
    before = snapshot(tmp_path)
    assert main(["export", str(exported_run / "checkpoints" / "step_000001.pt"), str(out)]) == 2
    one_line_error(capsys, "export")
    assert snapshot(tmp_path) == before


def test_export_into_the_current_directory_is_refused(exported_run, tmp_path, capsys, monkeypatch):
    """`cd w && rlalign export ../R .` deleted everything in w."""
    work = _folder(tmp_path / "w", {"paper.md": "draft"})
    monkeypatch.chdir(work)
    before = snapshot(tmp_path)
    assert main(["export", "../R", "."]) == 2
    assert "is the current directory" in one_line_error(capsys, "export")
    assert snapshot(tmp_path) == before


def test_export_refuses_the_base_model_folder_as_output(exported_run, arithmetic_model_dir, tmp_path, capsys):
    base = tmp_path / "base"
    save_model(load_model(arithmetic_model_dir)[0], base)
    before = snapshot(tmp_path)
    assert main(["export", str(exported_run), str(base), "--model-dir", str(base), "--overwrite"]) == 2
    assert "which this command reads" in one_line_error(capsys, "export")
    assert snapshot(tmp_path) == before


def test_export_overwrite_replaces_only_a_model_folder_of_its_own(exported_run, tmp_path, capsys):
    out = _model_folder(tmp_path / "export")
    assert main(["export", str(exported_run), str(out), "--overwrite"]) == 0
    assert load_model(out)[0].config.hidden_size == 32            # the arithmetic model replaced the tiny one
    (out / "README.md").write_text("the user's card")
    capsys.readouterr()
    assert main(["export", str(exported_run), str(out), "--overwrite"]) == 2
    assert "README.md" in one_line_error(capsys, "export")
    assert (out / "README.md").read_text() == "the user's card"


def test_export_into_a_new_or_empty_folder_works(exported_run, tmp_path):
    (tmp_path / "empty").mkdir()
    for out in (tmp_path / "new" / "deeper", tmp_path / "empty"):
        assert main(["export", str(exported_run), str(out)]) == 0
        assert (out / "checksums.json").is_file()


# ---- save_model and pretrain: the same rule --------------------------------------------------------------

def test_save_model_never_replaces_a_folder_with_foreign_files(tmp_path):
    folder = _folder(tmp_path / "m", {"notes.txt": "mine"})
    with pytest.raises(CheckpointError, match="holds files rlalign did not write \\(notes.txt\\)"):
        save_model(tiny_model("qwen3", num_hidden_layers=1), folder)
    assert (folder / "notes.txt").read_text() == "mine"
    _file(tmp_path / "f")
    with pytest.raises(CheckpointError, match="is a file"):
        save_model(tiny_model("qwen3", num_hidden_layers=1), tmp_path / "f")
    assert (tmp_path / "f").read_bytes() == b"precious bytes"


MODEL_NAMES = ["config.json", "model.safetensors", "checksums.json", "tokenizer.json",
               "model-00001-of-00002.safetensors"]
FOREIGN_NAMES = ["notes.txt", "model.safetensors.bak", "data", ".hidden", "README.md"]
_TINY = []


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(MODEL_NAMES + FOREIGN_NAMES), st.sampled_from(["file", "dir", "link"])),
                max_size=5, unique_by=lambda entry: entry[0]))
def test_save_model_replaces_a_folder_only_when_every_entry_is_its_own(tmp_path_factory, entries):
    """Whatever a folder holds, save_model replaces it only when every entry is a plain file of a saved model's;
    otherwise it refuses and nothing under the folder (or where its links point) changes."""
    if not _TINY:
        _TINY.append(tiny_model("qwen3", num_hidden_layers=1))
    root = tmp_path_factory.mktemp("folder")
    target, outside = root / "out", _file(root / "outside.bin")
    target.mkdir()
    for name, kind in entries:
        if kind == "file":
            (target / name).write_text(name)
        elif kind == "dir":
            _folder(target / name, {"inner.txt": "x"})
        else:
            (target / name).symlink_to(outside)
    ours = all(kind == "file" and name in MODEL_NAMES for name, kind in entries)
    before = snapshot(root)
    try:
        save_model(_TINY[0], target)
        replaced = True
    except CheckpointError:
        replaced = False
    assert replaced == ours, entries
    assert outside.read_bytes() == b"precious bytes"
    if not replaced:
        assert snapshot(root) == before


def test_pretrain_refuses_a_foreign_output_folder_before_training(tmp_path):
    from rlalign.train.pretrain import PretrainConfig, pretrain
    folder = _folder(tmp_path / "out", {"data.csv": "1,2"})
    with pytest.raises(CheckpointError, match="data.csv"):
        pretrain(PretrainConfig(out=str(folder), steps=1, hidden_size=16, num_layers=1, num_heads=1, num_kv_heads=1,
                                head_dim=16, intermediate_size=16, batch_size=2, eval_size=2), log=lambda *a: None)
    assert sorted(p.name for p in folder.iterdir()) == ["data.csv"]


# ---- the run directory -----------------------------------------------------------------------------------

def test_a_planted_lock_symlink_is_refused_and_its_target_untouched(tmp_path, capsys, arithmetic_model_dir):
    """`.lock -> ~/.bashrc` made `rlalign train` truncate and overwrite the link's target."""
    victim = _file(tmp_path / "victim")
    run = tmp_path / "run"
    run.mkdir()
    (run / ".lock").symlink_to(victim)
    assert main(["train", f"run.dir={run}", f"model.path={arithmetic_model_dir}", "run.steps=1"]) == 2
    err = one_line_error(capsys, "train")
    assert ".lock" in err and "symbolic link" in err
    assert victim.read_bytes() == b"precious bytes"
    with pytest.raises(Exception, match="symbolic link"):
        open_run_dir(run, resume=False, overwrite=True)
    assert victim.read_bytes() == b"precious bytes"


def test_a_lock_file_with_a_second_hard_link_is_refused(tmp_path):
    victim = _file(tmp_path / "victim")
    run = tmp_path / "run"
    run.mkdir()
    os.link(victim, run / ".lock")
    with pytest.raises(Exception, match="2 hard links"):
        open_run_dir(run, resume=False, overwrite=False)
    assert victim.read_bytes() == b"precious bytes"


def _recorded_run(tmp_path, steps=(1, 2), keep=3):
    run = tmp_path / "run"
    for step in steps:
        save_checkpoint(run, step, checkpoint_state(step), keep=keep)
    (run / "metrics.jsonl").write_text('{"step": 0}\n')
    return run


@pytest.fixture(scope="module")
def trained_run(arithmetic_model_dir, tmp_path_factory):
    """A finished 2-step run (checkpoints 1 and 2 recorded); tests work on copies (:func:`copy_of`)."""
    run = tmp_path_factory.mktemp("trained") / "run"
    run_training(load_config(TrainConfig, None, tiny_overrides(arithmetic_model_dir, run, steps=2)))
    return run


def copy_of(run: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(run, tmp_path / "run", symlinks=True))


def test_resume_keeps_another_runs_checkpoint_kept_as_a_backup(trained_run, arithmetic_model_dir, tmp_path):
    """docs/reliability.md: a checkpoint of another run in checkpoints/ is never touched. A resume deleted every
    step file numbered above latest.json as a 'leftover'."""
    run = copy_of(trained_run, tmp_path)
    backup = run / "checkpoints" / "step_000900.pt"
    backup.write_bytes(b"another run's step 900")
    assert main(["train", *tiny_overrides(arithmetic_model_dir, run, steps=3), "run.resume=true"]) == 0
    assert backup.read_bytes() == b"another run's step 900"
    assert load_latest_checkpoint(run)["step"] == 3


def test_resume_refuses_to_write_over_a_foreign_checkpoint_in_its_way(trained_run, arithmetic_model_dir, tmp_path,
                                                                      capsys):
    run = copy_of(trained_run, tmp_path)
    backup = run / "checkpoints" / "step_000003.pt"
    backup.write_bytes(b"another run's step 3")
    before = snapshot(run, skip_lock=True)
    assert main(["train", *tiny_overrides(arithmetic_model_dir, run, steps=3), "run.resume=true"]) == 2
    assert "holds step_000003.pt, after step 2" in one_line_error(capsys, "train")
    assert snapshot(run, skip_lock=True) == before
    from rlalign.train.run.checkpoint_files import CheckpointRefused
    with pytest.raises(CheckpointRefused, match="already exists"):   # the save itself never replaces it either
        save_checkpoint(run, 3, checkpoint_state(3))
    assert backup.read_bytes() == b"another run's step 3"


def test_rewinding_latest_json_does_not_delete_the_later_recorded_checkpoints(tmp_path):
    """latest.json pointed back at step 1 (to redo steps 2-3): resume deleted steps 2 and 3 as leftovers."""
    run = _recorded_run(tmp_path, steps=(1, 2, 3))
    manifest_path = run / "checkpoints" / "latest.json"
    manifest = json.loads(manifest_path.read_text())
    first = run / "checkpoints" / "step_000001.pt"
    manifest.update(step=1, file=first.name, sha256=hashlib.sha256(first.read_bytes()).hexdigest())
    manifest_path.write_text(json.dumps(manifest))
    before = snapshot(run, skip_lock=True)
    with pytest.raises(RunDirError, match="step_000002.pt, step_000003.pt, after step 1"):
        open_run_dir(run, resume=True, overwrite=False)
    assert snapshot(run, skip_lock=True) == before


def test_overwrite_deletes_only_the_previous_runs_files(trained_run, arithmetic_model_dir, tmp_path):
    """run.overwrite=true deleted checkpoints/ whole, a backup kept there included."""
    run = copy_of(trained_run, tmp_path)
    (run / "checkpoints" / "step_000900.pt").write_bytes(b"backup")
    (run / "notes.txt").write_text("mine")
    assert main(["train", *tiny_overrides(arithmetic_model_dir, run, steps=1), "run.overwrite=true"]) == 0
    assert (run / "checkpoints" / "step_000900.pt").read_bytes() == b"backup" and (run / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == ["step_000001.pt", "step_000900.pt"]
    assert load_latest_checkpoint(run)["step"] == 1


@pytest.mark.parametrize("case", ["model inside", "dataset inside", "reward inside", "config inside", "cwd"])
def test_overwrite_never_deletes_in_a_run_directory_holding_what_the_run_reads(trained_run, tmp_path, monkeypatch,
                                                                             capsys, case):
    """run.overwrite=true with model.path=RUN/policy deleted the model it was about to load; run.dir=. deleted the
    user's ./config.yaml. A run directory that is or contains an input of the run (model, dataset, reward, config
    file) or the current directory is refused before anything changes."""
    run = copy_of(trained_run, tmp_path)
    model = run / "policy"
    args = [f"model.path={model}" if case == "model inside" else f"model.path={trained_run / 'policy'}",
            f"run.dir={run}", "run.overwrite=true", "run.steps=1", "run.progress=false"]
    if case == "dataset inside":
        (run / "data.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
        args += ["task.name=dataset", f"task.path={run / 'data.jsonl'}"]
    if case == "reward inside":
        (tmp_path / "elsewhere").mkdir()
        monkeypatch.chdir(tmp_path / "elsewhere")
        args += [f"task.reward={run / 'r.py'}:score"]
        (run / "r.py").write_text("def score(prompt, completion, answer, **kw):\n    return 0.0\n")
    if case == "config inside":
        (run / "my.yaml").write_text("run:\n  steps: 1\n")
        args = [str(run / "my.yaml"), *args]
    if case == "cwd":
        monkeypatch.chdir(run)
    before = snapshot(run, skip_lock=True)
    assert main(["train", *args]) == 2
    err = one_line_error(capsys, "train")
    reason = {"reward inside": "nothing in a run directory runs as code", "cwd": "current directory"}
    assert "run.dir" in err and reason.get(case, "which this command reads") in err, err
    assert snapshot(run, skip_lock=True) == before


def test_overwrite_refuses_a_policy_folder_with_foreign_files_and_changes_nothing(tmp_path):
    run = _recorded_run(tmp_path)
    save_model(tiny_model("qwen3", num_hidden_layers=1), run / "policy")
    (run / "policy" / "my_eval.json").write_text("{}")
    before = snapshot(run, skip_lock=True)
    with pytest.raises(RunDirError, match="policy/ holds files rlalign did not write \\(my_eval.json\\)"):
        open_run_dir(run, resume=False, overwrite=True)
    assert snapshot(run, skip_lock=True) == before


@pytest.mark.parametrize("entry", ["checkpoints", "metrics.jsonl", "policy", "config.yaml"])
def test_a_run_entry_that_is_a_symlink_is_refused(tmp_path, entry):
    """A resume followed checkpoints -> elsewhere and deleted the step files there above latest.json."""
    run = _recorded_run(tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "step_000007.pt").write_bytes(b"someone else's")
    if entry == "checkpoints":
        (run / "checkpoints").rename(outside / "checkpoints")
        (outside / "checkpoints" / "step_000007.pt").write_bytes(b"someone else's")
        (run / "checkpoints").symlink_to(outside / "checkpoints")
    else:
        if (run / entry).exists():
            (run / entry).unlink()
        (run / entry).symlink_to(outside / "step_000007.pt")
    before = snapshot(tmp_path, skip_lock=True)
    with pytest.raises(RunDirError, match=f"{entry} is a symbolic link"):
        open_run_dir(run, resume=True, overwrite=False)
    assert snapshot(tmp_path, skip_lock=True) == before


def test_a_manifest_naming_files_outside_checkpoints_deletes_nothing(tmp_path):
    """history entries are deleted by a save: '../notes.txt' must never reach the run directory."""
    run = _recorded_run(tmp_path, steps=(1,))
    (run / "notes.txt").write_text("mine")
    manifest_path = run / "checkpoints" / "latest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["history"] = ["../notes.txt", "step_000001.pt"]
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(CheckpointCorrupt, match="not a checkpoint of this folder"):
        save_checkpoint(run, 2, checkpoint_state(2), keep=1)
    with pytest.raises(CheckpointCorrupt):
        open_run_dir(run, resume=True, overwrite=False)
    assert (run / "notes.txt").read_text() == "mine"


# ---- reports ---------------------------------------------------------------------------------------------

def test_report_never_writes_through_a_link_in_the_run_directory(tmp_path, capsys):
    victim = _file(tmp_path / "victim.md")
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 0, "eval/accuracy": 0.1}\n{"step": 1, "reward/mean": 0.5}\n')
    (run / "report.md").symlink_to(victim)
    assert main(["report", str(run)]) == 2
    assert "symbolic link" in one_line_error(capsys, "report")
    assert victim.read_bytes() == b"precious bytes"


def test_report_out_folder_with_foreign_files_is_refused(tmp_path, capsys):
    runs = []
    for name in ("a", "b"):
        runs.append(tmp_path / name)
        runs[-1].mkdir()
        (runs[-1] / "metrics.jsonl").write_text('{"step": 0, "eval/accuracy": 0.1}\n{"step": 1, "reward/mean": 0.5}\n')
    out = _folder(tmp_path / "out", {"compare.md": "old", "thesis.tex": "mine"})
    before = snapshot(tmp_path)
    assert main(["report", *map(str, runs), "--out", str(out)]) == 2
    assert "thesis.tex" in one_line_error(capsys, "report")
    assert snapshot(tmp_path) == before
    (out / "thesis.tex").unlink()
    assert main(["report", *map(str, runs), "--out", str(out)]) == 0   # only its own files there: replaced
    assert (out / "compare.md").read_text() != "old"


def test_parity_report_folder_with_foreign_files_is_refused_before_the_comparison(tmp_path, capsys):
    out = _folder(tmp_path / "out", {"results.csv": "1,2"})
    before = snapshot(tmp_path)
    assert main(["parity", "--report", str(out), "--prompts", "1", "--max-new-tokens", "2"]) == 2
    assert "results.csv" in one_line_error(capsys, "parity")
    assert snapshot(tmp_path) == before


def test_parity_record_never_replaces_a_file_that_is_not_a_rollout_record(tmp_path, capsys):
    mine = _file(tmp_path / "results.jsonl")
    link = _link(tmp_path / "link.jsonl", mine)
    for target in (mine, link):
        assert main(["parity", "--record", str(target), "--prompts", "1", "--max-new-tokens", "2"]) == 2
        one_line_error(capsys, "parity")
    assert mine.read_bytes() == b"precious bytes"
    record = tmp_path / "rollout.jsonl"
    assert main(["parity", "--record", str(record), "--prompts", "1", "--max-new-tokens", "2"]) == 0
    assert main(["parity", "--record", str(record), "--prompts", "1", "--max-new-tokens", "2"]) == 0   # its own: replaced
