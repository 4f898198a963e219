"""The training loop: one stage on one worker, top to bottom, for every objective (BC, DPO, ...).

Both engines (Ray Train, ``ray_train.py``; Ray actors, ``actors.py``) run :func:`run_stage` on each of
their workers (``worker.TrainWorker.run``) with the job the driver built (``trainer.stage_job``)::

    rows      the job's examples, from Ray's object store (one copy for all workers)
    lm        the loaded model (kept across stages), its adapter reset from job.init_adapter
    loss      objectives.objective(job.objective)(lm, rows, job, device): the stage's loss function
    stepper   DDP or a DeepSpeed engine around lm, AdamW, the schedule (stepper.py)
    for epoch in range(job.epochs):
        for idx in this rank's micro-batches (batches.py: packed, or length-bucketed):
            out = loss(stepper.model, [rows[i] for i in idx], idx)   # a Loss: value, tokens, ...
            stepper.step(out.value)                                   # + the per-step record
    rank 0    the trained weights' files and the stage's figures: a StageOutput; other ranks: None

The loss is the only part an objective owns (``objectives.py``); the rest is here. Every optimizer
step's loss, learning rate and tokens/s are recorded (``record.StepRecord``). Losses and token counts
stay on the device until the stage ends: no host synchronisation per step.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Any

from hamo_ray.training.batches import make_batches, rank_share
from hamo_ray.training.contracts import StageJob, StageOutput, TrainResult
from hamo_ray.training.objectives import objective
from hamo_ray.training.record import StepRecord
from hamo_ray.training.stepper import Stepper

__all__ = ["make_batches", "rank_share", "run_stage"]

logger = logging.getLogger(__name__)


def run_stage(worker: Any, job: StageJob) -> StageOutput | None:
    """Train one stage on this worker (every rank runs it; the collectives keep them in step).

    Args:
        worker: the ``TrainWorker`` (rank, world, device, the loaded model).
        job: the stage's job.

    Returns:
        Rank 0: the trained weights' files and the stage's ``TrainResult`` (``path`` empty, the driver
        writes the files). Other ranks: None.

    Raises:
        ValueError: an unknown ``job.objective``.
        RuntimeError: full-model training (``lora=False``) on a model that was not freshly loaded.
    """
    import torch

    t0 = time.perf_counter()
    loss_fn = objective(job.objective)
    rows = _rows(job)
    lm = _stage_model(worker, job)
    lengths = [r.tokens for r in rows]
    device, rank, world = worker.device, worker.rank, worker.world

    # The objective's loss; what it does before the first update (DPO's reference) runs here.
    loss = loss_fn(lm, rows, job, device)

    # The optimizer over this rank's steps; a pack budget left to the worker is chosen for this device.
    if job.spec.packed and job.pack_tokens == 0:  # the same on every rank (one collective)
        from hamo_ray.training.packing import device_pack_tokens

        job = replace(job, pack_tokens=device_pack_tokens(lm, lengths, job.batch_size, device))
    total = len(rank_share(make_batches(lengths, job, 0), rank, world)) * job.epochs
    stepper = Stepper(lm, job.step, total, device)
    lm.train()
    startup = time.perf_counter() - t0
    record = StepRecord(total, job.name, rank, world)

    # The epochs, timed between device synchronisations.
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.synchronize()
    record.begin()
    tokens = positions = 0
    accuracy = []  # per epoch, where the objective counts right rows (DPO)
    for epoch in range(job.epochs):
        correct, counted = torch.zeros((), device=device), 0
        for idx in rank_share(make_batches(lengths, job, epoch), rank, world):
            out = loss(stepper.model, [rows[i] for i in idx], idx)
            lr = stepper.lr
            stepper.step(out.value)
            record.step(out.value, lr, out.tokens)
            tokens, positions = tokens + out.tokens, positions + out.positions
            if out.correct is not None:
                correct += out.correct
                counted += out.counted
        if counted:
            accuracy.append(correct / counted)
        record.end_epoch()
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - record.start

    # The trained weights (collective under ZeRO-3); rank 0 sends them back with the figures.
    rows_out = record.rows()  # the one host synchronisation of the losses
    state = stepper.trainable_state()
    stepper.close()
    worker.dirty = worker.dirty or stepper.hooks_left
    if rank != 0:
        return None
    losses = record.epoch_losses(rows_out)
    logger.info(
        "%s: %d steps in %.1fs, losses %s", job.name, len(rows_out), seconds, [round(x, 4) for x in losses]
    )
    result = TrainResult(
        path="",  # the driver writes the files
        loss=losses[-1],
        losses=losses,
        tokens=tokens * world,
        seconds=seconds,
        padding=1 - tokens / max(1, positions) if positions else 0.0,
        startup_s=startup,
        steps=len(rows_out),
        accuracy=[float(x) for x in accuracy] or None,
        peak_gib=torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0,
        step_metrics=rows_out,
    )
    if result.accuracy is not None:
        logger.info("%s: accuracy per epoch %s", job.label, [round(x, 3) for x in result.accuracy])
    return StageOutput(files=_saved_files(lm, state), result=result)


def _rows(job: StageJob) -> list[Any]:
    """The job's rows: from Ray's object store, or as they came."""
    import ray

    examples = job.examples
    return ray.get(examples) if isinstance(examples, ray.ObjectRef) else examples


def _stage_model(worker: Any, job: StageJob) -> Any:
    """The worker's loaded model for the job's spec, with the stage's adapter (or checked fresh, full training)."""
    lm, _, loaded = worker.model(job.spec, reuse=job.reuse)
    if job.spec.lora:
        lm.reset_adapter(job.init_adapter, seed=job.seed)
    elif not loaded:
        raise RuntimeError("full-model training needs a freshly loaded model")
    worker.dirty = not job.reuse  # the next stage reloads weights this stage changes in place
    return lm


def _saved_files(lm: Any, state: dict[str, Any]) -> dict[str, bytes]:
    """The weights as peft (or, full training, Hugging Face) files: ``{file name: bytes}``."""
    import tempfile

    from hamo_ray.training.files import read_files

    with tempfile.TemporaryDirectory() as tmp:
        lm.save(tmp, state)
        return read_files(tmp)
