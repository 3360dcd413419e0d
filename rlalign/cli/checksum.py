"""``rlalign checksum DIR``: record the sha256 of a model folder's safetensors files in ``DIR/checksums.json``.

Loading a model folder verifies its safetensors files against ``checksums.json`` when there is one
(flipped bytes in tensor data are refused with the file's name); without it, loading says the bytes
are unverified. This command makes the sidecar for a folder you trust as it is now (a download you
checked, a folder saved by another tool). Rules:

- The folder must load as a model first: config.json parses, and every safetensors file's header,
  tensor names, dtypes, shapes and size are checked (no tensor data is read but for the hashing).
- It writes one file, ``checksums.json`` (atomically), and touches nothing else: other files in the
  folder (README, LICENSE, ...) are the user's and stay as they are (they are not covered).
- An existing ``checksums.json`` is verified and kept when it matches; when it does not, the command
  stops with one line, and ``--overwrite`` records the files as they are now. A folder or a
  ``checksums.json`` that is a symbolic link is refused.
"""

from __future__ import annotations

from rlalign.models.checkpoint import write_checksums


def register(subparsers) -> None:
    p = subparsers.add_parser("checksum", help="record a model folder's safetensors sha256 in DIR/checksums.json "
                                               "(loading then verifies them)")
    p.add_argument("model_dir", metavar="DIR", help="a model folder: config.json + safetensors")
    p.add_argument("--overwrite", action="store_true",
                   help="replace a checksums.json that does not match the files (records them as they are now)")
    p.set_defaults(func=run)


def run(args) -> int:
    path, sums, written = write_checksums(args.model_dir, overwrite=args.overwrite)
    what = "recorded" if written else "already recorded there and verified"
    print(f"{path}: sha256 of {len(sums)} safetensors file{'s' if len(sums) != 1 else ''} {what}")
    return 0
