"""Adapters in an object store: ``s3://``, ``gs://``, ``abfs://``, ``hdfs://`` or ``file://`` URIs.

On a cluster every policy replica must read every stage's adapter. Instead of a shared folder,
``serve.adapter_store`` may be a URI that ``pyarrow.fs`` opens; options ride in the URI's query
(``s3://bucket/adapters?region=eu-west-1``, ``?endpoint_override=minio:9000&scheme=http`` for
MinIO or another S3-compatible store) and credentials come from the usual places (``AWS_*``
environment variables, instance roles, ``GOOGLE_APPLICATION_CREDENTIALS``).

A publisher puts a stage folder there (``put``: uploaded unless the store already holds the same
content); each replica downloads what it is asked to serve into a local cache (``fetch``), so vLLM
loads from local disk. Every upload records a digest of the folder's files (``.hamo-digest``): a
cached copy is reused only while its digest equals the store's, so a stage that was redone after a
crash (same folder name, new weights) is never served stale. A folder without its
``adapter_config.json`` is incomplete: the upload writes that file last, and a fetch refuses it.

    store = ObjectStore("s3://bucket/run-7/adapters")
    store.put("runs/run-7/adapters/stage-1", "stage-1")
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
DIGEST_FILE = ".hamo-digest"  # sha256 of the folder's other files, written by every upload
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


def folder_digest(folder: Path) -> str:
    """sha256 over the relative paths and bytes of a folder's files (the digest file excluded)."""
    h = hashlib.sha256()
    for file in sorted(p for p in folder.rglob("*") if p.is_file() and p.name != DIGEST_FILE):
        h.update(file.relative_to(folder).as_posix().encode() + b"\0")
        with file.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        h.update(b"\0")
    return h.hexdigest()


def check_relative(rel: str) -> str:
    """``rel`` as a clean relative POSIX path inside a store; ObjectStoreError if empty, absolute or with ``..``."""
    path = PurePosixPath(rel)
    if not rel or path.is_absolute() or ".." in path.parts or str(path) in ("", "."):
        raise ObjectStoreError(f"{rel!r} must be a non-empty relative path without '..'")
    return str(path)


class ObjectStore:
    """A folder of adapter folders behind a ``pyarrow.fs`` URI (``s3://bucket/prefix?region=...``,
    ``file:///abs/path``); ObjectStoreError when pyarrow cannot open it."""

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
        """Copy a local adapter folder (ObjectStoreError without its ``adapter_config.json``) to ``rel``:
        its files, the digest, ``adapter_config.json`` last."""
        local = Path(local_dir)
        if not (local / ADAPTER_CONFIG).is_file():
            raise ObjectStoreError(f"{str(local)!r} holds no {ADAPTER_CONFIG} (not a peft adapter)")
        files = sorted(
            p for p in local.rglob("*") if p.is_file() and p.name not in (DIGEST_FILE, ADAPTER_CONFIG)
        )
        dest = self._path(rel)
        self.fs.create_dir(dest, recursive=True)
        for file in files:
            self._put_file(file, f"{dest}/{file.relative_to(local).as_posix()}")
        # The digest, then the config: a folder without its config is an upload cut short.
        self.write_text(f"{rel}/{DIGEST_FILE}", folder_digest(local))
        self._put_file(local / ADAPTER_CONFIG, f"{dest}/{ADAPTER_CONFIG}")
        logger.info("uploaded adapter %s to %s/%s", local, self.uri.split("?")[0], rel)

    def put(self, local_dir: str | Path, rel: str) -> bool:
        """Upload ``local_dir`` to ``rel`` unless the store holds the same content there; True if uploaded."""
        if self.exists(rel) and self.read_text(f"{rel}/{DIGEST_FILE}") == folder_digest(Path(local_dir)):
            return False
        self.upload(local_dir, rel)
        return True

    def _put_file(self, file: Path, path: str) -> None:
        self.fs.create_dir(path.rsplit("/", 1)[0], recursive=True)
        with file.open("rb") as src, self.fs.open_output_stream(path) as out:
            shutil.copyfileobj(src, out, 1 << 20)

    def fetch(self, rel: str, cache: Path) -> Path:
        """The local copy of the adapter folder ``rel``, downloaded into ``cache`` unless a copy with the
        store's digest is there; ObjectStoreError when the store holds no complete folder at ``rel``."""
        from pyarrow import fs as pafs

        rel = check_relative(rel)
        target = cache / rel
        if not self.exists(rel):
            raise ObjectStoreError(
                f"no adapter at {self.uri.split('?')[0].rstrip('/')}/{rel} (no {ADAPTER_CONFIG})"
            )
        digest = self.read_text(f"{rel}/{DIGEST_FILE}")
        if (target / ADAPTER_CONFIG).is_file():
            cached = target / DIGEST_FILE
            if digest is not None and cached.is_file() and cached.read_text() == digest:
                return target
            # Stale (the stage was redone) or unverifiable: move it aside, download again.
            stale = Path(tempfile.mkdtemp(prefix=f".{target.name}.stale.", dir=target.parent))
            try:
                os.replace(target, stale / "old")
            except FileNotFoundError:  # another replica on this machine moved it first
                pass
            shutil.rmtree(stale, ignore_errors=True)
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
