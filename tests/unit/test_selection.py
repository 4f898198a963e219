"""Coverage selection against a brute-force greedy, and the knee on known curves."""

from __future__ import annotations

import numpy as np
import pytest

from hamo_ray.selection import coverage_select, knee_point, leave_one_out_neighbours, reverse_neighbours


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
    import hamo_ray.selection as selection

    rng = np.random.default_rng(3)
    centers = rng.normal(size=(20, 16))
    emb = centers[rng.integers(0, 20, 1500)] + 0.3 * rng.normal(size=(1500, 16))
    emb[[40, 41, 42]] = emb[7]  # duplicates: ties resolved to the smaller index
    emb[99] = emb[98]
    exact = leave_one_out_neighbours(emb, 3)
    monkeypatch.setattr(selection, "EXACT_MAX_ROWS", 100)
    blocked = leave_one_out_neighbours(emb, 3, batch_size=128)
    # Rows may differ only where float rounding reorders near-ties (none here at float32 spacing).
    assert (blocked == exact).all()
    assert blocked[7].tolist() == [40, 41, 42] and blocked[40].tolist() == [7, 41, 42]


@pytest.mark.parametrize("fraction, expected", [(0.0, None), (0.5, 20), (1.0, 40)])
def test_budget_floor_as_a_share_of_the_stage(fraction, expected):
    """``selection.min_fraction`` raises the knee's budget to ceil(fraction * n); 0 keeps the knee."""
    from types import SimpleNamespace

    from hamo_ray.config import HamoConfig
    from hamo_ray.steps import select

    rng = np.random.default_rng(0)
    centres = rng.normal(size=(4, 16))
    x = np.concatenate([c + 0.01 * rng.normal(size=(10, 16)) for c in centres])  # 4 tight clusters
    trajs = [SimpleNamespace(card_id=f"c{i}") for i in range(len(x))]
    store = SimpleNamespace(vectors=lambda ids: x[[int(i[1:]) for i in ids]])
    cfg = HamoConfig.model_validate({"selection": {"min_fraction": fraction}})
    anchors, budget = select(cfg, trajs, store)
    knee = coverage_select(x).budget
    assert knee < 20  # the knee alone is small here, so the floor is what binds
    assert budget == len(anchors) == (expected or knee)
    assert len({a.card_id for a in anchors}) == budget
    with pytest.raises(ValueError, match="min_fraction"):
        HamoConfig.model_validate({"selection": {"min_fraction": 1.5}})
