"""A training worker: one rank's process, holding the loaded base model between stages.

Both engines run their stages on :class:`TrainWorker` objects: the actor engine (``actors.py``) makes
each one a Ray actor with a process group of its own; the Ray Train engine (``ray_train.py``)
subclasses it inside Ray Train's training function, where Ray Train owns the process group. A stage
is ``worker.run(job)``: the loop (``loop.run_stage``) with the job's objective. The model is loaded
once per spec (``model.load_model``) and kept; a stage whose spec differs, or one that changed the
weights in place (ZeRO-3, full training: ``dirty``), reloads it.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

from hamo_ray.training.contracts import ModelSpec, StageJob, StageOutput


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
        from hamo_ray.training.model import load_model

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

    def run(self, job: StageJob) -> StageOutput | None:
        """Train one stage (``loop.run_stage``, the job's objective); rank 0's output comes back."""
        from hamo_ray.training.loop import run_stage

        try:
            out = run_stage(self, job)
        finally:
            self._free()
        return out if self.rank == 0 else None

    def shutdown(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
