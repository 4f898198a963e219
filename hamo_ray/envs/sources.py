"""Checks that every data source a config names is there, before any work starts.

``Stream.__init__`` and the dry run (``jobs/stream.py --dry-run``) call ``check_data_sources``; a
missing source is a ``DataSourceError`` naming the setting and the path or URL, raised before Ray,
serving or any episode starts. Nothing is substituted for a missing source: generated ALFWorld games
(``env.alfworld.games=generated``) and the WebShop stand-in (``env.webshop.backend=standin``) are used
only where the config names them.

Per domain of the stream:

- ScienceWorld: the simulator jar shipped in the ``scienceworld`` wheel, and a ``java`` on PATH; with
  ``env.scienceworld.backend=agentgym``: the server at ``env.scienceworld.url`` answers as AgentGym's
  sciworld server, and ``rollout.num_workers x rollout.envs_per_worker`` fits ``env.scienceworld.max_envs``.
- TextCraft, BabyAI: their AgentGym server (``env.<domain>.url``) answers as one, the pool fits
  ``env.<domain>.max_envs``; experts come from files only.
- ALFWorld: ``official`` games under ``env.alfworld.data`` / ``$ALFWORLD_DATA`` (the
  ``alfworld-download`` layout); ``generated`` games need nothing (made on first use).
- WebShop: ``http``: the env server at ``env.webshop.url`` answers; ``text_env``: ``web_agent_site`` is
  importable; ``standin``: nothing.
- Experts: with ``env.expert_source=file``, the domain's file in ``env.expert_files`` exists and
  imports (``expert_data``); with ``simulator``, the domain's simulator must have an expert (the real
  WebShop has none).

Usage::

    for source in check_data_sources(cfg):
        print(source.line())
"""

from __future__ import annotations

import importlib.util
import shutil
from dataclasses import dataclass
from pathlib import Path

from hamo_ray.config import ConfigError, HamoConfig


class DataSourceError(ConfigError):
    """A data source the config names is missing or unreachable; the message names setting and location."""


@dataclass(frozen=True)
class Source:
    """One checked data source."""

    name: str  # what it is, e.g. "ALFWorld games"
    setting: str  # the config key that chose it
    location: str  # path, URL or "-"
    detail: str  # what was found

    def line(self) -> str:
        return f"ok  {self.name:<24} {self.setting:<28} {self.location}  ({self.detail})"


def _scienceworld() -> list[Source]:
    from scienceworld.constants import JAR_PATH

    if not Path(JAR_PATH).is_file():
        raise DataSourceError(
            f"env.domain scienceworld: the simulator jar {JAR_PATH} is missing (reinstall scienceworld)"
        )
    java = shutil.which("java")
    if java is None:
        raise DataSourceError("env.domain scienceworld: no `java` on PATH (ScienceWorld runs on Java 1.8+)")
    return [Source("ScienceWorld simulator", "env.domain", str(JAR_PATH), f"java at {java}")]


def _alfworld(cfg: HamoConfig) -> list[Source]:
    from hamo_ray.envs.alfworld.domain import GameStore

    store = GameStore(cfg.env)
    if not store.official:
        return [
            Source("ALFWorld games", "env.alfworld.games", str(store.generated), "generated on first use")
        ]
    store.check()
    n = sum(1 for _ in (store.root / "json_2.1.1" / "train").glob("*/*/game.tw-pddl"))
    return [
        Source("ALFWorld games", "env.alfworld.games", str(store.root), f"official, {n} train game files")
    ]


def _webshop(cfg: HamoConfig) -> list[Source]:
    env = cfg.env
    if env.webshop.backend == "standin":
        return [
            Source("WebShop", "env.webshop.backend", "standin", f"{env.webshop.products} generated products")
        ]
    if env.webshop.backend == "text_env":
        if importlib.util.find_spec("web_agent_site") is None:
            raise DataSourceError(
                "env.webshop.backend=text_env: `web_agent_site` is not importable (install WebShop from "
                "https://github.com/princeton-nlp/WebShop with its setup.sh in this environment)"
            )
        return [Source("WebShop", "env.webshop.backend", "web_agent_site", "text env importable")]
    import httpx

    url = env.webshop.url
    if not url:
        raise DataSourceError("env.webshop.url: required when env.webshop.backend=http")
    try:
        status = httpx.get(url.rstrip("/") + "/", timeout=10.0).status_code
    except httpx.HTTPError as err:
        raise DataSourceError(
            f"env.webshop.url: the WebShop env server {url} is unreachable (env.webshop.backend=http): "
            f"{type(err).__name__}: {err}"
        ) from None
    return [Source("WebShop", "env.webshop.url", url, f"env server answers (HTTP {status})")]


def agentgym_server(cfg: HamoConfig, domain: str, server: str, url: str | None) -> Source:
    """An AgentGym server of ``domain``: it answers ``GET /`` with its own banner, and the rollout pool
    fits its bound (``env.<domain>.max_envs``).

    Raises:
        DataSourceError: no URL, unreachable, another environment's server, or too many environments.
    """
    import httpx

    from hamo_ray.envs.agentgym.protocol import server_spec

    key = f"env.{domain}.url"
    if not url:
        raise DataSourceError(f"{key}: required (the AgentGym {server} server)")
    spec = server_spec(server)
    try:
        response = httpx.get(url.rstrip("/") + "/", timeout=10.0)
    except httpx.HTTPError as err:
        raise DataSourceError(
            f"{key}: the AgentGym {server} server {url} is unreachable: {type(err).__name__}: {err}"
        ) from None
    if f"environment {spec.banner}".lower() not in response.text.lower():
        raise DataSourceError(
            f"{key}: {url} is not an AgentGym {server} server (GET / answered HTTP "
            f"{response.status_code}: {response.text[:120]!r}; expected 'This is environment {spec.banner}.')"
        )
    r = cfg.rollout
    bound = cfg.env.section(domain).max_envs
    if r.num_workers * r.envs_per_worker > bound:
        raise DataSourceError(
            f"env.{domain}.max_envs={bound}: rollout.num_workers x rollout.envs_per_worker = "
            f"{r.num_workers} x {r.envs_per_worker} environments would be open on {url}"
        )
    return Source(f"AgentGym {server}", key, url, f"answers ({response.text.strip()[:60]})")


def _experts(cfg: HamoConfig, domain: str, load: bool) -> Source:
    from hamo_ray.envs.expert_data import expert_file, load_expert_file

    if cfg.env.expert_source == "simulator":
        if domain == "webshop" and cfg.env.webshop.backend != "standin":
            raise DataSourceError(
                f"env.expert_source=simulator: the real WebShop (env.webshop.backend={cfg.env.webshop.backend}) "
                "has no expert; set env.expert_source=file with env.expert_files.webshop (AgentGym / ETO data)"
            )
        if domain in ("textcraft", "babyai"):
            raise DataSourceError(
                f"env.expert_source=simulator: the AgentGym {domain} server has no expert; set "
                f"env.expert_source=file with env.expert_files.{domain} (AgentTraj items {domain}_<N>)"
            )
        if domain == "scienceworld" and cfg.env.scienceworld.backend == "agentgym":
            if importlib.util.find_spec("scienceworld") is None:
                raise DataSourceError(
                    "env.expert_source=simulator: env.scienceworld.backend=agentgym takes its gold paths from a "
                    "local simulator (pip install scienceworld), else set env.expert_source=file"
                )
            return Source(
                f"{domain} experts", "env.expert_source", "simulator", "a local simulator's gold paths"
            )
        return Source(f"{domain} experts", "env.expert_source", "simulator", "the simulator's expert")
    path = Path(expert_file(cfg, domain)).expanduser()
    if not path.is_file():
        raise DataSourceError(f"env.expert_files.{domain}: {path} does not exist")
    detail = "exists"
    if load:
        trajs = load_expert_file(path, domain, cfg.env)
        types = set(cfg.task_types(domain))
        train = sum(1 for t in trajs if t.task.split == "train" and t.task.task in types and t.score > 0)
        if not train:
            raise DataSourceError(
                f"env.expert_files.{domain}: {path} has no scored item of a train task of the configured "
                f"task types {sorted(types)} ({len(trajs)} trajectories in all)"
            )
        detail = f"{len(trajs)} trajectories, {train} usable train items of the configured task types"
    return Source(f"{domain} experts", f"env.expert_files.{domain}", str(path), detail)


def check_data_sources(cfg: HamoConfig, load_experts: bool = True) -> list[Source]:
    """Check every data source of ``cfg``'s domains (see the module docstring).

    Args:
        cfg: the run's configuration.
        load_experts: also import the expert files (validates every item; cached per process).

    Returns:
        The sources found, one line each.

    Raises:
        DataSourceError: a source is missing or unreachable (the message names setting and location).
        ExpertDataError: an expert file is malformed (file, item index and field named).
    """
    found: list[Source] = []
    for domain in cfg.domains():
        if domain == "scienceworld" and cfg.env.scienceworld.backend == "agentgym":
            found.append(agentgym_server(cfg, domain, "sciworld", cfg.env.scienceworld.url))
        elif domain == "scienceworld":
            found += _scienceworld()
        elif domain == "alfworld":
            found += _alfworld(cfg)
        elif domain == "webshop":
            found += _webshop(cfg)
        elif domain in ("textcraft", "babyai"):
            found.append(agentgym_server(cfg, domain, domain, cfg.env.section(domain).url))
        found.append(_experts(cfg, domain, load_experts))
    return found
