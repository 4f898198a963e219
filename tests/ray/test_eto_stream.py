"""ETO end to end on the shared training loop: BC, exploration and DPO on one kept worker group.

A 2-stage tiny stream with ``method.name=eto``: each stage trains the BC adapter, explores the stage's
tasks with it, and trains DPO on (expert, failure) pairs on the same training workers (the group the
stream keeps across stages, shut down when the run ends).

    flock /tmp/hamo-ray-tests.lock bash scripts/test.sh tests/ray/test_eto_stream.py -q
"""

from __future__ import annotations

import logging
import math

import pytest

from hamo_ray.config import load_config
from hamo_ray.run.stream import Stream

OVERRIDES = [
    "method.name=eto",
    "backbone.per_task=6",
    "backbone.epochs=2",
    "protocol.train_per_task=4",
    "protocol.test_per_task=1",
    "env.max_turns=6",
    "rollout.num_workers=2",
    "rollout.envs_per_worker=2",
    "train.epochs=1",
    "serve.port=18473",
    "serve.app_name=hamo-eto-test",
]


@pytest.mark.slow  # ~3 min: bash scripts/test.sh -m slow tests/ray/test_eto_stream.py
def test_eto_stream_trains_dpo_on_kept_workers(ray_session, tmp_path, caplog):
    cfg = load_config(
        "jobs/configs/tiny.yaml",
        [*OVERRIDES, f"run.root={tmp_path}", "run.id=e", f"backbone.cache_dir={tmp_path / 'backbones'}"],
    )
    stream = Stream(cfg)
    with caplog.at_level(logging.INFO):
        results = stream.run()
    assert [r.stage for r in results] == [1, 2]
    messages = [r.getMessage() for r in caplog.records]
    pairs = [m for m in messages if m.startswith("eto: ")]
    assert len(pairs) == 2, messages[-20:]
    assert any(not m.startswith("eto: 0 ") for m in pairs), pairs  # DPO trained at least once
    for stage in (1, 2):
        assert (tmp_path / "e" / "adapters" / f"stage-{stage}" / "adapter_model.safetensors").exists()
    assert stream.train_group.group is None  # the kept workers were stopped with the run
    # Per-step figures of both losses in the run's TensorBoard events, each counted on across stages.
    from hamo_ray.run.tracking import read_scalars

    scalars = read_scalars(tmp_path / "e" / "tensorboard")
    assert len(scalars["train/loss"]) > 1
    for tag in ("train/loss", "dpo/loss", "dpo/lr", "dpo/tokens_per_s"):
        points = sorted(scalars[tag])
        assert points and [s for s, _ in points] == list(range(len(points))), tag
        assert all(math.isfinite(v) for _, v in points), tag
