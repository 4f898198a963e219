"""The base of every config section, and the error a bad configuration raises."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class ConfigError(ValueError):
    """A configuration problem; the message names the key, file or value at fault."""


class _Cfg(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
