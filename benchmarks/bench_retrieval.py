"""Retrieval at scale: ``MemoryStore.search`` (LanceDB, ANN index + exact re-ranking) vs exact numpy.

For each size: the store is filled with clustered unit vectors (384 dims) and card fields, the
index (``--index-types``, default IVF_SQ) is built by ``ensure_index`` (its time is reported), then single queries (what the harness
sends: one task key, top-3) are timed one by one: p50/p99 latency of our indexed store and of an
exact numpy scan over the same matrix in memory; recall@3 of the index against the exact answer.
The queries are noisy copies of stored keys (a new variation of a known task).

    python benchmarks/bench_retrieval.py                          # 10^4, 10^5, 10^6 cards
    python benchmarks/bench_retrieval.py --sizes 10000 --queries 200
    python benchmarks/bench_retrieval.py --sizes 1000000 --index-types ivf_sq ivf_pq

Results also go to ``benchmarks/results/bench_retrieval.json`` (``--json PATH``), one row per
size, index type and nprobes.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import numpy as np
import pyarrow as pa
from common import Results, add_json_argument

from hamo_ray.memory import MemoryStore
from hamo_ray.memory.schema import CARD_FIELDS


def clustered(n: int, dim: int, seed: int = 0, clusters: int = 1000) -> np.ndarray:
    rng = np.random.default_rng(seed)
    centers = rng.normal(size=(clusters, dim)).astype(np.float32)
    out = np.empty((n, dim), dtype=np.float32)
    for s in range(0, n, 100_000):  # in chunks: bounded temporary memory at 10^6
        e = min(n, s + 100_000)
        x = centers[rng.integers(0, clusters, e - s)] + 0.6 * rng.normal(size=(e - s, dim)).astype(np.float32)
        out[s:e] = x / np.linalg.norm(x, axis=1, keepdims=True)
    return out


def fill(store: MemoryStore, vectors: np.ndarray, chunk: int = 100_000) -> None:
    for s in range(0, len(vectors), chunk):
        e = min(len(vectors), s + chunk)
        m = e - s
        cols = {name: pa.array([""] * m) for name in CARD_FIELDS}
        cols["id"] = pa.array([f"c{i}" for i in range(s, e)])
        cols["goal"] = pa.array([f"goal {i}" for i in range(s, e)])
        cols["variation"] = pa.array(np.arange(s, e))
        cols["stage"] = pa.array(np.zeros(m, dtype=np.int64))
        cols["score"] = pa.array(np.full(m, 100.0))
        cols["vector"] = vectors[s:e]
        store.add(cols)


def run(n: int, dim: int, queries: int, nprobes: list[int], refine: int, index_type: str) -> list[dict]:
    vectors = clustered(n, dim)
    rng = np.random.default_rng(1)
    qs = vectors[rng.integers(0, n, queries)] + 0.3 * rng.normal(size=(queries, dim)).astype(
        np.float32
    ) / np.sqrt(dim)
    qs /= np.linalg.norm(qs, axis=1, keepdims=True)
    with tempfile.TemporaryDirectory() as tmp:
        store = MemoryStore(tmp, dim=dim, index_threshold=1, index_type=index_type, refine_factor=refine)
        t0 = time.perf_counter()
        fill(store, vectors)
        t_fill = time.perf_counter() - t0
        t0 = time.perf_counter()
        store.ensure_index()
        t_index = time.perf_counter() - t0
        store.search(qs[:1], 3)  # warm the index cache
        runs = []
        for probes in nprobes:
            store.nprobes = probes
            ours, got = [], []
            for q in qs:
                t0 = time.perf_counter()
                [hits] = store.search(q, 3)
                ours.append(time.perf_counter() - t0)
                got.append([int(c.id[1:]) for c, _ in hits])
            runs.append((probes, ours, got))
    exact, truth = [], []
    for q in qs:
        t0 = time.perf_counter()
        sims = vectors @ q
        top = np.argpartition(-sims, 3)[:3]
        top = top[np.argsort(-sims[top])]
        exact.append(time.perf_counter() - t0)
        truth.append(top.tolist())
    pct = lambda xs, p: 1000 * float(np.percentile(xs, p))  # noqa: E731
    return [
        {
            "cards": n,
            "index": index_type,
            "nprobes": probes,
            "write_s": t_fill,
            "index_s": t_index,
            "lance_p50_ms": pct(ours, 50),
            "lance_p99_ms": pct(ours, 99),
            "numpy_p50_ms": pct(exact, 50),
            "numpy_p99_ms": pct(exact, 99),
            "p50_ratio": pct(exact, 50) / pct(ours, 50),
            "recall_at_3": float(np.mean([len(set(g) & set(t)) / 3 for g, t in zip(got, truth)])),
        }
        for probes, ours, got in runs
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--queries", type=int, default=300)
    parser.add_argument("--nprobes", type=int, nargs="+", default=[16])
    parser.add_argument("--refine", type=int, default=10)
    parser.add_argument(
        "--index-types", nargs="+", default=["ivf_sq"], choices=["ivf_sq", "ivf_pq", "ivf_hnsw_sq"]
    )
    add_json_argument(parser, __file__)
    args = parser.parse_args()
    results = Results(__file__, args)
    header = (
        f"{'cards':>9} | {'index':>11} | {'nprobes':>7} | {'write s':>7} {'index s':>7} | {'lance p50 ms':>12} {'p99 ms':>7} | "
        f"{'numpy p50 ms':>12} {'p99 ms':>7} | {'p50 ratio':>9} | recall@3"
    )
    print(header)
    print("-" * len(header))
    for n in args.sizes:
        for t in args.index_types:
            for row in run(n, args.dim, args.queries, args.nprobes, args.refine, t):
                r = results.add(row)
                print(
                    f"{r['cards']:>9} | {r['index']:>11} | {r['nprobes']:>7} | {r['write_s']:7.1f} {r['index_s']:7.1f} | "
                    f"{r['lance_p50_ms']:12.2f} {r['lance_p99_ms']:7.2f} | "
                    f"{r['numpy_p50_ms']:12.2f} {r['numpy_p99_ms']:7.2f} | {r['p50_ratio']:8.2f}x | {r['recall_at_3']:.3f}",
                    flush=True,
                )
    results.finish()


if __name__ == "__main__":
    main()
