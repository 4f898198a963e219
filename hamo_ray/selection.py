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


EXACT_MAX_ROWS = 8192  # up to this many cards: one numpy pass; above: symmetric torch blocks


def leave_one_out_neighbours(embeddings: np.ndarray, k: int = 3, batch_size: int = 2048) -> np.ndarray:
    """Top-``k`` most similar *other* rows for every row, by cosine similarity (exact).

    Up to ``EXACT_MAX_ROWS`` rows: numpy row blocks. Above: :func:`_blocked_topk`, which computes
    each block pair of the symmetric similarity matrix once, keeps a running top-(k+1) per row
    (``topk`` only on rows that a block can improve), and re-checks rows whose k-th similarity
    ties the next one. Either way the result is the exact
    top-k with ties resolved to the smaller index; memory stays ``O(batch_size * n)``.

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
    x = np.ascontiguousarray(x / np.maximum(norms, 1e-12))
    if n > EXACT_MAX_ROWS and k < n - 1:
        return _blocked_topk(x, k, batch_size)
    return _exact_rows(x, np.arange(n), k, batch_size)


def _exact_rows(x: np.ndarray, rows: np.ndarray, k: int, batch_size: int) -> np.ndarray:
    """Exact top-k other rows of ``x`` for the given row indices (stable tie-break by index)."""
    n = x.shape[0]
    out = np.empty((len(rows), k), dtype=np.int64)
    for start in range(0, len(rows), batch_size):
        idx = rows[start : start + batch_size]
        sims = x[idx] @ x.T
        sims[np.arange(len(idx)), idx] = -np.inf
        cand = (
            np.argpartition(-sims, k - 1, axis=1)[:, :k]
            if k < n - 1
            else np.argsort(-sims, axis=1, kind="stable")[:, :k]
        )
        cand_sims = np.take_along_axis(sims, cand, axis=1)
        # A candidate set cut inside a run of equal similarities may hold a larger index than an
        # excluded one: such rows are redone with a full stable sort.
        kth = cand_sims.min(axis=1, keepdims=True)
        tied = ((sims == kth).sum(axis=1) > (cand_sims == kth).sum(axis=1)).nonzero()[0]
        for r in tied:
            cand[r] = np.lexsort((np.arange(n), -sims[r]))[:k]
            cand_sims[r] = sims[r, cand[r]]
        order = np.lexsort((cand, -cand_sims), axis=1)
        out[start : start + len(idx)] = np.take_along_axis(cand, order, axis=1)
    return out


def _merge_topk(best_s: Any, best_i: Any, new_s: Any, new_i: Any, m: int, torch: Any) -> tuple[Any, Any]:
    """Keep the ``m`` best (similarity desc, index asc) of two candidate lists per row."""
    s = torch.cat([best_s, new_s], dim=1)
    i = torch.cat([best_i, new_i], dim=1)
    # Sort by index first, then stably by similarity: equal similarities stay in index order.
    by_idx = torch.argsort(i, dim=1, stable=True)
    s, i = torch.gather(s, 1, by_idx), torch.gather(i, 1, by_idx)
    by_sim = torch.argsort(s, dim=1, descending=True, stable=True)[:, :m]
    return torch.gather(s, 1, by_sim), torch.gather(i, 1, by_sim)


def _update_topk(best_s: Any, best_i: Any, rows: Any, sims: Any, offset: int, torch: Any, dim: int) -> None:
    """Fold a similarity block into the running top-m of ``rows`` (in place).

    ``rows`` index ``sims`` along ``dim`` (0: rows of the block, 1: its columns). Rows without m
    entries yet take the block's ``topk``. For the others only entries at least their current m-th
    best can enter: they are few once the running top-m is good, so they are found with one
    comparison and merged by a sort of those entries alone.
    """
    m = best_s.shape[1]
    block = sims if dim == 0 else sims.T
    fresh = torch.isinf(best_s[rows, m - 1])
    if bool(fresh.any()):
        need = fresh.nonzero().flatten()
        s, i = torch.topk(block[need].contiguous(), min(m, block.shape[1]), dim=1)
        target = rows[need]
        best_s[target], best_i[target] = _merge_topk(best_s[target], best_i[target], s, i + offset, m, torch)
        if bool(fresh.all()):
            return
    thr = best_s[rows, m - 1]
    if dim == 0:
        r, c = (sims >= thr.unsqueeze(1)).nonzero(as_tuple=True)
    else:  # compare in memory order, then swap the coordinates
        c, r = (sims >= thr.unsqueeze(0)).nonzero(as_tuple=True)
    keep = ~fresh[r]
    r, c = r[keep], c[keep]
    if r.numel() == 0:
        return
    grow, vals, idx = rows[r], block[r, c], c + offset
    touched = torch.unique(grow)
    all_r = torch.cat([touched.repeat_interleave(m), grow])
    all_s = torch.cat([best_s[touched].flatten(), vals])
    all_i = torch.cat([best_i[touched].flatten(), idx])
    # Order by (row, similarity desc, index asc) with successive stable sorts, keep m per row.
    order = torch.argsort(all_i, stable=True)
    order = order[torch.argsort(all_s[order], descending=True, stable=True)]
    order = order[torch.argsort(all_r[order], stable=True)]
    all_r, all_s, all_i = all_r[order], all_s[order], all_i[order]
    first = torch.searchsorted(all_r, all_r, side="left")
    pos = torch.arange(len(all_r)) - first
    top = pos < m
    best_s[all_r[top], pos[top]] = all_s[top]
    best_i[all_r[top], pos[top]] = all_i[top]


def _blocked_topk(x: np.ndarray, k: int, batch_size: int) -> np.ndarray:
    """Exact leave-one-out top-k over symmetric blocks with torch (matmul + filtered topk).

    Each pair of row blocks is multiplied once and serves both blocks' rows (half the flops).
    """
    import torch

    from hamo_ray.logs import Progress

    n, m = x.shape[0], k + 1
    t = torch.from_numpy(x)
    best_s = torch.full((n, m), -float("inf"))
    best_i = torch.full((n, m), n, dtype=torch.int64)  # index n: "none yet", sorts after any real one
    starts = list(range(0, n, batch_size))
    # Row block a multiplies with the blocks from a on: the pairs left shrink, so progress counts pairs.
    progress = Progress(
        len(starts) * (len(starts) + 1) // 2, f"select: {n} cards' neighbours", "block", logger
    )
    for bi, a in enumerate(starts):
        a_end = min(a + batch_size, n)
        rows_a = torch.arange(a, a_end)
        for b in starts[bi:]:  # the diagonal block first: it gives rows of ``a`` a tight threshold
            b_end = min(b + batch_size, n)
            sims = t[a:a_end] @ t[b:b_end].T
            if a == b:
                sims.fill_diagonal_(-float("inf"))
            _update_topk(best_s, best_i, rows_a, sims, b, torch, dim=0)
            if a != b:
                _update_topk(best_s, best_i, torch.arange(b, b_end), sims, a, torch, dim=1)
        progress.update(len(starts) - bi)
    progress.close()
    out = best_i[:, :k].numpy().copy()
    # topk may cut a run of equal similarities anywhere: when the k-th and (k+1)-th kept values are
    # equal, a smaller tied index may have been dropped; those rows are recomputed exactly.
    tied = (best_s[:, k - 1] == best_s[:, k]).nonzero().flatten().numpy()
    if len(tied):
        out[tied] = _exact_rows(x, tied, k, batch_size)
    return out


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
