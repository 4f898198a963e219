"""Tracking: TensorBoard event files written and read back; a missing backend is a named error."""

from __future__ import annotations

import math

import pytest

from hamo_ray.run.tracking import Tracker, check_backends, read_scalars


def test_tensorboard_events_round_trip(tmp_path):
    tracker = Tracker(tmp_path, ["tensorboard"], name="train")
    for step in range(5):
        tracker.log({"train/loss": 2.0 / (step + 1), "train/lr": 1e-3}, step=step)
    tracker.close()
    scalars = read_scalars(tmp_path / "tensorboard")
    assert [s for s, _ in scalars["train/loss"]] == [0, 1, 2, 3, 4]
    assert math.isclose(scalars["train/loss"][-1][1], 0.4, rel_tol=1e-6)
    assert len(scalars["train/lr"]) == 5


def test_unknown_or_missing_backend_is_named():
    with pytest.raises(ValueError, match="unknown backend 'neptune'"):
        check_backends(["neptune"])
    import importlib.util

    if importlib.util.find_spec("wandb") is None:
        with pytest.raises(ValueError, match="pip install wandb"):
            check_backends(["tensorboard", "wandb"])


def test_training_steps_number_on_across_stages_and_resumes(tmp_path):
    """Stage k's steps follow stage k-1's, per section; a resumed run's tracker continues the count."""
    stage1 = [{"loss": 2.0 - 0.1 * i, "lr": 1e-4 * (i + 1), "tokens_per_s": 900.0 + i} for i in range(4)]
    stage2 = [{"loss": 1.5 - 0.1 * i, "lr": 2e-4, "tokens_per_s": 950.0} for i in range(3)]
    tracker = Tracker(tmp_path, ["tensorboard"], name="stream")
    tracker.log_steps(stage1, "train")
    tracker.log({"score/d": 10.0}, step=1)
    tracker.log_steps([{"loss": 0.69, "lr": 1e-4, "tokens_per_s": 500.0}] * 2, "dpo")
    tracker.log_steps(stage2, "train")
    tracker.close()
    resumed = Tracker(tmp_path, ["tensorboard"], name="stream")  # e.g. the run resumed at stage 3
    resumed.log_steps(stage1[:2], "train")
    resumed.close()

    scalars = read_scalars(tmp_path / "tensorboard")
    loss = sorted(scalars["train/loss"])
    assert [s for s, _ in loss] == list(range(9))
    assert [v for _, v in loss] == pytest.approx([r["loss"] for r in stage1 + stage2 + stage1[:2]])
    assert sorted(scalars["train/lr"])[3][1] == pytest.approx(4e-4)
    assert len(scalars["train/tokens_per_s"]) == 9
    assert [s for s, _ in sorted(scalars["dpo/loss"])] == [0, 1]  # DPO has its own count
    assert scalars["score/d"] == [(1, 10.0)]


def test_progress_logs_compact_lines_off_a_terminal(caplog):
    """Off a terminal (pytest captures stderr): about one line per tenth, figures computed only then."""
    import logging

    from hamo_ray.logs import Progress, format_duration

    calls = []

    def figures():
        calls.append(1)
        return {"loss": 1.23456, "tok/s": 12345.6}

    log = logging.getLogger("hamo_ray.test_progress")
    progress = Progress(total=40, desc="train stage-1", unit="step", log=log)
    assert not progress.on_terminal
    with caplog.at_level(logging.INFO, logger="hamo_ray.test_progress"):
        for _ in range(40):
            progress.update(1, figures=figures)
    progress.close()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 10 == len(calls)
    assert lines[0].startswith("train stage-1: 4/40 steps (10%), ") and "ETA " in lines[0]
    assert "loss 1.235" in lines[0] and "tok/s 12,346" in lines[0]
    assert lines[-1].startswith("train stage-1: 40/40 steps (100%)") and "ETA" not in lines[-1]
    assert format_duration(75) == "1:15" and format_duration(3725) == "1:02:05"
    jumps = Progress(total=12, desc="cards", unit="card", log=log, lines=4)  # due every 3 cards
    with caplog.at_level(logging.INFO, logger="hamo_ray.test_progress"):
        for n in (5, 5, 2):  # batches jump over the multiples of 3: still one line each
            jumps.update(n)
    assert [r.getMessage().split(",")[0] for r in caplog.records[10:]] == [
        "cards: 5/12 cards (42%)",
        "cards: 10/12 cards (83%)",
        "cards: 12/12 cards (100%)",
    ]
    caplog.clear()
    silent = Progress(total=5, desc="rank 1", log=log, enabled=False)
    with caplog.at_level(logging.INFO, logger="hamo_ray.test_progress"):
        silent.update(5, figures=figures)
    assert len(caplog.records) == 0 and len(calls) == 10


def test_step_record_rows_and_epoch_means():
    """Per-step rows from device tensors (one synchronisation), epoch means from them; rank 0 only logs."""
    import torch

    from hamo_ray.training.record import StepRecord

    record = StepRecord(total_steps=5, desc="train t", rank=0, world=2)
    record.begin()
    losses = [3.0, 2.0, 1.0, 1.5, 0.5]
    for i, loss in enumerate(losses):
        record.step(torch.tensor(loss, requires_grad=True) * 1.0, lr=1e-3 * (i + 1), tokens=100)
        if i in (2, 4):
            record.end_epoch()
    rows = record.rows()
    assert [r["loss"] for r in rows] == losses
    assert [r["lr"] for r in rows] == pytest.approx([1e-3, 2e-3, 3e-3, 4e-3, 5e-3])
    assert all(math.isfinite(r["tokens_per_s"]) and r["tokens_per_s"] > 0 for r in rows)
    assert record.epoch_losses(rows) == pytest.approx([2.0, 1.0])
    assert sum(record.tokens) == 1000  # rank 0's tokens x world


def test_ray_trains_repeated_cleaner_warning_shows_once():
    """A private Ray's workers show Ray Train's every-second cleaner warning once, with the reason."""
    import importlib
    import inspect
    import logging

    from hamo_ray.logs import REPEATED_WARNINGS, FirstOnly, ray_worker_setup

    # Imported, not skipped: if a Ray upgrade moves this module, hamo_ray.logs.REPEATED_WARNINGS names a
    # logger that no longer exists and the filter silently does nothing, so this test must fail.
    cleaner = importlib.import_module("ray.train.v2._internal.execution.controller.placement_group_cleaner")
    ((prefix, _note),) = [REPEATED_WARNINGS[cleaner.logger.name]]  # the installed Ray's own logger
    # ... and its own words: a Ray upgrade that changes them fails here
    assert prefix in inspect.getsource(cleaner)
    ray_worker_setup()
    ray_worker_setup()  # idempotent: one filter
    log = logging.getLogger(cleaner.logger.name)
    assert sum(isinstance(f, FirstOnly) for f in log.filters) == 1
    seen: list[str] = []  # a handler of its own: Ray's loggers do not propagate to pytest's
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    log.addHandler(handler)
    try:
        for _ in range(5):
            log.warning("%s. State API may be temporarily unavailable. Continuing to monitor.", prefix)
        log.warning("Failed to remove placement group")  # any other warning passes
    finally:  # leave the process's logging as it was
        log.removeHandler(handler)
        for f in [f for f in log.filters if isinstance(f, FirstOnly)]:
            log.removeFilter(f)
    assert len(seen) == 2 and seen[1] == "Failed to remove placement group"
    assert seen[0].startswith(prefix) and "repeats of this warning are hidden" in seen[0]
