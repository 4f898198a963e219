"""Streams whose every episode goes through an AgentGym environment server on loopback.

- textcraft and babyai: a 1-stage stream from AgentTraj-format expert files (written by playing the
  stand-in's plans through its HTTP API), to scores and cards.
- scienceworld with ``env.scienceworld.backend=agentgym``: the stand-in runs the real simulator; the
  experts are the local simulator's gold paths replayed through the server.

After each stream, every environment the run created on the server is closed, and no episode failed.
"""

from __future__ import annotations

import json
import time

import pytest

from hamo_ray.config import load_config
from hamo_ray.envs.agentgym.standin import (
    AgentGymStandin,
    BabyAIBackend,
    SciWorldBackend,
    TextCraftBackend,
    agenttraj_items,
)
from hamo_ray.types import Trajectory


def _common(tmp_path, port: int) -> list[str]:
    return [
        "protocol.num_stages=1",
        "rollout.num_workers=1",
        "train.epochs=1",
        "backbone.epochs=2",
        f"serve.port={port}",
        f"serve.app_name=hamo-agentgym-{port}",
        f"run.root={tmp_path}",
        "run.id=x",
        f"backbone.cache_dir={tmp_path / 'backbones'}",
    ]


def _episodes(tmp_path, domain: str) -> list[Trajectory]:
    path = tmp_path / "x" / "episodes" / f"stage-1-{domain}.jsonl"
    return [Trajectory.model_validate_json(line) for line in path.read_text().splitlines()]


SERVER_DOMAINS = {
    # domain: (server name, backend, task types, train/dev items for the expert file)
    "textcraft": ("textcraft", TextCraftBackend, ["depth-1", "depth-2"]),
    "babyai": ("babyai", BabyAIBackend, ["GoToRedBall", "Pickup"]),
}


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("domain", sorted(SERVER_DOMAINS))
def test_one_stage_stream_on_an_agentgym_server(ray_session, tmp_path, domain) -> None:
    from hamo_ray.envs import get_domain
    from hamo_ray.run.stream import Stream

    start = time.time()
    name, backend, task_types = SERVER_DOMAINS[domain]
    server = AgentGymStandin(backend())
    server.start()
    try:
        d = get_domain(domain, load_config(overrides=[f"env.{domain}.url={server.url}"]).env)
        tasks = [t for tt in task_types for s in ("train", "dev") for t in d.tasks(s, tt, limit=4)]
        items = agenttraj_items(server, name, [d.item_of(t) for t in tasks])
        assert len(items) == len(tasks)
        path = tmp_path / f"{domain}.json"
        path.write_text(json.dumps(items))
        cfg = load_config(
            "jobs/configs/tiny.yaml",
            [
                f"env.domain={domain}",
                f"env.task_types=[{', '.join(task_types)}]",
                f"env.{domain}.url={server.url}",
                "env.expert_source=file",
                f"env.expert_files={{{domain}: {path}}}",
                "env.max_turns=8",
                "protocol.train_per_task=4",
                "protocol.test_per_task=2",
                "backbone.per_task=4",
                *_common(tmp_path, 18530 + len(domain)),
            ],
        )
        stream = Stream(cfg)
        results = stream.run()
        created = server.created
    finally:
        server.stop()
    assert len(results) == 1 and set(results[0].scores) == {domain}
    assert results[0].num_trajectories == 8 and results[0].num_cards > 0
    episodes = _episodes(tmp_path, domain)
    assert len(episodes) == 4 and all(e.error is None and e.actions for e in episodes)
    assert server.open_ids == set() and created > 0  # every environment created was closed
    print(f"{domain}: 1-stage stream through the server in {time.time() - start:.0f} s, "
          f"score {results[0].scores[domain]:.1f}, {created} environments")  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_scienceworld_stream_through_the_agentgym_server(ray_session, tmp_path) -> None:
    from hamo_ray.run.stream import Stream

    start = time.time()
    server = AgentGymStandin(SciWorldBackend())
    server.start()
    try:
        cfg = load_config(
            "jobs/configs/tiny.yaml",
            [
                "env.scienceworld.backend=agentgym",
                f"env.scienceworld.url={server.url}",
                "env.task_types=[find-living-thing]",
                "env.max_turns=12",
                "protocol.train_per_task=2",
                "protocol.test_per_task=2",
                "backbone.per_task=2",
                *_common(tmp_path, 18560),
            ],
        )
        results = Stream(cfg).run()
        created, requests = server.created, list(server.requests)
    finally:
        server.stop()
    assert len(results) == 1 and set(results[0].scores) == {"scienceworld"}
    assert results[0].num_trajectories == 2 and results[0].num_cards > 0
    episodes = _episodes(tmp_path, "scienceworld")
    assert len(episodes) == 2 and all(e.error is None and e.actions for e in episodes)
    # every episode (backbone experts, collection, evaluation) went through the server
    assert requests.count("/reset") >= 2 + 2 + 2 and server.open_ids == set() and created > 0
    print(f"scienceworld through the server: {time.time() - start:.0f} s, {created} environments")
