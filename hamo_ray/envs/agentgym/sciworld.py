"""ScienceWorld through an AgentGym sciworld server (``env.scienceworld.backend=agentgym``): the
server's item index of a task, the tasks it does not list, and gold paths from a local simulator.
"""

from __future__ import annotations

import importlib.util

from hamo_ray.config import ConfigSection, EnvConfig
from hamo_ray.envs.agentgym.client import AgentGymEnv
from hamo_ray.envs.agentgym.domains import file_expert
from hamo_ray.envs.agentgym.protocol import server_spec
from hamo_ray.envs.expert_ids import agentgym_sciworld_index
from hamo_ray.envs.scienceworld_jvm import capped_env_class
from hamo_ray.types import TaskSpec

# Tasks the AgentGym sciworld server leaves out of its item list (ids 5-x, 9-x, 10-x).
AGENTGYM_UNLISTED = (
    "grow-plant", "grow-fruit", "inclined-plane-determine-angle", "inclined-plane-friction-named-surfaces",
    "inclined-plane-friction-unnamed-surfaces", "mendelian-genetics-known-plant", "mendelian-genetics-unknown-plant",
)  # fmt: skip


def agentgym_item(task: TaskSpec) -> int:
    """The AgentGym sciworld server's ``data_idx`` of ``task`` (its place in ``agentgym_sciworld_items``).

    Raises:
        ValueError: the server does not list the task (named).
    """
    index = agentgym_sciworld_index().get((task.task, task.variation))
    if index is None:
        raise ValueError(f"{task.id}: the AgentGym sciworld server does not list this task")
    return index


class LocalGold:
    """Gold paths from a local simulator for tasks played on a server: loaded with the server's
    simplifications, one JVM (started on first use, closed with the environment)."""

    def __init__(self, cfg: ConfigSection) -> None:  # env.scienceworld (ScienceWorldConfig)
        self.cfg = cfg
        self._sw = None

    def __call__(self, task: TaskSpec) -> list[str]:
        if self._sw is None:
            self._sw = capped_env_class()(self.cfg.jvm_heap)
        self._sw.load(task.task, task.variation, self.cfg.server_simplifications, generateGoldPath=True)
        return list(self._sw.get_gold_action_sequence())

    def close(self) -> None:
        if self._sw is not None:
            self._sw.close()
            self._sw = None


def server_env(cfg: EnvConfig) -> AgentGymEnv:
    """An environment of the sciworld server at ``env.scienceworld.url``; its experts from the run's
    expert file, else from a local simulator where the package is installed."""
    sw = cfg.scienceworld
    expert = file_expert(cfg, "scienceworld")
    if expert is None and importlib.util.find_spec("scienceworld") is not None:
        expert = LocalGold(sw)
    return AgentGymEnv(
        server_spec("sciworld"), sw.url, item_of=agentgym_item, expert=expert, max_envs=sw.max_envs,
        setting="env.scienceworld.url", timeout=sw.timeout_s,
    )  # fmt: skip
