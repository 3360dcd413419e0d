"""The benchmarks' peaks follow the card: ``rlalign bench rollout`` and ``benchmarks/train_step.py`` take the spec
figures of the card ``torch.cuda.get_device_name()`` names (rlalign/bench/cards.py), a flag overrides them, an
unknown card needs the flags (one line), and the JSON says which figures were used and where they came from. The
card's name is monkeypatched: these run on the CPU."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import pytest
import torch
from hypothesis import given, strategies as st

from rlalign.bench import cards
from rlalign.bench import rollout as bench_rollout
from rlalign.bench.cards import CARDS, FLAG, SPEC, UnknownCardError, card_spec, resolve_peaks
from rlalign.cli.main import main

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "train_step.py"
_spec = importlib.util.spec_from_file_location("bench_train_step_cards", _PATH)
train_step = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(train_step)

# (get_device_name, HBM GB/s, dense bf16 TFLOP/s) as the datasheets give them
KNOWN = [("NVIDIA H100 80GB HBM3", 3350.0, 989.0), ("NVIDIA H200", 4800.0, 989.0),
         ("NVIDIA H200 141GB HBM3e", 4800.0, 989.0), ("NVIDIA H100 PCIe", 2000.0, 756.0),
         ("NVIDIA A100-SXM4-80GB", 2039.0, 312.0), ("NVIDIA A100-SXM4-40GB", 1555.0, 312.0),
         ("NVIDIA A100-PCIE-40GB", 1555.0, 312.0)]
UNKNOWN = ["NVIDIA H200 NVL", "NVIDIA GH200 480GB", "NVIDIA H100 NVL", "NVIDIA A100 80GB PCIe", "NVIDIA L40S",
           "NVIDIA GeForce RTX 4090", "Tesla V100-SXM2-16GB", ""]


@pytest.fixture
def card(monkeypatch):
    """Set the name torch.cuda.get_device_name() reports."""
    def set_name(name: str) -> None:
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: name)
    return set_name


@pytest.mark.parametrize("name, gbps, tflops", KNOWN)
def test_known_cards_have_their_datasheet_figures(name, gbps, tflops):
    spec = card_spec(name)
    assert spec is not None and (spec.peak_gbps, spec.peak_tflops) == (gbps, tflops)
    peaks = resolve_peaks(name)
    assert (peaks.card, peaks.peak_gbps, peaks.peak_tflops) == (name, gbps, tflops)
    assert (peaks.peak_gbps_source, peaks.peak_tflops_source) == (SPEC, SPEC) and "datasheet" in peaks.datasheet


@pytest.mark.parametrize("name", UNKNOWN)
def test_unknown_cards_need_both_flags(name):
    assert card_spec(name) is None
    with pytest.raises(UnknownCardError) as exc:
        resolve_peaks(name)
    message = str(exc.value)
    assert "\n" not in message and repr(name) in message and "--peak-gbps and --peak-tflops" in message
    with pytest.raises(UnknownCardError, match=r"give --peak-tflops$"):
        resolve_peaks(name, peak_gbps=100.0)
    peaks = resolve_peaks(name, 100.0, 50.0)
    assert (peaks.peak_gbps, peaks.peak_tflops, peaks.peak_gbps_source, peaks.peak_tflops_source) == \
        (100.0, 50.0, FLAG, FLAG) and peaks.datasheet is None


@given(name=st.sampled_from([n for n, _, _ in KNOWN] + UNKNOWN), gbps=st.none() | st.floats(0.1, 1e5),
       tflops=st.none() | st.floats(0.1, 1e4))
def test_a_flag_wins_and_the_spec_fills_the_rest(name, gbps, tflops):
    """Over every card and flag combination: a given flag is used as given (source "flag"); a missing one is the
    card's spec figure (source "spec") or, for an unknown card, an error naming exactly the missing flags."""
    spec = card_spec(name)
    try:
        peaks = resolve_peaks(name, gbps, tflops)
    except UnknownCardError as exc:
        assert spec is None and (gbps is None or tflops is None)
        assert ("--peak-gbps" in str(exc)) == (gbps is None) and ("--peak-tflops" in str(exc)) == (tflops is None)
        return
    for key, given_value in (("peak_gbps", gbps), ("peak_tflops", tflops)):
        if given_value is not None:
            assert getattr(peaks, key) == given_value and getattr(peaks, key + "_source") == FLAG
        else:
            assert getattr(peaks, key) == getattr(spec, key) and getattr(peaks, key + "_source") == SPEC
    assert (peaks.datasheet is not None) == (SPEC in (peaks.peak_gbps_source, peaks.peak_tflops_source))


def test_no_card_takes_only_the_flags():
    assert resolve_peaks(None).as_json() == {"card": None, "peak_gbps": None, "peak_tflops": None,
                                             "peak_gbps_source": None, "peak_tflops_source": None, "datasheet": None}
    assert resolve_peaks(None, 5.0).peak_gbps_source == FLAG


def test_the_table_names_each_card_once_with_positive_figures():
    assert all(s.peak_gbps > 0 and s.peak_tflops > 0 and s.datasheet for s in CARDS.values())
    assert all(card_spec(name) is spec for name, spec in CARDS.items())


# ---- rlalign bench rollout ------------------------------------------------------------------------

def _rollout_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench_rollout.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_rollout_reads_the_card_on_cuda(card):
    card("NVIDIA H100 80GB HBM3")
    peaks = bench_rollout.run_peaks(_rollout_args("--device", "cuda"))
    assert (peaks.card, peaks.peak_gbps, peaks.peak_tflops) == ("NVIDIA H100 80GB HBM3", 3350.0, 989.0)
    card("NVIDIA H200")
    peaks = bench_rollout.run_peaks(_rollout_args("--device", "cuda", "--peak-gbps", "4300"))
    assert (peaks.peak_gbps, peaks.peak_gbps_source, peaks.peak_tflops, peaks.peak_tflops_source) == \
        (4300.0, FLAG, 989.0, SPEC)


def test_rollout_on_the_cpu_never_reads_a_card(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: pytest.fail("read a card on the CPU"))
    peaks = bench_rollout.run_peaks(_rollout_args("--peak-gbps", "10"))
    assert (peaks.card, peaks.peak_gbps, peaks.peak_gbps_source, peaks.peak_tflops) == (None, 10.0, FLAG, None)


def test_rollout_on_an_unknown_card_stops_with_one_line_before_any_work(card, monkeypatch, capsys):
    card("NVIDIA L40S")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench_rollout, "_model_dir", lambda *a: pytest.fail("did work before refusing"))
    assert main(["bench", "rollout", "--device", "cuda", "--workload", "tiny", "--engines", "strict"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("rlalign bench rollout: error: no spec figures for the card "
                                               "'NVIDIA L40S'") and "--peak-gbps and --peak-tflops" in err[0]


# ---- benchmarks/train_step.py ---------------------------------------------------------------------

def test_train_step_mfu_peak_follows_the_card(card):
    card("NVIDIA H100 80GB HBM3")
    args = train_step.parse_args(["--device", "cuda"])
    assert (args.card, args.peak_tflops, args.peak_source) == ("NVIDIA H100 80GB HBM3", 989.0, SPEC)
    assert args.ceiling_tflops is None and args.ceiling_source is None   # no cuBLAS ceiling measured on an H100
    card("NVIDIA A100-SXM4-80GB")
    assert train_step.parse_args(["--device", "cuda"]).peak_tflops == 312.0
    card("NVIDIA H200")
    args = train_step.parse_args(["--device", "cuda"])
    assert (args.peak_tflops, args.peak_source, args.ceiling_tflops, args.ceiling_source) == \
        (989.0, SPEC, 780.0, "measured")
    args = train_step.parse_args(["--device", "cuda", "--peak-tflops", "900", "--ceiling-tflops", "700"])
    assert (args.peak_tflops, args.peak_source, args.ceiling_tflops, args.ceiling_source) == (900.0, FLAG, 700.0, FLAG)


def test_train_step_on_an_unknown_card_needs_the_flag(card, capsys):
    card("NVIDIA L40S")
    with pytest.raises(SystemExit) as exc:
        train_step.parse_args(["--device", "cuda"])
    assert exc.value.code == 2
    assert "no spec figures for the card 'NVIDIA L40S'" in capsys.readouterr().err
    args = train_step.parse_args(["--device", "cuda", "--peak-tflops", "362"])
    assert (args.peak_tflops, args.peak_source, args.ceiling_tflops) == (362.0, FLAG, None)
    # a variant's worker process needs no peak: it never reads the card
    assert train_step.parse_args(["--device", "cuda", "--worker", "strict"]).card is None


def test_train_step_table_without_a_ceiling():
    result = {"shape": {"shape": "tiny", "layers": 2, "tokens": 8, "sequences": 1, "longest": 8, "dtype": "bfloat16"},
              "device": "NVIDIA H100 80GB HBM3", "flops": {"total_flops": 1e12}, "peak_tflops": 989.0,
              "ceiling_tflops": None, "ratios": {},
              "rows": [{"variant": "strict", "ms": 10.0, "tokens_per_s": 800.0, "peak_gib": 1.0, "saved_gib": 0.5,
                        "loss": 1.0, "mfu": 0.5, "mfu_vs_cublas_ceiling": None}]}
    line = train_step._table(result).splitlines()[1]
    assert "MFU 50.0% of 989" in line and "% of None" not in line


def test_cards_module_reads_the_name_through_torch(card):
    card("NVIDIA H200")
    assert cards.cuda_card() == "NVIDIA H200"
