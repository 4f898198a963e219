"""The Ray Data card pipeline end to end on a local Ray: distil -> embed -> LanceDB -> retrieve.

Also: the LLM distiller against a loopback OpenAI-compatible endpoint, bad rows, skips, release.

Run: pytest tests/ray/test_memory_pipeline.py -q
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from hamo_ray.config import MemoryConfig
from hamo_ray.memory import (
    Embedder,
    MemoryStore,
    build_cards_dataset,
    release_internalised,
    retrieve,
    write_cards,
    write_cards_report,
)
from hamo_ray.types import TaskSpec, Trajectory, card_id

GOALS = {
    "boil": "Your task is to boil {x}. First, focus on the substance.",
    "use-thermometer": "Your task is to measure the temperature of {x}, which is located around the kitchen.",
    "find-living-thing": "Your task is to find a(n) living thing like a {x}. Then move it to the red box.",
    "grow-plant": "Your task is to grow a {x} plant from seed in the greenhouse.",
}
THINGS = ["water", "ice", "chocolate", "lead", "orange juice"]
ROOMS = ["hallway", "kitchen", "bedroom", "workshop", "art studio"]


def _trajectories() -> list[Trajectory]:
    out = []
    for t, (task, goal) in enumerate(GOALS.items()):
        for v, thing in enumerate(THINGS):
            room = ROOMS[(t + v) % len(ROOMS)]
            actions = [
                f"open door to {room}",
                f"go to {room}",
                "look around",
                f"pick up {thing}",
                f"focus on {thing}",
            ]
            out.append(
                Trajectory(
                    task=TaskSpec(domain="scienceworld", task=task, variation=v),
                    goal=goal.format(x=thing),
                    init_obs=f"This room is called the {room}. In it, you see: a {thing} and a table.",
                    actions=actions,
                    observations=["ok"] * len(actions),
                    score=100.0,
                    done=True,
                    source="expert",
                    cards_used=[] if v % 2 else ["abc"],
                    model=None if v % 2 else "base",
                )
            )
    return out


@pytest.fixture(scope="module")
def embedder() -> Embedder:
    return Embedder()


def test_pipeline_writes_cards_once_and_retrieves_own_card(ray_session, tmp_path, embedder):
    trajectories = _trajectories()
    assert len(trajectories) == 20
    mcfg = MemoryConfig(batch_size=8)
    store = MemoryStore(str(tmp_path / "memory"), dim=embedder.dim)

    assert write_cards(build_cards_dataset(trajectories, stage=1, mcfg=mcfg), store) == 20
    assert store.count() == 20
    assert write_cards(build_cards_dataset(trajectories, stage=1, mcfg=mcfg), store) == 0
    assert store.count() == 20

    cards = {c.id: c for c in store.cards(stage=1)}
    assert set(cards) == {card_id(t.id) for t in trajectories}
    target = trajectories[7]
    card = cards[card_id(target.id)]
    assert card.outline == f"1. navigate to {ROOMS[3]}; 2. pick up {THINGS[2]}; 3. focus on {THINGS[2]}"
    np.testing.assert_allclose(np.linalg.norm(store.vectors([card.id]), axis=1), 1.0, rtol=1e-5)

    hits = retrieve(store, embedder, target.goal, target.init_obs, k=3)
    assert hits[0][0].id == card.id and hits[0][1] == pytest.approx(1.0, abs=1e-4)
    assert len(hits) == 3 and hits[1][1] < hits[0][1]
    hits = retrieve(store, embedder, target.goal, target.init_obs, k=3, exclude_ids={card.id})
    assert card.id not in {c.id for c, _ in hits} and len(hits) == 3
    assert retrieve(store, embedder, target.goal, target.init_obs, k=3, max_stage=0) == []


class _Teacher(BaseHTTPRequestHandler):
    """An OpenAI-compatible endpoint: a good outline, except an empty one for "boil" tasks."""

    def log_message(self, *args) -> None:
        pass

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        empty = "Your task is to boil" in body["messages"][-1]["content"]
        content = "" if empty else "1. Go where the thing is.\n2. Focus on it."
        data = json.dumps({"choices": [{"message": {"content": content}, "finish_reason": "stop"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def test_llm_pipeline_rejects_bad_rows_falls_back_and_skips_stored(ray_session, tmp_path, embedder):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Teacher)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    trajectories = _trajectories()
    good = trajectories[5].model_dump(mode="json")
    bad = [
        {k: v for k, v in good.items() if k != "init_obs"},
        {**good, "actions": [], "observations": []},
        b'{"goal": "\xff\xfe"}',
    ]
    mcfg = MemoryConfig(
        batch_size=8, distiller="llm", llm_base_url=url, llm_max_retries=1, index_threshold=10
    )
    store = MemoryStore.from_config(str(tmp_path / "memory"), mcfg, dim=embedder.dim)
    report = write_cards_report(build_cards_dataset([*trajectories, *bad], 1, mcfg, store=store), store)
    assert report.added == 20 and store.count() == 20 and not report.indexed
    assert report.sources == {"llm": 15, "fallback": 5}  # the 5 "boil" outlines came back empty
    assert [(r.row, r.reason) for r in report.rejected] == [
        (20, "missing fields ['init_obs']"),
        (21, "empty action list"),
        (22, "not UTF-8: invalid start byte at byte 10"),
    ]
    assert report.rejected[0].trajectory_id == trajectories[5].id
    outlines = {c.task: c.outline for c in store.cards()}
    assert outlines["grow-plant"] == "1. Go where the thing is.; 2. Focus on it."
    assert outlines["boil"].startswith("1. navigate to")
    # A re-run skips stored trajectories before distilling: nothing reaches the endpoint.
    server.shutdown()
    again = write_cards_report(build_cards_dataset(trajectories, 1, mcfg, store=store), store)
    assert again.added == again.seen == 0 and store.count() == 20
    # method.release decides whether this runs; the replays (here the experts themselves) decide
    # which cards go, against memory.release_min_score.
    replays = trajectories[:3]
    strict = mcfg.model_copy(update={"release_min_score": 101.0})
    assert release_internalised(store, trajectories[:3], replays, strict) == []
    assert len(release_internalised(store, trajectories[:3], replays, mcfg)) == 3
    assert store.count(include_released=False) == 17


def _scienceworld_experts() -> list[Trajectory]:
    """Real gold trajectories: the two lifespan task types (whose variations share their animals) and
    find-living-thing (same variation numbers, another topic), variations 0-2 of the train split."""
    import shutil

    if shutil.which("java") is None:
        pytest.skip("ScienceWorld needs a Java runtime")
    from hamo_ray.config import EnvConfig
    from hamo_ray.envs import get_domain

    domain, out = get_domain("scienceworld", EnvConfig()), []
    with domain.make_env() as env:
        for task in ("lifespan-longest-lived", "lifespan-shortest-lived", "find-living-thing"):
            for spec in domain.tasks("train", task, limit=3):
                goal, init_obs = env.reset(spec)
                actions, observations, score = [], [], 0.0
                for action in env.expert_actions():
                    result = env.step(action)
                    actions.append(action)
                    observations.append(result.observation)
                    score = result.score
                    if result.done:
                        break
                out.append(
                    Trajectory(
                        task=spec, goal=goal, init_obs=init_obs, actions=actions, observations=observations,
                        score=score, done=True, source="expert",
                    )
                )  # fmt: skip
    return out


def test_real_cards_carry_both_vectors_and_training_never_sees_a_twin(ray_session, tmp_path, embedder):
    """Real ScienceWorld cards through the pipeline: ``vector`` embeds the key, ``card_vector`` the whole
    card; training-time retrieval skips every card of the example's world (the other lifespan type's
    card of the same variation names the animals present), which plain nearest-other retrieval returns."""
    from hamo_ray.memory import training_experience
    from hamo_ray.memory.worlds import world_of_card, world_of_trajectory
    from hamo_ray.types import card_text, key_text

    trajs = _scienceworld_experts()
    assert len(trajs) == 9 and all(t.score == 100.0 for t in trajs)
    mcfg = MemoryConfig(batch_size=4)
    store = MemoryStore(str(tmp_path / "memory"), dim=embedder.dim)
    assert write_cards(build_cards_dataset(trajs, stage=1, mcfg=mcfg), store) == 9
    cards = store.cards()
    ids = [c.id for c in cards]
    np.testing.assert_allclose(
        store.vectors(ids), embedder.embed([key_text(c.goal, c.init_obs) for c in cards]), atol=1e-4
    )
    np.testing.assert_allclose(
        store.vectors(ids, "card_vector"),
        embedder.embed([card_text(c.goal, c.init_obs, c.outline) for c in cards]),
        atol=1e-4,
    )
    lifespan = [t for t in trajs if t.task.task.startswith("lifespan")]
    plain = store.search(
        store.vectors([t.card_id for t in lifespan]), k=2, exclude_ids=[{t.card_id} for t in lifespan]
    )
    twins = sum(
        world_of_card(c) == world_of_trajectory(t) for t, hits in zip(lifespan, plain) for c, _ in hits
    )
    assert twins >= 3, "the twin is among the nearest other cards: the exclusion is tested"
    counts: dict[str, int] = {}
    experience = training_experience(store, trajs, k=2, max_stage=1, counts=counts)
    for t in trajs:
        assert len(experience[t.id]) == 2
        assert all(world_of_card(c) != world_of_trajectory(t) for c in experience[t.id]), t.id
    assert counts["same_world"] >= twins and counts["injected"] == 18
