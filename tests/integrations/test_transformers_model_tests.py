"""transformers' own model tests (scripts/transformers_model_tests.py) on the patched models.

Opt-in (about 2 minutes on 2 cores, and it needs transformers' sdist): set ``TRANSFORMERS_SDIST_PATH`` to
``transformers-<installed version>.tar.gz`` (``pip download --no-binary :all: --no-deps transformers==X``).
Patched, no test crashes; a test fails only on a one-line refusal of the patch, or because it asserts that the
config names another attention implementation than ``rlalign`` (the one that runs); and Qwen3-MoE is as good as
the dense Qwen3: every test the patched Qwen3 passes, the patched Qwen3-MoE passes too, unless it refuses a
sliding-window model (transformers' Qwen3-MoE attention honours ``config.sliding_window`` by itself, which one
test sets; the dense attention ignores it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("parameterized")   # transformers' test_modeling_common imports it

SDIST = os.environ.get("TRANSFORMERS_SDIST_PATH")
SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "transformers_model_tests.py"
ATTENTION_NAME_CHECKS = {"test_can_set_attention_dynamically", "test_sdpa_can_dispatch_non_composite_models"}

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not SDIST, reason="set TRANSFORMERS_SDIST_PATH=transformers-X.tar.gz to run "
                                                  "transformers' model tests (scripts/transformers_model_tests.py)")]


@pytest.fixture(scope="module")
def patched(tmp_path_factory):
    out = tmp_path_factory.mktemp("tf_model_tests")
    subprocess.run([sys.executable, str(SCRIPT), "--sdist", SDIST, "--workdir", str(out), "--modes", "patched",
                    "--families", "qwen3", "qwen3_moe", "--json", str(out / "results.json")], check=True)
    results = json.loads((out / "results.json").read_text())
    return {family: {r["test"]: r for r in modes["patched"]} for family, modes in results.items()}


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_patched_models_never_crash_or_compute_wrong(patched, family):
    records = patched[family].values()
    assert not [r for r in records if r["outcome"] == "crashed"]
    assert {r["test"] for r in records if r["outcome"] == "wrong"} <= ATTENTION_NAME_CHECKS
    for r in records:
        if r["outcome"] == "refused":
            assert "rlalign" in r["error"] and "\n" not in r["error"], r


def test_moe_is_as_good_as_dense(patched):
    dense, moe = patched["qwen3"], patched["qwen3_moe"]
    worse = {name: moe[name] for name, r in dense.items()
             if r["outcome"] == "passed" and moe[name]["outcome"] != "passed"
             and "sliding-window" not in moe[name]["error"]}
    assert not worse, worse
