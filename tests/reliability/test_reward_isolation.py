"""Rewards run in a worker process: a hang, os._exit, a crash or a KeyboardInterrupt inside a reward stops the run
with one line naming the reward (file.py:line:function) and the sample, never a hang or a silent death of the
trainer; the values are those of the in-process score, bit for bit."""

import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlalign.configlib import ConfigError, load_config
from rlalign.tasks import RewardError, RewardLoadError, RewardWorker, load_reward, score
from rlalign.train.config import TrainConfig
from tests.train.conftest import tiny_overrides

ROOT = Path(__file__).resolve().parents[2]   # the checkout, whatever the directory pytest runs from

REWARDS = '''
import os, random, subprocess, sys, time

def spins(prompt, completion, answer):
    if completion == "hang":
        while True:
            pass
    return 1.0

def sleeps(prompt, completion, answer):
    if completion == "hang":
        time.sleep(600)
    return 1.0

def exits(prompt, completion, answer):
    if completion == "exit":
        os._exit(7)
    return 0.0

def segfaults(prompt, completion, answer):
    os.kill(os.getpid(), 11)

def interrupts(prompt, completion, answer):
    raise KeyboardInterrupt

def calls_sys_exit(prompt, completion, answer):
    sys.exit(3)

def starts_a_child_and_hangs(prompt, completion, answer):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    with open(answer, "w") as f:
        f.write(str(child.pid))
    time.sleep(600)

def noisy(prompt, completion, answer, weight=1.0):
    return random.Random(prompt + completion).random() * weight

def always_hangs(prompt, completion, answer):
    while True:
        pass
'''


@pytest.fixture()
def rewards(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(REWARDS)
    return path


def _line(path, name):
    return next(i for i, text in enumerate(REWARDS.split("\n"), start=1) if text.startswith(f"def {name}("))


@pytest.mark.parametrize("name", ["spins", "sleeps"])
def test_a_hanging_reward_is_stopped_after_the_timeout_naming_reward_and_sample(rewards, name):
    with RewardWorker(f"{rewards}:{name}", timeout_s=0.5) as worker:
        with pytest.raises(RewardError) as err:
            worker.score(["1+1=", "2+2="], ["2", "hang"], ["2", "4"])
    text = str(err.value)
    assert text.startswith(f"reward {rewards}:{_line(rewards, name)}:{name} on sample 1 (prompt '2+2=') did not "
                           "return within task.reward_timeout_s=0.5 s"), text
    assert "\n" not in text


def test_os_exit_in_a_reward_is_one_line_with_the_exit_status(rewards):
    with RewardWorker(f"{rewards}:exits") as worker:
        with pytest.raises(RewardError, match=rf"exits on sample 2 \(prompt 'c'\) ended the reward process \(exit "
                                              r"status 7\) instead of returning a reward"):
            worker.score(["a", "b", "c"], ["1", "2", "exit"], ["1", "2", "3"])
        with pytest.raises(RewardError, match=r"its process stopped at an earlier call \(reward .*exit status 7"):
            worker.score(["a"], ["1"], ["1"])


def test_a_crash_of_the_reward_process_is_one_line(rewards):
    with RewardWorker(f"{rewards}:segfaults") as worker:
        with pytest.raises(RewardError, match=r"segfaults on sample 0 .* ended the reward process \(killed by SIGSEGV\)"):
            worker.score(["a"], ["1"], ["1"])


def test_keyboard_interrupt_raised_by_a_reward_is_a_reward_error(rewards):
    with RewardWorker(f"{rewards}:interrupts") as worker:
        with pytest.raises(RewardError, match=rf"interrupts on sample 0 \(prompt 'a'\) raised KeyboardInterrupt at "
                                              rf"{rewards}:{_line(rewards, 'interrupts') + 1}"):
            worker.score(["a"], ["1"], ["1"])


def test_sys_exit_in_the_worker_keeps_its_message(rewards):
    with RewardWorker(f"{rewards}:calls_sys_exit") as worker:
        with pytest.raises(RewardError, match=r"called sys.exit\(3\) at .*my_rewards.py"):
            worker.score(["a"], ["1"], ["1"])


def test_the_worker_returns_the_in_process_values_bit_for_bit(rewards):
    prompts = [f"{i}+{i}=" for i in range(50)]
    completions = [str(i * 3) for i in range(50)]
    extras = [{"weight": 0.5 + i, "other": [i]} for i in range(50)]
    expected = score(load_reward(f"{rewards}:noisy"), prompts, completions, ["0"] * 50, extras)
    with RewardWorker(f"{rewards}:noisy") as worker:
        got = worker.score(prompts, completions, ["0"] * 50, extras)
    assert [struct.pack("<d", x) for x in got] == [struct.pack("<d", x) for x in expected]


def test_a_reward_that_cannot_be_loaded_fails_when_the_worker_starts(tmp_path):
    with pytest.raises(RewardLoadError, match="not found"):
        RewardWorker(f"{tmp_path / 'missing.py'}:f")
    broken = tmp_path / "broken.py"
    broken.write_text("import sys\nsys.exit(5)\n")
    with pytest.raises(RewardLoadError, match="importing it raised SystemExit"):
        RewardWorker(f"{broken}:f")


def test_close_and_a_timeout_stop_the_worker_and_what_it_started(rewards, tmp_path):
    pid_file = tmp_path / "child.pid"
    worker = RewardWorker(f"{rewards}:starts_a_child_and_hangs", timeout_s=1.0)
    with pytest.raises(RewardError, match="did not return within"):
        worker.score(["a"], ["1"], [str(pid_file)])
    worker.close()
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child), "the reward's own child outlived the reward process"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:   # a zombie (killed, not yet reaped by init) counts as gone
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:   # reaped between the two looks
        return False


def test_the_worker_stops_itself_when_the_trainer_is_killed(rewards, tmp_path):
    """SIGKILL of the trainer while a reward hangs: the worker notices its parent is gone and ends."""
    script = (f"from rlalign.tasks import RewardWorker\n"
              f"w = RewardWorker({str(rewards) + ':always_hangs'!r}, timeout_s=600)\n"
              f"print(w._process.popen.pid, flush=True)\n"
              f"w.score(['a'], ['1'], ['1'])\n")
    trainer = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONPATH": str(ROOT)})
    worker_pid = int(trainer.stdout.readline())
    time.sleep(0.5)
    trainer.send_signal(signal.SIGKILL)
    trainer.wait()
    deadline = time.monotonic() + 5
    while _alive(worker_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(worker_pid)


def test_reward_timeout_is_a_config_field_with_a_rule():
    assert load_config(TrainConfig, None, []).task.reward_timeout_s == 30.0
    assert load_config(TrainConfig, None, ["task.reward_timeout_s=2.5"]).task.reward_timeout_s == 2.5
    with pytest.raises(ConfigError, match=r"task.reward_timeout_s must be a number in \(0, 86400\]"):
        load_config(TrainConfig, None, ["task.reward_timeout_s=0"])


def test_training_with_a_hanging_reward_stops_with_one_line(rewards, arithmetic_model_dir, tmp_path):
    """The CLI end to end (a child process, so a hang fails the test instead of hanging it)."""
    overrides = tiny_overrides(arithmetic_model_dir, tmp_path / "run", steps=2) + [
        f"task.reward={rewards}:always_hangs", "task.reward_timeout_s=1"]
    out = subprocess.run([sys.executable, "-m", "rlalign.cli.main", "train", *overrides], capture_output=True,
                         text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 2, out.stderr[-2000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith(f"rlalign train: error: reward {rewards}:{_line(rewards, 'always_hangs')}:always_hangs on "
                           "sample 0 (prompt "), last
    assert "did not return within task.reward_timeout_s=1 s" in last
    assert "Traceback" not in out.stderr
