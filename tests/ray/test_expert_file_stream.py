"""Imported expert files drive every stage of the cross-domain stream S -> A -> W, to the end, with the
WebShop HTTP backend (the loopback env server) instead of the stand-in.

The files are written in the public formats from episodes played here: ScienceWorld gold paths as
AgentGym items, ALFWorld walkthroughs (generated games) as ETO items, WebShop expert plans played
through the env server as AgentGym items. Each stage must train on exactly its domain's imported
trajectories (thoughts included); every domain is evaluated after every stage.
"""

from __future__ import annotations

import csv
import time

import pytest
from expert_formats import agentgym_item, eto_item, play, write

from hamo_ray.config import EnvConfig, load_config
from hamo_ray.envs import get_domain
from hamo_ray.envs.expert_ids import agentgym_sciworld_items
from hamo_ray.envs.webshop.catalog import build_catalog
from hamo_ray.envs.webshop.server import StandinServer
from hamo_ray.run.stream import Stream
from hamo_ray.types import TaskSpec, Trajectory


def _write_files(tmp_path, server: StandinServer, alf_dir: str) -> dict[str, str]:
    sw_env = get_domain("scienceworld", EnvConfig()).make_env()
    try:
        items = []
        for v in (0, 1):
            goal, obs, actions, observations, score = play(
                sw_env, TaskSpec(domain="scienceworld", task="find-living-thing", variation=v)
            )
            assert score == 100.0
            n = agentgym_sciworld_items().index(("find-living-thing", v))
            items.append(agentgym_item(f"sciworld_{n}", f"{goal}\n{obs}", actions, observations))
    finally:
        sw_env.close()
    files = {"scienceworld": write(tmp_path / "sciworld.json", items)}

    alf = get_domain(
        "alfworld", EnvConfig(domain="alfworld", alfworld={"games": "generated", "games_dir": alf_dir})
    )
    env = alf.make_env()
    try:
        items = []
        for v in (0, 1):
            task = TaskSpec(domain="alfworld", task="pick_and_place_simple", variation=v)
            goal, room, actions, observations, score = play(env, task)
            assert score == 100.0
            folder = env.game_file.parent.parent.name
            items.append(
                eto_item(
                    v,
                    f"{room}\n\nYour task is to: {goal}",
                    actions,
                    observations,
                    game_file=f"json_2.1.1/train/{folder}/trial_hamo",
                )
            )
    finally:
        env.close()
    files["alfworld"] = write(tmp_path / "alfworld.json", items)

    ws = get_domain(
        "webshop", EnvConfig(domain="webshop", webshop={"backend": "http", "url": server.url})
    ).make_env()
    try:
        items = []
        for n in (1500, 1501):
            goal, page, actions, observations, score = play(
                ws, TaskSpec(domain="webshop", task="all", variation=n), server.expert_plan(n)
            )
            assert score == 100.0
            items.append(agentgym_item(f"webshop_{n}", page, actions, observations))
    finally:
        ws.close()
    files["webshop"] = write(tmp_path / "webshop.json", items)
    return {d: str(p) for d, p in files.items()}  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(3000)
def test_imported_experts_drive_the_cross_stream_with_the_webshop_server(ray_session, tmp_path):
    start = time.time()
    server = StandinServer(build_catalog(0, 1000))
    server.start()
    try:
        alf_dir = str(tmp_path / "alfworld-games")
        files = _write_files(tmp_path, server, alf_dir)
        cfg = load_config(
            "jobs/configs/tiny-cross.yaml",
            [
                "env.expert_source=file",
                f"env.expert_files={{scienceworld: {files['scienceworld']}, alfworld: {files['alfworld']}, webshop: {files['webshop']}}}",
                "env.webshop.backend=http",
                f"env.webshop.url={server.url}",
                f"env.alfworld.games_dir={alf_dir}",
                "env.task_types={scienceworld: [find-living-thing], alfworld: [pick_and_place_simple], webshop: [all]}",
                "env.max_turns=12",
                # WebShop pages are long: the tiny backbone's tokenizer learns only ScienceWorld and ALFWorld
                # text (the real WebShop has no simulator expert for the backbone build), so give room.
                "model.max_model_len=2048",
                "train.max_seq_len=2048",
                "protocol.train_per_task=2",
                "protocol.test_per_task=1",
                "backbone.per_task=2",
                "backbone.epochs=1",
                "train.epochs=1",
                "rollout.num_workers=1",
                "serve.port=18476",
                "serve.app_name=hamo-expert-file-test",
                f"run.root={tmp_path}",
                "run.id=x",
                f"backbone.cache_dir={tmp_path / 'backbones'}",
            ],
        )  # fmt: skip
        stream = Stream(cfg)
        results = stream.run()
    finally:
        server.stop()
    assert [(r.stage, r.domain) for r in results] == [(1, "scienceworld"), (2, "alfworld"), (3, "webshop")]
    from hamo_ray.envs.expert_data import load_expert_file

    for r in results:
        imported = load_expert_file(files[r.domain], r.domain, cfg.env)
        trained = stream.folder.load_trajectories(r.stage)
        assert [t.id for t in trained] == [t.id for t in imported] and r.num_trajectories == 2
        assert all(t.thoughts and t.source == "expert" and t.score == 100.0 for t in trained)
        assert [t.actions for t in trained] == [t.actions for t in imported]
        assert r.adapter is not None and set(r.scores) == {"scienceworld", "alfworld", "webshop"}
    assert {t.task.variation for t in stream.folder.load_trajectories(3)} == {1500, 1501}
    for stage in (1, 2, 3):  # every domain's test episodes ran to their end, WebShop's through the server
        for domain in ("scienceworld", "alfworld", "webshop"):
            path = tmp_path / "x" / "episodes" / f"stage-{stage}-{domain}.jsonl"
            episodes = [Trajectory.model_validate_json(line) for line in path.read_text().splitlines()]
            assert episodes and all(e.error is None and e.actions for e in episodes), (
                stage,
                domain,
                episodes[0].error,
            )
    with open(tmp_path / "x" / "results" / "scores.csv") as f:
        rows = [(r["stage"], r["domain"]) for r in csv.DictReader(f)]
    assert rows == [(str(s), d) for s in (1, 2, 3) for d in ("alfworld", "scienceworld", "webshop")]
    print(f"cross-domain stream from imported experts: {time.time() - start:.0f} s")
