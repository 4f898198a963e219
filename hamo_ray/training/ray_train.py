"""The training engine on Ray Train: one long-lived ``TorchTrainer`` run serves every stage of a stream.

Ray Train's worker group starts once (35-45 s on an H200; 43-55 s with the first model load on 2 busy CPU
cores) and then lives for the whole stream. Its training function loads the base model once and serves stage jobs that the driver
hands to a small broker actor; each stage is the same loop as on the actor group (``loop.run_stage``,
with the loss the job's objective names: behavioural cloning, ETO's DPO), on Ray Train's own
process group (gloo on CPU, NCCL on GPUs, DeepSpeed ZeRO over it)::

    group = RayTrainGroup(tcfg, storage="runs/x/ray_train")   # the Ray Train run starts (in a thread)
    r1 = group.train(job1)                                      # loads the model, trains stage 1
    r2 = group.train(job2)                                      # the same workers: starts in well under 5 s
    group.shutdown()                                            # the run ends: fit() returns

Every stage ends with ``ray.train.report``: its figures, and rank 0's adapter as the run's checkpoint
(``<storage>/<run name>/checkpoint_*``, the latest kept), so the run is visible as a Ray Train run
(dashboard, ``ray list``), with one reported checkpoint per stage.

Failures are Ray Train's (``FailureConfig(max_failures=train.max_failures)``): a worker that dies
mid-stage makes Ray Train restart the worker group; the new workers reload the model and ask the
broker for the first job without a result, so the interrupted stage is retrained from its start,
and the driver, still waiting for that job's result, receives exactly one. Any exception in a stage
counts as a failure: a peer's death reaches the other ranks as an error of their collectives
(gloo's "Connection reset by peer" is a plain ``RuntimeError``), so a worker cannot tell a lost peer
from a bug, and Ray Train retries both. Each worker error is recorded with its job; when the
failures are spent, ``fit`` raises and the driver's waiting call raises
:class:`TrainingEngineError` naming the job, the rank and its traceback.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import traceback
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from hamo_ray.config import TrainConfig
from hamo_ray.training.contracts import StageJob, StageOutput, TrainResult
from hamo_ray.training.files import write_files
from hamo_ray.training.worker import TrainWorker

logger = logging.getLogger(__name__)

STOP = "stop"


class TrainingEngineError(RuntimeError):
    """The Ray Train run ended (its failures spent, or it could not start): no stage can train on it."""


@dataclass(frozen=True)
class WorkerError:
    """An exception a worker raised in a job: the job, the rank, the attempt and the traceback."""

    seq: int
    rank: int
    attempt: int
    error: str


class StageBroker:
    """The queue between the driver and the Ray Train workers (an async Ray actor, owned by the driver).

    Jobs are numbered 0, 1, ...; every rank asks for the same numbers in order, so all ranks of a
    (re)started group train the same job. A job is open until rank 0 posts its ``StageOutput``.
    """

    def __init__(self) -> None:
        import asyncio

        self.jobs: list[StageJob | None] = []
        self.results: dict[int, Any] = {}
        self.starts: list[dict[str, Any]] = []  # one row per (attempt, rank, job) started
        self.joins: dict[int, int] = {}  # rank -> how many times a worker of that rank started
        self.errors: list[WorkerError] = []
        self.stopped = False
        self.changed = asyncio.Condition()

    async def _notify(self) -> None:
        async with self.changed:
            self.changed.notify_all()

    async def submit(self, job: StageJob) -> int:
        self.jobs.append(job)
        await self._notify()
        return len(self.jobs) - 1

    async def stop(self) -> None:
        self.stopped = True
        await self._notify()

    def join(self, rank: int) -> tuple[int, int]:
        """A worker of ``rank`` starts: (its attempt, 1 for the run's first group, and the first open job).

        Ray Train restarts every rank together, so the ranks of one group count the same attempt.
        """
        self.joins[rank] = self.joins.get(rank, 0) + 1
        seq = 0
        while seq in self.results:
            seq += 1
        return self.joins[rank], seq

    async def next_job(self, seq: int, rank: int, pid: int, attempt: int) -> StageJob | None:
        """Job ``seq`` once it is submitted; None once the run is stopped (and the job not submitted)."""
        async with self.changed:
            await self.changed.wait_for(lambda: seq < len(self.jobs) or self.stopped)
        if seq >= len(self.jobs):
            return None
        self.starts.append(dict(seq=seq, rank=rank, pid=pid, attempt=attempt, at=time.time()))
        return self.jobs[seq]

    async def post(self, seq: int, result: Any) -> bool:
        """Record job ``seq``'s result; False (and ignored) if it already has one."""
        if seq in self.results:
            return False
        self.results[seq] = result
        # a closed job is never asked again: free its rows
        self.jobs[seq] = replace(self.jobs[seq], examples=None)
        await self._notify()
        return True

    async def result(self, seq: int, timeout_s: float) -> Any:
        """Job ``seq``'s result, or None after ``timeout_s`` (the caller checks the run and asks again)."""
        import asyncio

        try:
            async with self.changed:
                await asyncio.wait_for(self.changed.wait_for(lambda: seq in self.results), timeout_s)
        except asyncio.TimeoutError:
            return None
        return self.results[seq]

    def job_of(self, seq: int) -> StageJob:
        """Job ``seq`` (a finished one without its rows)."""
        return self.jobs[seq]

    def error(self, err: WorkerError) -> None:
        self.errors.append(err)

    def worker_errors(self) -> list[WorkerError]:
        return list(self.errors)

    def started(self) -> list[dict[str, Any]]:
        """Every (job, rank, pid, attempt) started so far: what a fault test or a dashboard reads."""
        return list(self.starts)


class RayTrainWorker(TrainWorker):
    """A :class:`TrainWorker` inside Ray Train's training function: Ray Train owns the process group."""

    def __init__(self, use_gpu: bool, threads: int):
        import ray.train

        ctx = ray.train.get_context()
        super().__init__(ctx.get_world_rank(), ctx.get_world_size(), use_gpu, threads)
        os.environ["LOCAL_RANK"] = str(ctx.get_local_rank())

    @property
    def device(self) -> Any:
        import ray.train.torch

        return ray.train.torch.get_device()

    def shutdown(self) -> None:  # Ray Train destroys its process group itself
        pass


def _storage_path(storage: str | Path | None) -> str | None:
    """Ray Train's ``storage_path``: a URI as it is, a local path made absolute; None: Ray's default."""
    if storage is None or "://" in str(storage):
        return None if storage is None else str(storage)
    return str(Path(storage).expanduser().resolve())


def serve_stages(config: dict[str, Any]) -> None:
    """Ray Train's training function: load nothing yet, then train every job the broker hands out."""
    import tempfile

    import ray
    import ray.train

    from hamo_ray.logs import setup_logging

    setup_logging()
    broker = config["broker"]
    worker = RayTrainWorker(config["use_gpu"], config["threads"])
    attempt, seq = ray.get(broker.join.remote(worker.rank))  # a restarted group resumes at the open job
    # A local storage path is the driver node's: another node's rank 0 reports figures only.
    checkpoints = (
        not config["local_storage"] or ray.get_runtime_context().get_node_id() == config["driver_node"]
    )
    logger.info("ray train worker %d/%d (attempt %d) from job %d", worker.rank, worker.world, attempt, seq)
    while True:
        job = ray.get(broker.next_job.remote(seq, worker.rank, os.getpid(), attempt))
        if job is None:
            return
        try:
            out = worker.run(job)
        except Exception as exc:  # Ray Train's failure to handle (see the module's docstring)
            error = WorkerError(seq, worker.rank, attempt, "".join(traceback.format_exception(exc)))
            ray.get(broker.error.remote(error))
            raise
        metrics = {"job": seq, "kind": job.objective, "name": job.name}
        if out is None:  # ranks > 0
            ray.train.report(metrics)
        else:
            ray.get(broker.post.remote(seq, out))
            metrics.update(loss=out.result.loss, tokens=out.result.tokens, seconds=out.result.seconds)
            with tempfile.TemporaryDirectory() as tmp:
                write_files(out.files, Path(tmp) / "adapter")
                ckpt = ray.train.Checkpoint.from_directory(tmp) if checkpoints else None
                ray.train.report(metrics, checkpoint=ckpt, checkpoint_dir_name=f"checkpoint_job{seq:04d}")
        seq += 1


class RayTrainGroup:
    """The driver's handle on a long-lived Ray Train run (needs a running Ray); the group's interface.

    Args:
        tcfg: the training settings (workers, CPUs/GPUs, resources, placement, ``max_failures``).
        name: the run's name prefix (a unique suffix is added: sweeps run several at once).
        storage: where Ray Train keeps the run (its checkpoints); default ``~/ray_results``.
    """

    def __init__(self, tcfg: TrainConfig, name: str = "hamo-train", storage: str | Path | None = None):
        import ray
        from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
        from ray.train.torch import TorchTrainer

        start = time.perf_counter()
        self.tcfg = tcfg
        self.name = f"{name}-{uuid.uuid4().hex[:8]}"
        self.broker = ray.remote(StageBroker).options(num_cpus=0, name=f"{self.name}-broker").remote()
        n = tcfg.num_workers
        threads = 4 if tcfg.use_gpu else max(1, (os.cpu_count() or 1) // n)
        resources = {"CPU": tcfg.cpus_per_worker, **tcfg.resources}
        run_config = RunConfig(
            name=self.name,
            storage_path=_storage_path(storage),
            failure_config=FailureConfig(max_failures=tcfg.max_failures),
            checkpoint_config=CheckpointConfig(num_to_keep=1),
        )
        self.trainer = TorchTrainer(
            serve_stages,
            train_loop_config={
                "broker": self.broker,
                "use_gpu": tcfg.use_gpu,
                "threads": threads,
                "local_storage": "://" not in str(storage or ""),
                "driver_node": ray.get_runtime_context().get_node_id(),
            },
            scaling_config=ScalingConfig(
                num_workers=n,
                use_gpu=tcfg.use_gpu,
                resources_per_worker=resources,
                placement_strategy=tcfg.placement_strategy,
            ),
            run_config=run_config,
        )
        self.error: BaseException | None = None
        self.result: Any = None
        self._thread = threading.Thread(target=self._fit, name=self.name, daemon=True)
        self._thread.start()
        self.workers = list(range(n))  # shutdown() is idempotent on this, as on the actor group
        self.startup_s = time.perf_counter() - start  # the workers start with the first job, in its start-up
        logger.info(
            "training on Ray Train: run %s, %d workers, max_failures %d", self.name, n, tcfg.max_failures
        )

    def _fit(self) -> None:
        try:
            self.result = self.trainer.fit()
        except BaseException as exc:  # kept for the waiting driver
            self.error = exc

    def train(self, job: StageJob) -> TrainResult:
        """One stage (the loop, with ``job.objective``) on the run's workers; the weights in ``job.out_dir``.

        Raises:
            TrainingEngineError: the run ended (shut down, or its failures spent) before the job finished.
        """
        import ray

        if not self.workers:
            raise TrainingEngineError(f"Ray Train run {self.name} was shut down")
        wall = time.perf_counter()
        seq = ray.get(self.broker.submit.remote(job))
        while True:
            out = ray.get(self.broker.result.remote(seq, 2.0))
            if out is not None:
                break
            if not self._thread.is_alive():
                raise TrainingEngineError(self._ended(seq))
        assert isinstance(out, StageOutput)
        path = write_files(out.files, job.out_dir)
        seconds = out.result.seconds
        return replace(out.result, path=str(path), startup_s=max(0.0, time.perf_counter() - wall - seconds))

    def _ended(self, seq: int) -> str:
        """Why job ``seq`` will never finish: the run's end, and the job's last worker error."""
        import ray

        job = ray.get(self.broker.job_of.remote(seq))
        why = f"Ray Train run {self.name} ended before job {seq} ({job.label}) finished"
        errors = [e for e in ray.get(self.broker.worker_errors.remote()) if e.seq == seq]
        if not errors:
            return f"{why}: {self.error!r}"
        last = errors[-1]
        return (
            f"{why}, train.max_failures={self.tcfg.max_failures} spent; "
            f"rank {last.rank}, attempt {last.attempt}:\n{last.error}"
        )

    def attempts(self) -> list[dict[str, Any]]:
        """Every (job, rank, pid, attempt) the run's workers started."""
        import ray

        return ray.get(self.broker.started.remote())

    def shutdown(self, timeout_s: float = 120.0) -> None:
        """End the run: the workers leave their loop, ``fit`` returns (idempotent)."""
        import ray

        if not self.workers:
            return
        self.workers = []
        try:
            ray.get(self.broker.stop.remote(), timeout=30)
        except Exception as e:
            logger.warning("ray train shutdown: %s", e)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.warning("Ray Train run %s did not end within %.0fs", self.name, timeout_s)
        ray.kill(self.broker)
