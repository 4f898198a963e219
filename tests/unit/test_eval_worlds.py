"""``protocol.eval_worlds``: with ``distinct`` no two evaluation episodes play one world."""

from __future__ import annotations

import pytest

from hamo_ray.config import ConfigError, load_config
from hamo_ray.envs import get_domain
from hamo_ray.memory.worlds import world_of_task
from hamo_ray.run.resources import TaskLists, distinct_worlds
from hamo_ray.types import TaskSpec

TYPES = "[lifespan-longest-lived,lifespan-shortest-lived,find-living-thing]"


def _lists(*overrides: str) -> TaskLists:
    cfg = load_config(None, [f"env.task_types={TYPES}", "protocol.test_per_task=4", *overrides])
    return TaskLists(cfg, {"scienceworld": get_domain("scienceworld", cfg.env)})


def test_all_takes_the_first_variations_so_the_lifespan_twins_share_their_worlds():
    test = _lists().test["scienceworld"]
    assert len(test) == 12
    longest = [t.variation for t in test if t.task == "lifespan-longest-lived"]
    shortest = [t.variation for t in test if t.task == "lifespan-shortest-lived"]
    assert longest == shortest  # the same 4 worlds twice
    assert len({world_of_task(t) for t in test}) == 8


def test_distinct_gives_every_episode_its_own_world_on_test_and_dev():
    lists = _lists("protocol.eval_worlds=distinct", "protocol.eval_seen=[scienceworld]")
    for column in ("scienceworld", "scienceworld@seen"):
        tasks = lists.test[column]
        assert len(tasks) == 12 and len({world_of_task(t) for t in tasks}) == 12, column
        assert [sum(t.task == tt for t in tasks) for tt in TYPES.strip("[]").split(",")] == [4, 4, 4]
    test = lists.test["scienceworld"]
    longest = [t.variation for t in test if t.task == "lifespan-longest-lived"]
    shortest = [t.variation for t in test if t.task == "lifespan-shortest-lived"]
    assert shortest == [v + 4 for v in longest]  # the next test variations: worlds no longest task plays
    # training tasks are never thinned
    assert lists.stages == _lists().stages


def test_distinct_worlds_stops_short_when_a_type_runs_out_of_worlds():
    a = [
        TaskSpec(domain="scienceworld", task="lifespan-longest-lived", variation=v, split="test")
        for v in (1, 2)
    ]
    b = [
        TaskSpec(domain="scienceworld", task="lifespan-shortest-lived", variation=v, split="test")
        for v in (1, 2, 3)
    ]
    assert [(t.task, t.variation) for t in distinct_worlds([a, b], 2)] == [
        ("lifespan-longest-lived", 1), ("lifespan-longest-lived", 2), ("lifespan-shortest-lived", 3)
    ]  # fmt: skip


def test_an_unknown_value_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match="eval_worlds"):
        load_config(None, ["protocol.eval_worlds=some"])


def test_a_domain_whose_worlds_need_a_reset_is_taken_as_with_all():
    """ALFWorld's worlds are rooms, told apart by the first observation: ``distinct`` cannot apply."""
    from hamo_ray.envs.alfworld.domain import AlfWorldDomain

    assert AlfWorldDomain.worlds_from_spec is False
    cfg = load_config(None, [f"env.task_types={TYPES}", "protocol.test_per_task=4"])
    sw = get_domain("scienceworld", cfg.env)
    sw.worlds_from_spec = False  # as ALFWorld's: no world known before a reset
    distinct = load_config(
        None, [f"env.task_types={TYPES}", "protocol.test_per_task=4", "protocol.eval_worlds=distinct"]
    )
    assert TaskLists(distinct, {"scienceworld": sw}).test == TaskLists(cfg, {"scienceworld": sw}).test
