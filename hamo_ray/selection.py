"""Retrieval-coverage selection of anchor trajectories (HaMo, Algorithm 1).

Over the cards of one stage:

1. leave-one-out retrieval: for each card ``i`` its ``k`` nearest *other* cards ``N_k(i)`` (cosine);
2. reverse it: ``R_j = {i | j in N_k(i)}``, the queries card ``j`` would serve;
3. greedy max coverage of ``F(S) = |U_{j in S} R_j|`` with a lazy priority queue (CELF), run to
   saturation, ties broken by the smaller card index;
4. the budget ``N*`` is the knee of the coverage-vs-picks curve (Kneedle: the point of the
   normalised curve farthest above the chord from the origin to saturation).

Usage::

    from hamo_ray.selection import coverage_select
    result = coverage_select(embeddings, k=3)
    anchors = [cards[i] for i in result.order]   # result.order has result.budget entries
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SelectionResult:
    """The outcome of coverage selection.

    Attributes:
        order: card indices in pick order, up to the budget.
        gains: marginal coverage gain of each pick in ``order``.
        curve: coverage ``F`` after each of the first n picks, run to saturation.
        budget: the knee of ``curve`` (number of anchors), ``len(order)``.
        full_order: all greedy picks to saturation (``order`` is its prefix).
        full_gains: the marginal gains of ``full_order``.
        n_hits: ``|R_j|`` for every card.
    """

    order: list[int]
    gains: list[int]
    curve: list[int]
    budget: int
    full_order: list[int]
    full_gains: list[int]
    n_hits: list[int]


def leave_one_out_neighbours(embeddings: np.ndarray, k: int = 3, batch_size: int = 4096) -> np.ndarray:
    """Top-``k`` most similar *other* rows for every row, by cosine similarity.

    Computed in row batches so memory stays ``O(batch_size * n)``.

    Args:
        embeddings: ``(n, d)`` array.
        k: neighbours per row; reduced to ``n - 1`` when fewer rows exist.
        batch_size: rows per similarity block.

    Returns:
        ``(n, min(k, n-1))`` int array of neighbour indices, nearest first (ties: smaller index).
    """
    x = np.asarray(embeddings, dtype=np.float32)
    if x.ndim != 2:
        raise ValueError(f"embeddings must be a 2-D array, got shape {x.shape}")
    n = x.shape[0]
    k = min(k, n - 1)
    if k <= 0:
        return np.zeros((n, 0), dtype=np.int64)
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    x = x / np.maximum(norms, 1e-12)
    out = np.empty((n, k), dtype=np.int64)
    for start in range(0, n, batch_size):
        stop = min(start + batch_size, n)
        sims = x[start:stop] @ x.T
        sims[np.arange(stop - start), np.arange(start, stop)] = -np.inf
        # Stable ordering: sort by (-similarity, index) so ties resolve to the smaller index.
        cand = (
            np.argpartition(-sims, k - 1, axis=1)[:, :k]
            if k < n - 1
            else np.argsort(-sims, axis=1, kind="stable")[:, :k]
        )
        cand_sims = np.take_along_axis(sims, cand, axis=1)
        order = np.lexsort((cand, -cand_sims), axis=1)
        out[start:stop] = np.take_along_axis(cand, order, axis=1)
    return out


def reverse_neighbours(neighbours: np.ndarray, n: int) -> list[np.ndarray]:
    """``R_j = {i | j in N(i)}`` for every card ``j`` (sorted query indices)."""
    buckets: list[list[int]] = [[] for _ in range(n)]
    for i, row in enumerate(neighbours):
        for j in row:
            buckets[int(j)].append(i)
    return [np.array(sorted(set(b)), dtype=np.int64) for b in buckets]


def lazy_greedy_coverage(sets: list[np.ndarray], universe: int) -> tuple[list[int], list[int]]:
    """Greedy max coverage with CELF lazy evaluation, run until no pick adds coverage.

    Ties are broken by the smaller set index, so the result equals the plain greedy's.

    Returns:
        (picks, gains) in pick order.
    """
    covered = np.zeros(universe, dtype=bool)
    heap = [(-len(s), j, 0) for j, s in enumerate(sets) if len(s) > 0]
    heapq.heapify(heap)
    picks: list[int] = []
    gains: list[int] = []
    while heap:
        neg_gain, j, evaluated_at = heapq.heappop(heap)
        if evaluated_at == len(picks):
            if -neg_gain <= 0:
                break
            picks.append(j)
            gains.append(-neg_gain)
            covered[sets[j]] = True
            continue
        gain = int((~covered[sets[j]]).sum())
        if gain > 0:
            heapq.heappush(heap, (-gain, j, len(picks)))
    return picks, gains


def knee_point(curve: list[float] | np.ndarray) -> int:
    """Kneedle knee of an increasing, concave-ish coverage curve.

    ``curve[i]`` is the coverage after ``i + 1`` picks. The curve is normalised to the unit square
    with the origin (0 picks, 0 coverage) prepended; the knee is the number of picks whose point lies
    farthest above the chord from the origin to the last point. A straight line (no diminishing
    returns) has no knee: every pick is kept.

    Returns:
        The budget: a number of picks in ``[1, len(curve)]`` (0 for an empty curve).
    """
    y = np.asarray(curve, dtype=np.float64)
    m = len(y)
    if m == 0:
        return 0
    if m == 1 or y[-1] <= 0:
        return 1
    xs = np.arange(1, m + 1) / m
    ys = y / y[-1]
    diff = ys - xs
    best = int(np.argmax(diff))
    if diff[best] <= 1e-9:
        return m
    return best + 1


def coverage_select(embeddings: np.ndarray, k: int = 3, min_budget: int = 1) -> SelectionResult:
    """Select compact, complementary anchors by retrieval coverage (METHOD.md step 2).

    Args:
        embeddings: ``(n, d)`` card embeddings of one stage.
        k: leave-one-out neighbours per card (3 in the paper).
        min_budget: never select fewer anchors than this (capped at ``n``).

    Returns:
        A ``SelectionResult``; ``order`` holds ``budget`` card indices.

    Raises:
        ValueError: ``embeddings`` is not 2-D.
    """
    x = np.asarray(embeddings)
    if x.ndim != 2:
        raise ValueError(f"embeddings must be a 2-D array, got shape {x.shape}")
    n = x.shape[0]
    if n == 0:
        return SelectionResult([], [], [], 0, [], [], [])
    neighbours = leave_one_out_neighbours(x, k)
    sets = reverse_neighbours(neighbours, n)
    picks, gains = lazy_greedy_coverage(sets, n)
    curve = np.cumsum(gains).astype(int).tolist()
    budget = knee_point(curve)
    budget = min(max(budget, min_budget), n)
    order = list(picks[:budget])
    order_gains = list(gains[:budget])
    if len(order) < budget:
        # Saturated before min_budget: fill with unpicked cards by index (gain 0).
        chosen = set(order)
        extra = [i for i in range(n) if i not in chosen][: budget - len(order)]
        order += extra
        order_gains += [0] * len(extra)
    return SelectionResult(
        order=order,
        gains=order_gains,
        curve=curve,
        budget=len(order),
        full_order=list(picks),
        full_gains=list(gains),
        n_hits=[len(s) for s in sets],
    )
