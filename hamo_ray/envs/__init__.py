"""Environments: the ``Env`` protocol and the built-in domains (importing this registers them)."""

from hamo_ray.envs import agentgym, alfworld, scienceworld, textworld, webshop  # noqa: F401
from hamo_ray.envs.base import Domain, Env, StepResult, get_domain, register_domain

__all__ = ["Domain", "Env", "StepResult", "get_domain", "register_domain"]
