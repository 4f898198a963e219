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
from hamo_ray.envs.agentgym.protocol import server_spec
from hamo_ray.envs.base import Domain, register_domain
from hamo_ray.types import TaskSpec

# Crafting depth -> goals of that depth on the real server (its sorted list is contiguous by depth).
TEXTCRAFT_DEPTHS = {1: 125, 2: 291, 3: 117, 4: 11}
TEXTCRAFT_NUM_GOALS = sum(TEXTCRAFT_DEPTHS.values())  # 544
BABYAI_LEVELS = (
    "GoToRedBallGrey",
    "GoToRedBall",
    "GoToRedBallNoDists",
    "GoToObjS6",
    "GoToLocalS8N7",
    "GoToObjMazeS7",
    "GoToImpUnlock",
    "GoToSeqS5R2",
    "GoToRedBlueBall",
    "GoToDoor",
    "GoToObjDoor",
    "Open",
    "OpenRedDoor",
    "OpenDoorLoc",
    "OpenRedBlueDoorsDebug",
    "OpenDoorsOrderN4Debug",
    "Pickup",
    "UnblockPickup",
    "PickupLoc",
    "PickupDistDebug",
    "PickupAbove",
    "PutNextLocalS6N4",
    "PutNextS7N4Carrying",
    "Unlock",
    "UnlockLocalDist",
    "KeyInBox",
    "UnlockPickupDist",
    "BlockedUnlockPickup",
    "UnlockToUnlock",
    "ActionObjDoor",
    "FindObjS7",
    "KeyCorridorS6R3",
    "OneRoomS20",
    "MoveTwoAcrossS8N9",
    "SynthS5R2",
    "SynthLoc",
    "SynthSeq",
    "MiniBossLevel",
    "BossLevel",
    "BossLevelNoUnlock",
)  # fmt: skip  (agentenv-babyai's all_levels 1-40, without "BabyAI-" and "-v0")
BABYAI_SEEDS = {"test": range(0, 5), "dev": range(5, 10), "train": range(10, 100)}


def _textcraft_blocks() -> dict[str, range]:
    blocks, start = {}, 0
    for depth, n in TEXTCRAFT_DEPTHS.items():
        blocks[f"depth-{depth}"] = range(start, start + n)
        start += n
    return blocks


TEXTCRAFT_BLOCKS = _textcraft_blocks()


def textcraft_depth(item: int) -> int:
    """The crafting depth of the server's goal ``item`` (mod 544)."""
    item %= TEXTCRAFT_NUM_GOALS
    return next(int(t.split("-")[1]) for t, r in TEXTCRAFT_BLOCKS.items() if item in r)


def _textcraft_split(position: int) -> str:
    return {0: "test", 1: "dev"}.get(position % 5, "train")


def textcraft_task(item: int) -> TaskSpec:
    """The task of the server's item ``item`` (``textcraft_<item>``; taken mod 544 as the server does)."""
    item %= TEXTCRAFT_NUM_GOALS
    for task_type, block in TEXTCRAFT_BLOCKS.items():
        if item in block:
            position = item - block.start
            return TaskSpec(
                domain="textcraft", task=task_type, variation=position, split=_textcraft_split(position)
            )
    raise AssertionError(item)  # unreachable: the blocks cover 0..543


def textcraft_item(task: TaskSpec) -> int:
    """The server's item index of a textcraft task.

    Raises:
        ValueError: the task is not one of the server's items (named).
    """
    block = TEXTCRAFT_BLOCKS.get(task.task)
    if block is None or not 0 <= task.variation < len(block):
        raise ValueError(f"{task.id}: the AgentGym textcraft server lists no such item")
    return block.start + task.variation


def babyai_task(item: int) -> TaskSpec:
    """The task of the server's item ``item`` (``babyai_<item>``).

    Raises:
        ValueError: the seed lies outside the seeds of this project's splits (0-99).
    """
    level, seed = BABYAI_LEVELS[item % 40], item // 40
    for split, seeds in BABYAI_SEEDS.items():
        if seed in seeds:
            return TaskSpec(domain="babyai", task=level, variation=seed, split=split)
    raise ValueError(f"babyai_{item}: seed {seed} is outside 0-{BABYAI_SEEDS['train'].stop - 1}")


def babyai_item(task: TaskSpec) -> int:
    """The server's item index of a babyai task (``40 x seed + level``).

    Raises:
        ValueError: an unknown level or a seed outside 0-99 (named).
    """
    if task.task not in BABYAI_LEVELS or not 0 <= task.variation < BABYAI_SEEDS["train"].stop:
        raise ValueError(f"{task.id}: the AgentGym babyai server lists no such item here")
    return 40 * task.variation + BABYAI_LEVELS.index(task.task)


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
            if _textcraft_split(p) == split
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
