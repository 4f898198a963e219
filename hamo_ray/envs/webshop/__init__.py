"""WebShop as a HaMo domain: an offline stand-in with generated data, or the real WebShop.

``env.webshop.backend`` chooses:

- ``standin`` (default): ``standin.WebShopStandinEnv`` over a generated catalogue (``catalog.py``) with
  WebShop's action space, text pages and reward (``reward.py``). Task types are the five product
  categories; variations index each category's instructions (train/dev/test disjoint). This is not
  the WebShop benchmark: its scores are not comparable with published WebShop numbers.
- ``text_env``: WebShop's own ``WebAgentTextEnv`` in-process (``web_agent_site`` must be importable).
- ``http``: a WebShop environment server (AgentGym API) at ``env.webshop.url``.

The real backends have one task type, ``all`` (see ``client.py`` for splits and how to start them), and
no expert: a run with them imports its WebShop experts (``env.expert_source=file``, ``expert_data.py``).
``server.py`` serves the stand-in behind the real env server's HTTP API (tests, smoke runs).

Usage::

    domain = get_domain("webshop", EnvConfig(domain="webshop"))
    task = domain.tasks("test", "fashion", limit=1)[0]
    env = domain.make_env()
    goal, obs = env.reset(task)     # "i need ... with color: black, and size: large, and price lower than 40.00 dollars"
    for action in env.expert_actions():
        result = env.step(action)   # search[...], click[b0...], click[black], click[large], click[buy now]
"""

from __future__ import annotations

from typing import Literal

from hamo_ray.config import ConfigError, ConfigSection, EnvConfig
from hamo_ray.envs.base import Domain, Env, register_domain
from hamo_ray.types import TaskSpec


class WebShopConfig(ConfigSection):
    """WebShop's settings, ``env.webshop.*``."""

    # the offline stand-in (generated catalogue), the real text env in-process, or an env server
    backend: Literal["standin", "text_env", "http"] = "standin"
    url: str | None = None  # env server base URL (AgentGym API), for backend=http
    products: int = 3000  # stand-in catalogue size (text_env: 100, 1000 or 100000 picks its index)
    seed: int = 0  # stand-in catalogue and instructions
    # Stand-in product ids: "asin" (WebShop's B0 + 8 letters/digits) or "short" (B0 + 4 digits, at most
    # 5,000 products): the same catalogue, ids a tiny model can copy from a results page into a click.
    ids: Literal["asin", "short"] = "asin"


@register_domain("webshop", config=WebShopConfig)
class WebShopDomain(Domain):
    """WebShop tasks: stand-in categories, or the real WebShop's goal list (task type ``all``).

    Raises:
        ConfigError: ``env.webshop.backend=http`` without ``env.webshop.url``; (on first use) a stand-in
            catalogue smaller than 50 products, or short ids with over 5,000.
    """

    env_memory_mb = 50  # resource hint per environment (measured well below this)
    lists_actions = True  # the page's clickables and the search template

    def __init__(self, cfg: EnvConfig) -> None:
        super().__init__(cfg)
        self.ws: WebShopConfig = cfg.webshop
        if self.ws.backend == "http" and not self.ws.url:
            raise ConfigError("env.webshop.url: required when env.webshop.backend=http")

    def _catalog(self):
        from hamo_ray.envs.webshop.catalog import build_catalog

        try:
            return build_catalog(self.ws.seed, self.ws.products, self.ws.ids)
        except ValueError as err:
            raise ConfigError(f"env.webshop.{err}") from None  # the message starts with the key: products=...

    def task_types(self) -> list[str]:
        if self.ws.backend == "standin":
            from hamo_ray.envs.webshop.catalog import CATEGORIES

            return list(CATEGORIES)
        from hamo_ray.envs.webshop.client import REAL_TASK_TYPE

        return [REAL_TASK_TYPE]

    def tasks(self, split: str, task_type: str, limit: int | None = None) -> list[TaskSpec]:
        """Instructions of ``task_type`` in ``split``, in increasing variation order.

        Raises:
            ConfigError: unknown split or task type.
        """
        self.check_split(split)
        self.check_task_types([task_type])
        if self.ws.backend == "standin":
            variations = self._catalog().split_range(task_type, split)
        else:
            from hamo_ray.envs.webshop.client import REAL_SPLITS

            variations = REAL_SPLITS[split]
        if limit is not None:
            variations = variations[:limit]
        return [TaskSpec(domain=self.name, task=task_type, variation=v, split=split) for v in variations]

    def make_env(self) -> Env:
        backend = self.ws.backend
        if backend == "standin":
            from hamo_ray.envs.webshop.standin import WebShopStandinEnv

            return WebShopStandinEnv(self._catalog())
        if backend == "http":
            from hamo_ray.envs.webshop.client import WebShopHttpEnv

            return WebShopHttpEnv(self.ws.url)
        from hamo_ray.envs.webshop.client import WebShopTextEnv

        n = self.ws.products
        return WebShopTextEnv(n if n in (100, 1000, 100000) else None)
