"""Which LoRA adapters the policy endpoint serves, under which names, from which folders.

Adapters live in one root (a run folder's ``adapters/``): a load names a folder in it (absolute or
relative), which must resolve inside the root and hold a peft adapter of a rank the engine takes. A
name is never reused for another folder. A name ending in ``:<12 hex digits>`` (a stage's,
``run.services.Services.adapter_name``) names the folder's content too (``objstore.folder_digest``): it is
loaded only while the folder holds exactly those weights, so a folder rewritten by a redone stage is
never served under the name of its first attempt.

The registry is also ``<root>/served_adapters.json``, so every replica (and a restarted one) serves
the same names. The root may be an object-store URI (``hamo_ray.serving.objstore``): paths are then
store paths, each replica downloads an adapter into its cache before loading it, and the registry
file lives in the store.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path

from hamo_ray.serving.objstore import ObjectStore, ObjectStoreError, default_cache, folder_digest, is_uri

logger = logging.getLogger(__name__)

REGISTRY_FILE = "served_adapters.json"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:\-]{0,127}$")
DIGEST_CHARS = 12  # hex digits of the content hash a stage adapter's name ends with
DIGEST_RE = re.compile(rf":([0-9a-f]{{{DIGEST_CHARS}}})$")


class AdapterError(Exception):
    """A rejected adapter load; ``status`` is the HTTP status to answer (400 or 409)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


class AdapterRegistry:
    """Name -> adapter folder for one root (created if missing) or store URI, persisted to the registry file.

    ``reserved``: names that cannot be used (the base model's); ``max_lora_rank``: the engine's.
    """

    def __init__(self, root: str | Path, reserved: set[str], max_lora_rank: int):
        self.remote = ObjectStore(str(root)) if is_uri(root) else None
        self.root = (default_cache(str(root)) if self.remote else Path(root).expanduser()).resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        self.reserved, self.max_lora_rank = set(reserved), max_lora_rank
        self._paths: dict[str, Path] = {}
        self._mtime: float | None = None

    def __contains__(self, name: str) -> bool:
        return name in self._paths

    def get(self, name: str) -> Path | None:
        return self._paths.get(name)

    def names(self) -> list[str]:
        return list(self._paths)

    def resolve(self, path: str) -> Path:
        """The adapter folder ``path`` names; AdapterError(400) for ``..``, outside the root, no peft
        adapter there, or a rank above ``max_lora_rank``."""
        if not path or ".." in Path(path).parts:
            raise AdapterError(400, f"lora_path {path!r} must not be empty or contain '..'")
        if self.remote is not None:  # a store path: download it into the local cache first
            try:
                path = str(self.remote.fetch(path, self.root))
            except (ObjectStoreError, OSError) as exc:
                raise AdapterError(400, f"lora_path {path!r}: {exc}") from None
        candidate = Path(path).expanduser()
        resolved = (candidate if candidate.is_absolute() else self.root / candidate).resolve()
        if resolved == self.root or not resolved.is_relative_to(self.root):
            raise AdapterError(400, f"lora_path {path!r} is outside the adapter root {str(self.root)!r}")
        config_file = resolved / "adapter_config.json"
        if not config_file.is_file():
            raise AdapterError(400, f"lora_path {path!r} holds no adapter_config.json (not a peft adapter)")
        try:
            config = json.loads(config_file.read_text())
            ranks = [int(config.get("r", 0)), *map(int, (config.get("rank_pattern") or {}).values())]
        except (OSError, ValueError, TypeError, AttributeError) as exc:
            raise AdapterError(400, f"cannot read {str(config_file)!r}: {exc}") from None
        if max(ranks) > self.max_lora_rank:
            raise AdapterError(
                400, f"adapter rank {max(ranks)} exceeds the server's max_lora_rank {self.max_lora_rank}"
            )
        return resolved

    def check(self, name: str, path: str) -> tuple[Path, bool]:
        """(resolved folder, already served under ``name``); AdapterError 400 (bad name or path) or 409
        (the name serves another folder, or names a digest the folder's files no longer have)."""
        if not _NAME.match(name or "") or name in self.reserved:
            raise AdapterError(
                400,
                f"lora_name {name!r} is invalid: use [A-Za-z0-9._:-], at most 128 characters, not the base name",
            )
        resolved = self.resolve(path)
        if (named := DIGEST_RE.search(name)) and not folder_digest(resolved).startswith(named.group(1)):
            raise AdapterError(
                409,
                f"lora_name {name!r} names weights with digest {named.group(1)}, but {str(resolved)!r} now "
                "holds other files (rewritten after it was published); publish them under their own digest",
            )
        known = self._paths.get(name)
        if known is not None and known != resolved:
            raise AdapterError(
                409, f"lora_name {name!r} already serves {str(known)!r}; publish under a new name"
            )
        return resolved, known is not None

    def add(self, name: str, path: Path, persist: bool = True) -> None:
        """Record ``name -> path``, with ``persist`` also in the registry file (a read-only root is logged)."""
        self._paths[name] = path
        if persist:
            entry = path.relative_to(self.root).as_posix() if self.remote else str(path)  # store paths
            try:
                self._write({**self._read(), name: entry})
            except OSError as exc:
                logger.warning("could not write the registry (other replicas will not see %r): %s", name, exc)

    def sync(self) -> list[tuple[str, Path]]:
        """Adopt (and return) the valid entries other replicas added to the registry file since the last look."""
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
                new.append((name, self.check(name, path)[0]))
            except AdapterError as exc:
                logger.warning("skipping registry entry %r: %s", name, exc.message)
        for name, path in new:
            self._paths[name] = path
        return new

    def _read(self) -> dict[str, str]:
        try:
            if self.remote is not None:
                data = json.loads(self.remote.read_text(REGISTRY_FILE) or "{}")
            else:
                data = json.loads((self.root / REGISTRY_FILE).read_text())
        except (OSError, ValueError):
            return {}
        return {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else {}

    def _write(self, entries: dict[str, str]) -> None:
        text = json.dumps(entries, indent=1, sort_keys=True)
        if self.remote is not None:
            return self.remote.write_text(REGISTRY_FILE, text)
        file, tmp = self.root / REGISTRY_FILE, self.root / f"{REGISTRY_FILE}.tmp{os.getpid()}"
        tmp.write_text(text)
        os.replace(tmp, file)
        self._mtime = file.stat().st_mtime
