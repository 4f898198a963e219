"""WebShop as a HaMo domain: an offline stand-in with generated data, or the real WebShop.

``env.webshop_backend`` chooses:

- ``standin`` (default): ``standin.WebShopStandinEnv`` over a generated catalogue (``catalog.py``) with
  WebShop's action space, text pages and reward (``reward.py``). Task types are the five product
  categories; variations index each category's instructions (train/dev/test disjoint). This is not
  the WebShop benchmark: its scores are not comparable with published WebShop numbers.
- ``text_env``: WebShop's own ``WebAgentTextEnv`` in-process (``web_agent_site`` must be importable).
- ``http``: a WebShop environment server (AgentGym API) at ``env.webshop_url``.

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

from hamo_ray.config import ConfigError, EnvConfig
from hamo_ray.envs.base import Domain, Env, register_domain
from hamo_ray.types import TaskSpec


@register_domain("webshop")
class WebShopDomain(Domain):
    """WebShop tasks: stand-in categories, or the real WebShop's goal list (task type ``all``).

    Raises:
        ConfigError: ``webshop_backend=http`` without ``webshop_url``; (on first use) a stand-in
            catalogue smaller than 50 products, or short ids with over 5,000.
    """

    env_memory_mb = 50  # resource hint per environment (measured well below this)

    def __init__(self, cfg: EnvConfig) -> None:
        super().__init__(cfg)
        if cfg.webshop_backend == "http" and not cfg.webshop_url:
            raise ConfigError("env.webshop_url: required when env.webshop_backend=http")

    def _catalog(self):
        from hamo_ray.envs.webshop.catalog import build_catalog

        try:
            return build_catalog(self.cfg.webshop_seed, self.cfg.webshop_products, self.cfg.webshop_ids)
        except ValueError as err:
            raise ConfigError(f"env.{err}") from None  # the message starts with the key: webshop_products=...

    def task_types(self) -> list[str]:
        if self.cfg.webshop_backend == "standin":
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
        if self.cfg.webshop_backend == "standin":
            variations = self._catalog().split_range(task_type, split)
        else:
            from hamo_ray.envs.webshop.client import REAL_SPLITS

            variations = REAL_SPLITS[split]
        if limit is not None:
            variations = variations[:limit]
        return [TaskSpec(domain=self.name, task=task_type, variation=v, split=split) for v in variations]

    def make_env(self) -> Env:
        backend = self.cfg.webshop_backend
        if backend == "standin":
            from hamo_ray.envs.webshop.standin import WebShopStandinEnv

            return WebShopStandinEnv(self._catalog())
        if backend == "http":
            from hamo_ray.envs.webshop.client import WebShopHttpEnv

            return WebShopHttpEnv(self.cfg.webshop_url)
        from hamo_ray.envs.webshop.client import WebShopTextEnv

        n = self.cfg.webshop_products
        return WebShopTextEnv(n if n in (100, 1000, 100000) else None)
