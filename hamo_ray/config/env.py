"""The ``env`` section: the settings every domain uses, and one section per domain (``env.<domain>.*``).

A domain declares its own settings model and registers it with the domain
(``@register_domain("name", config=Model)``, hamo_ray/envs/base.py), so a new domain brings its
settings without editing this module::

    env:
      domain: scienceworld             # what every domain uses: domain, task_types, max_turns, experts
      task_types: [boil, melt]
      max_turns: 50
      expert_source: simulator
      scienceworld: {jvm_heap: 1g, simplifications: easy}
      webshop: {backend: http, url: "http://host:36001"}

Every registered domain has its section (its defaults where the file gives none). An unknown key is
named (``env.scienceworld.heap``); a flat key of the old layout is refused naming its new place
(``env.jvm_heap is now env.scienceworld.jvm_heap``). A saved config (a run folder's or a sweep
export's ``config.yaml``) in the old layout is converted by ``upgrade_env_layout`` (``hamo_ray.config.upgrade_saved_config`` calls it).
"""

from __future__ import annotations

import copy
import importlib
from typing import Any, Literal

from pydantic import ConfigDict, Field, ValidationError, model_validator

from hamo_ray.config.base import ConfigError, ConfigKeyErrors, ConfigSection, _Cfg, error_lines

# The flat keys of the old layout and their place now (env.<key> -> env.<domain>.<key>).
MOVED_ENV_KEYS = {
    "jvm_heap": "scienceworld.jvm_heap",
    "simplifications": "scienceworld.simplifications",
    "webshop_backend": "webshop.backend",
    "webshop_url": "webshop.url",
    "webshop_products": "webshop.products",
    "webshop_seed": "webshop.seed",
    "webshop_ids": "webshop.ids",
    "textworld_games_dir": "textworld.games_dir",
    "alfworld_games": "alfworld.games",
    "alfworld_data": "alfworld.data",
    "alfworld_games_dir": "alfworld.games_dir",
    "alfworld_seed": "alfworld.seed",
    "alfworld_games_per_task": "alfworld.games_per_task",
}

_SECTIONS: dict[str, type[ConfigSection]] = {}
BUILTIN_DOMAINS = "hamo_ray.envs"  # the package whose import registers the built-in domains


def register_env_section(domain: str, model: type[ConfigSection]) -> None:
    """Make ``model`` the settings of ``domain``: ``env.<domain>.*`` (every field needs a default).

    Raises:
        ConfigError: ``domain`` is the name of a setting every domain uses (``env.max_turns``...).
    """
    if domain in EnvConfig.model_fields:
        raise ConfigError(f"domain {domain!r}: its settings would hide env.{domain}")
    _SECTIONS[domain] = model


def env_sections() -> dict[str, type[ConfigSection]]:
    """Every registered domain's settings model, by domain name (the built-in domains always among them)."""
    importlib.import_module(BUILTIN_DOMAINS)  # registers the built-in domains (once; cheap after)
    return dict(sorted(_SECTIONS.items()))


class EnvConfig(_Cfg):
    """What every domain uses, and one settings section per registered domain (``env.<domain>``)."""

    model_config = ConfigDict(frozen=True, extra="allow")  # the extras: the domains' sections, checked below

    domain: str = "scienceworld"
    # Task types of ``domain`` (a list), or per domain for cross-domain streams ({domain: [types]}).
    task_types: list[str] | dict[str, list[str]] = Field(
        default_factory=lambda: ["lifespan-longest-lived", "find-living-thing"]
    )
    max_turns: int = 50
    # Expert trajectories: the simulator's expert ("simulator": gold paths, walkthroughs, the stand-in's
    # plan) or files in the AgentGym / ETO conversation format ("file": hamo_ray/envs/expert_data.py).
    expert_source: Literal["simulator", "file"] = "simulator"
    expert_files: dict[str, str] = Field(default_factory=dict)  # domain -> JSON file, for expert_source=file
    # A folder keeping the simulator's expert trajectories per stage's tasks, shared by runs on the same
    # tasks (hamo_ray/envs/expert_cache.py); a sweep sets <root>/experts (sweep.share_experts).
    expert_cache: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _sections(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        sections = env_sections()
        out: dict[str, Any] = {}
        problems: list[str] = []
        for key, value in data.items():
            if key in cls.model_fields:
                out[key] = value
            elif key in sections:
                continue  # validated below
            elif key in MOVED_ENV_KEYS:
                problems.append(f"env.{key} is now env.{MOVED_ENV_KEYS[key]}")
            elif key not in sections:
                problems.append(f"unknown config key 'env.{key}'")
        for name, model in sections.items():
            value = data.get(name, {})
            try:
                out[name] = value if isinstance(value, model) else model.model_validate(value)
            except ValidationError as err:
                problems += error_lines(err, f"env.{name}")
        if problems:
            raise ConfigKeyErrors(problems)
        return out

    def section(self, domain: str) -> ConfigSection:
        """The settings of ``domain`` (``env.<domain>``).

        Raises:
            ConfigError: no domain of that name registered settings.
        """
        sections = self.__pydantic_extra__ or {}
        if domain not in sections:
            raise ConfigError(
                f"env.{domain}: no settings for domain {domain!r} (have: {', '.join(sections)})"
            )
        return sections[domain]


def upgrade_env_layout(data: dict[str, Any]) -> dict[str, Any]:
    """A saved config (a run folder's or a sweep export's ``config.yaml``, as a mapping) in today's layout.

    The flat ``env`` keys of the old layout move into their domain's section (``env.jvm_heap`` ->
    ``env.scienceworld.jvm_heap``, ``MOVED_ENV_KEYS``); a domain section the saved config holds gets the
    defaults of the keys it lacks (a key added after the config was saved holds its default, as the
    resume check assumes for every key); a config in the old layout gets the default section of every
    domain that never had flat keys (added after that layout: ``textcraft``, ``babyai``). Anything else is returned as it is. ``data`` is not modified;
    upgrading an upgraded config changes nothing.
    """
    if not isinstance(data, dict) or not isinstance(data.get("env"), dict):
        return data
    env = copy.deepcopy(data["env"])
    old_layout = any(key in env for key in MOVED_ENV_KEYS)
    for old, new in MOVED_ENV_KEYS.items():
        if old not in env:
            continue
        value = env.pop(old)
        domain, key = new.split(".")
        section = env.get(domain) if isinstance(env.get(domain), dict) else {}
        env[domain] = {**section, key: section.get(key, value)}
    flat_domains = {new.split(".")[0] for new in MOVED_ENV_KEYS.values()}
    for name, model in env_sections().items():
        if old_layout and name not in flat_domains and name not in env:
            env[name] = {}  # a domain added after the old layout (no flat keys): its defaults
        if isinstance(env.get(name), dict):
            env[name] = {**model().model_dump(mode="json"), **env[name]}
    return {**data, "env": env}
