"""Seeds: every (run seed, stage, purpose) draws anew; the methods of one seed share each stage's draws."""

from __future__ import annotations

import pytest

from hamo_ray.rollout.worker import turn_seed
from hamo_ray.steps import SEED_PURPOSES, stage_seed
from hamo_ray.types import TaskSpec


def test_stage_seeds_are_distinct_for_every_seed_stage_and_purpose():
    seeds = {(r, s, p): stage_seed(r, s, p) for r in range(5) for s in range(6) for p in SEED_PURPOSES}
    assert len(set(seeds.values())) == len(seeds)
    # run.seed + stage made seed 0 stage 2 train like seed 1 stage 1: no longer.
    assert stage_seed(0, 2, "train") != stage_seed(1, 1, "train")
    assert stage_seed(3, 1, "evaluate") == stage_seed(3, 1, "evaluate")  # the same for every method
    with pytest.raises(ValueError, match="purpose"):
        stage_seed(0, 1, "sampling")


def testturn_seeds_differ_across_stages_and_episodes():
    task, other = TaskSpec(domain="d", task="x", variation=0), TaskSpec(domain="d", task="x", variation=1)
    s1, s2 = stage_seed(0, 1, "evaluate"), stage_seed(0, 2, "evaluate")
    draws = {turn_seed(s, t, turn) for s in (s1, s2) for t in (task, other) for turn in range(3)}
    assert len(draws) == 12
    assert turn_seed(None, task, 0) is None
