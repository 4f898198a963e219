"""The Ray Data card pipeline end to end on a local Ray: distil -> embed -> LanceDB -> retrieve.

Run: pytest tests/ray/test_memory_pipeline.py -q
"""

from __future__ import annotations

import numpy as np
import pytest

from hamo_ray.config import MemoryConfig
from hamo_ray.memory import Embedder, MemoryStore, build_cards_dataset, retrieve, write_cards
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
