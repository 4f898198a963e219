"""The shared expert cache (``env.expert_cache``): runs on the same tasks read the trajectories the first
one played; other tasks or settings play again; a broken entry is replaced; parallel runs play once.

No Ray: ``play`` and ``_Pool`` stand for the pool (the real pool plays in tests/ray/test_sweep.py, marked slow)."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import pytest
import yaml

from hamo_ray.config import load_config
from hamo_ray.envs.expert_cache import cached_experts, entry_path, play_experts
from hamo_ray.sweep import expand_cells, load_sweep, stale_keys
from hamo_ray.types import TaskSpec, Trajectory

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "jobs" / "configs" / "tiny.yaml"
TASKS = [TaskSpec(domain="scienceworld", task="find-living-thing", variation=v) for v in (3, 7)]


def _cfg(tmp_path: Path, *over: str):
    return load_config(TINY, [f"env.expert_cache={tmp_path / 'experts'}", *over])


def _player(route: str, calls: list):
    def play() -> list[Trajectory]:
        calls.append(route)
        return [
            Trajectory(task=t, goal="find a living thing", init_obs="kitchen", actions=[f"go to {route}"],
                       observations=["ok"], score=100.0, done=True, source="expert")
            for t in TASKS
        ]  # fmt: skip

    return play


def test_a_second_run_on_the_same_tasks_reads_the_first_runs_experts(tmp_path):
    cfg, calls = _cfg(tmp_path), []
    first, hit = cached_experts(cfg, "scienceworld", TASKS, _player("kitchen", calls))
    assert not hit and calls == ["kitchen"]
    again, hit = cached_experts(cfg, "scienceworld", TASKS, _player("greenhouse", calls))
    assert hit and calls == ["kitchen"] and again == first  # the greenhouse replay never ran
    assert entry_path(cfg, "scienceworld", TASKS).parent == tmp_path / "experts"


@pytest.mark.parametrize(
    "change",
    [
        lambda cfg, tasks: (cfg, tasks[:1]),
        lambda cfg, tasks: (cfg, [tasks[0].model_copy(update={"variation": 4}), tasks[1]]),
        lambda cfg, tasks: (cfg, tasks[::-1]),
        lambda cfg, tasks: (
            cfg.model_copy(update={"env": cfg.env.model_copy(update={"max_turns": 9})}),
            tasks,
        ),
    ],
    ids=["fewer-tasks", "other-variation", "other-order", "other-max-turns"],
)
def test_other_tasks_or_settings_play_again(tmp_path, change):
    cfg, calls = _cfg(tmp_path), []
    cached_experts(cfg, "scienceworld", TASKS, _player("kitchen", calls))
    other_cfg, other_tasks = change(cfg, TASKS)
    assert entry_path(other_cfg, "scienceworld", other_tasks) != entry_path(cfg, "scienceworld", TASKS)
    _, hit = cached_experts(other_cfg, "scienceworld", other_tasks, _player("greenhouse", calls))
    assert not hit and calls == ["kitchen", "greenhouse"]


def test_the_domain_settings_are_part_of_the_key(tmp_path):
    cfg = _cfg(tmp_path)
    easy = entry_path(cfg, "scienceworld", TASKS)
    other = _cfg(tmp_path, "env.scienceworld.simplifications=teleportAction")
    assert entry_path(other, "scienceworld", TASKS) != easy
    assert entry_path(_cfg(tmp_path, "env.scienceworld.jvm_heap=2g"), "scienceworld", TASKS) != easy


def test_without_a_cache_every_run_plays(tmp_path):
    cfg, calls = load_config(TINY), []
    assert cfg.env.expert_cache is None and entry_path(cfg, "scienceworld", TASKS) is None
    for route in ("kitchen", "greenhouse"):
        assert cached_experts(cfg, "scienceworld", TASKS, _player(route, calls))[1] is False
    assert calls == ["kitchen", "greenhouse"] and not (tmp_path / "experts").exists()


@pytest.mark.parametrize("content", ["{not json\n", "", '{"task": 1}\n'], ids=["garbage", "empty", "invalid"])
def test_an_unreadable_entry_is_named_and_replaced(tmp_path, caplog, content):
    cfg, calls = _cfg(tmp_path), []
    path = entry_path(cfg, "scienceworld", TASKS)
    path.parent.mkdir(parents=True)
    path.write_text(content)
    with caplog.at_level(logging.WARNING, logger="hamo_ray.envs.expert_cache"):
        trajs, hit = cached_experts(cfg, "scienceworld", TASKS, _player("kitchen", calls))
    assert not hit and calls == ["kitchen"]
    assert any(str(path) in r.getMessage() for r in caplog.records)
    assert cached_experts(cfg, "scienceworld", TASKS, _player("greenhouse", calls)) == (trajs, True)


def test_a_failed_play_stores_nothing(tmp_path):
    cfg = _cfg(tmp_path)

    def fail():
        raise RuntimeError("stage 1: no usable expert trajectory")

    with pytest.raises(RuntimeError, match="no usable expert"):
        cached_experts(cfg, "scienceworld", TASKS, fail)
    assert not entry_path(cfg, "scienceworld", TASKS).exists()


def test_parallel_runs_on_the_same_tasks_play_once(tmp_path):
    cfg, calls, results = _cfg(tmp_path), [], []
    slow_play = _player("kitchen", calls)

    def play():
        time.sleep(0.3)  # the second run asks while the first still plays
        return slow_play()

    threads = [
        threading.Thread(target=lambda: results.append(cached_experts(cfg, "scienceworld", TASKS, play)))
        for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert calls == ["kitchen"]
    assert sorted(hit for _, hit in results) == [False, True] and results[0][0] == results[1][0]


def _sweep(tmp_path: Path, **keys):
    f = tmp_path / "sweep.yaml"
    data = {"base": str(TINY), "root": str(tmp_path / "runs"), "grid": {"method": ["base", "hamo"]}, **keys}
    f.write_text(yaml.safe_dump(data))
    return expand_cells(*load_sweep(f))


def test_a_sweeps_cells_share_one_cache_unless_told_otherwise(tmp_path):
    cells = _sweep(tmp_path)
    assert {cfg.env.expert_cache for _, cfg in cells} == {str(tmp_path / "runs" / "experts")}
    assert {cfg.env.expert_cache for _, cfg in _sweep(tmp_path, share_experts=False)} == {None}
    own = _sweep(tmp_path, overrides=[f"env.expert_cache={tmp_path / 'mine'}"])
    assert {cfg.env.expert_cache for _, cfg in own} == {str(tmp_path / "mine")}


def test_exports_made_before_the_cache_are_not_stale(tmp_path):
    """The committed SmolLM2 cells were exported without ``env.expert_cache``: they stay finished."""
    exported = next((ROOT / "results" / "smollm2-within" / "cells").glob("hamo-*-s0"))
    saved = yaml.safe_load((exported / "config.yaml").read_text())
    assert "expert_cache" not in saved["env"]
    sweep, base = load_sweep(ROOT / "jobs" / "configs" / "sweep-smollm2-within.yaml")
    (cfg,) = [c for name, c in expand_cells(sweep, base) if name == exported.name]
    assert cfg.env.expert_cache is not None
    assert stale_keys(exported, cfg) == []


class _Pool:
    def __init__(self, trajs):
        self.trajs, self.asked = trajs, []

    def run(self, tasks, spec, desc=""):
        self.asked.append((tasks, spec))
        return self.trajs


def test_play_experts_keeps_the_usable_episodes_and_raises_without_any(caplog):
    good = _player("kitchen", [])()[0]
    failed = good.model_copy(update={"error": "env crashed", "score": 0.0})
    unscored = good.model_copy(update={"score": 0.0})
    pool = _Pool([good, failed, unscored])
    with caplog.at_level(logging.WARNING, logger="hamo_ray.envs.expert_cache"):
        assert play_experts(pool, TASKS, 50, 1, "scienceworld") == [good]
    assert pool.asked == [(TASKS, None)]  # the expert plays (no policy)
    assert any("2 of 3 expert episodes failed or scored 0" in r.getMessage() for r in caplog.records)
    with pytest.raises(RuntimeError, match="stage 2: no usable expert trajectory"):
        play_experts(_Pool([failed, unscored]), TASKS, 50, 2, "scienceworld")
