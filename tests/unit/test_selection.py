"""Coverage selection against a brute-force greedy, and the knee on known curves."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from hamo_ray.selection import (
    coverage_select,
    fill_floor,
    knee_point,
    leave_one_out_neighbours,
    reverse_neighbours,
)


def brute_force_greedy(embeddings: np.ndarray, k: int = 3) -> tuple[list[int], list[int]]:
    """Plain greedy over explicit sets, recomputing every gain at every step."""
    x = embeddings / np.linalg.norm(embeddings, axis=1, keepdims=True)
    n = len(x)
    sims = x @ x.T
    np.fill_diagonal(sims, -np.inf)
    kk = min(k, n - 1)
    nbrs = [list(np.argsort(-sims[i], kind="stable")[:kk]) for i in range(n)]
    sets = [{i for i in range(n) if j in nbrs[i]} for j in range(n)]
    covered: set[int] = set()
    picks, gains = [], []
    while True:
        best, best_gain = None, 0
        for j in range(n):
            g = len(sets[j] - covered)
            if g > best_gain:
                best, best_gain = j, g
        if best is None:
            break
        picks.append(best)
        gains.append(best_gain)
        covered |= sets[best]
    return picks, gains


@pytest.mark.parametrize("seed", range(12))
def test_lazy_greedy_matches_brute_force(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 60))
    d = int(rng.integers(2, 16))
    emb = rng.normal(size=(n, d))
    result = coverage_select(emb, k=3)
    picks, gains = brute_force_greedy(emb, k=3)
    assert result.full_gains == gains
    assert result.full_order == picks
    assert result.curve == list(np.cumsum(gains))
    assert result.order == picks[: result.budget]
    assert result.gains == gains[: result.budget]
    assert 1 <= result.budget <= n
    # Saturation: every card is somebody's neighbour-query, so the curve ends at n.
    assert result.curve[-1] == n


def test_neighbours_exclude_self_and_reverse():
    emb = np.array([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0], [0.1, 0.9]])
    nbrs = leave_one_out_neighbours(emb, k=1)
    assert nbrs[:, 0].tolist() == [1, 0, 3, 2]
    sets = reverse_neighbours(nbrs, 4)
    assert [s.tolist() for s in sets] == [[1], [0], [3], [2]]


def test_batched_neighbours_equal_unbatched():
    emb = np.random.default_rng(0).normal(size=(50, 8))
    assert (leave_one_out_neighbours(emb, 3, batch_size=7) == leave_one_out_neighbours(emb, 3)).all()


def test_knee_on_known_curves():
    # Sharp elbow after 2 picks.
    assert knee_point([10, 18, 19, 19.5, 20]) == 2
    # Elbow after 3 picks.
    assert knee_point([4, 8, 12, 12.5, 13, 13.2]) == 3
    # A straight line has no diminishing returns: keep every pick.
    assert knee_point([1, 2, 3, 4, 5]) == 5
    assert knee_point([7]) == 1
    assert knee_point([]) == 0


def test_small_and_degenerate_inputs():
    assert coverage_select(np.zeros((0, 4))).budget == 0
    one = coverage_select(np.ones((1, 4)))
    assert one.order == [0] and one.budget == 1
    two = coverage_select(np.eye(2))
    assert sorted(two.full_order) == [0, 1] and two.budget >= 1
    with pytest.raises(ValueError, match="2-D"):
        coverage_select(np.ones(5))


def test_clustered_cards_pick_one_per_cluster_first():
    rng = np.random.default_rng(1)
    centers = rng.normal(size=(3, 16)) * 10
    emb = np.concatenate([c + rng.normal(size=(8, 16)) * 0.1 for c in centers])
    result = coverage_select(emb, k=3)
    clusters = {i // 8 for i in result.full_order[:3]}
    assert clusters == {0, 1, 2}
    assert result.budget < len(emb)


def test_blocked_neighbours_equal_exact_rows_with_ties(monkeypatch):
    """The symmetric torch blocks (used above EXACT_MAX_ROWS) give the exact numpy neighbours."""
    import hamo_ray.neighbours as neighbours

    rng = np.random.default_rng(3)
    centers = rng.normal(size=(20, 16))
    emb = centers[rng.integers(0, 20, 1500)] + 0.3 * rng.normal(size=(1500, 16))
    emb[[40, 41, 42]] = emb[7]  # duplicates: ties resolved to the smaller index
    emb[99] = emb[98]
    exact = leave_one_out_neighbours(emb, 3)
    monkeypatch.setattr(neighbours, "EXACT_MAX_ROWS", 100)
    blocked = leave_one_out_neighbours(emb, 3, batch_size=128)
    # Rows may differ only where float rounding reorders near-ties (none here at float32 spacing).
    assert (blocked == exact).all()
    assert blocked[7].tolist() == [40, 41, 42] and blocked[40].tolist() == [7, 41, 42]


@pytest.mark.parametrize("fraction, expected", [(0.0, None), (0.5, 20), (1.0, 40)])
def test_budget_floor_as_a_share_of_the_stage(fraction, expected):
    """``selection.min_fraction`` raises the knee's budget to ceil(fraction * n); 0 keeps the knee."""
    from types import SimpleNamespace

    from hamo_ray.config import HamoConfig
    from hamo_ray.run.stage import select

    rng = np.random.default_rng(0)
    centres = rng.normal(size=(4, 16))
    x = np.concatenate([c + 0.01 * rng.normal(size=(10, 16)) for c in centres])  # 4 tight clusters
    task = [SimpleNamespace(domain="d", task=f"type{i // 10}") for i in range(len(x))]  # the clusters
    trajs = [SimpleNamespace(card_id=f"c{i}", task=task[i]) for i in range(len(x))]
    store = SimpleNamespace(vectors=lambda ids, column="vector": x[[int(i[1:]) for i in ids]])
    cfg = HamoConfig.model_validate({"selection": {"min_fraction": fraction}})
    anchors, budget = select(cfg, trajs, store)
    knee = coverage_select(x).budget
    assert knee < 20  # the knee alone is small here, so the floor is what binds
    assert budget == len(anchors) == (expected or knee)
    assert len({a.card_id for a in anchors}) == budget
    per_type = Counter(a.task.task for a in anchors)
    assert max(per_type.values()) - min(per_type.values()) <= (1 if expected else budget)
    with pytest.raises(ValueError, match="min_fraction"):
        HamoConfig.model_validate({"selection": {"min_fraction": 1.5}})


def grouped_stage(seed: int = 0, types: int = 4, per_type: int = 6) -> np.ndarray:
    """The learning experiment's shape: ``types`` task types x ``per_type`` cards, in type order."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(types, 32))
    return np.concatenate([c + 0.6 * rng.normal(size=(per_type, 32)) for c in centres])


def per_group(order: list[int], groups: list) -> dict:
    return dict(Counter(groups[i] for i in order))


@pytest.mark.parametrize("seed", range(8))
def test_floor_is_balanced_over_task_types(seed):
    """Greedy saturates before the floor of 12: the fill goes round-robin, not to the first type."""
    x = grouped_stage(seed)
    groups = [f"type{i // 6}" for i in range(24)]
    result = coverage_select(x, k=3, min_budget=12, groups=groups, seed=seed)
    assert len(result.full_order) < 12  # saturated early: the floor is what fills
    assert result.budget == len(result.order) == len(set(result.order)) == 12
    assert per_group(result.order, groups) == {f"type{t}": 3 for t in range(4)}


@pytest.mark.parametrize("seed", range(4))
def test_floor_is_balanced_whatever_the_type_order(seed):
    """The same cards with the type blocks reordered, or interleaved, still give 3 per type."""
    x = grouped_stage(seed)
    groups = np.array([f"type{i // 6}" for i in range(24)])
    blocks = np.arange(24).reshape(4, 6)
    for perm in (blocks[[2, 0, 3, 1]].ravel(), blocks.T.ravel(), blocks[::-1].ravel()):
        g = groups[perm].tolist()
        result = coverage_select(x[perm], k=3, min_budget=12, groups=g, seed=seed)
        assert per_group(result.order, g) == {f"type{t}": 3 for t in range(4)}


def test_floor_is_deterministic_for_a_seed():
    x = grouped_stage(5)
    groups = [i // 6 for i in range(24)]
    runs = [coverage_select(x, k=3, min_budget=12, groups=groups, seed=11).order for _ in range(3)]
    assert runs[0] == runs[1] == runs[2]
    assert runs[0] == coverage_select(x, k=3, min_budget=12, groups=groups, seed=11).order


@pytest.mark.parametrize("budget", [10, 12, 15, 20])
def test_seeds_differ_only_in_ties(budget):
    """Across seeds: the same greedy picks, the same hit counts filled per type; only ties move."""
    x = grouped_stage(2)
    groups = [i // 6 for i in range(24)]
    results = [coverage_select(x, k=3, min_budget=budget, groups=groups, seed=s) for s in range(20)]
    hits = results[0].n_hits
    sat = len(results[0].full_order)
    sizes, fills = set(), set()
    for r in results:
        assert r.order[:sat] == results[0].full_order
        counts = per_group(r.order, groups)
        sizes.add(tuple(sorted(counts.values())))
        # Within a type the filled cards are the unpicked ones with the most hits.
        for g in set(groups):
            free = [i for i in range(24) if groups[i] == g and i not in r.full_order]
            filled = [i for i in r.order[sat:] if groups[i] == g]
            rest = [hits[i] for i in free if i not in filled]
            assert all(hits[i] >= max(rest, default=-1) for i in filled)
        fills.add(tuple(sorted((groups[i], hits[i]) for i in r.order[sat:])) if budget % 4 == 0 else None)
    assert len(sizes) == 1  # the per-type counts are the same up to which type gets a remainder
    assert len(fills) == 1  # with an even split, the same (type, hits) multiset for every seed


@pytest.mark.parametrize("seed", range(30))
def test_greedy_picks_always_stay(seed):
    """The floor only adds: the greedy picks (to the budget or saturation) come first, unchanged."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 50))
    x = rng.normal(size=(n, int(rng.integers(2, 12))))
    groups = rng.integers(0, int(rng.integers(1, 6)), n).tolist() if seed % 3 else None
    floor = int(rng.integers(1, n + 1))
    plain = coverage_select(x, k=3)
    result = coverage_select(x, k=3, min_budget=floor, groups=groups, seed=seed)
    assert result.full_order == plain.full_order
    assert result.budget == len(result.order) == len(set(result.order)) == max(floor, plain.budget)
    kept = min(result.budget, len(plain.full_order))
    assert result.order[:kept] == plain.full_order[:kept]
    assert result.gains[kept:] == [0] * (result.budget - kept)


def test_fill_goes_to_the_types_with_fewest_anchors_and_skips_exhausted_ones():
    groups = ["a"] * 6 + ["b"] * 6 + ["c"]
    hits = [1] * 13
    # Greedy took three of type a: b and c catch up first (c runs out after its only card), then
    # a and b take turns.
    for seed in range(5):
        extra = fill_floor([0, 1, 2], hits, 9, groups, seed=seed)
        assert per_group(extra[:4], groups) == {"b": 3, "c": 1}
        assert per_group(extra[4:], groups) == {"a": 1, "b": 1}
    # More than the cards there are: everything, once.
    assert sorted(fill_floor([0], hits, 50, groups, seed=1)) == list(range(1, 13))
    assert fill_floor([0, 1], hits, 2, groups) == []
    with pytest.raises(ValueError, match="groups"):
        fill_floor([0], hits, 5, groups[:-1])


def test_fill_without_types_goes_by_hits_then_seeded_ties_never_by_index():
    hits = [0, 1, 1, 1, 1, 1, 1, 5, 0, 3]
    for seed in range(10):
        extra = fill_floor([], hits, 4, None, seed=seed)
        assert extra[:2] == [7, 9]  # the most hits first
        assert {*extra[2:]} <= {1, 2, 3, 4, 5, 6}  # then two of the six tied at 1 hit
    draws = {tuple(fill_floor([], hits, 4, None, seed=s)[2:]) for s in range(10)}
    assert len(draws) > 1  # the tie is drawn, not taken in index order
    # All ties: a seeded permutation rather than 0, 1, 2, ...
    flat = [0] * 24
    orders = {tuple(fill_floor([], flat, 12, None, seed=s)) for s in range(5)}
    assert len(orders) == 5 and tuple(range(12)) not in orders


# -- what selection compares: the whole card (selection.embed) ------------------------------------------
def _stage_cards(tmp_path):
    """Six cards of one goal and one start room (identical keys) and two strategies (outlines), stored
    with both embeddings as the card pipeline stores them."""
    from hamo_ray.memory import Embedder, MemoryStore, card_from_trajectory
    from hamo_ray.types import TaskSpec, Trajectory, card_text, key_text

    strategies = [
        ["open door to kitchen", "go to kitchen", "pick up thermometer", "focus on thermometer"],
        ["open door to outside", "go to outside", "focus on egg giant tortoise", "wait1"],
    ]
    trajs = [
        Trajectory(
            task=TaskSpec(domain="scienceworld", task="lifespan-longest-lived", variation=v),
            goal="Your task is to find the animal with the longest life span.",
            init_obs="This room is called the hallway. In it, you see: a picture.",
            actions=strategies[v % 2] + ["look around"] * (v // 2),
            observations=["ok"] * (len(strategies[v % 2]) + v // 2),
            score=100.0,
            done=True,
            source="expert",
        )
        for v in range(6)
    ]
    embedder = Embedder()
    cards = [card_from_trajectory(t, 1, " ".join(t.actions)) for t in trajs]
    keys = embedder.embed([key_text(c.goal, c.init_obs) for c in cards])
    texts = embedder.embed([card_text(c.goal, c.init_obs, c.outline) for c in cards])
    store = MemoryStore(str(tmp_path / "mem"), dim=embedder.dim)
    store.add(
        [
            {**c.model_dump(), "vector": k, "card_vector": v}
            for c, k, v in zip(cards, keys, texts, strict=True)
        ]
    )
    return trajs, store


def test_select_compares_whole_cards_by_default_and_keys_on_request(tmp_path):
    from hamo_ray.config import load_config
    from hamo_ray.run.stage import select

    trajs, store = _stage_cards(tmp_path)
    cfg = load_config(None, ["method.name=hamo", "selection.k=2"])
    assert cfg.selection.embed == "card"
    anchors, budget = select(cfg, trajs, store, stage=1)
    # the card vectors tell the two strategies apart: the first two anchors are one of each
    assert {t.task.variation % 2 for t in anchors[:2]} == {0, 1} and budget <= len(trajs)
    # by key the six cards are one point: the knee keeps one anchor, of one strategy (measured: 1 of 6)
    by_key, _ = select(
        load_config(None, ["method.name=hamo", "selection.k=2", "selection.embed=key"]), trajs, store
    )
    assert len({t.task.variation % 2 for t in by_key}) == 1
    asked = []

    class Spy:
        def vectors(self, ids, column="vector"):
            asked.append(column)
            return store.vectors(ids, column)

    select(cfg, trajs, Spy(), stage=1)
    select(load_config(None, ["method.name=hamo", "selection.embed=key"]), trajs, Spy(), stage=1)
    assert asked == ["card_vector", "vector"]


def test_a_saved_config_without_selection_embed_reads_as_the_old_behaviour():
    """Runs and exports made before selection.embed existed compared keys: they read as ``key``."""
    from hamo_ray.config import HamoConfig, upgrade_saved_config

    saved = HamoConfig().model_dump(mode="json")
    del saved["selection"]["embed"]
    up = upgrade_saved_config(saved)
    assert up["selection"]["embed"] == "key" and "embed" not in saved["selection"]  # not modified
    assert HamoConfig.model_validate(up).selection.embed == "key"
    assert upgrade_saved_config(up) == up  # idempotent
    assert upgrade_saved_config(HamoConfig().model_dump(mode="json"))["selection"]["embed"] == "card"
    assert upgrade_saved_config({"train": {"epochs": 1}}) == {"train": {"epochs": 1}}


def test_resuming_a_run_started_before_selection_embed(tmp_path):
    """An old run folder resumes with selection.embed=key (what it did) and is refused with the new
    default, naming the key."""
    import yaml

    from hamo_ray.config import ConfigError, load_config
    from hamo_ray.run.folder import RunFolder

    cfg = load_config(None, [f"run.root={tmp_path}", "run.id=old", "run.resume=true", "selection.embed=key"])
    folder = RunFolder(tmp_path / "old", cfg)
    folder.prepare()
    saved = yaml.safe_load((folder.path / "config.yaml").read_text())
    del saved["selection"]["embed"]
    (folder.path / "config.yaml").write_text(yaml.safe_dump(saved))
    folder._check_same_config()  # what the run did: passes
    new = load_config(None, [f"run.root={tmp_path}", "run.id=old", "run.resume=true"])
    with pytest.raises(ConfigError, match="selection.embed"):
        RunFolder(tmp_path / "old", new)._check_same_config()
