"""Domains served by AgentGym environment servers: ``textcraft`` and ``babyai`` (and the item tables).

Each maps this project's tasks (task type, variation, split) onto the server's item index
(``data_idx``), the number AgentGym's AgentTraj / AgentEval ids carry (``textcraft_<N>``, ``babyai_<N>``):

- **textcraft** (``agentenv-textcraft``): item ``N`` is goal ``N mod 544`` of the server's list, the
  craftable items sorted by crafting depth (measured from its recipes: 125 of depth 1, 291 of depth
  2, 117 of depth 3, 11 of depth 4). Task types ``depth-1`` ... ``depth-4`` are those blocks; within a
  block, position ``p`` is test when ``p % 5 == 0``, dev when ``p % 5 == 1``, else train (60/20/20; our
  split, stated here: AgentGym publishes no split of the item list). Which item of a block is which
  goal follows the server's directory listing of its recipes; the blocks do not.
- **babyai** (``agentenv-babyai``): item ``N`` is level ``N % 40 + 1`` of the server's 40 BabyAI
  levels with seed ``N // 40``. Task types are the levels (``GoToRedBallGrey`` ... ``BossLevelNoUnlock``),
  the variation is the seed: test = seeds 0-4, dev = 5-9, train = 10-99 (our split).

Neither server offers expert actions: a run imports its experts (``env.expert_source=file``, AgentTraj
files, ``hamo_ray.envs.expert_data``); with them, an environment's ``expert_actions`` replays the file's
actions for its task (the embedded backbone's build plays those). Scores are 0-100 (``protocol.py``).
"""

from __future__ import annotations

import functools

from pydantic import Field

from hamo_ray.config import ConfigError, ConfigSection, EnvConfig
from hamo_ray.envs.agentgym.client import AgentGymEnv
from hamo_ray.envs.agentgym.items import (  # noqa: F401
    BABYAI_LEVELS,
    BABYAI_SEEDS,
    TEXTCRAFT_BLOCKS,
    TEXTCRAFT_DEPTHS,
    TEXTCRAFT_NUM_GOALS,
    babyai_item,
    babyai_task,
    textcraft_depth,
    textcraft_item,
    textcraft_split,
    textcraft_task,
)
from hamo_ray.envs.agentgym.protocol import server_spec
from hamo_ray.envs.base import Domain, register_domain
from hamo_ray.types import TaskSpec


# Crafting depth -> goals of that depth on the real server (its sorted list is contiguous by depth).
class ServerConfig(ConfigSection):
    """An AgentGym environment server's settings, ``env.<domain>.*``."""

    url: str | None = None  # the server's base URL, e.g. http://127.0.0.1:36001
    # At most this many environments open on the server from one process (rollout actors check
    # num_workers x envs_per_worker against it before any work).
    max_envs: int = Field(default=16, ge=1)
    timeout_s: float = Field(default=60.0, gt=0)  # one request


class FileExpert:
    """Expert actions read from the run's expert file (``env.expert_files.<domain>``), by task id."""

    def __init__(self, cfg: EnvConfig, domain: str) -> None:
        self.cfg, self.domain = cfg, domain

    @functools.cached_property
    def _by_task(self) -> dict[str, list[str]]:
        from hamo_ray.envs.expert_data import load_expert_file

        path = self.cfg.expert_files[self.domain]
        return {t.task.id: t.actions for t in load_expert_file(path, self.domain, self.cfg)}

    def __call__(self, task: TaskSpec) -> list[str]:
        if task.id not in self._by_task:
            raise NotImplementedError(
                f"{task.id}: no item of env.expert_files.{self.domain} ({self.cfg.expert_files[self.domain]})"
            )
        return self._by_task[task.id]


def file_expert(cfg: EnvConfig, domain: str) -> FileExpert | None:
    """The expert file's actions, where the run imports its experts; else None."""
    if cfg.expert_source == "file" and domain in cfg.expert_files:
        return FileExpert(cfg, domain)
    return None


class ServerDomain(Domain):
    """A domain whose every environment lives on an AgentGym server (``env.<name>.url``)."""

    server = ""  # the row of protocol.SERVERS
    env_memory_mb = 20  # the client only: the environment's memory is the server's

    def __init__(self, cfg: EnvConfig) -> None:
        super().__init__(cfg)
        if not self.settings.url:
            raise ConfigError(f"env.{self.name}.url: required (the AgentGym {self.server} server's URL)")

    def item_of(self, task: TaskSpec) -> int:
        raise NotImplementedError

    def make_env(self) -> AgentGymEnv:
        s = self.settings
        return AgentGymEnv(
            server_spec(self.server),
            s.url,
            item_of=self.item_of,
            expert=file_expert(self.cfg, self.name),
            max_envs=s.max_envs,
            setting=f"env.{self.name}.url",
            timeout=s.timeout_s,
        )


@register_domain("textcraft", config=ServerConfig)
class TextCraftDomain(ServerDomain):
    """AgentGym's TextCraft (Minecraft crafting in text), task types by crafting depth."""

    server = "textcraft"

    def task_types(self) -> list[str]:
        return list(TEXTCRAFT_BLOCKS)

    def tasks(self, split: str, task_type: str, limit: int | None = None) -> list[TaskSpec]:
        self.check_split(split)
        self.check_task_types([task_type])
        n = len(TEXTCRAFT_BLOCKS[task_type])
        out = [
            TaskSpec(domain=self.name, task=task_type, variation=p, split=split)
            for p in range(n)
            if textcraft_split(p) == split
        ]
        return out[:limit] if limit is not None else out

    def item_of(self, task: TaskSpec) -> int:
        return textcraft_item(task)


@register_domain("babyai", config=ServerConfig)
class BabyAIDomain(ServerDomain):
    """AgentGym's BabyAI (grid-world instructions in text), task types by level, variations by seed."""

    server = "babyai"
    lists_actions = True  # every observation lists the valid actions

    def task_types(self) -> list[str]:
        return list(BABYAI_LEVELS)

    def tasks(self, split: str, task_type: str, limit: int | None = None) -> list[TaskSpec]:
        self.check_split(split)
        self.check_task_types([task_type])
        seeds = BABYAI_SEEDS[split]
        seeds = seeds[:limit] if limit is not None else seeds
        return [TaskSpec(domain=self.name, task=task_type, variation=s, split=split) for s in seeds]

    def item_of(self, task: TaskSpec) -> int:
        return babyai_item(task)
