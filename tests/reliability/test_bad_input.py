"""Bad input that used to pass silently or crash with a traceback: each is refused with one line."""

import os
import subprocess
import sys

import pytest

from rlalign.cli.main import main
from rlalign.configlib import ConfigError, load_config
from rlalign.tasks import RewardError, load_reward, score
from rlalign.tasks.datasets import DatasetError, load_dataset
from rlalign.train.config import TrainConfig

REWARDS = '''
import sys

def exits(prompt, completion, answer):
    sys.exit(3)

def raises(prompt, completion, answer):
    return {}["missing"]

def huge(prompt, completion, answer):
    return -1e38
'''


@pytest.fixture()
def reward_file(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(REWARDS)
    return path


def test_reward_calling_sys_exit_is_a_reward_error(reward_file):
    with pytest.raises(RewardError, match=r"called sys.exit\(3\) at .*my_rewards.py:5"):
        score(load_reward(f"{reward_file}:exits"), ["1+1="], ["2"], ["2"])


def test_reward_that_raises_is_named_by_file_and_line(reward_file):
    with pytest.raises(RewardError) as err:
        score(load_reward(f"{reward_file}:raises"), ["1+1="], ["2"], ["2"])
    text = str(err.value)
    assert f"reward {reward_file}:7:raises on sample 0" in text and f"KeyError: 'missing' at {reward_file}:8" in text
    assert "rlalign_user_reward_" not in text


@pytest.mark.parametrize("value", [1e38, -1e38, 1e10, float("inf"), float("nan")])
def test_rewards_that_would_overflow_the_group_statistics_are_refused(value):
    with pytest.raises(RewardError, match="expected a finite float in \\[-1e\\+09, 1e\\+09\\]"):
        score(lambda p, c, a: value, ["q"], ["c"], ["a"])


def test_non_utf8_config_and_dataset_are_one_line(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_bytes(b"run:\n  steps: 3 # \xff\xfe\n")
    with pytest.raises(ConfigError, match="is not UTF-8 text"):
        load_config(TrainConfig, cfg, [])
    data = tmp_path / "d.jsonl"
    data.write_bytes(b'{"prompt": "a", "answer": "1"}\n{"prompt": "\xff", "answer": "2"}\n')
    with pytest.raises(DatasetError, match="d.jsonl:2: not UTF-8 text"):
        load_dataset(data)


def test_report_on_an_empty_metrics_file_is_one_line(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text("")
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "holds no records" in err


def test_report_drops_a_torn_last_line_and_says_so(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "eval/accuracy": 0.1}\n{"step": 1, "reward/mean": 0.5}\n'
                                            '{"step": 2, "rew')
    assert main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr()
    assert "dropped a torn last line" in out.err and (tmp_path / "report.md").exists()


def test_os_errors_in_the_cli_are_one_line(tmp_path, monkeypatch, capsys):
    import rlalign.cli.report as report_cli

    def full(args):
        raise OSError(28, "No space left on device", str(tmp_path / "report.png"))
    monkeypatch.setattr(report_cli, "run", full)
    assert main(["report", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == f"rlalign report: error: No space left on device: {tmp_path / 'report.png'}"


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions")
def test_parity_report_into_a_read_only_dir_fails_before_the_work(tmp_path, capsys):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    assert main(["parity", "--report", str(ro / "out"), "--prompts", "1"]) == 2
    assert "cannot create it" in capsys.readouterr().err


def test_doctor_json_without_a_gpu_still_prints_json():
    import json
    import torch
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    out = subprocess.run([sys.executable, "-m", "rlalign.cli.main", "doctor", "--device", "cuda", "--json"],
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert out.returncode == 2
    assert json.loads(out.stdout)["error"].startswith("--device cuda: no CUDA device is visible")


@pytest.mark.parametrize("command", [["generate", "--model", "default", "--prompt", "1+1="], ["parity"]])
def test_cuda_without_a_gpu_is_one_line(command, capsys):
    import torch
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    assert main([*command, "--device", "cuda"]) == 2
    assert "no CUDA device is visible here" in capsys.readouterr().err


def test_a_tokenizer_that_cannot_encode_the_prompt_is_refused():
    from rlalign.models.tokenizer import load_tokenizer
    from rlalign.train.setup import DEFAULT_MODEL_DIR, SetupError, TaskData
    task = TaskData(lambda i: None, [], None, load_tokenizer(DEFAULT_MODEL_DIR), chat=False)
    assert task.encode("1+2=") == load_tokenizer(DEFAULT_MODEL_DIR).encode("1+2=")
    with pytest.raises(SetupError, match="cannot encode 'é' in the prompt '1\\+é='"):
        task.encode("1+é=")


def test_generate_refuses_a_prompt_longer_than_the_model_positions(capsys):
    assert main(["generate", "--model", "rlalign/assets/default_model", "--prompt", "1+2=" * 40,
                 "--max-new-tokens", "4"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "exceeds the model's 64 positions" in err, err


def test_generate_refuses_a_model_without_eos(tmp_path, capsys):
    import json
    from tests.train.conftest import make_arithmetic_checkpoint
    model = make_arithmetic_checkpoint(tmp_path / "m")
    for name in ("config.json", "tokenizer_config.json", "generation_config.json"):
        path = model / name
        if path.exists():
            d = json.loads(path.read_text())
            d.pop("eos_token_id", None), d.pop("eos_token", None)
            path.write_text(json.dumps(d))
    assert main(["generate", "--model", str(model), "--prompt", "1+2="]) == 2
    assert "no eos token" in capsys.readouterr().err


@pytest.mark.parametrize("profile", ["strict", "native"])
def test_float16_checkpoint_must_choose_a_training_dtype(tmp_path, profile):
    import json
    import torch
    from rlalign.train.config import ModelSection
    from rlalign.train.setup import SetupError, load_policy
    from tests.train.conftest import make_arithmetic_checkpoint
    model = make_arithmetic_checkpoint(tmp_path / "m")
    cfg = json.loads((model / "config.json").read_text())
    cfg["torch_dtype"] = "float16"
    cfg.pop("dtype", None)
    (model / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SetupError, match="float16 checkpoint; train it in model.dtype=bfloat16"):
        load_policy(ModelSection(path=str(model)))
    assert next(load_policy(ModelSection(path=str(model), dtype="float32"))[0].parameters()).dtype == torch.float32


@pytest.fixture()
def read_only_dir(tmp_path):
    """A read-only filesystem (a tmpfs mounted ro): unlike file modes, root cannot write there either."""
    import shutil
    path = tmp_path / "ro"
    path.mkdir()
    if os.geteuid() != 0 or not shutil.which("mount"):
        pytest.skip("needs root to mount a read-only tmpfs")
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(path)]).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    yield path
    subprocess.run(["umount", str(path)])


def test_run_dir_on_a_read_only_filesystem_is_one_line(read_only_dir):
    from rlalign.train.run.directory import RunDirError, open_run_dir
    with pytest.raises(RunDirError, match="cannot create run.dir .*: Read-only file system"):
        open_run_dir(read_only_dir / "run", resume=False, overwrite=False)


def test_parity_report_on_a_read_only_filesystem_fails_before_the_work(read_only_dir, capsys):
    assert main(["parity", "--report", str(read_only_dir / "out"), "--prompts", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"rlalign parity: error: --report {read_only_dir / 'out'}: cannot create it (Read-only file system)"


def test_setup_failure_leaves_no_empty_run_dir_and_a_used_dir_fails_before_the_model_loads(tmp_path, monkeypatch):
    from rlalign.train import loop
    from rlalign.train.run.directory import RunDirError
    from rlalign.train.setup import SetupError
    cfg = load_config(TrainConfig, None, [f"model.path={tmp_path / 'no_model'}", f"run.dir={tmp_path / 'run'}"])
    with pytest.raises(SetupError, match="is not a directory"):
        loop.Trainer(cfg)
    assert not (tmp_path / "run").exists()
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text("{}\n")
    monkeypatch.setattr(loop, "load_policy", lambda section: pytest.fail("the model loaded before the run dir check"))
    with pytest.raises(RunDirError, match="is not empty"):
        loop.Trainer(cfg)
