"""Triton launch choices are a function of the shapes and the architecture only, never of the card: the SM count
they read is the architecture's reference count (an H100 PCIe, an H100 SXM and an H200 all launch as 132 SMs), and
no module but ``triton_backend._common`` asks the card for its SM count, memory size or clock."""

from __future__ import annotations

import importlib.util
import re
import types
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[2]


def _load_common():
    """``triton_backend/_common.py`` on its own: the package refuses to import without CUDA or the interpreter,
    and this module's facts (no kernel) are what is tested."""
    spec = importlib.util.spec_from_file_location("_launch_common_under_test",
                                                  ROOT / "rlalign" / "ops" / "triton_backend" / "_common.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_common = _load_common()


@pytest.mark.parametrize("card_sms", [1, 78, 114, 132, 144])
def test_hopper_cards_launch_as_the_reference_count(monkeypatch, card_sms):
    props = types.SimpleNamespace(major=9, minor=0, multi_processor_count=card_sms)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)
    _common.num_sms.cache_clear()
    try:
        assert _common.num_sms(0) == _common.REFERENCE_SMS[(9, 0)] == 132
    finally:
        _common.num_sms.cache_clear()


def test_outside_the_table_the_card_count_is_used(monkeypatch):
    props = types.SimpleNamespace(major=8, minor=0, multi_processor_count=108)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)
    _common.num_sms.cache_clear()
    try:
        assert _common.num_sms(0) == 108
    finally:
        _common.num_sms.cache_clear()


CARD_FACTS = re.compile(r"multi_processor_count|get_device_properties|total_memory|clock_rate|\bmem_get_info\b")


def test_no_kernel_module_reads_the_cards_facts():
    backend = ROOT / "rlalign" / "ops"
    readers = sorted(str(p.relative_to(ROOT)) for p in backend.rglob("*.py")
                     if p.name != "_common.py" and CARD_FACTS.search(p.read_text()))
    assert readers == [], f"launch choices must not read the card (use _common.num_sms): {readers}"
