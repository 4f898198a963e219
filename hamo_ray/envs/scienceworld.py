"""ScienceWorld (the ``scienceworld`` package, a Scala simulator driven through py4j) as a HaMo domain.

Usage::

    domain = get_domain("scienceworld", EnvConfig())
    tasks = domain.tasks("train", "find-living-thing", limit=3)
    with domain.make_env() as env:          # one heap-capped JVM, reused across reset() calls
        goal, obs = env.reset(tasks[0])
        for action in env.expert_actions():
            result = env.step(action)       # StepResult(observation, reward, done, score 0-100)

What the package offers (scienceworld 1.2.3) and how this module uses it:

- **Task names** ship as ``tasks.json`` in the wheel (``scienceworld.constants.ID2TASK``, 30 tasks):
  read in Python, no JVM. ``task_types()`` lists them in the paper's task-id order (1-1 ``boil`` ...
  10-2 ``mendelian-genetics-unknown-plant``).
- **Variation splits** live only in the jar (``getVariationsTrain/Dev/Test`` on a loaded task). For
  1.2.3 every split is a contiguous block ``train=[0, a) dev=[a, b) test=[b, n)``, so the bounds are
  tabulated below (``_SPLITS_1_2_3``; 3,592 / 1,796 / 1,819 = 7,207 variations; a unit test checks the
  table against the JVM). Any other package version asks its JVM once and caches the answer.
- **JVM launch** (``hamo_ray.envs.scienceworld_jvm``): the package's env with the JVM heap capped
  (``env.scienceworld.jvm_heap``); a Java exception from an action becomes the invalid-action answer, a JVM error
  (out of memory) is raised.
- **Stepping**: the package's ``step()`` also builds the valid-action list, the look/inventory texts and
  the task description on every call. ``ScienceWorldEnv.step`` instead calls ``server.step`` and reads
  ``server.getScore()`` / ``server.getCompleted()``. Measured here (2 cores, easy simplifications):

  ====================================  ===========================  ====================
  gold runs of                          fast path (this module)      package ``step()``
  ====================================  ===========================  ====================
  all 30 tasks x 3 variations (3,614)   median 5 ms, p90 19 ms       -
  lifespan-longest-lived                median 8 ms, max 14 ms       median 88, max 211 ms
  boil                                  median 10 ms, max 32 ms      median 48, max 99 ms
  use-thermometer                       median 5 ms, max 14 ms       median 23, max 65 ms
  mendelian-genetics-known-plant        median 17 ms, max 264 ms     median 121, max 1,216 ms
  ====================================  ===========================  ====================

  ``valid_actions()`` (the list the package builds every step) is on demand: 10-50 ms at the start
  of a task, more in rooms with many objects. ``reset`` (load + gold path) takes 0.06-1 s for most
  tasks, 2 s for boil/test-conductivity and ~5-6 s for the mendelian-genetics tasks.
- **Reset**: ``load(task, variation, simplifications, generateGoldPath=True)`` then one
  ``look around`` step, exactly as the package's own ``reset()`` does; that step's text (no trailing
  newline) is the initial observation. The step is needed: right after ``load`` the score and
  completion flags are stale (``load`` with a gold path leaves them at 1.0/True from the gold run).
  ``look around`` does not count as a move. The goal is ``server.getTaskDescription()``
  ("Your task is to ..."). The initial observation describes the start room, which varies with the
  variation (hallway, kitchen, greenhouse, art studio, foundry, ...): ~300-590 characters.
- **Score**: the simulator's score is 0-1 (shown 0-100, rounded to an int as the package does). The
  ``look around`` of reset can already earn partial credit (8 on the find-* tasks: ``env.score`` > 0
  before any action); rewards are score differences after it. A fatal mistake (e.g. focusing on the wrong object) gives
  -1 (-100) while ``getCompleted()`` stays False; the package marks that done, and so does this
  module, with the score clamped to 0. ``done`` is sticky: after it, further actions still run but
  the score is frozen and the reward is 0.
- **Malformed actions** (empty, whitespace, gibberish, 100k characters, control characters, unicode,
  1,500 random word salads) get the simulator's own ``"No known action matches that input."``; none
  raised. A Java exception thrown while applying an action is still turned into that answer
  (logged); JVM errors (``java.lang.Error``, e.g. out of memory) and a dead JVM are raised.
- **Gold paths**: ``get_gold_action_sequence()`` after a gold ``load``. They can run on after the
  task is done (lifespan tasks end with ``wait1`` after the winning focus), so stop at ``done``. The
  same variation can yield a different gold sequence on another ``load`` (e.g. which animal to pick),
  and the simulator is not fully deterministic: one grow-fruit gold run ended at 50 once and at 100
  on the next three loads. Call ``expert_actions()`` after each ``reset()``, do not cache it.
"""

from __future__ import annotations

import logging
import re
from typing import Literal

from pydantic import Field

from hamo_ray.config import ConfigError, ConfigSection, EnvConfig
from hamo_ray.envs.agentgym.sciworld import AGENTGYM_UNLISTED, LocalGold, agentgym_item, server_env  # noqa: F401
from hamo_ray.envs.base import Domain, EnvLifecycle, StepResult, register_domain
from hamo_ray.envs.scienceworld_jvm import capped_env_class, is_jvm_error
from hamo_ray.envs.scienceworld_tasks import query_splits, task_names, variation_splits  # noqa: F401
from hamo_ray.types import TaskSpec

logger = logging.getLogger(__name__)

INVALID_ACTION_OBSERVATION = "No known action matches that input."


class ScienceWorldConfig(ConfigSection):
    """ScienceWorld's settings, ``env.scienceworld.*``."""

    jvm_heap: str = "512m"  # one JVM per environment, heap capped (-Xmx)
    simplifications: str = "easy"  # the simplification preset passed to load()
    # "inprocess": a simulator per environment here; "agentgym": every rollout through an AgentGym
    # sciworld server at ``url`` (hamo_ray/envs/agentgym/), tasks as its data_idx (AgentGym's item list).
    backend: Literal["inprocess", "agentgym"] = "inprocess"
    url: str | None = None  # the server's base URL, for backend=agentgym
    max_envs: int = Field(default=16, ge=1)  # environments open on the server from one process
    timeout_s: float = Field(default=120.0, gt=0)  # one request to the server
    # What the server loads tasks with (AgentGym's server: none); the local expert plays the same.
    server_simplifications: str = ""


_HEAP_RE = re.compile(r"^[1-9][0-9]*[kKmMgG]?$")


class ScienceWorldEnv(EnvLifecycle):
    """One ScienceWorld simulator (one JVM, heap capped) that runs one episode at a time.

    Args:
        cfg: ``env.scienceworld``: ``jvm_heap`` (JVM ``-Xmx``) and ``simplifications`` (passed to every ``load``; ``"easy"``
            is the package's preset of teleport/open doors/open containers/self-watering pots/no
            electrical actions, or a comma-separated list of those names, or ``""``).

    Raises:
        ConfigError: a malformed ``jvm_heap`` or an unknown simplification.
    """

    def __init__(self, cfg: EnvConfig | None = None) -> None:
        sw_cfg: ScienceWorldConfig = (cfg or EnvConfig()).scienceworld
        if not _HEAP_RE.match(sw_cfg.jvm_heap):
            raise ConfigError(
                f"env.scienceworld.jvm_heap: {sw_cfg.jvm_heap!r} is not a JVM size such as '512m' or '2g'"
            )
        self.simplifications = sw_cfg.simplifications
        self._sw = capped_env_class()(sw_cfg.jvm_heap)
        self._server = self._sw.server
        known = ["easy", *self._sw.get_possible_simplifications()]
        unknown = [s for s in sw_cfg.simplifications.split(",") if s and s not in known]
        if unknown:
            self.close()
            raise ConfigError(
                f"env.scienceworld.simplifications: unknown simplification(s) {unknown}; known: {', '.join(known)}"
            )
        self._task: TaskSpec | None = None
        self._score = 0.0
        self._done = False

    @property
    def pid(self) -> int:
        """Process id of this environment's JVM."""
        return self._sw.java_process.pid

    @property
    def task(self) -> TaskSpec | None:
        """The loaded task (None before the first ``reset``)."""
        return self._task

    @property
    def score(self) -> float:
        """Score so far (0-100); the ``look around`` of ``reset`` may already earn partial credit."""
        return self._score

    def reset(self, task: TaskSpec) -> tuple[str, str]:
        """Load ``task`` (with its gold path) and return (goal, output of ``look around``).

        Raises:
            ValueError: the task type is unknown or the variation is out of range.
        """
        try:
            splits = variation_splits(task.task)
        except ConfigError as err:
            raise ValueError(str(err)) from None
        total = sum(len(v) for v in splits.values())
        if not 0 <= task.variation < total:
            raise ValueError(f"{task.id}: variation {task.variation} outside 0..{total - 1}")
        self._sw.load(task.task, task.variation, self.simplifications, generateGoldPath=True)
        observation = self._server.step("look around")
        self._task = task
        self._score, self._done = self._read_score()
        return self._server.getTaskDescription(), observation

    def step(self, action: str) -> StepResult:
        """Apply ``action`` through the simulator's raw step (no valid-action list: median ~5 ms)."""
        if self._task is None:
            raise RuntimeError("ScienceWorldEnv.step() before reset()")
        observation = self._raw_step(action)
        if self._done:
            return StepResult(observation, 0.0, True, self._score)
        score, done = self._read_score()
        reward = score - self._score
        self._score, self._done = score, done
        return StepResult(observation, reward, done, score)

    def expert_actions(self) -> list[str]:
        """The gold action sequence the simulator generated for the loaded task."""
        if self._task is None:
            raise RuntimeError("ScienceWorldEnv.expert_actions() before reset()")
        return list(self._server.getGoldActionSequence())

    def valid_actions(self) -> list[str]:
        """The valid action-object combinations now (10-50 ms at a task's start, more with many objects)."""
        if self._task is None:
            raise RuntimeError("ScienceWorldEnv.valid_actions() before reset()")
        return list(self._server.getValidActionObjectCombinations())

    def _close(self) -> None:
        """Stop the JVM (idempotent)."""
        self._sw.close()

    def _read_score(self) -> tuple[float, bool]:
        """(score on 0-100, done); a failed task (simulator score < 0) is done with score 0."""
        raw = int(round(100 * self._server.getScore()))
        if raw < 0:
            return 0.0, True
        return float(raw), bool(self._server.getCompleted())

    def _raw_step(self, action: str) -> str:
        from py4j.protocol import Py4JJavaError

        try:
            return self._server.step(action)
        except Py4JJavaError as err:
            if is_jvm_error(err):
                raise
            logger.warning("%s: action %r raised in the simulator: %s", self._task.id, action[:200], err)
            return INVALID_ACTION_OBSERVATION


@register_domain("scienceworld", config=ScienceWorldConfig)
class ScienceWorldDomain(Domain):
    """The 30 ScienceWorld tasks with the package's train/dev/test variation splits.

    With ``env.scienceworld.backend=agentgym`` every environment is one of the AgentGym sciworld server
    at ``env.scienceworld.url`` (``hamo_ray.envs.agentgym``); tasks the server does not list are refused.

    Raises:
        ConfigError: ``backend=agentgym`` without ``env.scienceworld.url``.
    """

    def __init__(self, cfg: EnvConfig) -> None:
        super().__init__(cfg)
        self.sw: ScienceWorldConfig = cfg.scienceworld
        if self.sw.backend == "agentgym" and not self.sw.url:
            raise ConfigError("env.scienceworld.url: required when env.scienceworld.backend=agentgym")

    @property
    def env_memory_mb(self) -> int:  # type: ignore[override]
        """One JVM per environment: the capped heap plus ~150 MB of JVM and py4j overhead (measured 350-470 MB);
        through a server, the client only, plus the local expert's JVM where it plays the experts."""
        heap = self.cfg.scienceworld.jvm_heap.lower()
        mb = int(heap[:-1]) * (1024 if heap.endswith("g") else 1) if heap[-1] in "mg" else 512
        if self.sw.backend == "agentgym" and self.cfg.expert_source == "file":
            return 20
        return mb + 150

    def task_types(self) -> list[str]:
        return task_names()

    def check_task_types(self, task_types: list[str]) -> None:
        """Unknown task types, and under ``backend=agentgym`` those the server does not list, are refused."""
        super().check_task_types(task_types)
        self._check_listed(task_types)

    def _check_listed(self, task_types: list[str]) -> None:
        if self.sw.backend != "agentgym":
            return
        unlisted = [t for t in task_types if t in AGENTGYM_UNLISTED]
        if unlisted:
            raise ConfigError(
                f"env.task_types: the AgentGym sciworld server (env.scienceworld.backend=agentgym) does not "
                f"list {unlisted}; it leaves out {', '.join(AGENTGYM_UNLISTED)}"
            )

    def tasks(self, split: str, task_type: str, limit: int | None = None) -> list[TaskSpec]:
        """Variations of ``task_type`` in ``split``, in increasing variation order.

        Raises:
            ConfigError: unknown split or task type; under ``backend=agentgym``, a task type the server
                does not list.
        """
        self.check_split(split)
        self._check_listed([task_type])
        variations = variation_splits(task_type)[split]
        if limit is not None:
            variations = variations[:limit]
        return [TaskSpec(domain=self.name, task=task_type, variation=v, split=split) for v in variations]

    def item_of(self, task: TaskSpec) -> int:
        """The AgentGym sciworld server's ``data_idx`` of ``task`` (``agentgym_item``)."""
        return agentgym_item(task)

    def make_env(self):
        if self.sw.backend == "inprocess":
            return ScienceWorldEnv(self.cfg)
        return server_env(self.cfg)
