import json
import subprocess
import sys

from rlalign import doctor


def test_doctor_json_is_green_on_this_machine():
    out = subprocess.run([sys.executable, "-m", "rlalign.cli.main", "doctor", "--json"], capture_output=True,
                         text=True, timeout=600)
    report = json.loads(out.stdout)
    assert out.returncode == 0, [c for c in report["checks"] if not c["holds"]]
    assert report["ok"] is True and report["device"] == "cpu"
    assert {c["op"] for c in report["checks"]} >= {"linear", "rms_norm", "attention", "logprob/entropy", "sample"}
    assert all(set(c) >= {"op", "invariance", "holds"} for c in report["checks"])
    assert report["environment"]["torch"]


def test_doctor_reports_a_violation(monkeypatch):
    broken = doctor.Check("linear", "planted violation", lambda dev, gen: (False, "row 3 differs"))
    crashing = doctor.Check("rms_norm", "planted crash", lambda dev, gen: 1 / 0)
    monkeypatch.setattr(doctor, "CHECKS", (broken, crashing))
    results, _ = doctor.run_checks("cpu", seed=1)
    assert [r.holds for r in results] == [False, False]
    assert results[0].detail == "row 3 differs" and "ZeroDivisionError" in results[1].detail
