"""A real 2-stage tiny stream: Ray, Serve + vLLM, LanceDB, ScienceWorld, training, end to end.

The endpoint is guarded by ``serve.api_key``: publishing, evaluation episodes and harness
retrieval all have to carry the key (``hamo_ray.run.services``), or the stream fails or scores 401s.
The method is ``hamo_release`` (hamo plus step 6: release decided by replaying each anchor without
cards), and the cards are written by the LLM distiller on the run's own endpoint
(``memory.llm_base_url=policy``): the toy model writes poor outlines, so some fall back, counted.
"""

from __future__ import annotations

import csv
import json
import math

import pytest

from hamo_ray.config import ConfigError, load_config
from hamo_ray.run.stream import Stream
from hamo_ray.serving.objstore import folder_digest
from hamo_ray.types import card_id

KEY = "stream-test-key"
OVERRIDES = [
    # A smaller backbone build and stream than jobs/configs/tiny.yaml, to keep the suite short.
    "backbone.per_task=6",
    "backbone.epochs=2",
    "protocol.train_per_task=6",
    "protocol.test_per_task=2",
    "env.max_turns=6",
    "rollout.num_workers=2",
    "rollout.envs_per_worker=2",
    "train.epochs=1",
    "serve.port=18471",  # not the default 8000: other servers may run on this machine
    "serve.app_name=hamo-stream-test",
]


@pytest.fixture(scope="module")
def finished_run(ray_session, tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    cfg = load_config(
        "jobs/configs/tiny.yaml",
        [
            *OVERRIDES,
            f"run.root={root}",
            "run.id=t",
            f"backbone.cache_dir={root / 'backbones'}",
            # adapters reach the replica through an object-store URI (file://: same code as s3://)
            f"serve.adapter_store=file://{root / 'store'}",
            f"serve.api_key={KEY}",
            "method.name=hamo_release",
            "memory.distiller=llm",
            "memory.llm_base_url=policy",
            "memory.llm_max_tokens=48",
            "memory.llm_max_retries=0",
        ],
    )
    results = Stream(cfg).run()
    return cfg, root / "t", results


def test_run_folder_contents(finished_run):
    cfg, run, results = finished_run
    assert [r.stage for r in results] == [1, 2]
    with open(run / "results" / "scores.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["stage"], r["domain"]) for r in rows] == [("1", "scienceworld"), ("2", "scienceworld")]
    assert all(0.0 <= float(r["score"]) <= 100.0 for r in rows)
    metrics = json.loads((run / "results" / "metrics.json").read_text())
    assert metrics["num_stages"] == 2 and "scienceworld" in metrics["average"]
    assert (run / "config.yaml").exists() and (run / "state.json").exists()
    # The stages trained inside one Ray Train run (train.engine=ray_train), its last checkpoint stage 2's.
    (train_run,) = (run / "ray_train").iterdir()
    ckpts = sorted(p.name for p in train_run.iterdir() if p.is_dir() and p.name.startswith("checkpoint_"))
    assert len(ckpts) == 1 and (train_run / ckpts[0] / "adapter" / "adapter_config.json").exists()
    # Every evaluated test task has exactly one episode per stage.
    for stage in (1, 2):
        episodes = (run / "episodes" / f"stage-{stage}-scienceworld.jsonl").read_text().splitlines()
        assert len(episodes) == 2 * len(cfg.env.task_types)


def test_every_request_carried_the_api_key(finished_run):
    """A 401 would show as an episode error; retrieval through the guarded harness injected cards."""
    _, run, results = finished_run
    used = []
    for stage in (1, 2):
        lines = (run / "episodes" / f"stage-{stage}-scienceworld.jsonl").read_text().splitlines()
        episodes = [json.loads(line) for line in lines]
        assert [e["error"] for e in episodes if e["error"]] == []
        committed = next(r.adapter_name for r in results if r.stage == stage)
        assert {e["model"] for e in episodes} == {committed}  # evaluated with the committed adapter
        used += [e["cards_used"] for e in episodes]
        # the stage's record counts what its evaluation injected (and what the gate held back)
        figures = next(r.evaluation for r in results if r.stage == stage)
        assert figures["cards_injected"] == sum(len(e["cards_used"]) for e in episodes)
        assert figures["cards_withheld"] == sum(e["cards_withheld"] for e in episodes)
    assert any(used)
    # training (conditioned, stage 2 retrieves stage 1's cards) counted what its examples carried
    assert results[1].train_cards["injected"] > 0 and set(results[1].train_cards) == {
        "injected",
        "withheld",
        "same_world",
    }


def test_the_api_key_is_in_no_file_of_the_run_folder(finished_run):
    """The key given on the command line reaches every request, but no file (config.yaml shows ***)."""
    _, run, _ = finished_run
    files = [f for f in run.rglob("*") if f.is_file()]
    leaked = [str(f.relative_to(run)) for f in files if KEY.encode() in f.read_bytes()]
    assert leaked == []
    assert "api_key: '***'" in (run / "config.yaml").read_text()


def test_selection_budget_and_replay(finished_run):
    _, _, results = finished_run
    for r in results:
        assert 1 <= r.budget <= r.num_trajectories
        assert len(r.anchors) == r.budget
    assert results[0].replay == []
    assert set(results[1].replay) <= set(results[0].anchors)


def test_cards_in_lancedb(finished_run):
    from hamo_ray.memory.store import MemoryStore

    _, run, results = finished_run
    store = MemoryStore(str(run / "memory"), "cards")
    assert store.count() == sum(r.num_trajectories for r in results)
    assert {c.stage for c in store.cards()} == {1, 2}
    # The LLM distiller on the run's own endpoint wrote (or fell back for) every card, counted.
    for r in results:
        d = r.distil
        assert d["cards_added"] == r.num_trajectories == d["llm_outlines"] + d["fallback_outlines"]
    # Released cards stay stored; search skips them.
    released = [i for r in results for i in r.released]
    assert store.count(include_released=False) == store.count() - len(released)


def test_release_is_decided_by_replaying_the_anchors(finished_run):
    _, _, results = finished_run
    for r in results:
        rel = r.release
        assert rel["replayed"] == len(r.anchors) and rel["released"] == len(r.released)
        assert 0.0 <= rel["replay_mean_score"] <= 100.0 and rel["replay_failed"] == 0
        assert set(r.released) <= {card_id(a) for a in r.anchors}
    assert results[0].release["followup_checked"] == 0
    assert results[1].release["followup_checked"] == len(results[0].released)


def test_adapters_load_in_peft(finished_run):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    cfg, run, results = finished_run
    from hamo_ray.backbones.toy import backbone_path

    for r in results:
        digest = folder_digest(run / r.adapter)[:12]  # the served name says which weights
        assert r.adapter == f"adapters/stage-{r.stage}" and r.adapter_name == f"stage-{r.stage}:{digest}"
        base = AutoModelForCausalLM.from_pretrained(backbone_path(cfg))
        model = PeftModel.from_pretrained(base, run / r.adapter)
        assert any("lora_A" in n for n, _ in model.named_parameters())


def test_adapters_went_through_the_store(finished_run):
    from hamo_ray.naming import store_prefix
    from hamo_ray.serving.objstore import ObjectStore

    cfg, run, results = finished_run
    store = ObjectStore(store_prefix(cfg.serve.adapter_store, run.name))  # the run's own prefix
    names = {r.adapter_name: r.adapter.split("/")[-1] for r in results}
    assert all(store.exists(folder) for folder in names.values())
    assert json.loads(store.read_text("served_adapters.json")) == names


def test_resubmitting_a_finished_run_does_nothing_and_no_resume_refuses(finished_run):
    cfg, run, results = finished_run
    again = Stream(cfg).run()
    assert again == results
    no_resume = cfg.model_copy(update={"run": cfg.run.model_copy(update={"resume": False})})
    with pytest.raises(ConfigError, match="finished stage"):
        Stream(no_resume).run()


def test_run_folder_has_tensorboard_events(finished_run):
    """Per-stage scores, budgets, memory size and phase timings are in the run's TensorBoard events."""
    from hamo_ray.run.tracking import read_scalars

    cfg, run, results = finished_run
    scalars = read_scalars(run / "tensorboard")
    assert [step for step, _ in scalars["score/scienceworld"]] == [r.stage for r in results]
    assert [v for _, v in scalars["score/scienceworld"]] == pytest.approx(
        [r.scores["scienceworld"] for r in results]
    )
    assert [v for _, v in scalars["memory/cards"]] == [r.num_cards for r in results]
    assert "seconds/train" in scalars and "stage/budget" in scalars
    assert [v for _, v in scalars["stage/train_loss"]] == pytest.approx([r.train_loss for r in results])
    # Every optimizer step of both stages, numbered on across them: stage 2's steps follow stage 1's
    # (a count restarting at 0 would repeat step numbers).
    for tag in ("train/loss", "train/lr", "train/tokens_per_s"):
        points = sorted(scalars[tag])
        assert len(points) >= 2 and [s for s, _ in points] == list(range(len(points))), tag
        assert all(math.isfinite(v) and v > 0 for _, v in points), tag


def test_run_folder_has_plots_and_report(finished_run):
    _, run, results = finished_run
    report = (run / "report.md").read_text()
    for png in ("stagewise.png", "bars.png", "retention.png"):
        assert (run / "results" / png).stat().st_size > 5_000 and f"results/{png}" in report
    assert all(f"| {r.stage} |" in report for r in results)
