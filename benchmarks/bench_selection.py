"""Coverage selection at scale: ``coverage_select`` (blocked exact neighbours + CELF) vs a plain greedy.

The baseline is the straightforward implementation on the same embeddings: exact leave-one-out
top-3 with numpy row blocks (``argpartition``), then a plain (non-lazy) greedy that recomputes every
card's marginal gain at every step (vectorised: one ``bincount`` over all (card, query) pairs per
step), run on the same neighbour lists: it must give identical picks and gains. The two neighbour
computations are compared too: rows that differ are float-rounding near-ties (~1e-7 apart). Where the baseline would take too long (10^5), it
runs a bounded number of neighbour blocks and greedy steps, checks that prefix, and the table
extrapolates its time (marked "~").

Data: clustered unit vectors (384 dims), like card embeddings of a few hundred task types.

    python benchmarks/bench_selection.py                 # 10^3, 10^4, 10^5
    python benchmarks/bench_selection.py --sizes 1000 10000

Results also go to ``benchmarks/results/bench_selection.json`` (``--json PATH``), one row per size.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from common import Results, add_json_argument

from hamo_ray.neighbours import exact_rows
from hamo_ray.selection import (
    coverage_select,
    knee_point,
    lazy_greedy_coverage,
    leave_one_out_neighbours,
    reverse_neighbours,
)


def clustered(n: int, dim: int = 384, clusters: int = 300, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    centers = rng.normal(size=(clusters, dim)).astype(np.float32)
    x = centers[rng.integers(0, clusters, n)] + 0.6 * rng.normal(size=(n, dim)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def plain_greedy(neighbours: np.ndarray, n: int, max_steps: int | None = None) -> tuple[list[int], list[int]]:
    """Greedy max coverage recomputing all gains each step (ties: smaller index)."""
    queries = np.repeat(np.arange(n), neighbours.shape[1])
    targets = neighbours.ravel()
    covered = np.zeros(n, dtype=bool)
    picks, gains = [], []
    while max_steps is None or len(picks) < max_steps:
        live = ~covered[queries]
        # distinct (target, query) pairs: a query lists each target once, so counts are set sizes
        gain = np.bincount(targets[live], minlength=n)
        best = int(np.argmax(gain))
        if gain[best] <= 0:
            break
        picks.append(best)
        gains.append(int(gain[best]))
        covered[queries[targets == best]] = True
    return picks, gains


def run(n: int, max_blocks: int, max_steps: int) -> dict:
    x = clustered(n)
    # coverage_select's steps, timed one by one (the same calls it makes).
    t0 = time.perf_counter()
    nb = leave_one_out_neighbours(x, 3)
    t_nb = time.perf_counter() - t0
    t0 = time.perf_counter()
    order, order_gains = lazy_greedy_coverage(reverse_neighbours(nb, n), n)
    budget = knee_point(np.cumsum(order_gains))
    t_greedy_ours = time.perf_counter() - t0
    t_ours_total = t_nb + t_greedy_ours
    if n <= 10_000:  # the public entry point agrees with its timed parts
        check = coverage_select(x, k=3)
        assert check.full_order == order and check.budget == budget

    block = 2048
    rows = np.arange(n)
    blocks = [rows[s : s + block] for s in range(0, n, block)]
    partial = len(blocks) > max_blocks
    t0 = time.perf_counter()
    base_nb = [exact_rows(x, b, 3, block) for b in blocks[:max_blocks]]
    t_base_nb = (time.perf_counter() - t0) * len(blocks) / min(len(blocks), max_blocks)
    checked_rows = sum(len(b) for b in base_nb)
    # Rows whose neighbours differ: float rounding of near-ties (torch blocks vs numpy rows, ~1e-7).
    nb_diff = int((np.concatenate(base_nb) != nb[:checked_rows]).any(axis=1).sum())

    steps = len(order)
    bounded = steps > max_steps
    t0 = time.perf_counter()
    picks, gains = plain_greedy(nb, n, max_steps if bounded else None)
    t_plain = (time.perf_counter() - t0) * (steps / len(picks) if bounded else 1.0)
    same = picks == order[: len(picks)] and gains == order_gains[: len(gains)]
    return {
        "cards": n,
        "ours_s": t_ours_total,
        "ours_neighbours_s": t_nb,
        "ours_greedy_s": t_greedy_ours,
        "plain_s": t_base_nb + t_plain,
        "plain_neighbours_s": t_base_nb,
        "plain_greedy_s": t_plain,
        "plain_extrapolated": partial or bounded,
        "ratio": (t_base_nb + t_plain) / t_ours_total,
        "same_picks_and_gains": same,
        "neighbour_rows_differing": nb_diff,
        "checked_rows": checked_rows,
        "checked_steps": len(picks),
        "steps": steps,
        "budget": budget,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1_000, 10_000, 100_000])
    parser.add_argument("--max-blocks", type=int, default=6, help="baseline neighbour blocks timed at most")
    parser.add_argument("--max-steps", type=int, default=3_000, help="baseline greedy steps timed at most")
    add_json_argument(parser, __file__)
    args = parser.parse_args()
    results = Results(__file__, args)
    header = (
        f"{'cards':>8} | {'ours s':>8} {'(nbrs':>7} {'greedy)':>8} | {'plain s':>9} {'(nbrs':>8} "
        f"{'greedy)':>9} | {'ratio':>6} | same picks+gains | nbr rows differing | checked | budget"
    )
    print(header)
    print("-" * len(header))
    for n in args.sizes:
        r = results.add(run(n, args.max_blocks, args.max_steps))
        mark = "~" if r["plain_extrapolated"] else " "
        checked = f"{r['checked_rows']}/{r['cards']} rows, {r['checked_steps']}/{r['steps']} steps"
        print(
            f"{r['cards']:>8} | {r['ours_s']:8.2f} {r['ours_neighbours_s']:7.2f} {r['ours_greedy_s']:8.2f} | "
            f"{mark}{r['plain_s']:8.1f} {r['plain_neighbours_s']:8.1f} {r['plain_greedy_s']:9.1f} | "
            f"{r['ratio']:5.1f}x | {str(r['same_picks_and_gains']):>16} | {r['neighbour_rows_differing']:>18} | "
            f"{checked} | {r['budget']}",
            flush=True,
        )
    results.finish()


if __name__ == "__main__":
    main()
