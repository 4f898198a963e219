"""Which LoRA adapters the policy endpoint serves, under which names, from which folders.

Adapters live in one local root (a run folder's ``adapters/``). A request to load one names it and
gives its folder, absolute or relative to the root; the folder must resolve inside the root and hold
a peft adapter whose rank fits the engine. Names are never reused for another folder, so a name
identifies one set of weights for the whole run.

The registry is also written to ``<root>/served_adapters.json`` so that every replica of the
deployment (and a replica Serve restarted) serves the same names: a replica that does not know a
requested name re-reads the file before answering 404.

The root may also be an object-store URI (``hamo_ray.serving.objstore``: ``s3://``, ``gs://``,
``file://``...). Paths are then relative to the store; each replica downloads a requested adapter
into its local cache before checking and loading it, and the registry file lives in the store.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path

from hamo_ray.serving.objstore import ObjectStore, ObjectStoreError, default_cache, is_uri

logger = logging.getLogger(__name__)

REGISTRY_FILE = "served_adapters.json"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:\-]{0,127}$")


class AdapterError(Exception):
    """A rejected adapter load; ``status`` is the HTTP status to answer (400 or 409)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


class AdapterRegistry:
    """Name -> adapter folder for one adapter root, persisted to ``served_adapters.json``.

    Args:
        root: the adapter root (created if missing), or an object-store URI.
        reserved: names that cannot be used (the base model's served name).
        max_lora_rank: the engine's ``max_lora_rank``; adapters of a larger rank are rejected.
    """

    def __init__(self, root: str | Path, reserved: set[str], max_lora_rank: int):
        self.remote = ObjectStore(str(root)) if is_uri(root) else None
        local = default_cache(str(root)) if self.remote else Path(root).expanduser()
        self.root = local.resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        self.reserved = set(reserved)
        self.max_lora_rank = max_lora_rank
        self._paths: dict[str, Path] = {}
        self._mtime: float | None = None

    def __contains__(self, name: str) -> bool:
        return name in self._paths

    def items(self) -> list[tuple[str, Path]]:
        return list(self._paths.items())

    def resolve(self, path: str) -> Path:
        """The adapter folder ``path`` names, checked to lie inside the root and hold a usable adapter.

        Raises:
            AdapterError: 400 for a path with ``..``, outside the root, not an adapter folder, or an
                adapter rank above ``max_lora_rank``.
        """
        if not path or ".." in Path(path).parts:
            raise AdapterError(400, f"lora_path {path!r} must not be empty or contain '..'")
        if self.remote is not None:  # a path in the store: download it into the local cache first
            try:
                path = str(self.remote.fetch(path, self.root))
            except ObjectStoreError as exc:
                raise AdapterError(400, f"lora_path {path!r}: {exc}") from None
            except OSError as exc:
                raise AdapterError(400, f"lora_path {path!r}: cannot read the adapter store: {exc}") from None
        candidate = Path(path).expanduser()
        resolved = (candidate if candidate.is_absolute() else self.root / candidate).resolve()
        if resolved == self.root or not resolved.is_relative_to(self.root):
            raise AdapterError(400, f"lora_path {path!r} is outside the adapter root {str(self.root)!r}")
        config_file = resolved / "adapter_config.json"
        if not config_file.is_file():
            raise AdapterError(400, f"lora_path {path!r} holds no adapter_config.json (not a peft adapter)")
        try:
            config = json.loads(config_file.read_text())
        except (OSError, ValueError) as exc:
            raise AdapterError(400, f"cannot read {str(config_file)!r}: {exc}") from None
        ranks = [int(config.get("r", 0)), *(int(r) for r in (config.get("rank_pattern") or {}).values())]
        if max(ranks) > self.max_lora_rank:
            raise AdapterError(
                400, f"adapter rank {max(ranks)} exceeds the server's max_lora_rank {self.max_lora_rank}"
            )
        return resolved

    def check(self, name: str, path: str) -> tuple[Path, bool]:
        """Validate a load request.

        Returns:
            (resolved folder, already served under this name).

        Raises:
            AdapterError: 400 for a bad name or path; 409 when the name serves another folder.
        """
        if not _NAME.match(name or "") or name in self.reserved:
            raise AdapterError(
                400,
                f"lora_name {name!r} is invalid: use [A-Za-z0-9._:-], at most 128 characters, not the base name",
            )
        resolved = self.resolve(path)
        known = self._paths.get(name)
        if known is not None and known != resolved:
            raise AdapterError(
                409, f"lora_name {name!r} already serves {str(known)!r}; publish under a new name"
            )
        return resolved, known is not None

    def add(self, name: str, path: Path, persist: bool = True) -> None:
        """Record ``name -> path``; with ``persist`` also in the registry file (a read-only root is logged)."""
        self._paths[name] = path
        if not persist:
            return
        # In a store, entries are store paths: each replica's cache is its own.
        entry = path.relative_to(self.root).as_posix() if self.remote else str(path)
        try:
            on_disk = self._read()
            on_disk[name] = entry
            self._write(on_disk)
        except OSError as exc:
            logger.warning("could not write the registry (other replicas will not see %r): %s", name, exc)

    def sync(self) -> list[tuple[str, Path]]:
        """Entries other replicas added to the registry file since the last look, still valid on disk."""
        if self.remote is None:  # a local file: read it again only when it changed
            try:
                mtime = (self.root / REGISTRY_FILE).stat().st_mtime
            except OSError:
                return []
            if mtime == self._mtime:
                return []
            self._mtime = mtime
        new = []
        for name, path in self._read().items():
            if name in self._paths:
                continue
            try:
                resolved, _ = self.check(name, path)
            except AdapterError as exc:
                logger.warning("skipping registry entry %r: %s", name, exc.message)
                continue
            new.append((name, resolved))
        return new

    def _read(self) -> dict[str, str]:
        try:
            if self.remote is not None:
                text = self.remote.read_text(REGISTRY_FILE) or "{}"
            else:
                text = (self.root / REGISTRY_FILE).read_text()
            data = json.loads(text)
        except (OSError, ValueError):
            return {}
        return {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else {}

    def _write(self, entries: dict[str, str]) -> None:
        text = json.dumps(entries, indent=1, sort_keys=True)
        if self.remote is not None:
            self.remote.write_text(REGISTRY_FILE, text)
            return
        file = self.root / REGISTRY_FILE
        tmp = file.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(text)
        os.replace(tmp, file)
        self._mtime = file.stat().st_mtime
