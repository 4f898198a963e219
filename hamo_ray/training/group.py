"""The driver's choice of training engine, and the group a stream keeps across its stages.

Two engines run the same loop (``loop.run_stage``) on the same workers (``worker.TrainWorker``):
one long-lived Ray Train run (``ray_train.RayTrainGroup``, ``train.engine=ray_train``, the default:
failures restart its worker group) or a group of Ray actors (``actors.TrainerGroup``,
``train.engine=actors``). Both have ``train(job) -> TrainResult``, ``shutdown()`` and ``startup_s``;
:func:`make_group` starts the configured one, :class:`KeptGroup` keeps it for a stream (started on
first use, closed by its owner). A stage whose model spec (base path, LoRA shape, dtype, attention)
differs from the loaded one reloads it; ZeRO-3 partitions the weights in place, so under ZeRO-3 every
stage reloads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from hamo_ray.config import TrainConfig
from hamo_ray.training.contracts import StageJob, TrainResult


class Engine(Protocol):
    """What the driver trains on: ``ray_train.RayTrainGroup`` or ``actors.TrainerGroup``."""

    startup_s: float  # the engine's own start-up (the workers may start with the first job)

    def train(self, job: StageJob) -> TrainResult:
        """One stage on every worker; the weights written to ``job.out_dir``."""
        ...

    def shutdown(self) -> None:
        """Stop the workers and free their resources (idempotent)."""
        ...


def make_group(tcfg: TrainConfig, name: str = "hamo-train", storage: str | Path | None = None) -> Engine:
    """A training group for ``tcfg.engine``: a long-lived Ray Train run (``ray_train``, the default;
    ``storage``: where Ray Train keeps it) or an ``actors.TrainerGroup`` of Ray actors (``actors``).

    Both have ``train(job)`` (any objective), ``shutdown()`` and ``startup_s``.
    """
    if tcfg.engine == "ray_train":
        from hamo_ray.training.ray_train import RayTrainGroup

        return RayTrainGroup(tcfg, name=name, storage=storage)
    from hamo_ray.training.actors import TrainerGroup

    return TrainerGroup(tcfg, name=name)


class KeptGroup:
    """The training group an owner (a stream) keeps across its stages: started on first use, closed by it.

    ``get()`` is None without ``train.keep_workers`` (every stage then starts a group of its own).
    The group is ``make_group``'s for ``train.engine``; ``storage`` is where a Ray Train run keeps its
    checkpoints (a stream: its run folder's ``ray_train/``)::

        kept = KeptGroup(cfg.train)
        try:
            train_model(..., group=kept.get())      # the first call starts the workers
            train_model(..., group=kept.get())      # the same workers, the base model still loaded
        finally:
            kept.close()
    """

    def __init__(self, tcfg: TrainConfig, storage: str | Path | None = None) -> None:
        self.tcfg, self.storage = tcfg, storage
        self.group: Engine | None = None

    def get(self) -> Engine | None:
        """The kept group, started on first use; None without ``keep_workers``."""
        if not self.tcfg.keep_workers:
            return None
        if self.group is None:
            self.group = make_group(self.tcfg, storage=self.storage)
        return self.group

    def close(self) -> None:
        """Stop the group, if one was started (idempotent; for ``finally:`` blocks)."""
        group, self.group = self.group, None
        if group is not None:
            group.shutdown()
