"""The base of every config section, and the error a bad configuration raises."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError


class ConfigError(ValueError):
    """A configuration problem; the message names the key, file or value at fault."""


class _Cfg(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


ConfigSection = _Cfg  # the base of a section a component declares itself (a domain's ``env.<domain>``)


class ConfigKeyErrors(ValueError):
    """Problems found by a validator that checks keys itself, each line naming its dotted key.

    ``load_config`` lists the lines as they are (pydantic would name only the enclosing section).
    """

    def __init__(self, lines: list[str]) -> None:
        super().__init__("; ".join(lines))
        self.lines = lines


def error_lines(err: ValidationError, prefix: str = "") -> list[str]:
    """One line per error of ``err``, each naming its dotted key (``prefix`` before the error's location)."""
    lines = []
    for e in err.errors():
        cause = (e.get("ctx") or {}).get("error")
        if isinstance(cause, ConfigKeyErrors):
            lines += cause.lines
            continue
        parts = tuple(p for p in (*prefix.split("."), *map(str, e["loc"])) if p)
        loc = ".".join(parts) or "<root>"
        if e["type"] == "extra_forbidden":
            lines.append(f"unknown config key {loc!r}")
        else:  # the value as given, secrets masked (the input of a section holds its every key)
            lines.append(f"config key {loc!r}: {e['msg']} (got {mask_secrets(e.get('input'), parts)!r})")
    return lines


# -- secrets masked in every output (hamo_ray.config.secrets says where secrets come from) ----------
MASK = "***"
# Secret settings: a value ("value") or a mapping whose values are secret ("mapping").
SECRET_KEYS: dict[str, str] = {
    "serve.api_key": "value",
    "memory.llm_api_key": "value",
    "memory.storage_options": "mapping",
}
# Values that stand for "no key" and are shown as they are.
_NOT_SECRET = (None, "", "EMPTY")


def _mask_value(kind: str, value: Any) -> Any:
    if kind == "mapping":
        return {k: MASK for k in value} if isinstance(value, Mapping) else (MASK if value else value)
    return value if value in _NOT_SECRET else MASK


def mask_secrets(data: Any, at: tuple[str, ...] = ()) -> Any:
    """A copy of ``data`` (a config dump, or the part of one at dotted path ``at``) with secrets masked.

    ``mask_secrets(cfg.model_dump(mode="json"))`` is what may be written or shown; ``at=("serve",)``
    masks a dump of the serve section alone. Anything that is not a mapping where a section is
    expected is returned as it is.
    """
    for dotted, kind in SECRET_KEYS.items():
        path = tuple(dotted.split("."))
        if path == at[: len(path)]:  # data is the secret itself, or lies inside it
            return MASK if len(at) > len(path) else _mask_value(kind, data)
    if not isinstance(data, Mapping):
        return data
    out = dict(data)
    for dotted, kind in SECRET_KEYS.items():
        path = tuple(dotted.split("."))
        if path[: len(at)] != at or len(path) == len(at):
            continue
        node = out
        for part in path[len(at) : -1]:  # copy each mapping on the way down
            if not isinstance(node.get(part), Mapping):
                break
            node[part] = dict(node[part])
            node = node[part]
        else:
            if path[-1] in node:
                node[path[-1]] = _mask_value(kind, node[path[-1]])
    return out
