"""Adapters in an object store: ``s3://``, ``gs://``, ``abfs://``, ``hdfs://`` or ``file://`` URIs.

On a cluster every policy replica must read every stage's adapter. Instead of a shared folder,
``serve.adapter_store`` may be a URI that ``pyarrow.fs`` opens; options ride in the URI's query
(``s3://bucket/adapters?region=eu-west-1``, ``?endpoint_override=minio:9000&scheme=http`` for
MinIO or another S3-compatible store) and credentials come from the usual places (``AWS_*``
environment variables, instance roles, ``GOOGLE_APPLICATION_CREDENTIALS``).

A publisher uploads a stage folder once (``upload``); each replica downloads what it is asked to
serve into a local cache (``fetch``), so vLLM loads from local disk. Adapter folders are immutable
under their names: a folder already in the cache is not fetched again. A folder without its
``adapter_config.json`` is incomplete: the upload writes that file last, and a fetch refuses it.

    store = ObjectStore("s3://bucket/run-7/adapters")
    store.upload("runs/run-7/adapters/stage-1", "stage-1")
    local = store.fetch("stage-1", Path("~/.cache/hamo_ray/adapters").expanduser())
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path, PurePosixPath

logger = logging.getLogger(__name__)

ADAPTER_CONFIG = "adapter_config.json"
CACHE_ENV = "HAMO_ADAPTER_CACHE"  # where replicas keep downloaded adapters


def is_uri(location: str | Path | None) -> bool:
    """Whether ``location`` is a URI (``scheme://...``) rather than a local path."""
    return location is not None and "://" in str(location)


def default_cache(uri: str) -> Path:
    """This machine's download folder for the store at ``uri`` (``$HAMO_ADAPTER_CACHE`` or ~/.cache)."""
    root = Path(os.environ.get(CACHE_ENV) or "~/.cache/hamo_ray/adapter_cache").expanduser()
    return root / hashlib.sha1(uri.encode()).hexdigest()[:16]


class ObjectStoreError(Exception):
    """The store cannot be opened, or an object is missing or incomplete."""


def check_relative(rel: str) -> str:
    """``rel`` as a clean relative POSIX path inside a store.

    Raises:
        ObjectStoreError: empty, absolute, or with ``..``.
    """
    path = PurePosixPath(rel)
    if not rel or path.is_absolute() or ".." in path.parts or str(path) in ("", "."):
        raise ObjectStoreError(f"{rel!r} must be a non-empty relative path without '..'")
    return str(path)


class ObjectStore:
    """A folder of adapter folders behind a ``pyarrow.fs`` URI.

    Args:
        uri: e.g. ``s3://bucket/prefix?region=...``; ``file:///abs/path`` for a local store.

    Raises:
        ObjectStoreError: pyarrow cannot open the URI (unknown scheme, bad query option...).
    """

    def __init__(self, uri: str):
        from pyarrow import fs as pafs

        self.uri = uri
        try:
            self.fs, base = pafs.FileSystem.from_uri(uri)
        except Exception as exc:  # ArrowInvalid, ArrowNotImplementedError, OSError
            raise ObjectStoreError(f"cannot open adapter store {uri!r}: {exc}") from None
        self.base = base.rstrip("/")

    def _path(self, rel: str) -> str:
        return f"{self.base}/{check_relative(rel)}"

    def exists(self, rel: str) -> bool:
        """Whether a complete adapter folder (with its ``adapter_config.json``) is stored at ``rel``."""
        from pyarrow import fs as pafs

        info = self.fs.get_file_info(f"{self._path(rel)}/{ADAPTER_CONFIG}")
        return info.type == pafs.FileType.File

    def upload(self, local_dir: str | Path, rel: str) -> None:
        """Copy a local adapter folder to ``rel``; ``adapter_config.json`` goes last (it marks completeness).

        Raises:
            ObjectStoreError: ``local_dir`` holds no ``adapter_config.json``.
        """
        local = Path(local_dir)
        files = sorted(p for p in local.rglob("*") if p.is_file())
        if not (local / ADAPTER_CONFIG).is_file():
            raise ObjectStoreError(f"{str(local)!r} holds no {ADAPTER_CONFIG} (not a peft adapter)")
        dest = self._path(rel)
        self.fs.create_dir(dest, recursive=True)
        # adapter_config.json last: a folder without it is incomplete (an upload cut short).
        for file in sorted(files, key=lambda p: p == local / ADAPTER_CONFIG):
            rel_file = file.relative_to(local)
            if rel_file.parent != Path("."):
                self.fs.create_dir(f"{dest}/{rel_file.parent.as_posix()}", recursive=True)
            with file.open("rb") as src, self.fs.open_output_stream(f"{dest}/{rel_file.as_posix()}") as out:
                shutil.copyfileobj(src, out, 1 << 20)
        logger.info("uploaded adapter %s to %s/%s (%d files)", local, self.uri, rel, len(files))

    def fetch(self, rel: str, cache: Path) -> Path:
        """The local copy of the adapter folder ``rel``, downloaded into ``cache`` if not there yet.

        Raises:
            ObjectStoreError: no complete adapter folder at ``rel``.
        """
        from pyarrow import fs as pafs

        rel = check_relative(rel)
        target = cache / rel
        if (target / ADAPTER_CONFIG).is_file():
            return target
        if not self.exists(rel):
            raise ObjectStoreError(
                f"no adapter at {self.uri.split('?')[0].rstrip('/')}/{rel} (no {ADAPTER_CONFIG})"
            )
        target.parent.mkdir(parents=True, exist_ok=True)
        # Download beside the target, then rename: a reader never sees half a folder.
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
        try:
            src = self._path(rel)
            for info in self.fs.get_file_info(pafs.FileSelector(src, recursive=True)):
                if info.type != pafs.FileType.File:
                    continue
                dest = tmp / info.path[len(src) :].lstrip("/")
                dest.parent.mkdir(parents=True, exist_ok=True)
                with self.fs.open_input_stream(info.path) as f, dest.open("wb") as out:
                    shutil.copyfileobj(f, out, 1 << 20)
            try:
                os.replace(tmp, target)
            except OSError:  # another replica on this machine got there first
                if not (target / ADAPTER_CONFIG).is_file():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        logger.info("fetched adapter %s/%s into %s", self.uri.split("?")[0], rel, target)
        return target

    def read_text(self, rel: str) -> str | None:
        """A small text object, or None when it does not exist."""
        try:
            with self.fs.open_input_stream(self._path(rel)) as f:
                return f.read().decode()
        except FileNotFoundError:
            return None

    def write_text(self, rel: str, text: str) -> None:
        """Write a small text object (one PUT on object stores: readers see the old or the new text)."""
        path = self._path(rel)
        self.fs.create_dir(path.rsplit("/", 1)[0], recursive=True)
        with self.fs.open_output_stream(path) as f:
            f.write(text.encode())
