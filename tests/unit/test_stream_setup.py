"""The stream refuses bad input before any work, and never silently overwrites finished stages."""

from __future__ import annotations

import json

import pytest
import yaml

from hamo_ray.config import ConfigError, load_config
from hamo_ray.run.folder import RunFolder
from hamo_ray.run.stream import Stream, split_stages
from hamo_ray.types import StageResult, TaskSpec


def _cfg(tmp_path, *extra):
    return load_config("jobs/configs/tiny.yaml", [f"run.root={tmp_path}", *extra])


def test_unknown_task_type_is_named(tmp_path):
    with pytest.raises(ConfigError, match="boill"):
        Stream(_cfg(tmp_path, "env.task_types=[boill]"))


def test_unknown_domain_is_named(tmp_path):
    with pytest.raises(ConfigError, match="nodomain"):
        Stream(_cfg(tmp_path, "env.domain=nodomain"))


def test_missing_model_path_is_named(tmp_path):
    with pytest.raises(ConfigError, match="/no/such/model"):
        Stream(_cfg(tmp_path, "model.path=/no/such/model"))


def test_action_constraint_needs_a_domain_that_lists_its_actions(tmp_path):
    from hamo_ray.envs import get_domain
    from hamo_ray.run.stream import check_action_constraint

    with pytest.raises(ConfigError, match=r"rollout.constrain_actions: .*scienceworld"):
        Stream(_cfg(tmp_path, "rollout.constrain_actions=true"))  # ScienceWorld alone: nothing to constrain
    cfg = load_config("jobs/configs/tiny-cross.yaml", ["rollout.constrain_actions=true"])
    domains = {name: get_domain(name, cfg.env) for name in cfg.domains()}
    assert check_action_constraint(cfg, domains) == ["scienceworld"]  # ALFWorld and WebShop constrained
    assert check_action_constraint(cfg.model_copy(update={"rollout": cfg.rollout.model_copy(
        update={"constrain_actions": False})}), domains) == []  # fmt: skip


def test_stages_are_disjoint_and_cover_every_task_type(tmp_path):
    stream = Stream(_cfg(tmp_path, "protocol.num_stages=3", "protocol.train_per_task=7"))
    ids = [t.id for stage in stream.stage_tasks for t in stage]
    assert len(ids) == len(set(ids)) == 7 * len(stream.cfg.env.task_types)
    for stage in stream.stage_tasks:
        assert {t.task for t in stage} == set(stream.cfg.env.task_types)
    test_ids = {t.id for t in stream.test_tasks["scienceworld"]}
    assert not test_ids & set(ids)


def test_split_stages_round_robin():
    tasks = {"a": [TaskSpec(domain="d", task="a", variation=i) for i in range(5)]}
    stages = split_stages(tasks, 2)
    assert [[t.variation for t in s] for s in stages] == [[0, 2, 4], [1, 3]]


def _finished_stage() -> StageResult:
    return StageResult(
        stage=1,
        method="hamo",
        num_trajectories=1,
        num_cards=1,
        budget=1,
        anchors=[],
        replay=[],
        adapter=None,
        adapter_name=None,
        train_loss=None,
        scores={"scienceworld": 10.0},
        seconds={},
    )


def test_finished_run_is_not_overwritten_silently(tmp_path):
    cfg = _cfg(tmp_path, "run.id=r1")
    folder = RunFolder(tmp_path / "r1", cfg)
    folder.prepare()
    folder.commit(_finished_stage())
    no_resume = _cfg(tmp_path, "run.id=r1", "run.resume=false")
    with pytest.raises(ConfigError, match="already holds 1 finished stage"):
        RunFolder(tmp_path / "r1", no_resume).prepare()
    changed = _cfg(tmp_path, "run.id=r1", "train.epochs=9")
    with pytest.raises(ConfigError, match="train.epochs"):
        RunFolder(tmp_path / "r1", changed).prepare()
    # rollout's settings may change on resume, but not the action constraint (what the policy can say).
    RunFolder(tmp_path / "r1", _cfg(tmp_path, "run.id=r1", "rollout.num_workers=1")).prepare()
    with pytest.raises(ConfigError, match="rollout.constrain_actions"):
        RunFolder(tmp_path / "r1", _cfg(tmp_path, "run.id=r1", "rollout.constrain_actions=true")).prepare()
    # A key added to the code after the run started (absent from its config.yaml) is its default: the
    # run resumes; a non-default value for it is a change.
    saved = yaml.safe_load((tmp_path / "r1" / "config.yaml").read_text())
    del saved["env"]["webshop"]["ids"]
    (tmp_path / "r1" / "config.yaml").write_text(yaml.safe_dump(saved))
    with pytest.raises(ConfigError, match="env.webshop"):
        RunFolder(tmp_path / "r1", _cfg(tmp_path, "run.id=r1", "env.webshop.ids=short")).prepare()
    # Same config: resumes with the committed stage; the state is untouched.
    assert [s.stage for s in RunFolder(tmp_path / "r1", cfg).prepare()] == [1]
    state = json.loads((tmp_path / "r1" / "state.json").read_text())
    assert len(state["stages"]) == 1
    assert (tmp_path / "r1" / "results" / "scores.csv").read_text().splitlines()[
        1
    ] == "1,scienceworld,hamo,10.0000,,"  # no episode counts recorded for this stage


def test_constructor_only_validates(tmp_path):
    """No task list (ALFWorld would generate its games), no folder, no Ray before ``run``."""
    import ray

    games = tmp_path / "games"
    cfg = _cfg(
        tmp_path,
        "env.domain=alfworld",
        "env.alfworld.games=generated",
        f"env.alfworld.games_dir={games}",
        "env.task_types=[pick_and_place_simple]",
        "run.id=lazy",
    )
    ray_before = ray.is_initialized()  # the whole suite's tests/ray session may already hold one
    stream = Stream(cfg)
    assert not games.exists() and not (tmp_path / "lazy").exists()
    assert ray.is_initialized() == ray_before  # the constructor starts no Ray
    assert "stage_tasks" not in vars(stream) and "test_tasks" not in vars(stream)
    assert stream.stage_domains == ["alfworld", "alfworld"] and stream.expected_stages == [1, 2]


def test_per_domain_train_and_test_counts(tmp_path):
    """``protocol.{train,test}_per_task`` one number, or one per domain (a missing or foreign domain named)."""
    cross = "jobs/configs/tiny-cross.yaml"
    counts = "{scienceworld: 2, alfworld: 5, webshop: 3}"
    train = "{scienceworld: 1, alfworld: 3, webshop: 2}"
    cfg = load_config(
        cross,
        [f"run.root={tmp_path}", f"protocol.test_per_task={counts}", f"protocol.train_per_task={train}"],
    )
    stream = Stream(cfg)
    for domain, n in {"scienceworld": 2, "alfworld": 5, "webshop": 3}.items():
        tasks = stream.test_tasks[domain]
        assert len(tasks) == n * len(cfg.task_types(domain)), domain
        assert {t.split for t in tasks} == {"test"}
    assert [len(stage) for stage in stream.stage_tasks] == [
        n * len(cfg.task_types(d)) for d, n in zip(cfg.domains(), [1, 3, 2])
    ]
    assert {t.split for stage in stream.stage_tasks for t in stage} == {"train"}
    assert cfg.per_domain("protocol.test_per_task", "alfworld") == 5
    assert (
        load_config(cross, []).per_domain("protocol.test_per_task", "alfworld") == 3
    )  # one number: every domain
    with pytest.raises(ConfigError, match="protocol.test_per_task has no entry for domain 'textworld'"):
        cfg.per_domain("protocol.test_per_task", "textworld")
    with pytest.raises(ConfigError, match="protocol.test_per_task has no entry for domain.*webshop"):
        load_config(cross, ["protocol.test_per_task={scienceworld: 2, alfworld: 5}"])
    with pytest.raises(ConfigError, match="protocol.train_per_task names domain.*textworld"):
        load_config(
            cross, ["protocol.train_per_task={scienceworld: 2, alfworld: 5, webshop: 3, textworld: 1}"]
        )
    with pytest.raises(ConfigError, match="protocol.test_per_task must be >= 1"):
        load_config(cross, ["protocol.test_per_task={scienceworld: 0, alfworld: 5, webshop: 3}"])
    with pytest.raises(ConfigError, match="protocol.train_per_task must be >= protocol.num_stages"):
        load_config(
            "jobs/configs/tiny.yaml", ["protocol.num_stages=3", "protocol.train_per_task={scienceworld: 2}"]
        )


def test_eval_seen_adds_the_dev_split_beside_the_test_split(tmp_path):
    """``protocol.eval_seen``: a domain's dev tasks (ALFWorld's seen rooms) as ``<domain>@seen``, on the
    domain's own pool; a domain the stream does not run is named."""
    from hamo_ray.run.resources import EnvPools

    cross = "jobs/configs/tiny-cross.yaml"
    cfg = load_config(
        cross, [f"run.root={tmp_path}", "protocol.eval_seen=[alfworld]", "protocol.test_per_task=2"]
    )
    stream = Stream(cfg)
    assert list(stream.test_tasks) == ["scienceworld", "alfworld", "webshop", "alfworld@seen"]
    seen, test = stream.test_tasks["alfworld@seen"], stream.test_tasks["alfworld"]
    assert len(seen) == len(test) == 2 * len(cfg.task_types("alfworld"))
    assert {t.split for t in seen} == {"dev"} and {t.domain for t in seen} == {"alfworld"}
    pools = EnvPools(cfg)
    pools._pools["alfworld"] = "the alfworld pool"  # no actors started: only the lookup is under test
    assert pools("alfworld@seen") == "the alfworld pool"
    with pytest.raises(ConfigError, match="protocol.eval_seen names domain.*textworld"):
        load_config(cross, ["protocol.eval_seen=[textworld]"])
