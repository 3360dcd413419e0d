"""Bad input that used to end in a traceback, run until killed, or pass silently: each is one line, exit 2.

config.json keys of the wrong type, characters a tokenizer cannot encode in ``generate``, a .parquet dataset without
pyarrow, a chat template that Jinja refuses, integer options of 0 or below, ``generate --n`` past the memory, and
garbage in RLALIGN_* environment variables. (The class-wide walks of the environment variables are in
test_environment.py.)"""

import argparse
import json
import os
import re
import resource
import shutil
import subprocess
import sys

from pathlib import Path

import pytest
import torch

from rlalign.cli.main import build_parser, main
from rlalign.contract.errors import RLAlignError
from rlalign.models.checkpoint import load_model_config
from rlalign.train.setup import DEFAULT_MODEL_DIR

ROOT = Path(__file__).resolve().parents[2]   # the checkout, whatever the directory pytest runs from


@pytest.fixture()
def model_dir(tmp_path):
    """A copy of the embedded default model (a few hundred KB) to break."""
    return shutil.copytree(DEFAULT_MODEL_DIR, tmp_path / "model")


def _edit_config(model_dir, **changes):
    path = model_dir / "config.json"
    cfg = json.loads(path.read_text())
    for key, value in changes.items():
        if value is _DROP:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    path.write_text(json.dumps(cfg))
    return path


_DROP = object()


def _one_line(capsys, command: str) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"rlalign {command}: error: ") and "\n" not in err, err
    return err


# ---- config.json ---------------------------------------------------------------------------------------------

def test_a_string_hidden_size_is_one_line_naming_the_file_and_key(model_dir, capsys):
    path = _edit_config(model_dir, hidden_size="128")
    assert main(["generate", "--model", str(model_dir), "--prompt", "1+2="]) == 2
    assert _one_line(capsys, "generate") == (f"rlalign generate: error: {path}: hidden_size must be an integer >= 1, "
                                             "got '128' (str)")


@pytest.mark.parametrize("key,value,expected", [
    ("hidden_size", -128, "hidden_size must be an integer >= 1, got -128"),
    ("num_hidden_layers", 4.0, "num_hidden_layers must be an integer >= 0, got 4.0 (float)"),
    ("num_key_value_heads", 0, "num_key_value_heads must be an integer >= 1, got 0"),
    ("max_position_embeddings", "64", "max_position_embeddings must be an integer >= 1"),
    ("tie_word_embeddings", "false", "tie_word_embeddings must be true or false, got 'false'"),
    ("rms_norm_eps", -1e-6, "rms_norm_eps must be a finite number > 0"),
    ("rope_theta", "1e4", "rope_theta must be a finite number > 0"),
    ("eos_token_id", "2", "eos_token_id must be a token id or a list of them"),
    ("architectures", "Qwen3ForCausalLM", "architectures must be a list of strings"),
    ("vocab_size", _DROP, "config.json is missing required key 'vocab_size'"),
])
def test_config_json_values_of_the_wrong_type_name_the_key(model_dir, key, value, expected):
    path = _edit_config(model_dir, **{key: value})
    with pytest.raises(RLAlignError) as err:
        load_model_config(model_dir)
    assert str(err.value).startswith(f"{path}: ") and expected in str(err.value) and "\n" not in str(err.value)


def test_every_key_the_loader_reads_is_type_checked(model_dir):
    """Each key of the loader's table refuses a value of another type (a JSON object fits none but the mappings)."""
    from rlalign.models.config import KEY_RULES
    original = (model_dir / "config.json").read_text()
    for key, (rule, _) in sorted(KEY_RULES.items()):
        (model_dir / "config.json").write_text(original)
        path = _edit_config(model_dir, **{key: "text" if rule == "a mapping" else {"unexpected": 1}})
        with pytest.raises(RLAlignError) as err:
            load_model_config(model_dir)
        assert str(err.value).startswith(f"{path}: {key} must be "), str(err.value)


# ---- prompts and chat templates ------------------------------------------------------------------------------

def test_generate_refuses_characters_the_tokenizer_cannot_encode(capsys):
    assert main(["generate", "--model", str(DEFAULT_MODEL_DIR), "--prompt", "1+2=", "--prompt", "1+é="]) == 2
    assert "the model's tokenizer cannot encode 'é' in the prompt '1+é='" in _one_line(capsys, "generate")


@pytest.mark.parametrize("template,expected", [
    ("{{ ''.__class__.__mro__ }}", r"Jinja's sandbox stopped the chat template at line 1: access to attribute "
                                    r"'__class__' of 'str' object is unsafe"),
    ("{% for m in messages %}{{ m.content }}", r"the chat template is not valid Jinja \(line 1: "),
    ("\n{{ raise_exception('no system role') }}", r"the chat template raised an error at line 2: no system role"),
    ("{{ messages[5].content }}", r"the chat template failed at line 1 \(UndefinedError: "),
])
def test_a_chat_template_jinja_refuses_is_one_line_naming_its_file(model_dir, template, expected, capsys):
    (model_dir / "chat_template.jinja").write_text(template)
    assert main(["generate", "--model", str(model_dir), "--prompt", "1+2=", "--chat"]) == 2
    err = _one_line(capsys, "generate")
    assert err.startswith(f"rlalign generate: error: {model_dir / 'chat_template.jinja'}: "), err
    assert re.search(expected, err), err


def test_the_trainer_reports_a_chat_template_error_in_one_line_too(model_dir):
    from rlalign.models.tokenizer import TokenizerError, load_tokenizer
    from rlalign.train.setup import TaskData
    (model_dir / "chat_template.jinja").write_text("{{ cycler.__init__.__globals__ }}")
    task = TaskData(lambda i: None, [], None, load_tokenizer(model_dir), chat=True)
    with pytest.raises(TokenizerError, match="chat_template.jinja: Jinja's sandbox stopped the chat template"):
        task.encode("1+2=")


# ---- datasets ------------------------------------------------------------------------------------------------

def test_parquet_without_pyarrow_names_the_package_to_install(tmp_path, monkeypatch, capsys):
    data = tmp_path / "train.parquet"
    data.write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)   # `import pyarrow.parquet` now raises ImportError
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    from rlalign.tasks.datasets import DatasetError, load_dataset
    with pytest.raises(DatasetError, match=rf"{data}: reading a .parquet file needs the pyarrow package, which is not "
                                           r"installed here: pip install pyarrow"):
        load_dataset(data)
    assert main(["train", "--dry-run", "task.name=dataset", f"task.path={data}", "task.reward=gsm8k"]) == 2
    assert "pip install pyarrow" in _one_line(capsys, "train")


@pytest.mark.parametrize("case", ["hub name", "missing column", "unreadable file", "reward model architecture"])
def test_data_and_reward_model_errors_are_one_line_at_the_cli(tmp_path, capsys, case):
    import json
    from rlalign.models.testing import make_tiny_reward_model
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"question": "1+1=", "answer": "2"}) + "\n")
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"PAR1 but not parquet")
    rm = make_tiny_reward_model(tmp_path / "rm", "qwen3")
    config = json.loads((rm / "config.json").read_text())
    (rm / "config.json").write_text(json.dumps({**config, "architectures": ["Qwen3ForTokenClassification"]}))
    args, expected = {
        "hub name": (["task.path=openai/gsm8k", "task.reward=math"], "never downloads a Hugging Face Hub dataset"),
        "missing column": ([f"task.path={data}", "task.reward=math"], "d.jsonl:1: missing field 'prompt'"),
        "unreadable file": ([f"task.path={bad}", "task.reward=math"], "bad.parquet: cannot read parquet"),
        "reward model architecture": ([f"task.path={data}", "task.columns={prompt: question}",
                                       f"task.rewards=[{{reward_model: {rm}}}]"], "is not a supported reward model"),
    }[case]
    assert main(["train", "--dry-run", "task.name=dataset", *args]) == 2
    assert expected in _one_line(capsys, "train")


# ---- integer options -----------------------------------------------------------------------------------------

def test_parity_train_batch_0_is_one_line(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["parity", "--train-batch", "0"])
    assert exit_.value.code == 2
    assert _one_line(capsys, "parity") == ("rlalign parity: error: argument --train-batch: must be an integer >= 1, "
                                           "got '0' (see rlalign parity --help)")


def _commands():
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name in ("generate", "parity", "doctor"):
        yield name, [name], sub.choices[name]
    bench = next(a for a in sub.choices["bench"]._actions if isinstance(a, argparse._SubParsersAction))
    yield "bench rollout", ["bench", "rollout"], bench.choices["rollout"]


COMMANDS = list(_commands())


@pytest.mark.parametrize("name,argv,parser", COMMANDS, ids=[c[0] for c in COMMANDS])
def test_every_integer_option_declares_its_range_and_refuses_values_outside_it(name, argv, parser, capsys):
    """No option is a bare ``type=int``; each typed option refuses 0 or -1 and text in one line."""
    options = [a for a in parser._actions if a.type is not None and a.option_strings]
    assert not [a.option_strings for a in options if a.type is int], "use rlalign.bench.args' integer types"
    for action in options:
        if action.type in (float, str) or getattr(action.type, "__module__", "") != "rlalign.bench.args":
            continue
        for bad in ("-1", "x", "0" if action.type.__name__ == "positive_int" else "-5"):
            with pytest.raises(SystemExit) as exit_:
                main([*argv, action.option_strings[0], bad])
            assert exit_.value.code == 2
            err = _one_line(capsys, name)
            assert f"argument {action.option_strings[0]}: must be an integer" in err, err


# ---- generate --n --------------------------------------------------------------------------------------------

def test_generate_refuses_completions_that_would_not_fit_before_any_work(monkeypatch, capsys):
    from rlalign.cli import generate
    from rlalign.train import config
    monkeypatch.setattr(config, "host_memory_bytes", lambda: 8 * 2**30)
    monkeypatch.setattr(generate, "load_model", lambda *a, **k: pytest.fail("the model loaded before the size check"))
    assert main(["generate", "--model", str(DEFAULT_MODEL_DIR), "--prompt", "1+2=", "--n", "1000000"]) == 2
    assert _one_line(capsys, "generate") == (
        "rlalign generate: error: --n 1000000 x 1 prompt(s) = 1000000 sequences would take about 10 GiB of host "
        "memory (estimated 2048 B + 256 B per new token each), more than half of this machine's 8 GiB; lower --n or "
        "--max-new-tokens")


def test_generate_n_past_any_machine_stops_at_once():
    """The command as a user runs it (a child with an address-space limit, so a regression fails instead of eating
    the machine's memory)."""
    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (8 * 2**30, 8 * 2**30))
    out = subprocess.run([sys.executable, "-m", "rlalign.cli.main", "generate", "--model", str(DEFAULT_MODEL_DIR),
                          "--prompt", "1+2=", "--n", "1000000000"], capture_output=True, text=True, timeout=120,
                         preexec_fn=limit, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip().startswith("rlalign generate: error: --n 1000000000 x 1 prompt(s) = 1000000000 "
                                         "sequences would take about 9537 GiB of host memory")


# ---- RLALIGN_* environment variables -----------------------------------------------------------------------

@pytest.fixture()
def run_dir(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 0, "eval/accuracy": 0.1}) + "\n"
                                            + json.dumps({"step": 1, "reward/mean": 0.5}) + "\n")
    return tmp_path


@pytest.mark.parametrize("name,value", [("RLALIGN_CPU_KERNELS", "yes"), ("RLALIGN_TRITON_DISABLE", "linaer"),
                                        ("RLALIGN_CACHE_DIR", "relative/cache"), ("RLALIGN_BACKEND", "tourch")])
def test_garbage_in_a_variable_stops_the_command_with_one_line(name, value, run_dir, monkeypatch, capsys):
    assert main(["report", str(run_dir)]) == 0
    capsys.readouterr()
    monkeypatch.setenv(name, value)
    assert main(["report", str(run_dir)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"rlalign report: error: {name}={value!r} is not allowed: it must be ") and "\n" not in err


def test_the_readers_refuse_garbage_too(monkeypatch, tmp_path):
    """Library use (no CLI): the variable is checked where it is read."""
    from rlalign.ops import _dispatch
    from rlalign.ops.torch_backend import clib
    try:
        monkeypatch.setenv("RLALIGN_CPU_KERNELS", "off")
        _dispatch.refresh_env()
        with pytest.raises(RLAlignError, match="RLALIGN_CPU_KERNELS='off' is not allowed"):
            clib.enabled()
        monkeypatch.delenv("RLALIGN_CPU_KERNELS")
        monkeypatch.setenv("RLALIGN_TRITON_DISABLE", "attention,bogus")
        _dispatch.refresh_env()
        with pytest.raises(RLAlignError, match="RLALIGN_TRITON_DISABLE='attention,bogus' is not allowed"):
            _dispatch.strict_impl("linear", torch.device("cpu"))
        monkeypatch.setenv("RLALIGN_CACHE_DIR", str(tmp_path / "a-file"))
        (tmp_path / "a-file").write_text("")
        with pytest.raises(RLAlignError, match="RLALIGN_CACHE_DIR=.* is not allowed: it must be an absolute directory"):
            clib._build()
    finally:
        monkeypatch.undo()
        _dispatch.refresh_env()
