"""Helpers of the file-safety tests: what a folder holds, the CLI's one-line error, a checkpoint state."""

import hashlib
import os
from pathlib import Path

import torch


def snapshot(root: Path, skip_lock: bool = False) -> dict[str, str]:
    """Every entry under ``root``: file -> sha256 of its bytes, link -> where it points, folder -> 'dir'
    (``skip_lock``: leave out ``.lock`` files, which every start rewrites with its pid)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            if skip_lock and name == ".lock":
                continue
            rel = str(p.relative_to(root))
            if p.is_symlink():
                out[rel] = "link -> " + os.readlink(p)
            elif p.is_dir():
                out[rel] = "dir"
            else:
                out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def one_line_error(capsys, command: str) -> str:
    """The command's stderr, checked to be one ``rlalign CMD: error: ...`` line without a traceback."""
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith(f"rlalign {command}: error: "), err
    assert "Traceback" not in err
    return err


def checkpoint_state(step, model_dir=None, model=None) -> dict:
    """A training state: the weights of ``model`` (real ones: export loads them) or a stand-in tensor."""
    weights = {k: v.clone() for k, v in model.state_dict().items()} if model is not None else {"w": torch.ones(3)}
    return {"step": step, "model": weights, "config": {"model": {"path": str(model_dir)}, "run": {"steps": 3}}}
