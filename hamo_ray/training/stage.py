"""A training stage on one worker, shared by behavioural cloning and ETO's DPO: set-up, epochs, figures, files.

``trainer.bc_stage`` and ``dpo.dpo_stage`` differ only in their loss; the rest is here::

    lm, examples = begin_stage(worker, job)             # examples, the loaded model, the stage's adapter
    run = StageRun(worker, job, lm, lengths, t0)        # the Stepper (loop.py); lm in train mode
    for epoch, batches in run.epochs():                 # this rank's batches, timed
        for idx in batches:
            run.step(loss, tokens, positions)           # optimizer step + per-step record
    out = run.finish()                                  # rank 0: a StageOutput (files, figures); else None

``job`` is the :class:`~hamo_ray.training.contracts.StageJob` the driver sent (DPO: its ``stage``).

Every optimizer step's loss, learning rate and tokens/s are recorded (:class:`StepRecord`); rank 0
returns them with its result (``TrainResult.step_metrics``), and the stream writes them to
TensorBoard as ``train/loss``, ``train/lr``, ``train/tokens_per_s`` (``dpo/...`` for DPO), numbered
on across stages (``tracking.Tracker.log_steps``). Rank 0 also logs a progress line (step/total,
loss, tokens/s, ETA) every tenth of the stage: a worker's output is never a terminal.

Losses stay on the device until :meth:`StepRecord.rows` (one synchronisation) or a progress line.
The clock is the host's: on a GPU a step's time is when the host got past it, so single steps
jitter while their sum is the stage's time; the tokens are rank 0's times the world size.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from hamo_ray.logs import Progress
from hamo_ray.training.contracts import StageJob, StageOutput, TrainResult
from hamo_ray.training.loop import Stepper, rank_share

logger = logging.getLogger(__name__)


def make_batches(lengths: list[int], job: StageJob, epoch: int) -> list[list[int]]:
    """The epoch's micro-batches of example indices: packed to the token budget, or length-bucketed."""
    from hamo_ray.training.examples import length_bucketed_batches
    from hamo_ray.training.packing import pack_batches

    if job.spec.packed:
        return pack_batches(lengths, job.pack_tokens, job.seed, epoch, job.bucket_pool)
    return length_bucketed_batches(lengths, job.batch_size, job.seed, epoch, job.bucket_pool)


def begin_stage(worker: Any, job: StageJob) -> tuple[Any, list[Any]]:
    """Worker side, first part of a stage: the job's examples, the loaded model, the stage's adapter.

    Returns:
        ``(lm, examples)``.

    Raises:
        RuntimeError: full-model training (``lora=False``) on a model that was not freshly loaded.
    """
    import ray

    examples = job.examples
    if isinstance(examples, ray.ObjectRef):
        examples = ray.get(examples)
    lm, _, loaded = worker.model(job.spec, reuse=job.reuse)
    if job.spec.lora:
        lm.reset_adapter(job.init_adapter, seed=job.seed)
    elif not loaded:
        raise RuntimeError("full-model training needs a freshly loaded model")
    worker.dirty = not job.reuse  # the next stage reloads weights this stage changes in place
    return lm, examples


class StageRun:
    """Worker side, training part of a stage (behavioural cloning and DPO alike)::

        lm, examples = begin_stage(worker, job)
        run = StageRun(worker, job, lm, lengths, t0)      # the Stepper; lm in train mode
        for epoch, batches in run.epochs():               # this rank's batches, timed
            for idx in batches:
                run.step(loss, tokens, positions)         # optimizer step + per-step record
        out = run.finish()                                # rank 0: a StageOutput; else None

    Args:
        worker: the ``TrainWorker``.
        job: the stage's job (``trainer.stage_job``).
        lm: the ``ActionLM`` from :func:`begin_stage`.
        lengths: each example's token count (for batching).
        t0: when the stage began on this worker (``time.perf_counter()``), for ``startup_s``.
    """

    def __init__(self, worker: Any, job: StageJob, lm: Any, lengths: list[int], t0: float) -> None:
        if job.spec.packed and job.pack_tokens == 0:  # chosen here, for this device (same on every rank)
            from dataclasses import replace

            from hamo_ray.training.packing import device_pack_tokens

            job = replace(job, pack_tokens=device_pack_tokens(lm, lengths, job.batch_size, worker.device))
        self.worker, self.job, self.lm, self.lengths = worker, job, lm, lengths
        per_rank = len(rank_share(make_batches(lengths, job, 0), worker.rank, worker.world))
        total = per_rank * job.epochs
        self.stepper = Stepper(lm, job.step, total, worker.device)
        lm.train()
        self.startup = time.perf_counter() - t0
        self.record = StepRecord(total, job.name, worker.rank, worker.world)
        self.tokens = self.positions = 0
        self.seconds = 0.0

    def epochs(self):
        """Yield ``(epoch, this rank's batches)``; the loop is timed between device synchronisations."""
        import torch

        cuda = self.worker.device.type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats()
            torch.cuda.synchronize()
        self.record.begin()
        for epoch in range(self.job.epochs):
            yield (
                epoch,
                rank_share(make_batches(self.lengths, self.job, epoch), self.worker.rank, self.worker.world),
            )
            self.record.end_epoch()
        if cuda:
            torch.cuda.synchronize()
        self.seconds = time.perf_counter() - self.record.start

    def step(self, loss: Any, tokens: int, positions: int = 0) -> None:
        """One optimizer step on ``loss``, recorded with the learning rate it used and its tokens."""
        lr = self.stepper.lr
        self.stepper.step(loss)
        self.record.step(loss, lr, tokens)
        self.tokens, self.positions = self.tokens + tokens, self.positions + positions

    def finish(self) -> StageOutput | None:
        """Gather the trained weights (collective), free the engine; rank 0 returns files and figures."""
        import tempfile

        import torch

        from hamo_ray.training.group import read_files

        rows = self.record.rows()  # the one host synchronisation of the losses
        losses = self.record.epoch_losses(rows)
        worker, stepper = self.worker, self.stepper
        state = stepper.trainable_state()  # collective under ZeRO-3
        stepper.close()
        worker.dirty = worker.dirty or stepper.hooks_left
        if worker.rank != 0:
            return None
        logger.info(
            "%s: %d steps in %.1fs, losses %s", self.job.name, len(rows), self.seconds,
            [round(x, 4) for x in losses],
        )  # fmt: skip
        with tempfile.TemporaryDirectory() as tmp:
            self.lm.save(tmp, state)
            files = read_files(tmp)
        cuda = worker.device.type == "cuda"
        result = TrainResult(
            path="",  # the driver writes the files
            loss=losses[-1],
            losses=losses,
            tokens=self.tokens * worker.world,
            seconds=self.seconds,
            padding=1 - self.tokens / max(1, self.positions) if self.positions else 0.0,
            startup_s=self.startup,
            steps=len(rows),
            peak_gib=torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0,
            step_metrics=rows,
        )
        return StageOutput(files=files, result=result)


class StepRecord:
    """The steps of one stage on one worker; only rank 0 logs progress lines.

    Args:
        total_steps: the steps this rank will take (all epochs).
        desc: the stage's name in the progress lines.
        rank, world: this worker's rank and the group's size.
    """

    def __init__(self, total_steps: int, desc: str, rank: int, world: int) -> None:
        self.world = world
        self.losses: list[Any] = []  # 0-d device tensors
        self.lrs: list[float] = []
        self.tokens: list[int] = []  # all ranks' tokens of the step (rank 0's x world)
        self.times: list[float] = []  # host clock after each step
        self.epoch_ends: list[int] = []  # steps done at the end of each epoch
        self.start = time.perf_counter()
        self._shown = 0  # steps already summarised in a progress line
        self.progress = Progress(total_steps, desc, unit="step", log=logger, enabled=rank == 0)

    def begin(self) -> None:
        """Start the clock (after the device is synchronised, just before the first step)."""
        self.start = self.progress.start = time.perf_counter()

    def step(self, loss: Any, lr: float, tokens: int) -> None:
        """Record one optimizer step: its loss (a tensor, kept on the device), learning rate, tokens."""
        self.losses.append(loss.detach())
        self.lrs.append(float(lr))
        self.tokens.append(tokens * self.world)
        self.times.append(time.perf_counter())
        self.progress.update(1, figures=self._figures)

    def end_epoch(self) -> None:
        self.epoch_ends.append(len(self.losses))

    def _figures(self) -> dict[str, Any]:
        """The steps since the last line: mean loss (one synchronisation), tokens/s, learning rate."""
        import torch

        first, last = self._shown, len(self.losses)
        self._shown = last
        before = self.times[first - 1] if first else self.start
        seconds = max(self.times[-1] - before, 1e-9)
        loss = float(torch.stack(self.losses[first:last]).float().mean())
        return {"loss": round(loss, 4), "tok/s": sum(self.tokens[first:last]) / seconds, "lr": self.lrs[-1]}

    def close(self) -> None:
        self.progress.close()

    def rows(self) -> list[dict[str, float]]:
        """One dict per step: ``loss``, ``lr``, ``tokens_per_s`` (the one synchronisation of the losses)."""
        import torch

        self.close()
        if not self.losses:
            return []
        losses = torch.stack(self.losses).float().cpu().tolist()
        out, before = [], self.start
        for loss, lr, tokens, t in zip(losses, self.lrs, self.tokens, self.times, strict=True):
            out.append({"loss": loss, "lr": lr, "tokens_per_s": tokens / max(t - before, 1e-9)})
            before = t
        return out

    def epoch_losses(self, rows: list[dict[str, float]]) -> list[float]:
        """The mean loss of each epoch, from :meth:`rows`."""
        out, begin = [], 0
        for end in self.epoch_ends:
            chunk = [r["loss"] for r in rows[begin:end]]
            out.append(sum(chunk) / max(1, len(chunk)))
            begin = end
        return out
