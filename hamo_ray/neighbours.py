"""Step 1 of coverage selection: each card's ``k`` nearest *other* cards (cosine), exactly.

Up to :data:`EXACT_MAX_ROWS` cards one numpy pass over row batches; above it symmetric torch blocks
(each block pair multiplied once, ``topk`` only on rows a block can improve, ties re-checked exactly),
which give the same neighbours. Ties go to the smaller card index.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

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
    return exact_rows(x, np.arange(n), k, batch_size)


def exact_rows(x: np.ndarray, rows: np.ndarray, k: int, batch_size: int) -> np.ndarray:
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
        out[tied] = exact_rows(x, tied, k, batch_size)
    return out
