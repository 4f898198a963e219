"""The base of every config section, and the error a bad configuration raises."""

from __future__ import annotations

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
    from hamo_ray.config.secrets import mask_secrets

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
