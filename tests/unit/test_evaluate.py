"""Stage step 7's bookkeeping: a prompt over the context is counted apart, never averaged in as a 0; an
episode lost to a fault is played again with the same task, and a stage that still lost episodes fails."""

from __future__ import annotations

import pytest

from hamo_ray.config import EvalConfig
from hamo_ray.evaluation.faults import StageFailed, fault_kind
from hamo_ray.rollout.client import PolicySpec
from hamo_ray.run.acting import evaluate
from hamo_ray.types import TaskSpec, Trajectory

SPEC = PolicySpec(base_url="http://127.0.0.1:9", model="base")  # no endpoint: no cache counters
TOO_LONG = (
    'RuntimeError: policy endpoint answered 400: {"error": {"message": "This model\'s maximum context '
    'length is 2048 tokens. However, your request has 2100 input tokens."}}'
)
DEAD = "RuntimeError: policy endpoint answered 500: EngineDeadError: EngineCore encountered an issue"


class _Pool:
    """Plays ``outcomes[task variation]`` in turn: each call of a task takes its next outcome."""

    def __init__(self, outcomes: dict[int, list[tuple[float, str | None]]]):
        self.outcomes = {v: list(o) for v, o in outcomes.items()}
        self.calls: list[list[int]] = []

    def run(self, tasks, spec, desc=""):
        self.calls.append([t.variation for t in tasks])
        out = []
        for t in tasks:
            score, error = self.outcomes[t.variation].pop(0)
            out.append(_traj(t.variation, score, error))
        return out


class _Folder:
    def __init__(self):
        self.saved = {}

    def save_episodes(self, stage, domain, trajs):
        self.saved[(stage, domain)] = trajs


def _task(v: int) -> TaskSpec:
    return TaskSpec(domain="scienceworld", task="x", variation=v)


def _traj(v: int, score: float, error: str | None = None) -> Trajectory:
    return Trajectory(task=_task(v), goal="g", init_obs="o", actions=["a"], observations=["b"], score=score,
                      source="policy", error=error)  # fmt: skip


def _evaluate(pool, n, ecfg=None, wait=None, folder=None):
    tasks = {"scienceworld": [_task(v) for v in range(n)]}
    return evaluate(lambda d: pool, folder or _Folder(), 1, tasks, SPEC, ecfg or EvalConfig(), wait)


def test_a_prompt_over_the_context_is_counted_apart_and_not_replayed():
    pool = _Pool({0: [(50.0, None)], 1: [(10.0, None)], 2: [(0.0, TOO_LONG)]})
    folder = _Folder()
    scores, stats = _evaluate(pool, 3, folder=folder)
    assert scores == {"scienceworld": 30.0}  # (50 + 10) / 2, not / 3
    assert stats["failed_episodes"] == 1 and stats["episodes"] == 3
    assert stats["failed/scienceworld"] == 1 and stats["episodes/scienceworld"] == 3
    assert "prefix_cache_hit_rate" not in stats
    assert pool.calls == [[0, 1, 2]]  # an outcome of the policy: a replay would fail the same way
    assert len(folder.saved[(1, "scienceworld")]) == 3  # every episode is saved, the failed one included


def test_faulted_episodes_are_played_again_after_the_endpoint_is_healthy():
    waits = []
    pool = _Pool(
        {0: [(50.0, None)], 1: [(0.0, DEAD), (0.0, DEAD), (20.0, None)], 2: [(0.0, DEAD), (30.0, None)]}
    )
    scores, stats = _evaluate(pool, 3, wait=lambda: waits.append(len(pool.calls)))
    assert pool.calls == [[0, 1, 2], [1, 2], [1]]  # only the lost ones, the same tasks (so the same seeds)
    assert waits == [1, 2]  # each replay waits for a healthy endpoint first
    assert scores == {"scienceworld": pytest.approx((50 + 20 + 30) / 3)}
    assert stats["failed_episodes"] == 0


def test_episodes_still_lost_fail_the_stage_naming_the_cause():
    pool = _Pool({0: [(50.0, None)], 1: [(0.0, DEAD)] * 3})
    folder = _Folder()
    with pytest.raises(
        StageFailed, match=r"1 of 2 episodes lost to faults.*engine died: 1.*max_failed_fraction=0"
    ):
        _evaluate(pool, 2, folder=folder)
    assert folder.saved == {}  # nothing of the failed stage is recorded as its evaluation
    # an allowance lets a share of them be left out (counted), as before
    pool = _Pool({0: [(50.0, None)], 1: [(0.0, DEAD)] * 3})
    scores, stats = _evaluate(pool, 2, EvalConfig(max_failed_fraction=0.5, retries=2))
    assert scores == {"scienceworld": 50.0} and stats["failed_episodes"] == 1
    # no replays at all: the first loss is final
    pool = _Pool({0: [(0.0, "httpx.ConnectError: [Errno 111] Connection refused")]})
    with pytest.raises(StageFailed, match="connection: 1"):
        _evaluate(pool, 1, EvalConfig(retries=0))
    assert pool.calls == [[0]]


@pytest.mark.parametrize(
    "error, kind",
    [
        (None, None),
        (TOO_LONG, None),
        (
            "RuntimeError: policy endpoint answered 400: The decoder prompt (length 600) is longer than the "
            "maximum model length of 512",
            None,
        ),  # fmt: skip
        (DEAD, "engine died"),
        ("RuntimeError: policy endpoint answered 503: engine unhealthy", "engine died"),
        ("ActorDiedError: The actor died unexpectedly", "rollout actor died"),
        ("ReadTimeout: timed out", "timeout"),
        ("EnvStepTimeout: step exceeded 60 s", "timeout"),
        ("ConnectError: [Errno 111] Connection refused", "connection"),
        ("RuntimeError: harness answered 500: boom", "harness"),
        ("Py4JNetworkError: An error occurred while trying to connect to the Java server", "connection"),
        ("KeyError: 'observation'", "environment or client error"),
    ],
)
def test_fault_kinds(error, kind):
    assert fault_kind(error) == kind


def test_the_cards_of_played_episodes_are_counted_injected_withheld_and_dropped():
    class _CardPool(_Pool):
        def run(self, tasks, spec, desc=""):
            return [
                t.model_copy(
                    update={"cards_used": ["c"] * t.task.variation, "cards_withheld": 1, "cards_dropped": 2}
                )
                for t in super().run(tasks, spec, desc)
            ]

    pool = _CardPool({0: [(50.0, None)], 1: [(10.0, None)], 2: [(0.0, TOO_LONG)], 3: [(0.0, None)]})
    _, stats = _evaluate(pool, 4)
    # the failed episode (variation 2) is not counted: its prompt never reached the model
    assert (stats["cards_injected"], stats["cards_withheld"], stats["cards_dropped"]) == (0 + 1 + 3, 3, 6)
