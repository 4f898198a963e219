"""The actor engine (``train.engine=actors``): a long-lived group of Ray Core actors with their own process group.

Each worker (``worker.TrainWorker``, a Ray actor) loads the base model once; a stage only resets the
LoRA weights (from the previous stage's adapter folder, or fresh), builds its optimizer and
DDP/DeepSpeed wrapper, trains and returns the adapter files to the driver (through Ray's object
store, so the driver's ``out_dir`` need not be on a shared file system). The workers form one
``torch.distributed`` group (gloo on CPU, NCCL on GPU), placed by a placement group
(``TrainConfig.placement_strategy``)::

    group = TrainerGroup(tcfg)                 # start-up: actors + process group (once)
    r1 = train_model(base, ex1, out1, tcfg, pad_id=0, group=group)   # loads the model
    r2 = train_model(base, ex2, out2, tcfg, pad_id=0, group=group, init_adapter=out1)
    group.shutdown()

``train(job)`` sends a typed job (``contracts.StageJob``) to every worker, which runs the loop on it
(``loop.run_stage``, with the loss its objective names); rank 0's files are written to the job's
``out_dir`` and its ``TrainResult`` returned. No failure handling: a dead worker fails the stage
(the Ray Train engine, ``ray_train.py``, restarts it). ``group.make_group`` picks the engine.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from dataclasses import replace

from hamo_ray.config import TrainConfig
from hamo_ray.training.contracts import StageJob, StageOutput, TrainResult
from hamo_ray.training.files import write_files
from hamo_ray.training.worker import TrainWorker

logger = logging.getLogger(__name__)


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

    def train(self, job: StageJob) -> TrainResult:
        """One stage (the loop, with ``job.objective``) on every worker; rank 0's files to ``job.out_dir``.

        Returns:
            Rank 0's ``TrainResult`` with its ``path``; ``startup_s`` is this call's wall time outside
            the training loop.
        """
        import ray

        wall = time.perf_counter()
        out: StageOutput = ray.get([w.run.remote(job) for w in self.workers])[0]
        path = write_files(out.files, job.out_dir)
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
