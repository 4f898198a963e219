"""Environments: the ``Env`` protocol, the built-in domains and the domain registry.

Importing this package imports the built-in domains, which register themselves in
``hamo_ray.envs.base``; ``get_domain`` is the registry's front door. A domain module imports
``hamo_ray.envs.base`` (never this package), so the registry has no import cycle.
"""

from hamo_ray.config import EnvConfig
from hamo_ray.envs import agentgym, alfworld, scienceworld, textworld, webshop  # noqa: F401
from hamo_ray.envs.base import Domain, Env, EnvLifecycle, StepResult, register_domain, registered_domain

__all__ = ["Domain", "Env", "EnvLifecycle", "StepResult", "get_domain", "register_domain"]


def get_domain(name: str, cfg: EnvConfig) -> Domain:
    """A new instance of the domain registered as ``name``, with the environment settings ``cfg``.

    Raises:
        ConfigError: an unknown domain, naming the known ones.
    """
    return registered_domain(name)(cfg)
