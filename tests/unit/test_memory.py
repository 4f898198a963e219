"""Unit tests of the harness memory (no Ray): distiller, LanceDB store, embedder.

Run: pytest tests/unit/test_memory.py -q
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from hamo_ray.memory import (
    Embedder,
    MemoryStore,
    card_from_trajectory,
    card_schema,
    get_distiller,
    key_text,
    outline_from_trajectory,
)
from hamo_ray.types import Card, TaskSpec, Trajectory, card_id, card_text

DIM = 4
ROOT = Path(__file__).resolve().parents[2]


def _traj(actions: list[str], task: str = "boil", variation: int = 0) -> Trajectory:
    return Trajectory(
        task=TaskSpec(domain="scienceworld", task=task, variation=variation),
        goal=f"Your task is to {task}.",
        init_obs="This room is called the hallway.",
        actions=actions,
        observations=["ok"] * len(actions),
        score=100.0,
        done=True,
        source="expert",
    )


THERMOMETER = [
    "open door to kitchen",
    "go to kitchen",
    "look around",
    "pick up thermometer",
    "focus on thermometer in inventory",
    "inventory",
    "open door to hallway",
    "go to hallway",
    "teleport to living room",
    "look around",
    "pick up unknown substance B",
    "0",
    "use thermometer in inventory on unknown substance B",
    "use thermometer in inventory on unknown substance B",
    "wait1",
]


def test_outline_groups_navigation_drops_look_around_and_numbers_steps():
    outline = outline_from_trajectory(_traj(THERMOMETER))
    assert outline == (
        "1. navigate to kitchen; 2. pick up thermometer; 3. focus on thermometer in inventory; "
        "4. navigate to living room (via hallway); 5. pick up unknown substance B; "
        "6. use thermometer in inventory on unknown substance B (x2); 7. wait1"
    )
    assert "look around" not in outline and ". inventory" not in outline and ". 0" not in outline


def test_outline_is_deterministic_and_collapses_repeated_blocks():
    actions = ["go to sink"] + ["activate sink", "deactivate sink", "look around"] * 4 + ["wait1"]
    first = outline_from_trajectory(_traj(actions))
    assert first == outline_from_trajectory(_traj(list(actions)))
    assert first == "1. navigate to sink; 2. repeat 4 times: activate sink, deactivate sink; 3. wait1"


def test_outline_is_capped_with_a_final_marker():
    actions = [f"pick up object {i}" for i in range(30)]
    outline = outline_from_trajectory(_traj(actions))
    steps = outline.split("; ")
    assert len(steps) == 13 and steps[-1] == "..." and steps[-2] == "12. pick up object 11"
    assert outline_from_trajectory(_traj(actions[:12])).split("; ")[-1] == "12. pick up object 11"
    assert outline_from_trajectory(_traj(["look around", "inventory"])) == ""


def test_general_digest_names_what_the_goal_asks_for_not_the_variation():
    from hamo_ray.memory.distill import general_outline_from_trajectory, get_distiller, goal_target

    def traj(goal, init_obs, actions):
        return Trajectory(
            task=TaskSpec(domain="scienceworld", task="t", variation=0), goal=goal, init_obs=init_obs,
            actions=actions, observations=["ok"] * len(actions), score=100.0, source="expert",
        )  # fmt: skip

    living = traj(
        "Your task is to find a(n) living thing. First, focus on the thing. Then, move it to the red box in the bathroom.",
        "This room is called the greenhouse. In it, you see: a bee hive, a flower pot 1.",
        ["open door to outside", "go to outside", "focus on blue jay", "pick up blue jay", "go to kitchen",
         "go to bathroom", "move egg blue jay egg in inventory to red box"],
    )  # fmt: skip
    assert general_outline_from_trajectory(living) == (
        "1. navigate to outside; 2. focus on the living thing; 3. pick up the living thing; "
        "4. navigate to bathroom (via kitchen); 5. move the living thing in inventory to red box"
    )
    lifespan = traj(
        "Your task is to find the animal with the longest life span. The animals are in the 'outside' location.",
        "This room is called the kitchen.",
        ["go to outside", "focus on egg giant tortoise"],
    )  # fmt: skip
    assert goal_target(lifespan.goal) == "the animal with the longest life span"
    assert get_distiller("outline_general").distill([lifespan]) == [
        "1. navigate to outside; 2. focus on the animal with the longest life span"
    ]
    # Names the task gives (goal, initial observation) are kept: an ALFWorld receptacle, the goal's object.
    alf = traj(
        "Your task is to: put a creditcard in drawer.",
        "You are in the middle of a room. You see a sidetable 1, a drawer 1.",
        ["take creditcard 1 from sidetable 1", "move creditcard 1 to drawer 1"],
    )  # fmt: skip
    assert general_outline_from_trajectory(alf) == (
        "1. take creditcard 1 from sidetable 1; 2. move creditcard 1 to drawer 1"
    )
    assert goal_target("Buy a shirt") == "the thing the task asks for"


def test_distiller_registry_and_card():
    traj = _traj(THERMOMETER)
    distiller = get_distiller("outline")
    [outline] = distiller.distill([traj])
    card = card_from_trajectory(traj, stage=2, outline=outline)
    assert card.id == card_id(traj.id) and card.trajectory_id == traj.id and card.stage == 2
    assert (card.domain, card.task, card.variation, card.score) == ("scienceworld", "boil", 0, 100.0)
    assert key_text(card.goal, card.init_obs) == card.key_text
    with pytest.raises(KeyError, match="unknown distiller"):
        get_distiller("nope")


def _unit(v: list[float]) -> np.ndarray:
    a = np.asarray(v, dtype=np.float32)
    return a / np.linalg.norm(a)


def _rows(n: int, stage: int = 0, start: int = 0) -> list[dict]:
    """Card rows whose vectors point at increasing angles in the first two dimensions."""
    rows = []
    for i in range(start, start + n):
        card = card_from_trajectory(_traj(["pick up x"], variation=i), stage=stage, outline="1. pick up x")
        angle = i * 0.1
        rows.append({**card.model_dump(), "vector": _unit([np.cos(angle), np.sin(angle), 0.0, 0.0])})
    return rows


def test_schema_is_card_fields_released_and_vectors():
    schema = card_schema(DIM)
    assert schema.names == [*Card.model_fields, "released", "vector", "card_vector"]
    assert schema.field("vector").type.list_size == DIM
    assert schema.field("card_vector").type.list_size == DIM and schema.field("card_vector").nullable


def test_card_vectors_are_stored_beside_the_key_vectors(tmp_path):
    store = MemoryStore(str(tmp_path / "mem"), dim=DIM)
    rows = _rows(3)
    cards = [_unit([0.0, 0.0, 1.0, float(i)]) for i in range(3)]
    assert store.add([{**r, "card_vector": v} for r, v in zip(rows, cards, strict=True)]) == 3
    ids = [rows[2]["id"], rows[0]["id"]]
    np.testing.assert_allclose(store.vectors(ids, "card_vector"), [cards[2], cards[0]], atol=1e-6)
    np.testing.assert_allclose(store.vectors(ids), [rows[2]["vector"], rows[0]["vector"]], atol=1e-6)
    # search matches the key vectors only
    assert store.search(rows[1]["vector"], k=1)[0][0][0].id == rows[1]["id"]
    # rows without a card vector (written by hand) are stored; selection on the card refuses them
    assert store.add(_rows(1, start=10)) == 1
    with pytest.raises(ValueError, match="without a 'card_vector'.*selection.embed=key"):
        store.vectors([rows[0]["id"], _rows(1, start=10)[0]["id"]], "card_vector")
    with pytest.raises(ValueError, match="width"):
        store.add([{**_rows(1, start=20)[0], "card_vector": np.ones(DIM + 1, dtype=np.float32)}])
    with pytest.raises(ValueError, match="unknown vector column"):
        store.vectors(ids, "other")


def test_table_written_before_the_card_vector_column(tmp_path):
    """An old run's memory: new cards are added without the column, and selection by card text refuses
    clearly (selection.embed=key selects as the run did)."""
    import lancedb
    import pyarrow as pa

    old = pa.schema([f for f in card_schema(DIM) if f.name != "card_vector"])
    lancedb.connect(str(tmp_path / "mem")).create_table("cards", schema=old)
    store = MemoryStore(str(tmp_path / "mem"))
    rows = [{**r, "card_vector": r["vector"]} for r in _rows(3)]
    assert store.add(rows) == 3 and not store.has_card_vectors()
    assert store.vectors([rows[1]["id"]]).shape == (1, DIM)
    with pytest.raises(ValueError, match="created before cards had a 'card_vector'.*selection.embed=key"):
        store.vectors([rows[1]["id"]], "card_vector")
    assert MemoryStore(str(tmp_path / "new"), dim=DIM).has_card_vectors()


def test_add_count_and_idempotent_readd(tmp_path):
    store = MemoryStore(str(tmp_path / "mem"), dim=DIM)
    assert store.count() == 0 and store.cards() == []
    assert store.add(_rows(5)) == 5
    assert store.count() == 5
    assert store.add(_rows(5)) == 0
    assert store.add(_rows(7)) == 2
    assert store.add(_rows(2, start=20) * 2) == 2  # duplicates inside one write
    assert store.count() == 9
    cards = store.cards()
    assert len(cards) == 9 and all(isinstance(c, Card) for c in cards)
    ids = [cards[3].id, cards[0].id]
    np.testing.assert_allclose(np.linalg.norm(store.vectors(ids), axis=1), 1.0, rtol=1e-5)
    with pytest.raises(KeyError):
        store.vectors(["missing"])


def test_search_nearest_exclusion_and_stage_filter(tmp_path):
    store = MemoryStore(str(tmp_path / "mem"))  # the first add sets the width
    store.add(_rows(5, stage=0) + _rows(5, stage=1, start=5))
    ids = [r["id"] for r in _rows(5, stage=0) + _rows(5, stage=1, start=5)]
    query = _unit([np.cos(0.31), np.sin(0.31), 0.0, 0.0])  # nearest: variation 3, then 2/4
    [hits] = store.search(query[None, :], k=3)
    assert [c.variation for c, _ in hits] == [3, 4, 2]
    assert hits[0][1] == pytest.approx(np.cos(0.01), abs=1e-5)
    assert hits[0][1] >= hits[1][1] >= hits[2][1]
    both = store.search(np.stack([query, query]), k=2, exclude_ids=[set(), {ids[3], ids[4]}])
    assert [c.variation for c, _ in both[0]] == [3, 4]
    assert [c.variation for c, _ in both[1]] == [2, 5]
    far = _unit([np.cos(0.8), np.sin(0.8), 0.0, 0.0])  # nearest overall: stage 1 cards
    [hits] = store.search(far, k=2, max_stage=0)
    assert [(c.variation, c.stage) for c, _ in hits] == [(4, 0), (3, 0)]
    assert len(store.cards(stage=1)) == 5
    with pytest.raises(ValueError, match="width"):
        store.search(np.ones((1, DIM + 1), dtype=np.float32), k=1)


def test_second_instance_sees_later_rows(tmp_path):
    uri = str(tmp_path / "mem")
    writer = MemoryStore(uri, dim=DIM)
    writer.add(_rows(2))
    reader = MemoryStore(uri)
    assert reader.count() == 2 and reader.dim == DIM
    writer.add(_rows(3, start=10))
    assert reader.count() == 5
    [hits] = reader.search(_unit([np.cos(1.1), np.sin(1.1), 0, 0]), k=1)
    assert hits[0][0].variation == 11


def test_reader_in_another_process_sees_rows(tmp_path):
    uri = str(tmp_path / "mem")
    MemoryStore(uri, dim=DIM).add(_rows(3))
    code = f"from hamo_ray.memory import MemoryStore; print(MemoryStore({uri!r}).count())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "3"


def test_bad_write_raises_and_leaves_table_unchanged(tmp_path):
    store = MemoryStore(str(tmp_path / "mem"), dim=DIM)
    store.add(_rows(3))
    before = store.cards()
    bad = _rows(2, start=10)
    bad[1] = {**bad[1], "vector": np.ones(DIM + 2, dtype=np.float32)}
    with pytest.raises(ValueError, match="width"):
        store.add(bad)
    wide = [{**r, "vector": np.ones(DIM + 2, dtype=np.float32)} for r in _rows(2, start=10)]
    with pytest.raises(ValueError, match="width 6 does not match"):
        store.add(wide)
    with pytest.raises(ValueError, match="lack columns"):
        store.add([{k: v for k, v in r.items() if k != "goal"} for r in _rows(1, start=30)])
    with pytest.raises(ValueError, match="variation"):
        store.add([{**_rows(1, start=40)[0], "variation": "not a number"}])
    assert store.count() == 3 and store.cards() == before
    with pytest.raises(ValueError, match="width"):
        MemoryStore(store.uri, dim=DIM + 1)


def test_existing_ids_and_release_marks_without_deleting(tmp_path):
    store = MemoryStore(str(tmp_path / "mem"), dim=DIM)
    rows = _rows(5)
    store.add(rows)
    ids = [r["id"] for r in rows]
    assert store.existing_ids([ids[0], "nope", ids[3]]) == {ids[0], ids[3]}
    query = _unit([np.cos(0.31), np.sin(0.31), 0.0, 0.0])  # nearest: variation 3
    assert store.search(query, k=1)[0][0][0].variation == 3
    assert store.release([ids[3], "unknown"]) == 1
    assert store.release([ids[3]]) == 0  # already released
    assert store.count() == 5 and store.count(include_released=False) == 4
    assert [c.variation for c, _ in store.search(query, k=2)[0]] == [4, 2]
    assert len(store.cards()) == 5  # still stored
    assert store.add(rows) == 0  # a re-run neither duplicates nor un-releases
    assert store.count(include_released=False) == 4


def test_table_written_before_the_released_column(tmp_path):
    import lancedb
    import pyarrow as pa

    old = pa.schema([f for f in card_schema(DIM) if f.name != "released"])
    lancedb.connect(str(tmp_path / "mem")).create_table("cards", schema=old)
    store = MemoryStore(str(tmp_path / "mem"))
    rows = _rows(3)
    assert store.add(rows) == 3 and len(store.search(rows[0]["vector"], k=3)[0]) == 3
    assert store.release([rows[0]["id"]]) == 1  # adds the column, then marks
    assert store.add(_rows(4)) == 1 and store.count(include_released=False) == 3
    assert rows[0]["id"] not in {c.id for c, _ in store.search(rows[0]["vector"], k=4)[0]}


@pytest.mark.parametrize("index_type", ["ivf_sq", "ivf_pq", "ivf_hnsw_sq"])
def test_index_switch_keeps_results(tmp_path, index_type):
    rng = np.random.default_rng(0)
    centers = rng.normal(size=(20, 32))
    vecs = centers[rng.integers(0, 20, 600)] + 0.5 * rng.normal(size=(600, 32))
    vecs = (vecs / np.linalg.norm(vecs, axis=1, keepdims=True)).astype(np.float32)
    rows = []
    for i, v in enumerate(vecs):
        card = card_from_trajectory(_traj(["x"], variation=i), stage=0, outline="1. x")
        rows.append({**card.model_dump(), "vector": v})
    store = MemoryStore(
        str(tmp_path / "mem"),
        dim=32,
        index_threshold=500,
        index_type=index_type,
        nprobes=24,
        refine_factor=20,
    )
    for i, row in enumerate(rows):
        row["stage"] = i % 3
    store.add(rows[:400])
    assert store.ensure_index() is False and not store.indexed()  # below the threshold: exact
    queries = vecs[:50] + 0.05 * rng.normal(size=(50, 32)).astype(np.float32)
    store.add(rows[400:])
    exact = [[c.id for c, _ in h] for h in store.search(queries, k=3)]
    assert store.ensure_index() is True and store.indexed()
    approx = [[c.id for c, _ in h] for h in store.search(queries, k=3)]
    recall = np.mean([len(set(a) & set(e)) / 3 for a, e in zip(approx, exact)])
    assert recall >= 0.9, recall
    # search prefilters on released and stage: both carry scalar indices, not a scan per query
    scalar = {tuple(i.columns): i.index_type for i in store._open().list_indices()}
    assert scalar[("released",)] == "Bitmap" and scalar[("stage",)] == "BTree", scalar
    early = store.search(queries, k=3, max_stage=0)
    assert all(c.stage == 0 for h in early for c, _ in h) and all(len(h) == 3 for h in early)
    store.release([exact[0][0]])
    assert exact[0][0] not in {c.id for c, _ in store.search(queries[:1], k=3)[0]}
    assert store.ensure_index() is True  # already indexed: folds new rows in
    assert exact[0][0] not in {c.id for c, _ in store.search(queries[:1], k=3)[0]}
    with pytest.raises(ValueError, match="index_type 'hnsw'"):
        MemoryStore(str(tmp_path / "other"), dim=32, index_type="hnsw")


@pytest.fixture(scope="module")
def embedder() -> Embedder:
    return Embedder()


def test_embedder_unit_vectors_and_similarity(embedder):
    texts = [
        "Your task is to boil water.",
        "Your task is to heat water until it boils.",
        "Your task is to find the animal with the longest life span.",
    ]
    vectors = embedder.embed(texts)
    assert vectors.shape == (3, 384) and vectors.dtype == np.float32 and embedder.dim == 384
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, rtol=1e-5)
    assert vectors[0] @ vectors[1] > vectors[0] @ vectors[2] + 0.2
    assert embedder.embed([]).shape == (0, 384)
    batch = {"goal": np.array(texts[:2], dtype=object), "init_obs": np.array(["a", "b"], dtype=object)}
    out = embedder(batch)
    assert out["vector"].shape == (2, 384) and "card_vector" not in out
    np.testing.assert_allclose(out["vector"][0], embedder.embed([key_text(texts[0], "a")])[0], atol=1e-5)
    out = embedder({**batch, "outline": np.array(["1. boil", "2. heat"], dtype=object)})
    np.testing.assert_allclose(out["vector"][1], embedder.embed([key_text(texts[1], "b")])[0], atol=1e-5)
    want = embedder.embed([card_text(texts[1], "b", "2. heat")])[0]
    np.testing.assert_allclose(out["card_vector"][1], want, atol=1e-5)


def test_the_card_vector_sees_the_outline_past_a_long_start_room(embedder):
    """Selection compares whole cards: two cards of one goal and one start room are near by key (the
    same text) and apart by card text when their outlines differ, even when the room alone fills the
    embedding model's 256 word pieces (the outline comes before the room)."""
    goal = "Your task is to find the animal with the longest life span. First, focus on it."
    room = "This room is called the outside. In it, you see: " + ", ".join(
        f"a {x} {i}" for i, x in enumerate(["tree", "fence", "axe", "egg", "fire pit", "ant"] * 20)
    )
    outlines = ["1. navigate to outside; 2. focus on egg giant tortoise", "1. open the oven; 2. boil water"]
    keys = embedder.embed([key_text(goal, room)] * 2)
    cards = embedder.embed([card_text(goal, room, z) for z in outlines])
    assert keys[0] @ keys[1] == pytest.approx(1.0, abs=1e-5)
    assert cards[0] @ cards[1] < 0.99  # measured 0.963 (0.847 with a short room)
    after = embedder.embed([f"{key_text(goal, room)}\n{z}" for z in outlines])  # the outline last: cut off
    assert after[0] @ after[1] == pytest.approx(1.0, abs=1e-4)
    assert card_text(goal, room, outlines[0]).index(outlines[0]) < card_text(goal, room, outlines[0]).index(
        room
    )


def test_import_is_light():
    code = textwrap.dedent(
        """
        import sys, hamo_ray.memory
        heavy = [m for m in ("torch", "ray", "lancedb", "sentence_transformers") if m in sys.modules]
        assert not heavy, heavy
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_a_table_created_by_another_writer_at_the_same_moment_is_opened(tmp_path, monkeypatch):
    """Two writers creating the table together: LanceDB refuses one commit ("Retryable commit conflict");
    the loser opens the winner's table instead of failing (it once made the harness answer 500)."""
    import lancedb

    uri = str(tmp_path / "mem")
    real_connect = lancedb.connect

    def connect(*args, **kwargs):
        db = real_connect(*args, **kwargs)
        real_create = db.create_table

        def create_table(name, *a, **kw):
            real_create(name, *a, **kw)  # the other writer wins the race
            raise RuntimeError("lance error: Retryable commit conflict for version 2")

        db.create_table = create_table
        return db

    monkeypatch.setattr(lancedb, "connect", connect)
    store = MemoryStore(uri, dim=DIM)
    assert store.dim == DIM and store.count() == 0
    store.add(_rows(2))
    assert store.count() == 2


def test_threads_creating_one_table_together_all_get_it(tmp_path):
    import threading
    from concurrent.futures import ThreadPoolExecutor

    for trial in range(10):
        barrier = threading.Barrier(6)

        def make(_, uri=str(tmp_path / f"mem{trial}"), barrier=barrier):
            barrier.wait()
            return MemoryStore(uri, dim=DIM)

        with ThreadPoolExecutor(6) as pool:
            stores = list(pool.map(make, range(6)))
        stores[0].add(_rows(1))
        assert all(s.count() == 1 for s in stores)


# -- training-time retrieval: no card of the example's own world; gating ---------------------------------
def _world_traj(
    domain: str, task: str, variation: int, init_obs: str = "This room is called the hallway."
) -> Trajectory:
    return Trajectory(
        task=TaskSpec(domain=domain, task=task, variation=variation),
        goal=f"Your task is to {task} ({variation}).",
        init_obs=init_obs,
        actions=["look around"],
        observations=["ok"],
        score=100.0,
        done=True,
        source="expert",
    )


def _store_of(tmp_path, trajs_and_angles, stage: int = 1) -> MemoryStore:
    """A memory holding one card per trajectory, its key vector at the given angle."""
    store = MemoryStore(str(tmp_path / "mem"), dim=DIM)
    rows = []
    for traj, angle in trajs_and_angles:
        card = card_from_trajectory(traj, stage, "1. look around")
        rows.append({**card.model_dump(), "vector": _unit([np.cos(angle), np.sin(angle), 0.0, 0.0])})
    store.add(rows)
    return store


def test_worlds_per_domain():
    from hamo_ray.memory.worlds import world_of_card, world_of_task, world_of_trajectory

    sw = [_world_traj("scienceworld", t, 3) for t in ("lifespan-longest-lived", "lifespan-shortest-lived")]
    assert world_of_trajectory(sw[0]) == world_of_trajectory(sw[1])  # one variation's animals
    assert world_of_trajectory(sw[0]) == world_of_card(card_from_trajectory(sw[1], 1, "x"))
    other = [
        _world_traj("scienceworld", "lifespan-longest-lived", 4),  # another variation
        _world_traj("scienceworld", "find-living-thing", 3),  # another topic, the same number
        sw[0].model_copy(update={"task": sw[0].task.model_copy(update={"split": "test"})}),
    ]
    assert all(world_of_trajectory(t) != world_of_trajectory(sw[0]) for t in other)
    assert world_of_task(TaskSpec(domain="scienceworld", task="find-plant", variation=8)) == world_of_task(
        TaskSpec(domain="scienceworld", task="find-animal", variation=8)
    )
    room = "You are in the middle of a room. Looking quickly around you, you see a cabinet 1, a sinkbasin 1."
    a = _world_traj("alfworld", "pick_and_place_simple", 0, room)
    b = _world_traj("alfworld", "pick_clean_then_place_in_recep", 7, room)  # the same room, another game
    c = _world_traj("alfworld", "pick_and_place_simple", 1, room.replace("cabinet 1", "drawer 1"))
    assert world_of_trajectory(a) == world_of_trajectory(b) != world_of_trajectory(c)
    w = [_world_traj("webshop", "fashion", v) for v in (0, 0, 1)]
    assert world_of_trajectory(w[0]) == world_of_trajectory(w[1]) != world_of_trajectory(w[2])


def test_training_experience_never_retrieves_a_card_of_the_examples_world(tmp_path):
    from hamo_ray.memory.recall import training_experience

    query = _world_traj("scienceworld", "lifespan-longest-lived", 3)
    twins = [
        _world_traj("scienceworld", "lifespan-shortest-lived", 3),
        _world_traj("scienceworld", "lifespan-longest-lived-then-shortest-lived", 3),
    ]
    others = [
        _world_traj("scienceworld", "find-living-thing", 3),
        _world_traj("scienceworld", "lifespan-shortest-lived", 4),
        _world_traj("scienceworld", "lifespan-longest-lived", 5),
    ]
    # the twins are the query's nearest cards (they share its goal's words and its room)
    store = _store_of(
        tmp_path,
        [(query, 0.0), (twins[0], 0.01), (twins[1], 0.02)]
        + [(t, 0.1 * (i + 1)) for i, t in enumerate(others)],
    )
    counts: dict[str, int] = {}
    got = training_experience(store, [query, others[0]], k=2, counts=counts)
    assert [c.trajectory_id for c in got[query.id]] == [others[0].id, others[1].id]
    # find-living-thing of variation 3 shares the start room, not the world: the lifespan cards serve it
    assert [c.trajectory_id for c in got[others[0].id]] == [twins[1].id, twins[0].id]
    assert query.card_id not in {c.id for c in got[query.id]}
    assert counts == {"injected": 4, "withheld": 0, "same_world": 2}
    assert training_experience(store, [query], k=5, max_stage=0) == {query.id: []}


def test_training_experience_asks_again_when_the_world_fills_the_first_answer(tmp_path):
    """ALFWorld: 15 games of one room nearer than any other card (more than the k + 8 first asked)."""
    from hamo_ray.memory.recall import training_experience

    room = "You are in the middle of a room. Looking quickly around you, you see a cabinet 1."
    same = [_world_traj("alfworld", "pick_and_place_simple", v, room) for v in range(16)]
    elsewhere = [_world_traj("alfworld", "pick_and_place_simple", 100 + v, f"{room} {v}") for v in range(3)]
    store = _store_of(
        tmp_path,
        [(t, 0.001 * i) for i, t in enumerate(same)] + [(t, 0.5 + 0.1 * i) for i, t in enumerate(elsewhere)],
    )
    counts: dict[str, int] = {}
    got = training_experience(store, same[:1], k=2, counts=counts)
    assert [c.trajectory_id for c in got[same[0].id]] == [elsewhere[0].id, elsewhere[1].id]
    assert counts["same_world"] == 15


def test_gate_withholds_cards_below_the_threshold_or_of_another_domain(tmp_path):
    from hamo_ray.config import MemoryConfig
    from hamo_ray.memory.recall import gate, training_experience

    sw = _world_traj("scienceworld", "boil", 1)
    hits = [
        (card_from_trajectory(sw, 1, "x"), 0.9),
        (card_from_trajectory(_world_traj("webshop", "fashion", 2), 1, "y"), 0.8),
        (card_from_trajectory(_world_traj("scienceworld", "melt", 9), 1, "z"), 0.3),
    ]
    assert gate(hits, MemoryConfig()) == (hits, [])  # off by default
    assert gate(hits, MemoryConfig(gate_min_similarity=0.5)) == (hits[:2], hits[2:])
    assert gate(hits, MemoryConfig(gate_same_domain=True), "scienceworld") == ([hits[0], hits[2]], [hits[1]])
    both = MemoryConfig(gate_min_similarity=0.5, gate_same_domain=True)
    assert gate(hits, both, "scienceworld") == ([hits[0]], hits[1:])
    with pytest.raises(ValueError, match="domain"):
        gate(hits, MemoryConfig(gate_same_domain=True))
    # training gates alike: the first card is near (cos 0.995), the second far (cos 0.825)
    query, near, far = (
        _world_traj("scienceworld", t, v) for t, v in (("boil", 1), ("melt", 2), ("freeze", 5))
    )
    store = _store_of(tmp_path, [(query, 0.0), (near, 0.1), (far, 0.6)])
    counts: dict[str, int] = {}
    got = training_experience(store, [query], 2, mcfg=MemoryConfig(gate_min_similarity=0.9), counts=counts)
    assert [c.trajectory_id for c in got[query.id]] == [near.id]
    assert counts == {"injected": 1, "withheld": 1, "same_world": 0}


def test_the_harness_gates_as_training_does(tmp_path, embedder):
    """The harness's retrieval (inference) withholds what ``gate`` withholds and says how many."""
    from hamo_ray.config import MemoryConfig
    from hamo_ray.serving.harness import HarnessServer
    from hamo_ray.types import card_text

    trajs = [_world_traj("scienceworld", "boil", 1), _world_traj("webshop", "fashion", 2)]
    cards = [card_from_trajectory(t, 1, "1. look around") for t in trajs]
    keys = embedder.embed([key_text(c.goal, c.init_obs) for c in cards])
    texts = embedder.embed([card_text(c.goal, c.init_obs, c.outline) for c in cards])
    uri = str(tmp_path / "mem")
    MemoryStore(uri, dim=embedder.dim).add(
        [
            {**c.model_dump(), "vector": k, "card_vector": v}
            for c, k, v in zip(cards, keys, texts, strict=True)
        ]
    )

    def harness(uri: str, mcfg: MemoryConfig):  # the replica's state, without Serve's async constructor
        import threading

        server = HarnessServer.func_or_class.__new__(HarnessServer.func_or_class)
        server.max_stage, server.embedder, server.memory_uri, server.memory = None, embedder, uri, mcfg
        server._store, server._store_lock = None, threading.Lock()
        return server

    goal, obs = trajs[0].goal, trajs[0].init_obs
    ungated = harness(uri, MemoryConfig()).retrieve_cards(goal, obs, 2)
    assert [c["domain"] for c in ungated["cards"]] == ["scienceworld", "webshop"] and ungated["withheld"] == 0
    same = harness(uri, MemoryConfig(gate_same_domain=True))
    got = same.retrieve_cards(goal, obs, 2, domain="scienceworld")
    assert [c["domain"] for c in got["cards"]] == ["scienceworld"] and got["withheld"] == 1
    with pytest.raises(ValueError, match="domain"):
        same.retrieve_cards(goal, obs, 2)
    low = ungated["scores"][1]
    got = harness(uri, MemoryConfig(gate_min_similarity=low + 1e-3)).retrieve_cards(goal, obs, 2)
    assert len(got["cards"]) == 1 and got["withheld"] == 1 and got["scores"] == ungated["scores"][:1]
