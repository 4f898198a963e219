"""Retrieval-coverage selection of anchor trajectories (HaMo, Algorithm 1).

Over the cards of one stage:

1. leave-one-out retrieval: for each card ``i`` its ``k`` nearest *other* cards ``N_k(i)`` (cosine);
2. reverse it: ``R_j = {i | j in N_k(i)}``, the queries card ``j`` would serve;
3. greedy max coverage of ``F(S) = |U_{j in S} R_j|`` with a lazy priority queue (CELF), run to
   saturation, ties broken by the smaller card index;
4. the budget ``N*`` is the knee of the coverage-vs-picks curve (Kneedle: the point of the
   normalised curve farthest above the chord from the origin to saturation);
5. a floor above the saturation point (``min_budget`` > greedy picks) is filled by :func:`fill_floor`:
   round-robin over the cards' groups (task types), fewest anchors first, each group's cards by hit
   count ``|R_j|``, ties by a seeded draw; never by card index.

Usage::

    from hamo_ray.selection import coverage_select
    result = coverage_select(embeddings, k=3)
    anchors = [cards[i] for i in result.order]   # result.order has result.budget entries
"""

from __future__ import annotations

import heapq
import logging
import random
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hamo_ray.neighbours import leave_one_out_neighbours

__all__ = [
    "SelectionResult",
    "coverage_select",
    "fill_floor",
    "knee_point",
    "lazy_greedy_coverage",
    "leave_one_out_neighbours",
    "reverse_neighbours",
    "sample_replay",
    "select_anchors",
]

logger = logging.getLogger(__name__)


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


def reverse_neighbours(neighbours: np.ndarray, n: int) -> list[np.ndarray]:
    """``R_j = {i | j in N(i)}`` for every card ``j`` (sorted, distinct query indices)."""
    nb = np.asarray(neighbours, dtype=np.int64)
    queries = np.repeat(np.arange(nb.shape[0], dtype=np.int64), nb.shape[1])
    targets = nb.ravel()
    pairs = np.unique(targets * max(n, 1) + queries)  # sorted by (target, query), duplicates gone
    targets, queries = pairs // max(n, 1), pairs % max(n, 1)
    bounds = np.searchsorted(targets, np.arange(n + 1))
    return [queries[bounds[j] : bounds[j + 1]] for j in range(n)]


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


def fill_floor(
    order: list[int],
    n_hits: Sequence[int],
    budget: int,
    groups: Sequence[Hashable] | None = None,
    seed: int = 0,
) -> list[int]:
    """The cards that top ``order`` (the greedy picks) up to ``budget``, in fill order.

    The greedy picks are all kept; the extra cards are drawn from the unpicked ones, round-robin
    over ``groups``: each next card goes to the group with the fewest cards chosen so far (greedy
    picks included), equal counts in a seeded order of the groups; a group's cards go by hit count
    (``n_hits``, more first), equal counts in a seeded order. A group whose cards are used up is
    skipped. Without groups every card is in one group (hit count, then the seeded draw). Card
    indices never decide, so cards that arrive grouped (a stage's trajectories come task type by
    task type) do not tilt the floor towards the first group.

    Args:
        order: the card indices already chosen (kept, first).
        n_hits: ``|R_j|`` for every card.
        budget: the number of cards wanted in all.
        groups: one group key per card (its task type), or None.
        seed: the draw that breaks ties (the same seed, the same fill).

    Returns:
        ``budget - len(order)`` card indices (fewer if the cards run out), in fill order.
    """
    n = len(n_hits)
    if groups is not None and len(groups) != n:
        raise ValueError(f"groups has {len(groups)} entries for {n} cards")
    want = min(budget, n) - len(order)
    if want <= 0:
        return []
    # numpy generators take non-negative seeds only: any int seed goes through random.Random first.
    rng = np.random.default_rng(random.Random(seed).getrandbits(64))
    keys = list(groups) if groups is not None else [None] * n
    tie = rng.permutation(n)
    chosen = np.zeros(n, dtype=bool)
    chosen[list(order)] = True
    free = np.flatnonzero(~chosen)
    hits = np.asarray(n_hits, dtype=np.int64)
    free = free[np.lexsort((tie[free], -hits[free]))]  # hit count desc, then the seeded draw
    queues: dict[Hashable, list[int]] = {}
    for i in free.tolist():
        queues.setdefault(keys[i], []).append(i)
    count = {g: 0 for g in queues}
    for i in order:
        if keys[i] in count:
            count[keys[i]] += 1
    names = list(queues)
    rank = {names[j]: r for r, j in enumerate(rng.permutation(len(names)).tolist())}
    heap = [(count[g], rank[g], g) for g in names]
    heapq.heapify(heap)
    taken = dict.fromkeys(names, 0)
    extra: list[int] = []
    while heap and len(extra) < want:
        c, r, g = heapq.heappop(heap)
        extra.append(queues[g][taken[g]])
        taken[g] += 1
        if taken[g] < len(queues[g]):
            heapq.heappush(heap, (c + 1, r, g))
    return extra


def coverage_select(
    embeddings: np.ndarray,
    k: int = 3,
    min_budget: int = 1,
    batch_size: int = 2048,
    groups: Sequence[Hashable] | None = None,
    seed: int = 0,
) -> SelectionResult:
    """Select compact, complementary anchors by retrieval coverage (docs/method.md step 2).

    Args:
        embeddings: ``(n, d)`` card embeddings of one stage.
        k: leave-one-out neighbours per card (3 in the paper).
        min_budget: never select fewer anchors than this (capped at ``n``).
        batch_size: rows per similarity block (memory ``O(batch_size * n)``).
        groups: one key per card (its task type): a floor above the greedy saturation point is
            filled round-robin over them (:func:`fill_floor`); None: one group.
        seed: the draw that breaks the floor's ties (the stage's seed).

    Returns:
        A ``SelectionResult``; ``order`` holds ``budget`` card indices.

    Raises:
        ValueError: ``embeddings`` is not 2-D, or ``groups`` does not have one entry per card.
    """
    x = np.asarray(embeddings)
    if x.ndim != 2:
        raise ValueError(f"embeddings must be a 2-D array, got shape {x.shape}")
    n = x.shape[0]
    if groups is not None and len(groups) != n:
        raise ValueError(f"groups has {len(groups)} entries for {n} cards")
    if n == 0:
        return SelectionResult([], [], [], 0, [], [], [])
    neighbours = leave_one_out_neighbours(x, k, batch_size)
    sets = reverse_neighbours(neighbours, n)
    n_hits = [len(s) for s in sets]
    picks, gains = lazy_greedy_coverage(sets, n)
    curve = np.cumsum(gains).astype(int).tolist()
    budget = knee_point(curve)
    budget = min(max(budget, min_budget), n)
    order = list(picks[:budget])
    order_gains = list(gains[:budget])
    if len(order) < budget:
        # Saturated before min_budget: every greedy pick stays; the rest (gain 0) is filled
        # round-robin over the groups, by hit count, ties by the seeded draw.
        extra = fill_floor(order, n_hits, budget, groups, seed)
        order += extra
        order_gains += [0] * len(extra)
    return SelectionResult(
        order=order,
        gains=order_gains,
        curve=curve,
        budget=len(order),
        full_order=list(picks),
        full_gains=list(gains),
        n_hits=n_hits,
    )


def select_anchors(
    trajectories: list[Any],
    vectors: np.ndarray | None,
    k: int,
    min_budget: int,
    batch_size: int,
    groups: Sequence[Hashable] | None = None,
    seed: int = 0,
) -> tuple[list[Any], int]:
    """A stage's anchors: its trajectories in coverage order, cut at the knee (docs/method.md step 2).

    Args:
        trajectories: the stage's trajectories, in the order of ``vectors``' rows.
        vectors: their cards' embeddings; None: no selection, every trajectory is an anchor.
        k: leave-one-out neighbours per card.
        min_budget: never fewer anchors than this.
        batch_size: rows per similarity block.
        groups: one key per trajectory (its task type), for the floor's round-robin; None: one group.
        seed: the floor's tie-break draw (the stage's seed).

    Returns:
        ``(anchors, budget)``.
    """
    if vectors is None:
        return list(trajectories), len(trajectories)
    result = coverage_select(
        vectors, k=k, min_budget=min_budget, batch_size=batch_size, groups=groups, seed=seed
    )
    logger.info("select: budget %d of %d (coverage curve %s)", result.budget, len(trajectories), result.curve)
    return [trajectories[i] for i in result.order], result.budget


def sample_replay(earlier: list[Any], n_anchors: int, ratio: float, seed: int) -> list[Any]:
    """Replay (docs/method.md step 3): ``ratio`` x ``n_anchors`` of the earlier stages' anchors, at random.

    Args:
        earlier: the anchors of the stages committed so far.
        n_anchors: this stage's anchors.
        ratio: replayed per anchor (``replay.ratio``).
        seed: the sample's seed (fixed per run and stage, so a redone stage replays the same).
    """
    n = min(len(earlier), round(ratio * n_anchors))
    picked = random.Random(seed).sample(earlier, n) if n else []
    logger.info("replay: %d of %d earlier anchors", len(picked), len(earlier))
    return picked
