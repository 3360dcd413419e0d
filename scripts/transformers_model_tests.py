#!/usr/bin/env python
"""Run transformers' own model tests (``ModelTesterMixin``, rebuilt from its source distribution) on the
``*ForCausalLM`` of every family rlalign patches, unpatched and with ``rlalign.integrations.transformers.patch``
applied to every model the tests build, and print the outcome counts side by side.

    python scripts/transformers_model_tests.py                        # all families, both modes
    python scripts/transformers_model_tests.py --families qwen3_moe --details
    python scripts/transformers_model_tests.py --sdist transformers-5.19.0.tar.gz    # offline

What is rebuilt, and why. The sdist of transformers (``pip download --no-binary :all: --no-deps
transformers==<installed version>``) ships ``tests/test_modeling_common.py`` (``ModelTesterMixin``: 117 tests of
a model class: forward/backward, save/load, hidden-state shapes, padding, resizing, gradient checkpointing,
initialisation, export, ...) but not ``tests/models/<family>/``, ``tests/causal_lm_tester.py`` or the two modules
it imports (``tests/generation/test_utils.py``, ``tests/exporters/test_export.py``). The script extracts the
file from the sdist of the installed version, stubs the two mixins as empty classes (so the ``generate``
tests of ``GenerationTesterMixin`` and the export tests of ``ExportTesterMixin`` are not run), and writes one
test class per family: ``ModelTesterMixin`` over the family's ``*ForCausalLM`` with a small model tester
(batch 13 x 7 tokens with a random padding mask, as transformers' ``CausalLMModelTester``; the config is
rlalign's tiny config of the family: SiLU, 2 layers, 4 heads / 2 KV heads, Qwen3-MoE with 4 experts, top-2,
both layers sparse), since those are the models the patch accepts.

Patched mode wraps each family class's ``__init__`` so every instance the tests construct is patched (strict
profile) right after transformers builds it. Outcomes per test: ``passed``, ``skipped``, ``refused`` (the test
failed on an ``UnsupportedInputError`` / ``UnsupportedModelError``: the patch declined a feature with its
one-line message), ``wrong`` (an ``AssertionError``: a value or shape the test checks differs) and ``crashed``
(any other exception). ``--details`` lists each test whose outcome differs between the modes, with the first
line of its error. Needs pytest and parameterized (transformers' test dependencies) and the network for the
first download (or ``--sdist``); results are cached under ``--workdir``.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import subprocess
import sys
import tarfile
import textwrap
from pathlib import Path

FAMILIES = ("qwen3", "qwen3_moe", "qwen2", "llama")
MODES = ("unpatched", "patched")
OUTCOMES = ("passed", "skipped", "refused", "wrong", "crashed")
ENV_PATCH = "PATCH_WITH_RLALIGN"          # "1": patch every model the tests build
ENV_REPORT = "RLALIGN_TF_TESTS_REPORT"        # JSON-lines file the conftest appends one outcome per test to

# ---- files written into the rebuilt test tree --------------------------------------------------------------

CONFTEST = '''
"""Written by rlalign's scripts/transformers_model_tests.py: optional patching and outcome classification."""
import functools
import json
import os

import pytest


def _auto_patch(cls):
    from rlalign.integrations.transformers import patch
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if type(self) is cls:
            patch(self, "strict")
    cls.__init__ = __init__


def pytest_configure(config):
    if os.environ.get("%(patch)s") == "1":
        import transformers
        from rlalign.models import architectures
        for name in architectures.architectures():
            _auto_patch(getattr(transformers, name))


def _outcome(report, excinfo):
    if report.passed:
        return "passed"
    if report.skipped:
        return "skipped"
    from rlalign.integrations.transformers import UnsupportedInputError, UnsupportedModelError
    if excinfo is not None and excinfo.errisinstance((UnsupportedInputError, UnsupportedModelError)):
        return "refused"
    if excinfo is not None and excinfo.errisinstance(AssertionError):
        return "wrong"
    return "crashed"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.when == "call" or (report.when == "setup" and not report.passed):
        first = ""
        if call.excinfo is not None:
            first = (call.excinfo.exconly().strip().splitlines() or [""])[0][:300]
        with open(os.environ["%(report)s"], "a") as f:
            f.write(json.dumps({"test": item.name, "subtest": type(report).__name__ == "SubtestReport",
                                "outcome": _outcome(report, call.excinfo), "error": first}) + "\\n")
''' % {"patch": ENV_PATCH, "report": ENV_REPORT}

STUB_EXPORT = '''
class ExportTesterMixin:
    """Stub: transformers' export tests are not part of the sdist and are not run."""
'''

STUB_GENERATION = '''
class GenerationTesterMixin:
    """Stub: transformers' generate tests are not part of the sdist and are not run."""
'''

TEST_MODULE = '''
"""Written by rlalign's scripts/transformers_model_tests.py: ModelTesterMixin over each family's *ForCausalLM."""
import unittest

import transformers
from transformers.testing_utils import torch_device

from rlalign.models.testing import tiny_hf_config

from .generation.test_utils import GenerationTesterMixin
from .test_modeling_common import ModelTesterMixin, ids_tensor, random_attention_mask

OVERRIDES = dict(vocab_size=99, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8, max_position_embeddings=512, pad_token_id=0, bos_token_id=1,
                 eos_token_id=2)
FAMILY_OVERRIDES = {"qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                      norm_topk_prob=True, mlp_only_layers=[], decoder_sparse_step=1)}


class FamilyModelTester:
    """transformers' CausalLMModelTester surface: a small config of the family and padded inputs."""

    def __init__(self, parent, family, batch_size=13, seq_length=7):
        self.parent, self.family = parent, family
        self.batch_size, self.seq_length, self.is_training = batch_size, seq_length, True
        cfg = tiny_hf_config(family, **OVERRIDES, **FAMILY_OVERRIDES.get(family, {}))
        self.model_type = cfg.pop("model_type")
        cfg.pop("architectures")
        self.config_kwargs = cfg
        self.vocab_size, self.hidden_size = cfg["vocab_size"], cfg["hidden_size"]
        self.num_hidden_layers, self.num_attention_heads = cfg["num_hidden_layers"], cfg["num_attention_heads"]

    def get_config(self):
        return transformers.AutoConfig.for_model(self.model_type, **self.config_kwargs)

    def prepare_config_and_inputs_for_common(self):
        input_ids = ids_tensor([self.batch_size, self.seq_length], self.vocab_size)
        mask = random_attention_mask([self.batch_size, self.seq_length])
        return self.get_config(), {"input_ids": input_ids.to(torch_device), "attention_mask": mask.to(torch_device)}


def _test_class(family, architecture):
    model_class = getattr(transformers, architecture)

    class Test(ModelTesterMixin, GenerationTesterMixin, unittest.TestCase):
        all_model_classes = (model_class,)
        test_all_params_have_gradient = family != "qwen3_moe"    # an expert no token chose has none

        def setUp(self):
            self.model_tester = FamilyModelTester(self, family)

    Test.__name__ = Test.__qualname__ = f"{architecture}Test"
    return Test


FAMILY = "%(family)s"
from rlalign.models import architectures  # noqa: E402
globals()[f"{architectures.get(FAMILY).architecture}Test"] = _test_class(FAMILY, architectures.get(FAMILY).architecture)
'''


# ---- the steps -------------------------------------------------------------------------------------------------

def installed_version() -> str:
    import transformers
    return transformers.__version__


def obtain_sdist(version: str, workdir: Path, given: Path | None) -> Path:
    """The sdist of ``version``: ``given``, a copy already in ``workdir``, else ``pip download`` (no wheels)."""
    if given is not None:
        return given
    found = sorted(workdir.glob(f"transformers-{version}.tar.gz"))
    if found:
        return found[0]
    cmd = [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", "-d", str(workdir),
           f"transformers=={version}"]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    return workdir / f"transformers-{version}.tar.gz"


def build_tree(sdist: Path, root: Path, family: str) -> Path:
    """A package ``<root>/transformers_tests`` with test_modeling_common.py from the sdist, the stubs and the family's module."""
    tests = root / "transformers_tests"
    if root.exists():
        shutil.rmtree(root)
    (tests / "generation").mkdir(parents=True)
    (tests / "exporters").mkdir()
    with tarfile.open(sdist) as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith("/tests/test_modeling_common.py"))
        (tests / "test_modeling_common.py").write_bytes(tar.extractfile(member).read())
    for path, text in {"__init__.py": "", "generation/__init__.py": "", "exporters/__init__.py": "",
                       "generation/test_utils.py": STUB_GENERATION, "exporters/test_export.py": STUB_EXPORT,
                       "conftest.py": CONFTEST, f"test_family_{family}.py": TEST_MODULE % {"family": family}}.items():
        (tests / path).write_text(textwrap.dedent(text).lstrip())
    return tests / f"test_family_{family}.py"


def run_mode(test_file: Path, mode: str, report: Path, extra: list[str]) -> list[dict]:
    """Run the family's tests in one mode (a fresh process); returns the outcome records."""
    report.unlink(missing_ok=True)
    env = dict(os.environ, **{ENV_PATCH: "1" if mode == "patched" else "0", ENV_REPORT: str(report)})
    repo = Path(__file__).resolve().parents[1]
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(repo), env.get("PYTHONPATH", "")) if p)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", "-o", "addopts=",
           "--rootdir", str(test_file.parents[1]), str(test_file), *extra]
    subprocess.run(cmd, cwd=test_file.parents[1], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if not report.exists():
        raise SystemExit(f"no outcomes recorded for {test_file.name} ({mode}): run the command by hand:\n  "
                         + " ".join(cmd))
    return per_test([json.loads(line) for line in report.read_text().splitlines()])


# a test's outcome is the worst of its own report and its subtests' (unittest subTest)
SEVERITY = {"skipped": 0, "passed": 1, "refused": 2, "wrong": 3, "crashed": 4}


def per_test(records: list[dict]) -> list[dict]:
    """One record per test: the most severe outcome among its reports, with that report's error line."""
    worst: dict[str, dict] = {}
    for r in records:
        kept = worst.get(r["test"])
        if kept is None or SEVERITY[r["outcome"]] > SEVERITY[kept["outcome"]]:
            worst[r["test"]] = r
    return list(worst.values())


def counts(records: list[dict]) -> collections.Counter:
    return collections.Counter(r["outcome"] for r in records)


def print_table(results: dict) -> None:
    print(f"\n{'family':<10} {'mode':<10} {'tests':>5} " + " ".join(f"{o:>8}" for o in OUTCOMES))
    for family, modes in results.items():
        for mode, records in modes.items():
            c = counts(records)
            print(f"{family:<10} {mode:<10} {len(records):>5} " + " ".join(f"{c[o]:>8}" for o in OUTCOMES))


def print_details(results: dict) -> None:
    for family, modes in results.items():
        if len(modes) < 2:
            continue
        before = {r["test"]: r for r in modes["unpatched"]}
        print(f"\n{family}: tests whose outcome differs (unpatched -> patched)")
        for r in sorted(modes["patched"], key=lambda r: (r["outcome"], r["test"])):
            b = before.get(r["test"])
            if b is None or b["outcome"] != r["outcome"]:
                print(f"  {r['test']}: {b['outcome'] if b else '?'} -> {r['outcome']}  {r['error']}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--sdist", type=Path, help="transformers-<installed version>.tar.gz (default: pip download)")
    ap.add_argument("--workdir", type=Path, default=Path.home() / ".cache" / "rlalign" / "transformers-model-tests")
    ap.add_argument("--details", action="store_true", help="list the tests whose outcome the patch changes")
    ap.add_argument("--json", type=Path, help="also write every outcome record to this file")
    ap.add_argument("pytest_args", nargs="*", help="passed to pytest after --, e.g. -- -k hidden_states")
    args = ap.parse_args(argv)
    version = installed_version()
    args.workdir.mkdir(parents=True, exist_ok=True)
    sdist = obtain_sdist(version, args.workdir, args.sdist)
    results: dict[str, dict[str, list[dict]]] = {}
    for family in args.families:
        test_file = build_tree(sdist, args.workdir / f"tree-{family}", family)
        for mode in args.modes:
            print(f"transformers {version} model tests: {family}, {mode} ...", flush=True)
            records = run_mode(test_file, mode, args.workdir / f"{family}-{mode}.jsonl", args.pytest_args)
            results.setdefault(family, {})[mode] = records
    print_table(results)
    if args.details:
        print_details(results)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
