"""The ``Env`` protocol every domain speaks, and the domain registry.

A *domain* (ScienceWorld, ALFWorld, WebShop, ...) knows its task types and splits and makes
environments; an *environment* runs one episode at a time::

    domain = get_domain("scienceworld", env_cfg)
    tasks = domain.tasks("test", task_type="find-living-thing", limit=5)
    env = domain.make_env()
    goal, obs = env.reset(tasks[0])
    step = env.step("look around")      # StepResult(observation, reward, done, score 0-100)
    env.expert_actions()                # gold actions for the loaded task

``get_domain`` is ``hamo_ray.envs.get_domain`` (the package imports the built-in domains, which
register themselves here). Register a new domain with ``@register_domain("name", config=NameConfig)`` on a ``Domain`` subclass;
``NameConfig`` (a ``ConfigSection``, every field with a default) holds the domain's own settings,
``env.name.*`` in a config file or override, ``cfg.env.name`` (or ``domain.settings``) in code.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from hamo_ray.config import ConfigError, ConfigSection, EnvConfig, register_env_section
from hamo_ray.types import TaskSpec

SPLITS = ("train", "dev", "test")  # every domain's splits, in this order


@dataclass(frozen=True)
class StepResult:
    observation: str
    reward: float  # score change caused by this step
    done: bool
    score: float  # task score so far, on 0-100


@runtime_checkable
class Env(Protocol):
    def reset(self, task: TaskSpec) -> tuple[str, str]:
        """Load ``task`` and return (goal, initial observation)."""

    def step(self, action: str) -> StepResult:
        """Apply ``action``; a malformed action gets the environment's own invalid-action answer."""

    def expert_actions(self) -> list[str]:
        """The gold action sequence of the loaded task."""

    def valid_actions(self) -> list[str] | None:
        """Valid actions now, where the domain can list them (may be slow)."""

    def close(self) -> None:
        """Release the environment's process/resources."""


class EnvLifecycle:
    """The lifecycle every environment shares: ``with env:`` closes it on the way out, and a second
    ``close()`` does nothing. A subclass releases its resources in ``_close`` (called once)."""

    _closed: bool = False

    def close(self) -> None:
        """Release the environment's process/resources (once; later calls do nothing)."""
        if not self._closed:
            self._closed = True
            self._close()

    def _close(self) -> None:
        """What closing releases (the subclass's process, simulator, server session)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Domain(ABC):
    """A family of tasks with splits; subclasses list the task types and tasks and make the environments."""

    name: str = ""
    env_memory_mb: int = 200  # resource hint: memory of one environment (rollout actors reserve it)
    thread_safe: bool = True  # False: an actor steps its environments one call at a time
    # True: valid_actions() is cheap and short enough to constrain every reply to (rollout.constrain_actions)
    lists_actions: bool = False
    # True: a task's world (hamo_ray.memory.worlds) follows from its spec, before playing it; False (ALFWorld,
    # whose worlds are rooms told apart by the first observation): protocol.eval_worlds=distinct cannot apply
    worlds_from_spec: bool = True

    def __init__(self, cfg: EnvConfig) -> None:
        self.cfg = cfg

    @property
    def settings(self) -> ConfigSection:
        """This domain's own settings, ``env.<name>`` (the model given to ``register_domain``)."""
        return self.cfg.section(self.name)

    @abstractmethod
    def task_types(self) -> list[str]:
        """The domain's task type names."""

    @abstractmethod
    def tasks(self, split: str, task_type: str, limit: int | None = None) -> list[TaskSpec]:
        """Tasks of one type from one split, in the split's canonical order.

        Raises:
            ConfigError: an unknown split or task type, naming it.
        """

    @abstractmethod
    def make_env(self) -> Env:
        """A new environment (its own process or simulator where the domain needs one)."""

    def check_split(self, split: str) -> None:
        """Raise a ``ConfigError`` naming ``split`` unless it is one of ``SPLITS``."""
        if split not in SPLITS:
            raise ConfigError(f"unknown {self.name} split {split!r}; known: {', '.join(SPLITS)}")

    def check_task_types(self, task_types: list[str]) -> None:
        """Raise a ``ConfigError`` naming ``env.task_types`` if any of ``task_types`` is unknown."""
        known = self.task_types()
        unknown = [t for t in task_types if t not in known]
        if unknown:
            raise ConfigError(
                f"env.task_types: unknown {self.name} task(s) {unknown}; known: {', '.join(sorted(known))}"
            )


_DOMAINS: dict[str, type[Domain]] = {}


def registered_domain(name: str) -> type[Domain]:
    """The ``Domain`` class registered as ``name`` (``hamo_ray.envs.get_domain`` loads the built-in ones first).

    Raises:
        ConfigError: no domain of that name, naming the known ones.
    """
    if name not in _DOMAINS:
        raise ConfigError(f"env.domain: unknown domain {name!r}; known: {', '.join(sorted(_DOMAINS))}")
    return _DOMAINS[name]


def register_domain(
    name: str, config: type[ConfigSection] | None = None
) -> Callable[[type[Domain]], type[Domain]]:
    """Register a ``Domain`` subclass as ``name``, with ``config`` as its settings section ``env.<name>``."""

    def deco(cls: type[Domain]) -> type[Domain]:
        cls.name = name
        _DOMAINS[name] = cls
        if config is not None:
            register_env_section(name, config)
        return cls

    return deco
