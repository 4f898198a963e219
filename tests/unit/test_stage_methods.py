"""One stage of every method preset, in process: which steps ran, with what (no Ray, no model).

``stage.run_stage`` drives stage 2 (stage 1 committed) against fakes of the rollout pools, the
services (publishing), the trainer, the tracker and the memory store; the endpoint is a real
``runtime.Endpoint`` (it only builds the rollout specs) on an address nothing listens on. The real
components keep their own tests (tests/ray: streams, training, serving; tests/unit: selection,
release, evaluation, memory).
"""

from __future__ import annotations

import typing
import zlib
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import pytest

from hamo_ray.config import MethodConfig, load_config
from hamo_ray.memory.distill import card_from_trajectory
from hamo_ray.memory.pipeline import WriteReport
from hamo_ray.rollout.client import PolicySpec
from hamo_ray.run import stage as stage_mod
from hamo_ray.run.folder import RunFolder
from hamo_ray.run.resources import stage_seed
from hamo_ray.run.services import Endpoint
from hamo_ray.run.stage import StageContext, initial_stage, run_stage
from hamo_ray.training.contracts import TrainResult
from hamo_ray.types import StageResult, TaskSpec, Trajectory

DOMAIN = "scienceworld"
TYPES = ("find-living-thing", "lifespan-longest-lived")

# What each preset is meant to do at a stage (docs/method.md): trains an adapter, injects cards into
# the training examples, selects anchors by coverage (else all trajectories), replays earlier anchors,
# runs ETO's exploration + DPO, releases internalised cards, injects cards at evaluation.
EXPECTED = {
    "hamo": dict(train=1, cards=1, selection=1, replay=1, dpo=0, release=0, retrieval=1),
    "base": dict(train=0, cards=0, selection=0, replay=0, dpo=0, release=0, retrieval=0),
    "harness": dict(train=0, cards=0, selection=0, replay=0, dpo=0, release=0, retrieval=1),
    "model_only": dict(train=1, cards=0, selection=1, replay=1, dpo=0, release=0, retrieval=0),
    "agenttuning": dict(train=1, cards=0, selection=0, replay=0, dpo=0, release=0, retrieval=0),
    "eto": dict(train=1, cards=0, selection=0, replay=0, dpo=1, release=0, retrieval=0),
    "hamo_no_selection": dict(train=1, cards=1, selection=0, replay=1, dpo=0, release=0, retrieval=1),
    "hamo_no_replay": dict(train=1, cards=1, selection=1, replay=0, dpo=0, release=0, retrieval=1),
    "hamo_no_conditioning": dict(train=1, cards=0, selection=1, replay=1, dpo=0, release=0, retrieval=1),
    "hamo_release": dict(train=1, cards=1, selection=1, replay=1, dpo=0, release=1, retrieval=1),
}


def test_every_preset_has_an_expectation():
    assert set(typing.get_args(MethodConfig.model_fields["name"].annotation)) == set(EXPECTED)


# -- fakes ------------------------------------------------------------------------------------------
def _tasks(variations, split: str = "train") -> list[TaskSpec]:
    return [TaskSpec(domain=DOMAIN, task=tt, variation=v, split=split) for tt in TYPES for v in variations]


def _episode(task: TaskSpec, spec: PolicySpec | None) -> Trajectory:
    """Experts solve everything; the BC adapter explores and fails (ETO's pairs); other policy episodes
    solve the first task type (released when replayed without cards) and score 50 on the second."""
    if spec is None:
        score, source = 100.0, "expert"
    elif spec.model.endswith("-bc"):
        score, source = 0.0, "policy"
    else:
        score, source = (100.0 if task.task == TYPES[0] else 50.0), "policy"
    return Trajectory(
        task=task, goal=f"goal {task.id}", init_obs="a room", actions=["look", "act"], observations=["o", "p"],
        score=score, done=True, source=source, model=None if spec is None else spec.model,
    )  # fmt: skip


@dataclass
class Run:
    domain: str
    task_ids: list[str]
    spec: PolicySpec | None
    desc: str


class FakePool:
    def __init__(self, domain: str, runs: list[Run]) -> None:
        self.domain, self.runs = domain, runs

    def run(self, tasks, spec, desc=""):
        self.runs.append(Run(self.domain, [t.id for t in tasks], spec, desc))
        return [_episode(t, spec) for t in tasks]


class FakeStore:
    """The memory: cards with vectors clustered by task type (so coverage selection cuts early)."""

    def __init__(self) -> None:
        self.cards, self.vecs, self.released = {}, {}, []

    def add(self, trajs, stage: int) -> int:
        new = [t for t in trajs if t.card_id not in self.cards]
        for t in new:
            self.cards[t.card_id] = card_from_trajectory(t, stage, f"outline of {t.task.id}")
            v = np.zeros(8)
            v[TYPES.index(t.task.task)] = 1.0
            v += 0.01 * np.random.default_rng(zlib.crc32(t.card_id.encode())).normal(size=8)
            self.vecs[t.card_id] = v / np.linalg.norm(v)
        return len(new)

    def count(self, include_released: bool = True) -> int:
        return len(self.cards)

    def vectors(self, ids, column="vector"):
        return np.stack([self.vecs[i] for i in ids])

    def search(self, queries, k, exclude_ids=None, max_stage=None):
        out = []
        for n, q in enumerate(np.atleast_2d(queries)):
            hits = [
                (c, float(self.vecs[c.id] @ q))
                for c in self.cards.values()
                if c.id not in self.released
                and (max_stage is None or c.stage <= max_stage)
                and (exclude_ids is None or c.id not in exclude_ids[n])
            ]
            out.append(sorted(hits, key=lambda h: (-h[1], h[0].id))[:k])
        return out

    def release(self, ids) -> int:
        new = [i for i in dict.fromkeys(ids) if i not in self.released]
        self.released += new
        return len(new)


class Folder(RunFolder):
    """A real run folder (trajectories, episodes, anchors) whose memory is the fake store."""

    def __init__(self, path, cfg, store: FakeStore) -> None:
        super().__init__(path, cfg)
        self.fake_store = store

    def store(self, cfg):
        return self.fake_store


@dataclass
class FakeServices:
    published: list[tuple[str, str]] = field(default_factory=list)

    def adapter_name(self, stage: int, tag: str = "", digest: str = "") -> str:
        assert len(digest) == 64  # publish names the adapter's content (its folder's sha256)
        return f"stage-{stage}{tag}"

    def publish(self, name: str, adapter) -> dict:
        self.published.append((name, str(adapter)))
        return {}


def _train_result(out_dir, loss: float) -> TrainResult:
    rows = [{"loss": loss, "lr": 1e-3, "tokens_per_s": 10.0}]
    return TrainResult(
        str(out_dir), loss, [loss], tokens=20, seconds=0.1, padding=0.0, steps=1, step_metrics=rows
    )


@dataclass
class FakeTrainer:
    bc_calls: list[dict] = field(default_factory=list)
    dpo_calls: list[dict] = field(default_factory=list)
    pairs: list = field(default_factory=list)

    def bc(self, batch, cards, out_dir, *, init_adapter, seed, name):
        self.bc_calls.append(
            dict(batch=list(batch), cards=cards, out_dir=out_dir, init=init_adapter, seed=seed)
        )
        return _train_result(out_dir, 1.5)

    def encode_pairs(self, pairs):
        self.pairs = list(pairs)
        return list(pairs)

    def dpo(self, pairs, init_adapter, out_dir, *, seed, name):
        self.dpo_calls.append(dict(pairs=pairs, init=init_adapter, out_dir=out_dir, seed=seed, name=name))
        return _train_result(out_dir, 0.5)


@dataclass
class FakeTracker:
    sections: list[str] = field(default_factory=list)

    def log_steps(self, rows, section: str = "train") -> None:
        self.sections.append(section)


def _world(tmp_path, monkeypatch, method: str):
    """Stage 1 committed (its trajectories stored, its cards in memory, four anchors, two released)."""
    cfg = load_config("jobs/configs/tiny.yaml", [f"run.root={tmp_path}", "run.id=r", f"method.name={method}"])
    m, store, runs = cfg.method, FakeStore(), []
    monkeypatch.setattr(
        stage_mod, "add_stage_cards", lambda st, trajs, stage, mcfg: WriteReport(added=st.add(trajs, stage))
    )
    folder = Folder(tmp_path / "r", cfg, store)
    first = [_episode(t, None) for t in _tasks(range(6))]
    folder.save_trajectories(1, first)
    if m.uses_memory:
        store.add(first, 1)
    anchors = [first[0], first[1], first[6], first[7]]
    done = [
        StageResult(
            stage=1, method=method, domain=DOMAIN, num_trajectories=len(first), num_cards=store.count(), budget=4,
            anchors=[t.id for t in anchors], replay=[], adapter="adapters/stage-1" if m.train else None,
            adapter_name="stage-1" if m.train else None, train_loss=1.0 if m.train else None,
            scores={DOMAIN: 50.0}, seconds={}, released=[first[0].card_id, first[6].card_id] if m.release else [],
        )
    ]  # fmt: skip
    ctx = StageContext(
        cfg=cfg, folder=folder, pools=lambda domain: FakePool(domain, runs),
        endpoint=Endpoint("http://127.0.0.1:9", harness_url="http://127.0.0.1:9/harness"),
        services=FakeServices(), trainer=FakeTrainer(), tracker=FakeTracker(),
        tasks=SimpleNamespace(stages=[_tasks(range(6)), _tasks(range(6, 12))], test={DOMAIN: _tasks(range(2), "test")}),
    )  # fmt: skip
    return SimpleNamespace(cfg=cfg, ctx=ctx, store=store, runs=runs, done=done, first=first, anchors=anchors)


# -- the test ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", list(EXPECTED))
def test_one_stage_of_each_method_runs_its_steps(tmp_path, monkeypatch, method):
    w = _world(tmp_path, monkeypatch, method)
    want, cfg, ctx = EXPECTED[method], w.cfg, w.ctx
    trainer, services, runs = ctx.trainer, ctx.services, w.runs

    result = run_stage(ctx, 2, DOMAIN, w.done)

    # 1. collect: the stage's tasks played by the experts, stored
    expert_runs = [r for r in runs if r.spec is None]
    stage_tasks = [t.id for t in _tasks(range(6, 12))]
    assert [r.task_ids for r in expert_runs] == [stage_tasks]
    trajs = w.ctx.folder.load_trajectories(2)
    assert [t.task.id for t in trajs] == stage_tasks and result.num_trajectories == 12
    # 2. distil: the stage's cards into the memory (methods with memory only)
    if cfg.method.uses_memory:
        assert result.distil["cards_added"] == 12 and result.num_cards == 24
    else:
        assert result.distil == {} and result.num_cards == 0
    # 3. select: a coverage cut, or every trajectory an anchor
    if want["selection"]:
        assert 0 < result.budget < 12 and len(result.anchors) == result.budget
    else:
        assert result.anchors == [t.id for t in trajs] and result.budget == 12
    # 4. replay: earlier anchors (only for training methods with replay)
    earlier = {t.id for t in w.anchors}
    if want["replay"]:
        assert result.replay and set(result.replay) <= earlier
    else:
        assert result.replay == []
    # 5. train: one BC run on anchors + replay, from the previous adapter, cards or none
    assert len(trainer.bc_calls) == want["train"]
    if want["train"]:
        call = trainer.bc_calls[0]
        assert [t.id for t in call["batch"]] == result.anchors + result.replay
        assert call["init"] == ctx.folder.path / "adapters" / "stage-1"
        assert call["seed"] == stage_seed(cfg.run.seed, 2, "train")
        if want["cards"]:
            assert set(call["cards"]) == {t.id for t in call["batch"]}
            for t in call["batch"]:
                cards = call["cards"][t.id]
                assert len(cards) == cfg.memory.top_k and t.card_id not in {c.id for c in cards}
        else:
            assert call["cards"] == {}
    # ETO: the BC adapter explores the stage's tasks, DPO on the (expert, failure) pairs
    explored = [r for r in runs if r.spec is not None and r.spec.model.endswith("-bc")]
    assert len(trainer.dpo_calls) == len(explored) == want["dpo"]
    if want["dpo"]:
        assert explored[0].task_ids == stage_tasks and explored[0].desc == "stage 2 ETO exploration"
        assert explored[0].spec.seed == stage_seed(cfg.run.seed, 2, "explore")
        assert len(trainer.pairs) == 12
        dpo = trainer.dpo_calls[0]
        assert dpo["init"] == ctx.folder.path / "adapters" / "stage-2-bc"
        assert dpo["seed"] == stage_seed(cfg.run.seed, 2, "dpo")
        assert result.train_loss == 0.5  # the DPO adapter is the stage's
    assert ctx.tracker.sections == ["train"] * want["train"] + ["dpo"] * want["dpo"]
    # 6. publish: by the one step, once per adapter trained (ETO: its BC adapter, then the DPO one)
    if want["train"]:
        bc = [("stage-2-bc", "adapters/stage-2-bc")] if want["dpo"] else []
        assert services.published == [*bc, ("stage-2", "adapters/stage-2")]
        assert (result.adapter, result.adapter_name) == ("adapters/stage-2", "stage-2")
    else:
        assert services.published == [] and result.adapter is None and result.adapter_name is None
        assert result.train_loss is None
    # release: the anchors replayed by the new adapter without any card, plus stage 1's released tasks
    replays = [r for r in runs if r.desc.startswith("stage 2 release replay")]
    assert len(replays) == want["release"]
    if want["release"]:
        (replay,) = replays
        assert replay.spec.harness_url is None and replay.spec.model == "stage-2"
        anchor_tasks = [t.task.id for t in trajs if t.id in set(result.anchors)]
        assert sorted(replay.task_ids) == sorted(anchor_tasks + [w.first[0].task.id, w.first[6].task.id])
        solved = [t.card_id for t in trajs if t.id in set(result.anchors) and t.task.task == TYPES[0]]
        assert solved and sorted(result.released) == sorted(solved) and w.store.released == result.released
        assert result.release["followup_checked"] == 2.0 and result.release["followup_solved"] == 1.0
    else:
        assert result.released == [] and result.release == {} and w.store.released == []
    # 7. evaluate: the stage's adapter (or the base model), cards injected with retrieval only
    (evaluation,) = [r for r in runs if "evaluation" in r.desc]
    assert evaluation.spec.model == ("stage-2" if want["train"] else "base")
    assert (evaluation.spec.harness_url is not None) == bool(want["retrieval"])
    assert evaluation.spec.seed == stage_seed(cfg.run.seed, 2, "evaluate")
    assert result.scores == {DOMAIN: 75.0} and result.evaluation["episodes"] == 4
    assert len((ctx.folder.path / "episodes" / f"stage-2-{DOMAIN}.jsonl").read_text().splitlines()) == 4
    # every step timed, and only the steps that ran
    phases = ["collect", "distil", "select", "replay"]
    phases += ["train", "publish"] * want["train"] + ["dpo"] * want["dpo"] + ["release"] * want["release"]
    assert list(result.seconds) == [*phases, "evaluate"]
    assert len(runs) == 1 + want["dpo"] + want["release"] + 1  # nothing else was played


def test_stage_zero_evaluates_the_base_model(tmp_path, monkeypatch):
    w = _world(tmp_path, monkeypatch, "hamo")
    result = initial_stage(w.ctx)
    (evaluation,) = w.runs
    assert evaluation.spec.model == "base" and evaluation.spec.seed == stage_seed(
        w.cfg.run.seed, 0, "evaluate"
    )
    assert result.stage == 0 and result.adapter is None and list(result.seconds) == ["evaluate"]
    assert w.ctx.trainer.bc_calls == [] and w.ctx.services.published == []
