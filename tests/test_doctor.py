import json
import os
import subprocess
import sys

from rlalign import doctor


def test_doctor_json_is_green_on_this_machine():
    out = subprocess.run([sys.executable, "-m", "rlalign.cli.main", "doctor", "--json"], capture_output=True,
                         text=True, timeout=600)
    report = json.loads(out.stdout)
    assert out.returncode == 0, [c for c in report["checks"] if not c["holds"]]
    assert report["ok"] is True and report["device"] == "cpu"
    assert {c["op"] for c in report["checks"]} >= {"linear", "rms_norm", "attention", "logprob/entropy", "sample", "model",
                                                "delta_chunks"}
    assert all(set(c) >= {"op", "invariance", "holds"} for c in report["checks"])
    assert report["environment"]["torch"]
    assert {c["op"] for c in report["checks"]} >= {"MKL (library)", "across machines"}
    assert report["environment"]["cpu_capability"] and "mkl_branch" in report["environment"]


def test_cross_machine_mode_pins_mkl_and_the_probe_equals_the_reference():
    """With RLALIGN_CPU_CROSS_MACHINE=1 the CLI pins MKL before any work; the probe through every strict op then
    has the reference bits (recorded on another code path's machine: docs/cpu.md, "Across machines")."""
    code = ("import json, sys; from rlalign.cli.main import main; from rlalign import mklmode; mklmode.pin(); "
            "from rlalign.doctor import machine; import torch; "
            "print(json.dumps([c.run(torch.device('cpu'), None) for c in machine.CHECKS] + [mklmode.branch()]))")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MKL_")}
    env["RLALIGN_CPU_CROSS_MACHINE"] = "1"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    (mkl_holds, mkl_detail), (probe_holds, probe_detail), branch = json.loads(out.stdout)
    assert mkl_holds and probe_holds, (mkl_detail, probe_detail)
    assert branch in ("COMPATIBLE", None)


def test_machine_probe_names_the_ops_that_differ_from_the_reference(monkeypatch, tmp_path):
    from rlalign.doctor import machine

    ref = machine.reference()
    ref["ops"]["rope"] = "0" * 16
    planted = tmp_path / "reference.json"
    planted.write_text(json.dumps(ref))
    monkeypatch.setattr(machine, "REFERENCE", planted)
    holds, detail = machine.compare()
    assert not holds and "rope" in detail.split("in: ")[1].split(", ")


def test_doctor_reports_a_violation(monkeypatch):
    broken = doctor.Check("linear", "planted violation", lambda dev, gen: (False, "row 3 differs"))
    crashing = doctor.Check("rms_norm", "planted crash", lambda dev, gen: 1 / 0)
    monkeypatch.setattr(doctor, "CHECKS", (broken, crashing))
    results, _ = doctor.run_checks("cpu", seed=1)
    assert [r.holds for r in results] == [False, False]
    assert results[0].detail == "row 3 differs" and "ZeroDivisionError" in results[1].detail


def test_bmm_check_covers_exactly_the_shapes_the_backend_tiles(monkeypatch):
    """The bmm == mm check is an assumption of the library-tile route only: a (K, N) whose tile fails
    primitives.tiles_hold runs the compiled kernel, so the check skips it and names it (an AVX-512 Xeon's MKL
    breaks bmm == mm at K = N = 1,024, where the route never uses it); with every shape refused it does not hold
    (nothing would have been checked)."""
    import torch
    from rlalign.ops.torch_backend import primitives
    monkeypatch.setattr(primitives, "tiles_hold", lambda k, n, threads: (k, n) == (16, 128))
    holds, detail = doctor.library.bmm_equals_mm(torch.device("cpu"), torch.Generator().manual_seed(0))
    assert holds and detail == ("not relied on (compiled kernel): K=48 N=128, K=128 N=15, K=64 N=1024, K=256 N=768, "
                                "K=1024 N=1024"), detail
    monkeypatch.setattr(primitives, "tiles_hold", lambda k, n, threads: False)
    holds, detail = doctor.library.bmm_equals_mm(torch.device("cpu"), torch.Generator().manual_seed(0))
    assert not holds and "no shape left to check" in detail



def test_attention_tile_check_names_the_routed_widths_and_needs_the_kernels_for_them(monkeypatch):
    """A width whose library GEMM fails gemms.items_hold runs the compiled row kernel: named, not re-checked; without
    the kernels strict raises there, so the check does not hold. The widths kept on the library are re-checked."""
    import torch
    from rlalign.ops.torch_backend import clib
    from rlalign.ops.torch_backend.attention import gemms
    monkeypatch.setattr(gemms, "items_hold", lambda m, k, n, transpose_b, threads: n != 6)
    monkeypatch.setattr(gemms, "items_hold_on", lambda *shape: True)   # the re-check is planted last
    holds, detail = doctor.library.attention_tile_rows(torch.device("cpu"), torch.Generator().manual_seed(0))
    assert holds and detail == "compiled row kernel: p.v D=6", detail
    monkeypatch.setattr(clib, "library", lambda: None)
    holds, detail = doctor.library.attention_tile_rows(torch.device("cpu"), torch.Generator().manual_seed(0))
    assert not holds and detail.endswith("(strict raises there): p.v D=6"), detail
    monkeypatch.setattr(gemms, "items_hold_on", lambda *shape: False)
    monkeypatch.setattr(gemms, "items_hold", lambda *shape: True)
    holds, detail = doctor.library.attention_tile_rows(torch.device("cpu"), torch.Generator().manual_seed(0))
    assert not holds and detail.startswith("q.k D=2:"), detail

def test_three_paths_check_names_the_path_that_differs(monkeypatch):
    """The model check catches a paged path one ulp off the packed forward (here: planted in the paged attention's
    output) and names the family, dtype, path and sequence; unplanted it holds."""
    import torch
    from rlalign.doctor import paths
    from rlalign.models import blocks
    holds, detail = paths.check_three_paths(torch.device("cpu"), torch.Generator().manual_seed(3))
    assert holds, detail
    paged = blocks.PagedAttend.__call__

    def one_ulp_off(self, q, k, v, layer, scale):
        out = paged(self, q, k, v, layer, scale)
        return torch.nextafter(out, torch.full_like(out, float("inf")))
    monkeypatch.setattr(blocks.PagedAttend, "__call__", one_ulp_off)
    holds, detail = paths.check_three_paths(torch.device("cpu"), torch.Generator().manual_seed(3))
    assert not holds
    assert detail.startswith("qwen3 (q/k norm, head_dim 16) fp32: one-shot prefill: hidden rows of sequence"), detail
