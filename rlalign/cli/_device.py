"""The ``--device`` check shared by the commands: a device that is not there fails in one line, before any work."""

from __future__ import annotations

from rlalign.contract.errors import RLAlignError


class DeviceUnavailable(RLAlignError):
    pass


def require_device(device: str) -> None:
    """Raise :class:`DeviceUnavailable` unless ``device`` (cpu, cuda, cuda:N) can be used here."""
    import torch

    if device == "cpu":
        return
    if device != "cuda" and not (device.startswith("cuda:") and device[5:].isdigit()):
        raise DeviceUnavailable(f"--device {device!r} is not a device (use cpu, cuda or cuda:N)")
    if not torch.cuda.is_available():
        raise DeviceUnavailable(f"--device {device}: no CUDA device is visible here (torch.cuda.is_available() is "
                                "False); use --device cpu")
    index = int(device[5:]) if ":" in device else 0
    if index >= torch.cuda.device_count():
        raise DeviceUnavailable(f"--device {device}: only {torch.cuda.device_count()} CUDA device(s) are visible")
