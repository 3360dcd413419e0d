"""The tiny arithmetic checkpoint of tests/train, shared (session scope) with the fault tests; a run directory
with real checkpoints of it, for export."""

import pytest

from rlalign.models.checkpoint import load_model
from rlalign.train.run.checkpoint_files import save_checkpoint
from tests.reliability.helpers import checkpoint_state
from tests.train.conftest import arithmetic_model_dir  # noqa: F401  (a fixture)


@pytest.fixture()
def exported_run(arithmetic_model_dir, tmp_path):
    """A run directory R with two recorded checkpoints of the arithmetic model, a user's file in it, and the
    base model; the checkpoint files are real (export loads them)."""
    model, _ = load_model(arithmetic_model_dir)
    run = tmp_path / "R"
    for step in (1, 2):
        save_checkpoint(run, step, checkpoint_state(step, arithmetic_model_dir, model), keep=2)
    (run / "metrics.jsonl").write_text('{"step": 0}\n')
    (run / "config.yaml").write_text("run:\n  steps: 2\n")
    (run / "notes.txt").write_text("the user's notes")
    return run
