"""benchmarks/reproduce.py's table of published numbers and the evidence folder, checked without running anything
heavy.

Every claim: its sentence is in the file that publishes it, with the published value in it; its command names an
existing script or CLI subcommand whose argument parser accepts it (``rlalign train`` overrides: the config loader
accepts them); its reader parses the recorded output under benchmarks/evidence/, giving the published value. The
evidence folder holds exactly what a claim or a document cites: every kept file is listed in its README with the
claims and documents that cite it, every listed or cited file exists.
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import sys
from pathlib import Path
from unittest import mock

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import reproduce  # noqa: E402

CLAIMS = reproduce.CLAIMS
COMMANDS = sorted({c.command for c in CLAIMS})


def _forms(value: float) -> set[str]:
    """The ways a published value may be written in prose (117933 -> '117,933'; 7.1 -> '7.10')."""
    forms = {f"{value:g}", f"{value:.1f}", f"{value:.2f}", f"{value:.3f}", f"{value:.4f}"}
    if float(value).is_integer():
        forms |= {f"{int(value):,}", str(int(value))}
    return forms


def test_claim_ids_are_unique():
    ids = [c.id for c in CLAIMS]
    assert len(ids) == len(set(ids)), f"duplicate claim ids: {sorted(i for i in ids if ids.count(i) > 1)}"


@pytest.mark.parametrize("claim", CLAIMS, ids=lambda c: c.id)
def test_claim_is_published_where_it_says(claim):
    text = (ROOT / claim.source).read_text()
    assert claim.sentence in text, f"{claim.id}: {claim.source} no longer says {claim.sentence!r}"
    if claim.published is None:
        assert "[pending" in claim.sentence, f"{claim.id}: an unpublished claim must point at a marked place"
        return
    assert len(claim.published) == len(claim.labels), f"{claim.id}: {claim.published} vs labels {claim.labels}"
    for value in claim.published:
        assert _forms(value) & {w for w in _tokens(claim.sentence)}, \
            f"{claim.id}: published {value} does not appear in {claim.sentence!r}"


def _tokens(sentence: str) -> set[str]:
    """Number-like words of a sentence ('**0.33-0.43x**' -> {'0.33', '0.43'})."""
    cleaned = "".join(ch if ch.isdigit() or ch in ".," else " " for ch in sentence)
    return {w.strip(".,") for w in cleaned.split() if any(ch.isdigit() for ch in w)}


@pytest.mark.parametrize("claim", CLAIMS, ids=lambda c: c.id)
def test_repeats_follow_the_rule(claim):
    if claim.repeats < 3:
        assert claim.repeats == 1 and "deterministic" in claim.why, \
            f"{claim.id}: a timing needs >= 3 runs; one run only for a deterministic result, saying why"
        assert claim.check == reproduce.EXACT or claim.check.kind == "abs", f"{claim.id}: a timing check on one run"
    assert claim.device in ("cpu", "cuda", "cuda:2")


class _Parsed(Exception):
    def __init__(self, namespace):
        self.namespace = namespace


def _parse_only(argv: list[str]):
    """Run argv's program in this process up to its argument parser; return the parsed namespace
    (argparse exits non-zero on a bad flag). Nothing after the parse runs."""
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        raise _Parsed(original(self, args, namespace))

    with mock.patch.object(argparse.ArgumentParser, "parse_args", parse_then_stop), \
            mock.patch.object(sys, "argv", argv[1:]), mock.patch.dict(os.environ), pytest.raises(_Parsed) as parsed:
        if argv[1:3] == ["-m", "rlalign.cli.main"]:
            from rlalign.cli.main import main
            main(argv[3:])
        else:
            script = ROOT / argv[1]
            assert script.is_file(), f"{argv[1]} does not exist"
            runpy.run_path(str(script), run_name="__main__")
    return parsed.value.namespace


@pytest.mark.parametrize("command", COMMANDS)
def test_command_names_a_real_program_and_parses(command, tmp_path):
    for argv in reproduce.argv_steps(command, tmp_path):
        assert argv[0] == sys.executable, f"{command}: only `rlalign ...` and `python ...` are public commands"
        args = _parse_only(argv)
        if getattr(args, "command", None) == "train":   # the overrides must be keys the config knows
            from rlalign.configlib import load_config
            from rlalign.train.config import TrainConfig
            config, overrides = args.config, list(args.overrides)
            if config is not None and "=" in config:   # `rlalign train a.b=c`: overrides only (as the CLI reads it)
                config, overrides = None, [config] + overrides
            load_config(TrainConfig, config, overrides)


RECORDED = [c for c in CLAIMS if c.recorded]


@pytest.mark.parametrize("claim", RECORDED, ids=lambda c: c.id)
def test_reader_parses_its_recorded_output(claim):
    value = claim.read((ROOT / claim.recorded).read_text())
    assert len(value) == len(claim.labels), f"{claim.id}: read {value}, labels {claim.labels}"
    if claim.published is not None and claim.recorded_matches:
        off = [(p, v) for p, v in zip(claim.published, value) if not claim.check.holds(p, v)]
        assert not off, f"{claim.id}: {claim.recorded} gives {value}, published {claim.published} ({off})"


def test_every_claim_has_its_recorded_output():
    missing = [c.id for c in CLAIMS if not c.recorded or not (ROOT / c.recorded).is_file()]
    assert not missing, f"claims without a recorded output under benchmarks/evidence/: {missing}"
    outside = [c.id for c in CLAIMS if not c.recorded.startswith(reproduce.EVIDENCE + "/")]
    assert not outside, f"recorded outputs outside {reproduce.EVIDENCE}/: {outside}"


def _claim(published, check, repeats=3):
    return reproduce.Claim("t", "README.md", "", published, ("v",), "python -c pass", "stdout",
                           lambda text: (json.loads(text)["v"],), "cpu", repeats, reproduce.TIMING, check, "")


def _runs(*values):
    return [reproduce.Run(json.dumps({"v": v}), 1.0, 0.5, 0.6) for v in values]


def test_verdicts():
    rel = reproduce.Check("rel", 0.15)
    got = reproduce.summarize(_claim((1.0,), rel), _runs(0.94, 1.03, 0.98))
    assert (got["median"], got["min"], got["max"]) == ((0.98,), (0.94,), (1.03,))
    assert got["verdict"].startswith("reproduced")
    assert reproduce.summarize(_claim((1.3,), rel), _runs(0.94, 1.03, 0.98))["verdict"].startswith("NOT")
    assert reproduce.summarize(_claim(None, rel), _runs(1.0))["verdict"] == "not published"
    exact = reproduce.summarize(_claim((0.0,), reproduce.EXACT, 1), _runs(1))
    assert exact["verdict"].startswith("NOT")
    failed = reproduce.summarize(_claim((1.0,), rel), [reproduce.Run(None, 1.0, 0.5, 0.5, "rc=2 in `x`")])
    assert failed["verdict"] == "command failed" and "rc=2" in failed["error"]
    unreadable = reproduce.summarize(_claim((1.0,), rel), [reproduce.Run("{}", 1.0, 0.5, 0.5)])
    assert unreadable["verdict"] == "command failed" and "could not read" in unreadable["error"]


def test_main_runs_a_claim_end_to_end(monkeypatch, tmp_path, capsys):
    claim = reproduce.Claim("echo", "README.md", "", (2.0,), ("v",),
                            "python -c \"import json; print(json.dumps(dict(v=2.0)))\"", "stdout",
                            lambda text: (json.loads(text)["v"],), "cpu", 1, reproduce.DETERMINISTIC,
                            reproduce.EXACT, "")
    monkeypatch.setattr(reproduce, "CLAIMS", (claim,))
    out = tmp_path / "result.json"
    assert reproduce.main(["--json", str(out), "--save-outputs", str(tmp_path / "raw")]) == 0
    printed = capsys.readouterr().out
    assert "reproduced: 2" in printed and "load average" in printed
    assert json.loads(out.read_text())["claims"][0]["verdict"].startswith("reproduced")
    assert json.loads((tmp_path / "raw" / "echo_1.json").read_text()) == {"v": 2.0}


def test_unknown_claim_id_is_one_clear_line():
    with pytest.raises(SystemExit, match="unknown claim"):
        reproduce.select("no-such-claim", None)


ROLLOUT_CLAIMS = [c for c in CLAIMS if c.command.startswith("rlalign bench rollout")]


@pytest.mark.parametrize("claim", ROLLOUT_CLAIMS, ids=lambda c: c.id)
def test_rollout_claims_name_the_peaks_their_recorded_output_used(claim, tmp_path):
    """The benchmark's default peaks follow the card (rlalign/bench/cards.py): a published roofline fraction keeps
    its meaning only if its command names the peaks its recorded output was computed with."""
    (argv,) = reproduce.argv_steps(claim.command, tmp_path)
    args = _parse_only(argv)
    text = (ROOT / claim.recorded).read_text()
    recorded = reproduce._json_tail(text)["workload"]
    assert args.peak_gbps == recorded["peak_gbps"], f"{claim.id}: --peak-gbps {args.peak_gbps}, recorded {recorded}"
    # outputs recorded before the per-op roofline existed have no peak_tflops: the CUDA default of then, 780
    assert args.peak_tflops == recorded.get("peak_tflops", 780.0), f"{claim.id}: --peak-tflops {args.peak_tflops}"
