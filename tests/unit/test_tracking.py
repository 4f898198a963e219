"""Tracking: TensorBoard event files written and read back; a missing backend is a named error."""

from __future__ import annotations

import math

import pytest

from hamo_ray.tracking import Tracker, check_backends, read_scalars


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
