"""A sweep's shared caches kept with its tracked results, so cells run on other machines share them too.

The cells of one seed share the simulator's expert trajectories (``share_experts``: ``<root>/experts``)
and their stage 0 (``share_initial``: ``<root>/initial``). Those folders live under ``root``, with the
run folders, and are lost with the machine; a sweep that runs over several machines (or sessions) would
then replay the expert for the later cells of a seed, and ScienceWorld's expert takes other routes on
another load (22 of 48 trajectories differed between two cells), so the methods of one seed would no
longer train on the same data. With ``results`` set, each cache is therefore also kept, gzip-compressed,
under ``<results>/shared/<cache>/`` (or under ``<shared>/<cache>/`` when the sweep file sets ``shared:``,
so that two sweeps over one root, such as an experiment's trained and flat methods, keep one copy):

- ``restore_shared`` (at the sweep's start) copies every kept entry into ``<root>/<cache>/``; a kept
  entry wins over a different local one (a warning names it): the exported cells trained on the kept one;
- ``save_shared`` (after each finished cell, and at the start) keeps every local entry not kept yet,
  written to a temporary file and renamed; a kept entry is never overwritten.

Lock files and temporary files are never copied. Each kept file is small (an expert entry of 12
ScienceWorld trajectories is ~1.5 KB gzipped; a stage-0 entry of 24 episodes ~25 KB).
"""

from __future__ import annotations

import gzip
import logging
import os
from pathlib import Path

from hamo_ray.sweep.grid import SweepConfig

logger = logging.getLogger("hamo_ray.sweep")

CACHES = {"experts": "share_experts", "initial": "share_initial"}  # <root>/<name>, the sweep key that sets it


def kept_folder(sweep: SweepConfig) -> Path | None:
    """Where the caches are kept: the sweep's ``shared:``, else ``<results>/shared``; None without results."""
    if not sweep.results:
        return None
    return Path(sweep.shared) if sweep.shared else Path(sweep.results) / "shared"


def _caches(sweep: SweepConfig) -> list[str]:
    return [name for name, key in CACHES.items() if getattr(sweep, key)] if sweep.results else []


def _local_files(folder: Path) -> list[Path]:
    """The cache's entry files (relative), without locks, temporaries or hidden folders."""
    if not folder.is_dir():
        return []
    out = []
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder)
        if (
            path.is_file()
            and not path.name.endswith(".lock")
            and not any(p.startswith(".") for p in rel.parts)
        ):
            out.append(rel)
    return out


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_bytes(data)
    tmp.replace(path)


def save_shared(sweep: SweepConfig) -> list[Path]:
    """Keep every local cache entry not yet kept (:func:`kept_folder`); returns the files written."""
    written = []
    for name in _caches(sweep):
        local, kept = Path(sweep.root) / name, kept_folder(sweep) / name
        for rel in _local_files(local):
            dest = kept / f"{rel}.gz"
            if dest.exists():
                continue
            # mtime=0: the same entry gzips to the same bytes on every machine (no spurious git change)
            _write_atomic(dest, gzip.compress((local / rel).read_bytes(), mtime=0))
            written.append(dest)
    if written:
        logger.info("sweep: kept %d shared cache files under %s", len(written), kept_folder(sweep))
    return written


def restore_shared(sweep: SweepConfig) -> list[Path]:
    """Copy every kept cache entry into ``<root>/<cache>/``; returns the local files written.

    Raises:
        ValueError: a kept file that does not decompress (named): a results folder to repair by hand,
            never silently replaced by a new replay.
    """
    written = []
    for name in _caches(sweep):
        local, kept = Path(sweep.root) / name, kept_folder(sweep) / name
        if not kept.is_dir():
            continue
        for gz in sorted(kept.rglob("*.gz")):
            rel = gz.relative_to(kept).with_suffix("")  # drop .gz
            if any(p.startswith(".") for p in rel.parts):
                continue
            try:
                data = gzip.decompress(gz.read_bytes())
            except (OSError, EOFError) as exc:
                raise ValueError(f"sweep: the kept cache file {gz} cannot be read ({exc})") from None
            dest = local / rel
            if dest.is_file():
                if dest.read_bytes() == data:
                    continue
                logger.warning(
                    "sweep: %s differs from the kept %s; the kept one is used (the exported cells used it)",
                    dest,
                    gz,
                )
            _write_atomic(dest, data)
            written.append(dest)
    if written:
        logger.info("sweep: restored %d shared cache files from %s", len(written), kept_folder(sweep))
    return written
