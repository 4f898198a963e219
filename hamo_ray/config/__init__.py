"""Typed, frozen configuration of a HaMo run.

Defaults live in code; a YAML file holds only the differences; dotted ``key=value`` overrides on
the command line win over both::

    python jobs/stream.py --config jobs/configs/tiny.yaml train.epochs=1 env.task_types=[lifespan-longest-lived]

An unknown key, a wrong type or a bad value is a ``ConfigError`` naming the key, raised before any
work starts.

The sections live in ``base`` (``ConfigError``), ``experiment`` (run, method, model, backbone,
protocol, prompt), ``env`` (what every domain uses, and each domain's own section ``env.<domain>``,
registered by the domain) and ``components`` (memory, selection, replay, train, serve, rollout, ray);
every name is importable from ``hamo_ray.config`` itself. A saved config (a run folder's
``config.yaml``) is read with ``load_saved_config``, which converts an older layout first.

Secrets (``serve.api_key``, ``memory.llm_api_key``, ``memory.storage_options``) also come from the
environment (``HAMO_API_KEY``, ``HAMO_API_KEY_FILE``, ...; the command line beats the environment, the
environment the file) and are masked (``***``) in everything written or shown: ``to_yaml``,
``public_dump``, error messages (``hamo_ray.config.secrets``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, Field, ValidationError, model_validator

from hamo_ray.config.base import ConfigError, ConfigSection, _Cfg, error_lines
from hamo_ray.config.components import (
    STORE_SCHEMES,
    MemoryConfig,
    RayConfig,
    ReplayConfig,
    RolloutConfig,
    SelectionConfig,
    ServeConfig,
    TrainConfig,
)
from hamo_ray.config.env import (
    MOVED_ENV_KEYS,
    EnvConfig,
    env_sections,
    register_env_section,
    upgrade_env_layout,
)
from hamo_ray.config.experiment import (
    BackboneConfig,
    EvalConfig,
    MethodConfig,
    ModelConfig,
    PromptConfig,
    ProtocolConfig,
    RunConfig,
)
from hamo_ray.config.secrets import (
    MASK,
    SECRET_ENV,
    SECRET_KEYS,
    fill_from_environment,
    is_loopback,
    mask_secrets,
    strip_masked,
)

__all__ = [
    "BackboneConfig",
    "ConfigError",
    "ConfigSection",
    "EnvConfig",
    "EvalConfig",
    "MOVED_ENV_KEYS",
    "HamoConfig",
    "MemoryConfig",
    "MethodConfig",
    "ModelConfig",
    "PromptConfig",
    "ProtocolConfig",
    "RayConfig",
    "ReplayConfig",
    "RolloutConfig",
    "RunConfig",
    "STORE_SCHEMES",
    "SelectionConfig",
    "ServeConfig",
    "TrainConfig",
    "apply_override",
    "env_sections",
    "load_config",
    "MASK",
    "SECRET_ENV",
    "SECRET_KEYS",
    "is_loopback",
    "mask_secrets",
    "load_saved_config",
    "read_config_file",
    "register_env_section",
    "upgrade_saved_config",
]


# Keys added with a new default whose old behaviour a saved config that lacks them must keep: a run or
# an export made before the key existed did the old thing, not the new default (section, key, old value).
OLD_BEHAVIOUR: tuple[tuple[str, str, Any], ...] = (
    ("selection", "embed", "key"),  # selection compared the cards' keys before it compared whole cards
    ("protocol", "seeds", "legacy"),  # select and replay seeded from run.seed * 1000 + stage before
)


def upgrade_saved_config(data: dict[str, Any]) -> dict[str, Any]:
    """A saved config (a run folder's or a sweep export's ``config.yaml``, as a mapping) in today's layout.

    The old flat ``env`` keys move into their domain's section (``hamo_ray.config.env``); a section that
    lacks a key of ``OLD_BEHAVIOUR`` gets the value that reproduces what the run did then
    (``selection.embed: key``, ``protocol.seeds: legacy``), not today's default. Any other key the saved config lacks holds its
    default (the resume check and the sweep's staleness check assume so). ``data`` is not modified;
    upgrading an upgraded config changes nothing.
    """
    data = upgrade_env_layout(data)
    if not isinstance(data, dict):
        return data
    out = dict(data)
    for section, key, old in OLD_BEHAVIOUR:
        values = out.get(section)
        if isinstance(values, dict) and key not in values:
            out[section] = {**values, key: old}
    return out


# Counts given as one number or one per domain of the stream ({scienceworld: 6, alfworld: 24, ...}).
PER_DOMAIN_COUNTS = ("backbone.per_task", "protocol.train_per_task", "protocol.test_per_task")


class HamoConfig(_Cfg):
    run: RunConfig = RunConfig()
    method: MethodConfig = MethodConfig()
    model: ModelConfig = ModelConfig()
    backbone: BackboneConfig = BackboneConfig()
    env: EnvConfig = Field(default_factory=EnvConfig)  # validated on use: the domains register its sections
    protocol: ProtocolConfig = ProtocolConfig()
    eval: EvalConfig = EvalConfig()
    prompt: PromptConfig = PromptConfig()
    memory: MemoryConfig = MemoryConfig()
    selection: SelectionConfig = SelectionConfig()
    replay: ReplayConfig = ReplayConfig()
    train: TrainConfig = TrainConfig()
    serve: ServeConfig = ServeConfig()
    rollout: RolloutConfig = RolloutConfig()
    ray: RayConfig = RayConfig()

    @model_validator(mode="after")
    def _check(self) -> HamoConfig:
        if self.train.lora_r > self.serve.max_lora_rank:
            raise ValueError(
                f"train.lora_r ({self.train.lora_r}) exceeds serve.max_lora_rank ({self.serve.max_lora_rank})"
            )
        if "chat_template" in self.serve.engine_kwargs:  # the server alone would render with it
            raise ValueError(
                "serve.engine_kwargs.chat_template: set model.chat_template (training renders with it too)"
            )
        domains = self.domains()
        for key in PER_DOMAIN_COUNTS:
            per_task = self._setting(key)
            if not isinstance(per_task, dict):
                continue
            if missing := [d for d in domains if d not in per_task]:
                raise ValueError(f"{key} has no entry for domain(s) {', '.join(missing)}")
            if key.startswith("protocol.") and (extra := [d for d in per_task if d not in domains]):
                raise ValueError(f"{key} names domain(s) this stream does not run: {', '.join(extra)}")
        if extra := [d for d in self.protocol.eval_seen if d not in domains]:
            raise ValueError(
                f"protocol.eval_seen names domain(s) this stream does not run: {', '.join(extra)}"
            )
        return self

    @property
    def prompt_budget(self) -> int:
        """Prompt tokens a turn may use, in training and at inference alike (the context rule's budget,
        ``prompt.history``): ``model.max_model_len - rollout.max_tokens``. Its one owner."""
        return self.model.max_model_len - self.rollout.max_tokens

    def _setting(self, key: str):
        section, name = key.split(".")
        return getattr(getattr(self, section), name)

    def per_domain(self, key: str, domain: str) -> int:
        """A count of ``PER_DOMAIN_COUNTS`` for ``domain``: the key's one number, or its entry for the domain.

        Raises:
            ConfigError: ``domain`` is not a domain of this stream.
        """
        value = self._setting(key)
        if not isinstance(value, dict):
            return value
        if domain not in value:
            raise ConfigError(f"{key} has no entry for domain {domain!r} (it names {sorted(value)})")
        return value[domain]

    def backbone_per_task(self, domain: str) -> int:
        """Pre-training variations per task type of ``domain`` (``backbone.per_task``, one or per domain)."""
        return self.per_domain("backbone.per_task", domain)

    def domains(self) -> list[str]:
        """The domains of the stream, in stage order."""
        return list(self.protocol.order) if self.protocol.kind == "cross_domain" else [self.env.domain]

    def task_types(self, domain: str) -> list[str]:
        """The task types used for ``domain``.

        Raises:
            ConfigError: ``env.task_types`` is per domain and does not name ``domain``.
        """
        tt = self.env.task_types
        if isinstance(tt, dict):
            if domain not in tt:
                raise ConfigError(f"env.task_types has no entry for domain {domain!r} (has: {', '.join(tt)})")
            return list(tt[domain])
        if domain != self.env.domain:
            raise ConfigError(
                f"env.task_types is a list for env.domain={self.env.domain!r}; give a mapping per domain "
                f"to use {domain!r}"
            )
        return list(tt)

    def to_yaml(self) -> str:
        """The config as YAML, secrets masked (``***``): what a run folder, an export or ``--print-config``
        shows. ``model_dump`` keeps the real values (for code that needs them, never for a file)."""
        return yaml.safe_dump(self.public_dump(), sort_keys=False)

    def public_dump(self) -> dict[str, Any]:
        """``model_dump(mode="json")`` with every secret masked (``hamo_ray.config.secrets``)."""
        return mask_secrets(self.model_dump(mode="json"))


def _parse_value(text: str) -> Any:
    """Parse a command-line value with YAML rules: ``3`` -> int, ``[a,b]`` -> list, ``x`` -> str."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def _subkeys(model: type[BaseModel]) -> dict[str, Any]:
    """The keys under ``model`` and their types: its fields, and for ``env`` the domains' sections."""
    keys = {name: field.annotation for name, field in model.model_fields.items()}
    if model is EnvConfig:
        keys |= env_sections()
    return keys


def apply_override(data: dict[str, Any], dotted: str) -> None:
    """Set ``a.b.c=value`` in a nested dict, checking each key against ``HamoConfig``'s fields."""
    if "=" not in dotted:
        raise ConfigError(f"override {dotted!r} is not of the form key=value")
    key, _, raw = dotted.partition("=")
    parts = key.strip().split(".")
    if _secret_like(parts):  # a secret (or a misspelt one) is never shown in an error
        dotted = f"{key}={MASK}"
    model: type[BaseModel] | None = HamoConfig
    node = data
    for i, part in enumerate(parts):
        path = ".".join(parts[: i + 1])
        keys = _subkeys(model) if model is not None else {}
        if part not in keys:
            if model is EnvConfig and part in MOVED_ENV_KEYS:
                raise ConfigError(f"env.{part} is now env.{MOVED_ENV_KEYS[part]} (in override {dotted!r})")
            raise ConfigError(f"unknown config key {path!r} in override {dotted!r}")
        annotation = keys[part]
        is_section = isinstance(annotation, type) and issubclass(annotation, BaseModel)
        if i == len(parts) - 1:
            if is_section:
                raise ConfigError(f"config key {path!r} is a section; set one of its fields")
            # a secret stays the string given (YAML would read 0123 as a number)
            node[part] = raw if path in SECRET_KEYS and SECRET_KEYS[path] == "value" else _parse_value(raw)
        else:
            if not is_section:
                raise ConfigError(f"config key {path!r} is not a section (in override {dotted!r})")
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"config key {path!r} must be a mapping")
            model = annotation


def _secret_like(parts: list[str]) -> bool:
    dotted = ".".join(parts).lower()
    return any(dotted.startswith(k) for k in SECRET_KEYS) or any(
        w in parts[-1].lower() for w in ("key", "secret", "token", "password")
    )


def _format_validation_error(err: ValidationError, source: str) -> str:
    return f"invalid configuration ({source}):\n  " + "\n  ".join(error_lines(err))


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``over`` on top of ``base``, section by section (lists and values are replaced whole)."""
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def read_config_file(path: Path, _seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """The raw mapping of a YAML config file, with its ``extends:`` chain merged in.

    ``extends: other.yaml`` (relative to the file) makes a preset hold only its differences from
    another preset, so variants (one node, two nodes) cannot drift from the preset they vary.

    Raises:
        ConfigError: a missing file, malformed YAML, a non-mapping, or an ``extends`` cycle.
    """
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    if path.resolve() in _seen:
        raise ConfigError(f"config file {str(path)!r}: 'extends' forms a cycle")
    try:
        loaded = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {str(path)!r} is not valid YAML: {exc}") from exc
    if loaded is not None and not isinstance(loaded, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping at the top level")
    data = dict(loaded or {})
    parent = data.pop("extends", None)
    if parent is None:
        return data
    if not isinstance(parent, str):
        raise ConfigError(f"config file {str(path)!r}: 'extends' must name one YAML file")
    base = read_config_file(path.parent / parent, (*_seen, path.resolve()))
    return _merge(base, data)


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> HamoConfig:
    """Load a config: code defaults, then the YAML file's differences, then dotted overrides.

    Args:
        path: a YAML file holding only the keys that differ from the defaults (or from the file its
            ``extends:`` names), or None.
        overrides: ``key.sub=value`` strings, applied in order.

    Returns:
        The validated, frozen ``HamoConfig``.

    Raises:
        ConfigError: a missing file, malformed YAML, an unknown key or a wrong type; the message names it.
    """
    data: dict[str, Any] = {}
    source = "defaults"
    if path is not None:
        data = read_config_file(Path(path))
        source = str(path)
    return _validate(data, overrides, source)


def load_saved_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> HamoConfig:
    """Load a config a run saved (its folder's ``config.yaml``), in an older layout too, then overrides.

    Like ``load_config``, after ``upgrade_saved_config`` (the old flat ``env`` keys move into their
    domain's section): a run started before a layout change is still read.

    Raises:
        ConfigError: as ``load_config``.
    """
    data = upgrade_saved_config(read_config_file(Path(path)))
    return _validate(data, overrides, str(path))


def _validate(data: dict[str, Any], overrides: list[str] | tuple[str, ...], source: str) -> HamoConfig:
    # Secrets: a masked one (a saved config's ***) reads as unset; the environment beats the file, the
    # command line beats both (hamo_ray/config/secrets.py).
    data = fill_from_environment(strip_masked(data))
    for item in overrides:
        apply_override(data, item)
    try:
        return HamoConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err, source)) from None
