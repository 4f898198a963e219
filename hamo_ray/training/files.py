"""Adapter files between rank 0 and the driver: read from the folder a worker saved, written whole.

Rank 0 saves the trained weights to a temporary folder and sends them back as ``{file name: bytes}``
(``read_files``, in ``loop.py``); the driver (and a Ray Train checkpoint) writes them with
``write_files``: a temporary folder renamed into place, so an ``out_dir`` holds a whole adapter or none.
"""

from __future__ import annotations

import shutil
from pathlib import Path


def write_files(files: dict[str, bytes], out_dir: str | Path) -> Path:
    """Write ``{name: bytes}`` to ``out_dir`` whole or not at all (a temporary folder, then a rename)."""
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name, data in files.items():
        (tmp / name).write_bytes(data)
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    return out_dir


def read_files(folder: str | Path) -> dict[str, bytes]:
    """The files of a flat folder as ``{name: bytes}``."""
    return {p.name: p.read_bytes() for p in sorted(Path(folder).iterdir()) if p.is_file()}
