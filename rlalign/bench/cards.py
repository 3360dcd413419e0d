"""The spec figures of a GPU, by the name ``torch.cuda.get_device_name()`` reports, for the benchmarks' rooflines.

A roofline fraction is only as good as the peak it divides by, and the peak depends on the card: the rollout
benchmark (``rlalign bench rollout``) and ``benchmarks/train_step.py`` read the card they run on and take its
datasheet figures (:data:`CARDS`) by default. ``--peak-gbps`` / ``--peak-tflops`` override them; a card not in the
table needs both flags (:class:`UnknownCardError`): no figure is guessed from a similar name.

The figures (NVIDIA's datasheets; the dense figure is half the datasheet's "with sparsity" BF16 Tensor Core one):

    card (get_device_name)     datasheet product          HBM bandwidth   dense BF16 tensor core
    NVIDIA H200                H200 SXM                   4.8 TB/s        989 TFLOP/s   (1,979 with sparsity)
    NVIDIA H100 80GB HBM3      H100 SXM                   3.35 TB/s       989 TFLOP/s   (1,979 with sparsity)
    NVIDIA H100 PCIe           H100 PCIe                  2.0 TB/s        756 TFLOP/s   (1,513 with sparsity)
    NVIDIA A100-SXM4-80GB      A100 80GB SXM              2,039 GB/s      312 TFLOP/s   (624 with sparsity)
    NVIDIA A100-SXM4-40GB      A100 40GB SXM              1,555 GB/s      312 TFLOP/s
    NVIDIA A100-PCIE-40GB      A100 40GB PCIe             1,555 GB/s      312 TFLOP/s

Sources: NVIDIA H200 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h200), NVIDIA H100 Tensor Core GPU
datasheet (nvidia.com/en-us/data-center/h100; the H100 PCIe product brief PB-11133-001 states "greater than
2,000 GBps"), NVIDIA A100 Tensor Core GPU datasheet (nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf). The
datasheets themselves could not be fetched where this table was written; the figures were checked against
pages that reproduce them: glennklockwood.com/garden/processors/h100 (BF16 989.4 dense / 1978.9 sparse, from
NVIDIA's Hopper whitepaper) and /A100 (1.555 TB/s 40 GB, 2.039 TB/s 80 GB, BF16 312 / 624, citing the A100
datasheet), thundercompute.com/blog/nvidia-a100-specs-full-guide (A100 40GB PCIe and SXM 1,555 GB/s, 80GB SXM
2,039 GB/s), itkb.uw.cz "NVIDIA H200 vs B300" (H200 SXM 4.8 TB/s, BF16 ~989 dense).

Left out on purpose (they need the flags): the H200 NVL and the H100 NVL (PCIe cards whose BF16 figure is below
the SXM one's and which we could not check), the GH200 (a different memory system), the A100 80GB PCIe, and every
other card.
"""

from __future__ import annotations

import dataclasses

from rlalign.contract.errors import RLAlignError

SPEC, FLAG = "spec", "flag"


@dataclasses.dataclass(frozen=True)
class CardSpec:
    """One card's datasheet figures: HBM bandwidth (GB/s, 1e9 bytes) and dense BF16 tensor-core TFLOP/s."""
    product: str
    peak_gbps: float
    peak_tflops: float
    datasheet: str


_H200 = "NVIDIA H200 Tensor Core GPU datasheet"
_H100 = "NVIDIA H100 Tensor Core GPU datasheet"
_A100 = "NVIDIA A100 Tensor Core GPU datasheet"

# get_device_name() -> figures, by exact name (the names CUDA's driver reports for these boards)
CARDS: dict[str, CardSpec] = {
    "NVIDIA H200": CardSpec("H200 SXM", 4800.0, 989.0, _H200),
    "NVIDIA H100 80GB HBM3": CardSpec("H100 SXM", 3350.0, 989.0, _H100),
    "NVIDIA H100 PCIe": CardSpec("H100 PCIe", 2000.0, 756.0, _H100),
    "NVIDIA A100-SXM4-80GB": CardSpec("A100 80GB SXM", 2039.0, 312.0, _A100),
    "NVIDIA A100-SXM4-40GB": CardSpec("A100 40GB SXM", 1555.0, 312.0, _A100),
    "NVIDIA A100-PCIE-40GB": CardSpec("A100 40GB PCIe", 1555.0, 312.0, _A100),
}
# names that contain "H200" but are other boards (their figures differ from the H200 SXM's)
_NOT_H200_SXM = ("NVL", "GH200")


class UnknownCardError(RLAlignError):
    """The card is not in :data:`CARDS` and the peaks were not given: one line, naming the flags."""


def card_spec(name: str) -> CardSpec | None:
    """The figures of the card ``name`` (as ``torch.cuda.get_device_name()`` reports it), None when unknown.
    Any H200 name that is not an NVL board or a GH200 is the H200 SXM (drivers and clouds add suffixes such as
    ``NVIDIA H200 141GB HBM3e``)."""
    name = " ".join(name.split())
    if name in CARDS:
        return CARDS[name]
    if "H200" in name and not any(word in name for word in _NOT_H200_SXM):
        return CARDS["NVIDIA H200"]
    return None


@dataclasses.dataclass(frozen=True)
class Peaks:
    """The peaks a benchmark divides by, with where each came from ("spec": the card's datasheet figure,
    "flag": given on the command line, None: none, e.g. on the CPU without a flag)."""
    card: str | None
    peak_gbps: float | None
    peak_tflops: float | None
    peak_gbps_source: str | None
    peak_tflops_source: str | None
    datasheet: str | None = None

    def as_json(self) -> dict:
        return dataclasses.asdict(self)


def resolve_peaks(card: str | None, peak_gbps: float | None = None, peak_tflops: float | None = None,
                  need: tuple[str, ...] = ("peak_gbps", "peak_tflops")) -> Peaks:
    """The peaks for a run on ``card`` (None: no GPU; then only the flags count): each flag given wins, the
    card's spec fills the rest. ``need``: the peaks this benchmark must have on a GPU; a card without spec
    figures raises :class:`UnknownCardError` unless every needed one was given."""
    given = {"peak_gbps": peak_gbps, "peak_tflops": peak_tflops}
    spec = card_spec(card) if card is not None else None
    if card is not None and spec is None:
        missing = [k for k in need if given[k] is None]
        if missing:
            flags = " and ".join("--" + k.replace("_", "-") for k in missing)
            raise UnknownCardError(f"no spec figures for the card {card!r} (known: {', '.join(CARDS)}, any other "
                                   f"H200 SXM name): give {flags}")
    values, sources = {}, {}
    for key, value in given.items():
        if value is not None:
            values[key], sources[key] = value, FLAG
        elif spec is not None:
            values[key], sources[key] = getattr(spec, key), SPEC
        else:
            values[key], sources[key] = None, None
    used_spec = SPEC in sources.values()
    return Peaks(card, values["peak_gbps"], values["peak_tflops"], sources["peak_gbps"], sources["peak_tflops"],
                 f"{spec.datasheet} ({spec.product})" if used_spec else None)


def cuda_card() -> str:
    """The name of the current CUDA device, as ``torch.cuda.get_device_name()`` reports it."""
    import torch
    return torch.cuda.get_device_name()


__all__ = ["CARDS", "CardSpec", "Peaks", "UnknownCardError", "card_spec", "resolve_peaks", "cuda_card", "SPEC", "FLAG"]
