"""What a stage's steps run against, typed: the stage context and the parts it is made of.

Each part is a protocol, so a reader following a trajectory from the rollout into training keeps the
trail (``ctx.trainer.bc`` is :class:`Trainer.bc`), and the stage tests put in-process fakes in their
place. The real parts: ``run.resources.EnvPools`` (pools), ``run.services.Endpoint`` (endpoint),
``run.services.Services`` (services), ``training.driver.StageTrainer`` (trainer),
``run.tracking.Tracker`` (tracker), ``run.resources.TaskLists`` (tasks).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from hamo_ray.config import HamoConfig
from hamo_ray.evaluation.faults import run_checked
from hamo_ray.run.folder import RunFolder
from hamo_ray.types import Card, TaskSpec, Trajectory

if TYPE_CHECKING:
    from hamo_ray.rollout.client import PolicySpec
    from hamo_ray.training.contracts import EncodedPair, TrainResult


class Pool(Protocol):
    """A domain's rollout pool: one trajectory per task, in task order (``rollout.pool.RolloutPool``)."""

    def run(
        self, tasks: list[TaskSpec], policy: PolicySpec | None = None, desc: str = "episodes"
    ) -> list[Trajectory]: ...


class PolicyEndpoint(Protocol):
    """Where the policy (and the harness) answer (``run.services.Endpoint``)."""

    base_url: str
    api_key: str | None

    def spec(
        self, model: str, cfg: HamoConfig, *, seed: int | None, retrieval: bool = False
    ) -> PolicySpec: ...


class AdapterServices(Protocol):
    """Names, publishes and serves a run's adapters (``run.services.Services``)."""

    def adapter_name(self, stage: int, tag: str = "", digest: str = "") -> str: ...

    def publish(self, name: str, adapter: str | Path) -> dict: ...

    def acting(self, name: str | None) -> PolicyEndpoint: ...

    def stop_acting(self) -> None: ...


class Trainer(Protocol):
    """Trains a stage's adapters (``training.driver.StageTrainer``)."""

    def bc(
        self, batch: Sequence[Trajectory], cards: dict[str, list[Card]], out_dir: Path, *,
        init_adapter: Path | None, seed: int, name: str,
    ) -> TrainResult: ...  # fmt: skip

    def encode_pairs(self, pairs: list[tuple[Trajectory, Trajectory]]) -> list[EncodedPair]: ...

    def dpo(
        self, pairs: list[EncodedPair], init_adapter: Path, out_dir: Path, *, seed: int, name: str
    ) -> TrainResult: ...


class StepLog(Protocol):
    """Records per-step figures (``run.tracking.Tracker``)."""

    def log_steps(self, rows: list[dict[str, float]], section: str = "train") -> None: ...


class Tasks(Protocol):
    """The run's task lists (``run.resources.TaskLists``): each stage's training tasks, every domain's test tasks."""

    stages: list[list[TaskSpec]]
    test: dict[str, list[TaskSpec]]


@dataclass(frozen=True)
class StageContext:
    """What a stage's steps run against: the stream's parts (in-process fakes in the stage tests).

    ``pools(domain)`` is the domain's rollout pool; ``services`` names, publishes and serves adapters
    (None: the endpoint serves what it serves); ``trainer`` trains them; ``tracker`` records per-step
    figures; ``tasks`` are the run's task lists.
    """

    cfg: HamoConfig
    folder: RunFolder
    pools: Callable[[str], Pool]
    endpoint: PolicyEndpoint
    services: AdapterServices | None = None
    trainer: Trainer | None = None
    tracker: StepLog | None = None
    tasks: Tasks | None = None


@dataclass(frozen=True)
class Adapter:
    """A trained adapter of a stage: its folder (relative to the run folder), its final training loss,
    and its served name once ``run.stage.publish`` has published it."""

    path: str
    loss: float
    name: str | None = None
    # The cards its training examples carried (``memory.recall.training_experience``'s tally): injected,
    # withheld by the gate, same_world (cards of the example's own world, never retrieved in training).
    cards: dict[str, float] = field(default_factory=dict)


class Release(NamedTuple):
    """What the release step did: the card ids released and the figures of ``StageResult.release``."""

    ids: list[str]
    figures: dict[str, float]


# -- acting: the endpoint a served model plays through, and the fault-checked rollout ------------------
def acting(ctx: StageContext, model: str | None) -> PolicyEndpoint:
    """The endpoint whose policy acts as ``model``: ``services.acting`` (merged weights or LoRA), else the run's."""
    do = getattr(ctx.services, "acting", None)
    return ctx.endpoint if do is None else do(model)


def stop_acting(ctx: StageContext) -> None:
    stop = getattr(ctx.services, "stop_acting", None)
    if stop is not None:
        stop()


def healthy(ctx: StageContext, endpoint: Any = None) -> Callable[[], None] | None:
    """Blocks until ``endpoint`` (default: the run's) answers healthy (``eval.recover_timeout_s``); None
    without one."""
    wait = getattr(endpoint or ctx.endpoint, "wait_healthy", None)
    return None if wait is None else lambda: wait(ctx.cfg.eval.recover_timeout_s)


def play_checked(
    ctx: StageContext, domain: str, tasks: list[TaskSpec], spec: PolicySpec, desc: str, endpoint: Any = None
) -> list[Trajectory]:
    """``pools(domain).run``, with faulted episodes replayed and a stage failure over ``eval``'s allowance."""
    e = ctx.cfg.eval
    wait = healthy(ctx, endpoint)
    return run_checked(ctx.pools(domain), tasks, spec, desc, e.max_failed_fraction, e.retries, wait)
