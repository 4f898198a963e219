"""ETO's (success, failure) pairs from expert and explored trajectories."""

from __future__ import annotations

from hamo_ray.training.dpo import build_pairs
from hamo_ray.types import TaskSpec, Trajectory


def _traj(variation: int, score: float, source: str, error: str | None = None) -> Trajectory:
    return Trajectory(
        task=TaskSpec(domain="d", task="t", variation=variation),
        goal="g",
        init_obs="o",
        actions=[] if error else ["a"],
        observations=[] if error else ["b"],
        score=score,
        source=source,
        error=error,
    )


def test_pairs_only_where_the_agent_did_worse():
    expert = [
        _traj(0, 100, "expert"),
        _traj(1, 100, "expert"),
        _traj(2, 100, "expert"),
        _traj(3, 100, "expert"),
    ]
    explored = [
        _traj(0, 30, "policy"),
        _traj(1, 100, "policy"),
        _traj(2, 0, "policy", error="boom"),
        _traj(9, 0, "policy"),
    ]
    pairs = build_pairs(expert, explored)
    assert [(c.task.variation, r.task.variation, r.score) for c, r in pairs] == [(0, 0, 30)]
    assert pairs[0][0].source == "expert"
