"""Seeds: every (run seed, stage, purpose) draws anew; the methods of one seed share each stage's draws."""

from __future__ import annotations

import pytest

from hamo_ray.rollout.worker import turn_seed
from hamo_ray.run.resources import SEED_PURPOSES, stage_seed
from hamo_ray.types import TaskSpec


def test_stage_seeds_are_distinct_for_every_seed_stage_and_purpose():
    seeds = {(r, s, p): stage_seed(r, s, p) for r in range(5) for s in range(6) for p in SEED_PURPOSES}
    assert len(set(seeds.values())) == len(seeds)
    # run.seed + stage made seed 0 stage 2 train like seed 1 stage 1: no longer.
    assert stage_seed(0, 2, "train") != stage_seed(1, 1, "train")
    assert stage_seed(3, 1, "evaluate") == stage_seed(3, 1, "evaluate")  # the same for every method
    with pytest.raises(ValueError, match="purpose"):
        stage_seed(0, 1, "sampling")


# Pinned: a resumed run redraws a redone stage's seeds from these functions, and paired comparisons
# across methods and runs rely on them. A change to either function (its hash, its string, its mask)
# changes every run's sampling and must fail here, not pass because the function agrees with itself.
STAGE_SEEDS = {
    (0, 1, "evaluate"): 198597451,
    (0, 1, "train"): 437257941,
    (0, 2, "train"): 737680456,
    (1, 1, "train"): 225120918,
    (3, 2, "explore"): 1608898764,
    (7, 3, "dpo"): 2068190188,
    (42, 5, "release"): 635496756,
}


@pytest.mark.parametrize(("args", "seed"), list(STAGE_SEEDS.items()), ids=lambda v: str(v))
def test_stage_seed_values_are_pinned(args, seed):
    assert stage_seed(*args) == seed


def test_turn_seed_values_are_pinned():
    task = TaskSpec(domain="scienceworld", task="boil", variation=3, split="test")
    assert task.id == "scienceworld/boil/test/3"  # the string the turn seed hashes
    assert turn_seed(198597451, task, 0) == 232452712
    assert turn_seed(198597451, task, 5) == 2108688103
    assert turn_seed(12345, task, 0) == 222467109


def test_turn_seeds_differ_across_stages_and_episodes():
    task, other = TaskSpec(domain="d", task="x", variation=0), TaskSpec(domain="d", task="x", variation=1)
    s1, s2 = stage_seed(0, 1, "evaluate"), stage_seed(0, 2, "evaluate")
    draws = {turn_seed(s, t, turn) for s in (s1, s2) for t in (task, other) for turn in range(3)}
    assert len(draws) == 12
    assert turn_seed(None, task, 0) is None


def test_select_and_replay_seed_through_stage_seed_unless_a_run_is_legacy(tmp_path):
    """protocol.seeds: new runs draw selection and replay from stage_seed; an old run (its saved config
    lacks the key) reads as legacy, keeps its draws on resume, and its exported cell is not stale under a
    config that pins legacy, but is under today's default."""
    import yaml

    from hamo_ray.config import HamoConfig, upgrade_saved_config
    from hamo_ray.run.folder import compared
    from hamo_ray.run.resources import process_seed
    from hamo_ray.sweep.export import stale_keys

    cfg = HamoConfig.model_validate({"run": {"seed": 2}})
    assert cfg.protocol.seeds == "stage"
    assert process_seed(cfg, 3, "select") == stage_seed(2, 3, "select") != 2003
    assert process_seed(cfg, 3, "replay") == stage_seed(2, 3, "replay") != process_seed(cfg, 3, "select")
    legacy = HamoConfig.model_validate({"run": {"seed": 2}, "protocol": {"seeds": "legacy"}})
    assert process_seed(legacy, 3, "select") == process_seed(legacy, 3, "replay") == 2003
    assert process_seed(legacy, 3, "train") == stage_seed(2, 3, "train")  # only select and replay
    old = cfg.model_dump(mode="json")
    del old["protocol"]["seeds"]
    assert upgrade_saved_config(old)["protocol"]["seeds"] == "legacy"
    assert compared("protocol", "seeds")  # a resume under another scheme is refused, not mixed
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(old))
    assert stale_keys(tmp_path, cfg) == ["protocol.seeds"]
    assert stale_keys(tmp_path, legacy) == []
