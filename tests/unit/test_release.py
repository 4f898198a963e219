"""Step 6, release by internalisation: a card goes when the trained model solves its task without cards."""

from __future__ import annotations

import pytest

from hamo_ray.config import load_config
from hamo_ray.evaluation.faults import StageFailed
from hamo_ray.memory import release_internalised
from hamo_ray.run.acting import release
from hamo_ray.run.context import StageContext
from hamo_ray.run.folder import RunFolder
from hamo_ray.run.resources import SEED_PURPOSES, stage_seed
from hamo_ray.run.tracking import stage_scalars
from hamo_ray.types import StageResult, TaskSpec, Trajectory


class FakeStore:
    """``release(ids) -> int`` recording the ids, counting only those not released before."""

    def __init__(self) -> None:
        self.released: list[str] = []

    def release(self, ids) -> int:
        new = [i for i in dict.fromkeys(ids) if i not in self.released]
        self.released += new
        return len(new)


def _task(i: int, domain: str = "scienceworld") -> TaskSpec:
    return TaskSpec(domain=domain, task="find-living-thing", variation=i)


def _traj(
    task: TaskSpec, score: float = 100.0, source: str = "policy", error: str | None = None
) -> Trajectory:
    return Trajectory(
        task=task, goal="g", init_obs="o", actions=["look"], observations=["room"], score=score, source=source,
        error=error,
    )  # fmt: skip


def _anchors(n: int, domain: str = "scienceworld") -> list[Trajectory]:
    return [_traj(_task(i, domain), source="expert") for i in range(n)]


def _mcfg(threshold: float = 100.0):
    return load_config("jobs/configs/tiny.yaml", [f"memory.release_min_score={threshold}"]).memory


def test_released_iff_replay_reaches_the_threshold():
    anchors, store = _anchors(4), FakeStore()
    replays = [_traj(a.task, s) for a, s in zip(anchors, (100.0, 79.0, 80.0, 0.0), strict=True)]
    ids = release_internalised(store, anchors, list(reversed(replays)), _mcfg(80.0))  # matched by task id
    assert ids == [anchors[0].card_id, anchors[2].card_id]  # anchor order
    assert store.released == ids


def test_failed_replays_and_anchors_without_replay_keep_their_card():
    anchors, store = _anchors(4), FakeStore()
    replays = [
        _traj(anchors[0].task, 100.0, error="TimeoutError: no reply"),  # an error never counts as solved
        _traj(anchors[1].task, 100.0),
        _traj(anchors[2].task, 100.0),
        _traj(anchors[2].task, 50.0),  # two replays of one task: every one must be solved
    ]  # anchors[3] has no replay
    assert release_internalised(store, anchors, replays, _mcfg()) == [anchors[1].card_id]
    assert store.released == [anchors[1].card_id]


def test_a_replay_of_no_anchor_is_refused():
    anchors, store = _anchors(2), FakeStore()
    stray = _traj(_task(7), 100.0)
    with pytest.raises(ValueError, match="scienceworld/find-living-thing/train/7.*no anchor"):
        release_internalised(store, anchors, [_traj(anchors[0].task), stray], _mcfg())
    assert store.released == []  # nothing released on a mismatch


def _result(stage: int = 1, **extra) -> StageResult:
    return StageResult(
        stage=stage, method="hamo_release", num_trajectories=1, num_cards=1, budget=1, anchors=[], replay=[],
        adapter=None, adapter_name=None, train_loss=None, scores={"scienceworld": 10.0}, seconds={}, **extra,
    )  # fmt: skip


def test_stage_result_release_fields_round_trip_state_json(tmp_path):
    figures = {"replayed": 4.0, "released": 2.0, "replay_failed": 0.0, "replay_mean_score": 62.5,
               "followup_checked": 3.0, "followup_solved": 1.0}  # fmt: skip
    result = _result(release=figures, released=["card-a", "card-b"])
    assert StageResult.model_validate_json(result.model_dump_json()) == result
    cfg = load_config(
        "jobs/configs/tiny.yaml", [f"run.root={tmp_path}", "run.id=r", "method.name=hamo_release"]
    )
    folder = RunFolder(tmp_path / "r", cfg)
    folder.prepare()
    folder.commit(result)
    (back,) = RunFolder(tmp_path / "r", cfg).prepare()
    assert back.release == figures and back.released == ["card-a", "card-b"]


def test_old_stage_results_without_release_fields_load():
    old = _result().model_dump(mode="json")
    del old["release"], old["released"]
    loaded = StageResult.model_validate(old)
    assert loaded.release == {} and loaded.released == []


def test_stage_scalars_include_the_release_figures():
    values = stage_scalars(_result(release={"replayed": 4.0, "followup_solved": 1.0}))
    assert values["release/replayed"] == 4.0 and values["release/followup_solved"] == 1.0
    assert not any(k.startswith("release/") for k in stage_scalars(_result()))


def test_release_seed_is_its_own_purpose():
    assert "release" in SEED_PURPOSES
    others = {stage_seed(0, 2, p) for p in SEED_PURPOSES if p != "release"}
    assert stage_seed(0, 2, "release") not in others


# -- stage.release with a fake endpoint, pool and run folder ------------------------------------------


class FakeEndpoint:
    def __init__(self) -> None:
        self.calls: list[tuple[str, dict]] = []

    def spec(self, model, cfg, *, seed, retrieval=False):
        self.calls.append((model, {"seed": seed, "retrieval": retrieval}))
        return f"spec:{model}"


class FakePool:
    """Plays each task with a fixed score per task id (100 when not listed, None: an error); records runs."""

    def __init__(self, domain: str, scores: dict[str, float | None], runs: list) -> None:
        self.domain, self.scores, self.runs = domain, scores, runs

    def run(self, tasks, spec, desc=""):
        self.runs.append((self.domain, [t.id for t in tasks], spec))
        return [self._play(t) for t in tasks]

    def _play(self, task: TaskSpec) -> Trajectory:
        score = self.scores.get(task.id, 100.0)
        return _traj(task, 0.0, error="RuntimeError: env died") if score is None else _traj(task, score)


class FakeFolder:
    def __init__(self, trajectories: dict[int, list[Trajectory]]) -> None:
        self.trajectories = trajectories

    def load_trajectories(self, stage):
        return self.trajectories.get(stage)


def _context(tmp_path, scores, trajectories, *overrides):
    runs = []  # no validation, no Ray: only what release uses
    ctx = StageContext(
        cfg=load_config(
            "jobs/configs/tiny.yaml", [f"run.root={tmp_path}", "method.name=hamo_release", *overrides]
        ),
        folder=FakeFolder(trajectories),
        pools=lambda domain: FakePool(domain, scores, runs),
        endpoint=FakeEndpoint(),
    )
    return ctx, runs


def test_release_replays_without_cards_and_follows_up_the_previous_stage(tmp_path):
    earlier = [_traj(_task(10 + i), source="expert") for i in range(3)]
    anchors = _anchors(3)
    prev = _result(1, released=[earlier[0].card_id, earlier[1].card_id])  # earlier[2] was not released
    scores = {anchors[1].task.id: 40.0, anchors[2].task.id: None, earlier[1].task.id: 30.0}
    # By default a replay lost to a fault fails the stage (it would release fewer cards than a clean run)
    ctx, runs = _context(tmp_path, scores, {1: earlier})
    with pytest.raises(StageFailed, match="release replay.*1 of 5 episodes lost"):
        release(ctx, 2, "scienceworld", anchors, FakeStore(), "stage-2", [_result(0), prev])
    assert [len(tids) for _, tids, _ in runs] == [5, 1, 1]  # the lost one was played twice more
    # within eval.max_failed_fraction, it is counted (replay_failed) and releases nothing
    ctx, runs = _context(tmp_path, scores, {1: earlier}, "eval.max_failed_fraction=0.25", "eval.retries=0")
    store = FakeStore()
    ids, figures = release(ctx, 2, "scienceworld", anchors, store, "stage-2", [_result(0), prev])

    seed = stage_seed(ctx.cfg.run.seed, 2, "release")
    assert ctx.endpoint.calls == [("stage-2", {"seed": seed, "retrieval": False})]  # no cards at all
    # one rollout: the anchors' tasks, then the previous stage's released ones (earlier[2] is not replayed)
    replayed = [a.task.id for a in anchors] + [earlier[0].task.id, earlier[1].task.id]
    assert runs == [("scienceworld", replayed, "spec:stage-2")]
    assert ids == store.released == [anchors[0].card_id]
    assert figures == {
        "replayed": 3.0, "released": 1.0, "replay_failed": 1.0, "replay_mean_score": 70.0,
        "followup_checked": 2.0, "followup_solved": 1.0,
    }  # fmt: skip


def test_release_first_stage_and_cross_domain_follow_up(tmp_path):
    anchors = _anchors(2, "alfworld")
    ctx, runs = _context(tmp_path, {}, {})
    ids, figures = release(ctx, 1, "alfworld", anchors, FakeStore(), "stage-1", [])
    assert len(ids) == 2 and figures["followup_checked"] == 0.0 and len(runs) == 1  # nothing to follow up

    earlier = _anchors(2)  # stage 1 was ScienceWorld: its tasks go to that domain's pool
    ctx, runs = _context(tmp_path, {}, {1: earlier})
    prev = _result(1, released=[t.card_id for t in earlier])
    ids, figures = release(ctx, 2, "alfworld", anchors, FakeStore(), "stage-2", [prev])
    assert sorted((d, len(tids)) for d, tids, _ in runs) == [("alfworld", 2), ("scienceworld", 2)]
    assert all(task.startswith(d) for d, tids, _ in runs for task in tids)
    assert figures["followup_checked"] == figures["followup_solved"] == 2.0 and len(ids) == 2
