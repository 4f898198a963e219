"""A training worker group that lives across stages: Ray Core actors with their own process group.

Each worker loads the base model once; a stage only resets the LoRA weights (from the previous
stage's adapter folder, or fresh), builds its optimizer and DDP/DeepSpeed wrapper, trains and
returns the adapter files to the driver (through Ray's object store, so the driver's ``out_dir``
need not be on a shared file system). The workers form one ``torch.distributed`` group (gloo on
CPU, NCCL on GPU), placed by a placement group (``TrainConfig.placement_strategy``)::

    group = TrainerGroup(tcfg)                 # start-up: actors + process group (once)
    r1 = train_model(base, ex1, out1, tcfg, pad_id=0, group=group)   # loads the model
    r2 = train_model(base, ex2, out2, tcfg, pad_id=0, group=group, init_adapter=out1)
    group.shutdown()

The group's methods are the losses: ``train_bc(job)`` and ``train_dpo(job)`` send a typed job
(``contracts.py``) to every worker, which runs the loss's stage function on it (``trainer.bc_stage``,
``dpo.dpo_stage``); rank 0's files are written to the job's ``out_dir`` and its ``TrainResult``
returned. A stream keeps one group across its stages in a :class:`KeptGroup`.

A stage whose model spec (base path, LoRA shape, dtype, attention) differs from the loaded one
reloads it; ZeRO-3 partitions the weights in place, so under ZeRO-3 every stage reloads.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from hamo_ray.config import TrainConfig
from hamo_ray.training.contracts import DpoJob, ModelSpec, StageJob, StageOutput, TrainResult

logger = logging.getLogger(__name__)


class TrainWorker:
    """One training process (a Ray actor): a rank of the group, holding the loaded model between stages."""

    def __init__(self, rank: int, world: int, use_gpu: bool, threads: int):
        self.rank, self.world, self.use_gpu = rank, world, use_gpu
        self.lm: Any = None
        self.spec: Any = None
        self.dirty = False  # the loaded weights were changed in place (ZeRO-3, full training)
        os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": "0"})
        import torch

        from hamo_ray.logs import setup_logging

        setup_logging()
        torch.set_num_threads(threads)

    def address(self) -> tuple[str, int]:
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def init_group(self, addr: str, port: int) -> None:
        import torch
        import torch.distributed as dist

        os.environ.update({"MASTER_ADDR": addr, "MASTER_PORT": str(port)})
        if self.use_gpu:
            torch.cuda.set_device(0)  # Ray gives each worker one visible GPU
        dist.init_process_group(
            "nccl" if self.use_gpu else "gloo", rank=self.rank, world_size=self.world, init_method="env://"
        )

    @property
    def device(self) -> Any:
        import torch

        return torch.device("cuda", 0) if self.use_gpu else torch.device("cpu")

    def model(self, spec: ModelSpec, reuse: bool = True) -> tuple[Any, float, bool]:
        """The loaded ``ActionLM`` for ``spec``: (model, seconds spent loading, whether it loaded)."""
        from hamo_ray.training.loop import load_model

        if self.lm is not None and reuse and not self.dirty and spec == self.spec:
            return self.lm, 0.0, False
        self.lm = None
        self._free()
        start = time.perf_counter()
        self.lm, self.spec, self.dirty = load_model(spec, self.device), spec, False
        return self.lm, time.perf_counter() - start, True

    def _free(self) -> None:
        import gc

        import torch

        gc.collect()
        if self.use_gpu:
            torch.cuda.empty_cache()

    def run(
        self, stage: Callable[[TrainWorker, Any], StageOutput | None], job: StageJob | DpoJob
    ) -> StageOutput | None:
        """Run one stage, ``stage(self, job)`` (a loss's stage function); rank 0's output comes back."""
        try:
            out = stage(self, job)
        finally:
            self._free()
        return out if self.rank == 0 else None

    def shutdown(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


class TrainerGroup:
    """The driver's handle on a long-lived :class:`TrainWorker` group (needs a running Ray)."""

    def __init__(self, tcfg: TrainConfig, name: str = "hamo-train"):
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        start = time.perf_counter()
        n = tcfg.num_workers
        bundle = {"CPU": tcfg.cpus_per_worker, **({"GPU": 1} if tcfg.use_gpu else {}), **tcfg.resources}
        # Unique per group: streams of one job (a sweep's parallel cells, a cell retried after its
        # process died and left its group behind) must not collide on a placement group's name.
        self.pg = placement_group(
            [dict(bundle) for _ in range(n)],
            strategy=tcfg.placement_strategy,
            name=f"{name}-{uuid.uuid4().hex[:8]}",
        )
        ray.get(self.pg.ready(), timeout=600)
        threads = 4 if tcfg.use_gpu else max(1, (os.cpu_count() or 1) // n)
        actor = ray.remote(TrainWorker)
        self.workers = [
            actor.options(
                num_cpus=tcfg.cpus_per_worker,
                num_gpus=1 if tcfg.use_gpu else 0,
                resources=dict(tcfg.resources),
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=i),
                runtime_env={"env_vars": {"PYTHONUNBUFFERED": "1"}},
            ).remote(i, n, tcfg.use_gpu, threads)
            for i in range(n)
        ]
        addr, port = ray.get(self.workers[0].address.remote())
        ray.get([w.init_group.remote(addr, port) for w in self.workers])
        self.startup_s = time.perf_counter() - start
        logger.info("training group: %d workers up in %.1fs", n, self.startup_s)

    def train_bc(self, job: StageJob) -> TrainResult:
        """A behavioural-cloning stage (``trainer.bc_stage``) on every worker; the weights in ``job.out_dir``."""
        from hamo_ray.training.trainer import bc_stage

        return self._run(bc_stage, job, job.out_dir)

    def train_dpo(self, job: DpoJob) -> TrainResult:
        """A DPO stage (``dpo.dpo_stage``) on every worker; the weights in ``job.stage.out_dir``."""
        from hamo_ray.training.dpo import dpo_stage

        return self._run(dpo_stage, job, job.stage.out_dir)

    def _run(self, stage: Callable, job: StageJob | DpoJob, out_dir: str) -> TrainResult:
        """Run ``stage(worker, job)`` on every worker, write rank 0's files to ``out_dir``.

        Returns:
            Rank 0's ``TrainResult`` with its ``path``; ``startup_s`` is this call's wall time outside
            the training loop.
        """
        import ray

        wall = time.perf_counter()
        out: StageOutput = ray.get([w.run.remote(stage, job) for w in self.workers])[0]
        path = write_files(out.files, out_dir)
        seconds = out.result.seconds
        return replace(out.result, path=str(path), startup_s=max(0.0, time.perf_counter() - wall - seconds))

    def shutdown(self) -> None:
        """Stop the workers and free their resources (idempotent)."""
        import ray
        from ray.util.placement_group import remove_placement_group

        if not self.workers:
            return
        try:
            ray.get([w.shutdown.remote() for w in self.workers], timeout=60)
        except Exception as e:  # a dead worker: kill anyway
            logger.warning("training group shutdown: %s", e)
        for w in self.workers:
            ray.kill(w)
        remove_placement_group(self.pg)
        self.workers = []


def write_files(files: dict[str, bytes], out_dir: str | Path) -> Path:
    """Write ``{name: bytes}`` to ``out_dir`` whole or not at all (a temporary folder, then a rename)."""
    import shutil

    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name, data in files.items():
        (tmp / name).write_bytes(data)
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    return out_dir


def read_files(folder: str | Path) -> dict[str, bytes]:
    """The files of a flat folder as ``{name: bytes}``."""
    return {p.name: p.read_bytes() for p in sorted(Path(folder).iterdir()) if p.is_file()}


def make_group(tcfg: TrainConfig, name: str = "hamo-train", storage: str | Path | None = None):
    """A training group for ``tcfg.engine``: a long-lived Ray Train run (``ray_train``, the default;
    ``storage``: where Ray Train keeps it) or a :class:`TrainerGroup` of Ray actors (``actors``).

    Both have ``train_bc(job)``, ``train_dpo(job)``, ``shutdown()`` and ``startup_s``.
    """
    if tcfg.engine == "ray_train":
        from hamo_ray.training.ray_train import RayTrainGroup

        return RayTrainGroup(tcfg, name=name, storage=storage)
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
        self.group: Any = None

    def get(self) -> Any:
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
