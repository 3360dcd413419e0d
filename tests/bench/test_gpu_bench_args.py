"""The benchmark scripts refuse bad sizes with one line and exit code 2 before they look for a GPU (so the refusal is
checked here, on the CPU): benchmarks/gpu_attention.py's --sweep-batches / --sweep-shape, benchmarks/gpu_linear.py's --ws-m /
--ws-deep-ring / --ws-stop-after (and its sweep-only options without --sweep-ws), benchmarks/gpu_moe.py's --tokens, benchmarks/collectives.py's --tokens / --buckets; the lists all go through
rlalign.bench.args.positive_ints, whose class is tested here too."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, strategies as st

from rlalign.bench.args import positive_ints

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _run(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BENCH / script), *args], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("args, message", [
    (("--sweep-batches", "0,8"), "--sweep-batches '0,8': comma-separated batch sizes, each >= 1"),
    (("--sweep-batches", "8,x"), "--sweep-batches '8,x'"),
    (("--sweep-shape", "512,32"), "--sweep-shape '512,32': CTX,HQ,HKV"),
    (("--sweep-shape", "512,30,8"), "HQ a multiple of HKV"),
    (("--sweep-shape=-1,32,8",), "each >= 1")])
def test_gpu_attention_refuses_bad_sweep_sizes(args, message):
    proc = _run("gpu_attention.py", "--sweep-decode", *args)
    assert proc.returncode == 2 and message in proc.stdout, (proc.returncode, proc.stdout, proc.stderr[-500:])


@pytest.mark.parametrize("args, message", [
    (("--ws-m=0,462",), "--ws-m '0,462': comma-separated row counts, each >= 1"),
    (("--ws-m=-3",), "each >= 1"), (("--ws-m", "x"), "--ws-m 'x'"),
    (("--ws-deep-ring",), "--ws-deep-ring needs --ws-shapes 8b-p4"),
    (("--ws-stop-after", "0"), "--ws-stop-after 0.0: seconds, > 0"),
    (("--ws-stop-after=-5",), "seconds, > 0")])
def test_gpu_linear_refuses_bad_sweep_sizes(args, message):
    proc = _run("gpu_linear.py", "--sweep-ws", *args)
    assert proc.returncode == 2 and message in proc.stdout, (proc.returncode, proc.stdout, proc.stderr[-500:])


def test_gpu_attention_small_tiles_need_the_decode_sweep():
    proc = _run("gpu_attention.py", "--sweep-small-tiles")
    assert proc.returncode == 2 and "only applies to --sweep-decode" in proc.stdout, (proc.returncode, proc.stdout)


@pytest.mark.parametrize("args", [("--ws-small",), ("--ws-stop-after", "30")])
def test_gpu_linear_sweep_options_need_the_sweep(args):
    proc = _run("gpu_linear.py", *args)
    assert proc.returncode == 2 and "only apply to --sweep-ws" in proc.stdout, (proc.returncode, proc.stdout)


@given(st.lists(st.integers(-3, 10 ** 6), min_size=1, max_size=6))
def test_positive_ints_takes_exactly_lists_of_counts_of_at_least_one(values):
    text = ",".join(map(str, values))
    assert positive_ints(text) == (tuple(values) if min(values) >= 1 else None)
    assert positive_ints(text, len(values) + 1) is None


@pytest.mark.parametrize("text", ["", ",", "4,", "x", "4;8", "1.5", " ", "4,,8"])
def test_positive_ints_refuses_malformed_lists(text):
    assert positive_ints(text) is None


@pytest.mark.parametrize("script, args, message", [
    ("gpu_moe.py", ("--tokens", "4096,0"), "--tokens '4096,0': comma-separated token counts, each >= 1"),
    ("collectives.py", ("--out", "unused", "--buckets", "x"), "--buckets 'x': comma-separated counts, each >= 1"),
    ("collectives.py", ("--out", "unused", "--tokens=-8"), "--tokens '-8'")])
def test_other_scripts_refuse_bad_count_lists(script, args, message):
    proc = _run(script, *args)
    assert proc.returncode == 2 and message in proc.stderr, (proc.returncode, proc.stdout, proc.stderr[-500:])
