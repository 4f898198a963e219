"""Secret values of the config: where they come from, and how they are kept out of every output.

Three settings are secrets (``SECRET_KEYS``): ``serve.api_key`` (the bearer key of the policy and harness
apps), ``memory.llm_api_key`` (the LLM distiller's endpoint key) and the values of
``memory.storage_options`` (object-store credentials for LanceDB). Besides the config file and the
command line, each is read from an environment variable or from a file an environment variable names
(``SECRET_ENV``)::

    HAMO_API_KEY / HAMO_API_KEY_FILE                 serve.api_key
    HAMO_LLM_API_KEY / HAMO_LLM_API_KEY_FILE         memory.llm_api_key
    HAMO_STORAGE_OPTIONS / HAMO_STORAGE_OPTIONS_FILE memory.storage_options (a YAML/JSON mapping)

The command line (a dotted override) beats the environment, and the environment beats the config
file; a variable and its ``_FILE`` twin set together are refused. A file holds the value alone (its
surrounding whitespace is dropped); one that others may read is used with a warning.

A secret is written nowhere: ``HamoConfig.to_yaml`` (a run folder's ``config.yaml``, a sweep export,
``--print-config``) and the tracker's parameters show ``MASK`` (``***``) in its place; error messages
mask it; the fields are left out of reprs. A saved config read back (``load_saved_config``, or
``load_config`` of a run folder's file) drops a masked value, so the environment or the command line
supplies it again, and a resume never compares secrets (``run.folder.compared``).
"""

from __future__ import annotations

import ipaddress
import logging
import os
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from hamo_ray.config.base import _NOT_SECRET, MASK, SECRET_KEYS, ConfigError, mask_secrets  # noqa: F401

logger = logging.getLogger(__name__)

# The environment variables that supply each: the value itself, and a file holding it.
SECRET_ENV: dict[str, tuple[str, str]] = {
    "serve.api_key": ("HAMO_API_KEY", "HAMO_API_KEY_FILE"),
    "memory.llm_api_key": ("HAMO_LLM_API_KEY", "HAMO_LLM_API_KEY_FILE"),
    "memory.storage_options": ("HAMO_STORAGE_OPTIONS", "HAMO_STORAGE_OPTIONS_FILE"),
}
LOOPBACK_NAMES = ("localhost", "localhost.localdomain", "ip6-localhost")


def is_secret(section: str, key: str) -> bool:
    """Whether ``section.key`` holds a secret (never saved as it is, so never compared on resume)."""
    return f"{section}.{key}" in SECRET_KEYS


def is_loopback(host: str) -> bool:
    """True for an address only this machine reaches (``127.0.0.0/8``, ``::1``, ``localhost``)."""
    name = host.strip().strip("[]").lower()
    if name in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def mask_text(text: str, secrets: list[str] | tuple[str, ...]) -> str:
    """``text`` with every occurrence of the (non-trivial) ``secrets`` replaced by ``MASK``."""
    for s in sorted(
        {s for s in secrets if s and s not in _NOT_SECRET and len(s) >= 4}, key=len, reverse=True
    ):
        text = text.replace(s, MASK)
    return text


def secret_values(data: Any) -> list[str]:
    """The secret strings in a config (a ``HamoConfig`` or its dump), to mask in free text."""
    if hasattr(data, "model_dump"):
        data = data.model_dump(mode="json")
    out = []
    for dotted, kind in SECRET_KEYS.items():
        node = data
        for part in dotted.split("."):
            node = node.get(part) if isinstance(node, Mapping) else None
        if kind == "mapping" and isinstance(node, Mapping):
            out += [str(v) for v in node.values()]
        elif isinstance(node, str):
            out.append(node)
    return out


def strip_masked(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` (a raw config mapping) without masked secrets: a saved config's ``***`` reads as unset.

    ``data`` is not modified.
    """
    if not isinstance(data, dict):
        return data
    out = dict(data)
    for dotted, kind in SECRET_KEYS.items():
        section, key = dotted.split(".")
        values = out.get(section)
        if not isinstance(values, dict) or key not in values:
            continue
        value = values[key]
        if kind == "mapping" and isinstance(value, dict):
            kept = {k: v for k, v in value.items() if v != MASK}
            if kept != value:
                out[section] = {**values, key: kept}
        elif value == MASK:
            out[section] = {k: v for k, v in values.items() if k != key}
    return out


def _read_secret_file(var: str, path: str) -> str:
    f = Path(path).expanduser()
    try:
        text = f.read_text()
    except OSError as exc:
        raise ConfigError(
            f"{var}={path}: cannot read the file ({type(exc).__name__}: {exc.strerror})"
        ) from None
    try:
        if f.stat().st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            logger.warning("%s=%s: others may read the file; chmod 600 it", var, path)
    except OSError:
        pass
    value = text.strip()
    if not value:
        raise ConfigError(f"{var}={path}: the file is empty")
    return value


def _parse_options(var: str, text: str) -> dict[str, str]:
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        value = None
    if not isinstance(value, dict):  # the text itself is not shown: it may hold credentials
        raise ConfigError(f"{var} must hold a YAML or JSON mapping (e.g. {{aws_region: us-east-1}})")
    return {str(k): str(v) for k, v in value.items()}


def from_environment(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The secrets the environment supplies, by dotted key (``{"serve.api_key": "..."}``).

    Raises:
        ConfigError: a variable and its ``_FILE`` twin both set, an unreadable or empty file, or a
            storage-options value that is no mapping; the message names the variable, never the value.
    """
    env = os.environ if environ is None else environ
    found: dict[str, Any] = {}
    for dotted, (var, file_var) in SECRET_ENV.items():
        value, path = env.get(var) or None, env.get(file_var) or None
        if value and path:
            raise ConfigError(f"{var} and {file_var} are both set; set one (they supply {dotted})")
        if path:
            value = _read_secret_file(file_var, path)
        if value is None:
            continue
        if SECRET_KEYS[dotted] == "mapping":
            value = _parse_options(file_var if path else var, value)
        found[dotted] = value
    return found


def fill_from_environment(data: dict[str, Any], environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """``data`` (a raw config mapping, before the command line's overrides) with the environment's secrets.

    A key's variable replaces the file's value; storage options from the environment are merged over
    the file's, key by key. ``data`` is not modified.
    """
    out = dict(data)
    for dotted, value in from_environment(environ).items():
        section, key = dotted.split(".")
        values = out.get(section)
        values = dict(values) if isinstance(values, dict) else {}
        if SECRET_KEYS[dotted] == "mapping" and isinstance(values.get(key), dict):
            value = {**values[key], **value}
        values[key] = value
        out[section] = values
    return out


def key_sources(dotted: str) -> str:
    """How to give the secret ``dotted`` (for error messages): ``serve.api_key, HAMO_API_KEY or ...``."""
    var, file_var = SECRET_ENV[dotted]
    return f"{dotted}, {var} or {file_var}"
