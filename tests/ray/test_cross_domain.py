"""The tiny cross-domain stream S -> A -> W, end to end: a scores row per stage x domain."""

from __future__ import annotations

import csv
import json

import pytest

from hamo_ray.config import load_config
from hamo_ray.run.stream import Stream


@pytest.mark.timeout(1800)
@pytest.mark.slow  # ~4.5 min on 2 cores: bash scripts/test.sh -m slow tests/ray/test_cross_domain.py
def test_cross_domain_stream(ray_session, tmp_path):
    cfg = load_config(
        "jobs/configs/tiny-cross.yaml",
        [
            "protocol.train_per_task=2",
            "protocol.test_per_task=1",
            "env.max_turns=12",  # ALFWorld ends episodes at max_turns: its experts need room
            "backbone.per_task=3",
            "backbone.epochs=1",
            "train.epochs=1",
            "rollout.num_workers=1",
            "serve.port=18474",
            "serve.app_name=hamo-cross-test",
            f"run.root={tmp_path}",
            "run.id=x",
            f"backbone.cache_dir={tmp_path / 'backbones'}",
        ],
    )
    results = Stream(cfg).run()
    assert [(r.stage, r.domain) for r in results] == [(1, "scienceworld"), (2, "alfworld"), (3, "webshop")]
    with open(tmp_path / "x" / "results" / "scores.csv") as f:
        rows = [(r["stage"], r["domain"]) for r in csv.DictReader(f)]
    assert rows == [(str(s), d) for s in (1, 2, 3) for d in ("alfworld", "scienceworld", "webshop")]
    metrics = json.loads((tmp_path / "x" / "results" / "metrics.json").read_text())
    assert metrics["stage_domains"] == ["scienceworld", "alfworld", "webshop"]
    assert metrics["first_domain"] == "scienceworld" and len(metrics["retention"]) == 3
    assert metrics["backward_transfer"] is not None
