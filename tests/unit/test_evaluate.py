"""Stage step 7's bookkeeping: a failed episode is counted apart, never averaged in as a 0."""

from __future__ import annotations

from hamo_ray.rollout.client import PolicySpec
from hamo_ray.stage import evaluate
from hamo_ray.types import TaskSpec, Trajectory


class _Pool:
    def __init__(self, trajs):
        self.trajs = trajs

    def run(self, tasks, spec, desc=""):
        return self.trajs


class _Folder:
    def __init__(self):
        self.saved = {}

    def save_episodes(self, stage, domain, trajs):
        self.saved[(stage, domain)] = trajs


def _traj(v: int, score: float, error: str | None = None) -> Trajectory:
    task = TaskSpec(domain="scienceworld", task="x", variation=v)
    return Trajectory(task=task, goal="g", init_obs="o", actions=["a"], observations=["b"], score=score,
                      source="policy", error=error)  # fmt: skip


def test_failed_episodes_are_left_out_of_the_score_and_counted():
    trajs = [
        _traj(0, 50.0),
        _traj(1, 10.0),
        _traj(2, 0.0, error="RuntimeError: policy endpoint answered 400"),
    ]
    folder = _Folder()
    spec = PolicySpec(base_url="http://127.0.0.1:9", model="base")  # no endpoint: no cache counters
    scores, stats = evaluate(lambda d: _Pool(trajs), folder, 1, {"scienceworld": trajs}, spec)
    assert scores == {"scienceworld": 30.0}  # (50 + 10) / 2, not / 3
    assert stats["failed_episodes"] == 1 and stats["episodes"] == 3
    assert stats["failed/scienceworld"] == 1 and stats["episodes/scienceworld"] == 3
    assert "prefix_cache_hit_rate" not in stats
    assert len(folder.saved[(1, "scienceworld")]) == 3  # every episode is saved, the failed one included
    all_failed = [_traj(0, 0.0, error="x")]
    scores, stats = evaluate(lambda d: _Pool(all_failed), folder, 1, {"scienceworld": all_failed}, spec)
    assert scores == {"scienceworld": 0.0} and stats["failed_episodes"] == 1
