"""A training worker group that lives across stages: Ray Core actors with their own process group.

Each worker loads the base model once; a stage only resets the LoRA weights (from the previous
stage's adapter folder, or fresh), builds its optimizer and DDP/DeepSpeed wrapper, trains and
returns the adapter files to the driver (through Ray's object store, so the driver's ``out_dir``
need not be on a shared file system). The workers form one ``torch.distributed`` group (gloo on
CPU, NCCL on GPU), placed by a placement group (``TrainConfig.placement_strategy``)::

    group = TrainerGroup(tcfg)                 # start-up: actors + process group (once)
    r1 = train_model(base, ex1, out1, tcfg, storage, pad_id=0, group=group)   # loads the model
    r2 = train_model(base, ex2, out2, tcfg, storage, pad_id=0, group=group, init_adapter=out1)
    group.shutdown()

A stage whose model spec (base path, LoRA shape, dtype, attention) differs from the loaded one
reloads it; ZeRO-3 partitions the weights in place, so under ZeRO-3 every stage reloads.
"""

from __future__ import annotations

import importlib
import logging
import os
import socket
import time
import uuid
from pathlib import Path
from typing import Any

from hamo_ray.config import TrainConfig

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

    def model(self, spec_dict: dict[str, Any], reuse: bool = True) -> tuple[Any, float, bool]:
        """The loaded ``ActionLM`` for ``spec_dict``: (model, seconds spent loading, whether it loaded)."""
        from hamo_ray.training.loop import ModelSpec, load_model

        spec = ModelSpec(**{**spec_dict, "target_modules": tuple(spec_dict["target_modules"])})
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

    def run(self, fn: str, job: dict[str, Any]) -> dict[str, Any] | None:
        """Run ``fn`` ("module:function", called as ``fn(worker, job)``); rank 0's result comes back."""
        module, name = fn.split(":")
        try:
            out = getattr(importlib.import_module(module), name)(self, job)
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
        self.key = self.key_of(tcfg)
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

    @staticmethod
    def key_of(tcfg: TrainConfig) -> tuple:
        """What a group is built for; a config with another key needs another group."""
        resources = tuple(sorted(tcfg.resources.items()))
        return (tcfg.num_workers, tcfg.use_gpu, tcfg.cpus_per_worker, tcfg.placement_strategy, resources)

    def run(self, fn: str, job: dict[str, Any]) -> dict[str, Any]:
        """Run ``fn(worker, job)`` on every worker; rank 0's result (large values: ``ray.put`` refs)."""
        import ray

        return ray.get([w.run.remote(fn, job) for w in self.workers])[0]

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


def group_for(holder: Any, tcfg: TrainConfig) -> TrainerGroup | None:
    """The group kept on ``holder`` (a stream), started on first use; None without ``keep_workers``.

    A config whose workers differ from the kept group's (count, GPU, CPUs, placement) replaces it.
    """
    if not tcfg.keep_workers:
        return None
    group = getattr(holder, "_train_group", None)
    if group is not None and group.key != TrainerGroup.key_of(tcfg):
        shutdown_group(holder)
        group = None
    if group is None:
        group = TrainerGroup(tcfg)
        holder._train_group = group
    return group


def shutdown_group(holder: Any) -> None:
    """Stop the group kept on ``holder``, if any (for ``finally:`` blocks)."""
    group = getattr(holder, "_train_group", None)
    if group is not None:
        holder._train_group = None
        group.shutdown()
