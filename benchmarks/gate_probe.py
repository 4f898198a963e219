"""Experience gating's threshold, set on train/dev-split probes (issue 43, item 3); never the test split.

The memory holds train-split expert cards (ScienceWorld gold paths played offline, distilled by
``memory.distiller``, embedded by the project's ``Embedder`` and stored in a LanceDB ``MemoryStore``
in a temporary folder, as a stage stores them). Each dev-split task is a query: its key
``key_text(goal, first observation)`` is embedded and ``hamo_ray.memory.recall.recall`` returns its
top-k cards with their cosine similarities, as the harness's ``/retrieve`` does at inference. Every
hit is labelled *same type* (the card's task type is the query's) or *other type*.

The rule (fixed before looking at any run): the threshold ``tau`` maximises Youden's J,
``P(same >= tau) - P(other >= tau)``, over the top-k hits (candidates: midpoints between consecutive
distinct cosines, and the two ends); ties go to the lowest ``tau`` (withhold least). When no
threshold separates better than none (J <= 0), the rule says: no gate. The chosen ``tau`` is then
applied through ``hamo_ray.memory.recall.gate`` (``memory.gate_min_similarity``) to the same hits,
and the cards injected and withheld are counted per query type.

    python benchmarks/gate_probe.py                     # the experiment's 3 types, top_k 2 (~1-2 min)
    python benchmarks/gate_probe.py --k 0               # every card of the memory ranked (all pairs)
    python benchmarks/gate_probe.py --json docs/results/gate-probe.json
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from common import Results, add_json_argument, play_gold

ROOT = Path(__file__).resolve().parents[1]
# learning-smollm2-within.yaml's task types (the dev-split comparisons run on them)
TYPES = ["lifespan-longest-lived", "lifespan-shortest-lived", "find-living-thing"]


# -- pure parts -------------------------------------------------------------------------------------
def youden_threshold(same: Sequence[float], other: Sequence[float]) -> tuple[float | None, float]:
    """The rule: the lowest threshold maximising ``P(same >= t) - P(other >= t)``.

    Returns:
        ``(tau, J)``; ``tau`` is None when no threshold beats injecting everything (``J <= 0``) or a
        side is empty.
    """
    if not same or not other:
        return None, 0.0
    values = sorted(set(same) | set(other))
    candidates = [values[0] - 1e-6] + [(a + b) / 2 for a, b in zip(values, values[1:])] + [values[-1] + 1e-6]
    s, o = np.asarray(same), np.asarray(other)
    best, best_j = None, 0.0
    for t in candidates:
        j = float((s >= t).mean() - (o >= t).mean())
        if j > best_j + 1e-12:
            best, best_j = t, j
    return (None if best is None else round(float(best), 4)), best_j


def describe(values: Sequence[float]) -> dict[str, Any]:
    """n, min, 10th/50th/90th percentile, max (None when empty)."""
    if not values:
        return {"n": 0}
    a = np.asarray(values)
    return {
        "n": len(values),
        "min": float(a.min()),
        "p10": float(np.percentile(a, 10)),
        "median": float(statistics.median(values)),
        "p90": float(np.percentile(a, 90)),
        "max": float(a.max()),
    }


# -- the probe ----------------------------------------------------------------------------------------
def gold_paths(domain, tasks, max_turns: int):
    """The train tasks' expert trajectories (played offline; kept as ``play_experts`` keeps them)."""
    env = domain.make_env()
    out = []
    try:
        for task in tasks:
            traj = play_gold(env, task, max_turns)
            if traj.actions and traj.score > 0:
                out.append(traj)
    finally:
        env.close()
    return out


def dev_keys(domain, tasks) -> list[tuple[Any, str, str]]:
    """``(task, goal, first observation)`` of each dev task (the simulator reset, no step)."""
    env = domain.make_env()
    try:
        return [(task, *env.reset(task)) for task in tasks]
    finally:
        env.close()


def store_cards(trajs, mcfg, embedder, store) -> None:
    """Distil (``memory.pipeline.distil_batch``), embed and store the cards, as a stage does."""
    from hamo_ray.memory.pipeline import distil_batch, encode_input

    batch = {
        "row": np.arange(len(trajs)),
        "trajectory": np.array([encode_input(t) for t in trajs], dtype=object),
    }
    cards = distil_batch(batch, 1, mcfg.distiller, mcfg)
    ok = cards["reject_reason"] == ""
    if not ok.all():
        raise RuntimeError(f"{int((~ok).sum())} trajectories rejected by the distiller")
    store.add(embedder(cards))


def run(args: argparse.Namespace, results: Results) -> dict[str, Any]:
    from hamo_ray.config import EnvConfig, MemoryConfig
    from hamo_ray.envs import get_domain
    from hamo_ray.memory.embed import Embedder, key_text
    from hamo_ray.memory.recall import gate, recall
    from hamo_ray.memory.store import MemoryStore

    domain = get_domain("scienceworld", EnvConfig(domain="scienceworld", max_turns=args.max_turns))
    t0 = time.perf_counter()
    train = [t for tt in args.task_types for t in domain.tasks("train", tt, limit=args.train_per_task)]
    dev = [t for tt in args.task_types for t in domain.tasks("dev", tt, limit=args.dev_per_task)]
    trajs = gold_paths(domain, train, args.max_turns)
    queries = dev_keys(domain, dev)
    play_s = time.perf_counter() - t0

    mcfg = MemoryConfig(distiller=args.distiller)
    embedder = Embedder(mcfg.embedding_model)
    with tempfile.TemporaryDirectory() as tmp:
        store = MemoryStore(tmp, dim=embedder.dim)
        store_cards(trajs, mcfg, embedder, store)
        k = args.k or store.count()
        vectors = embedder.embed([key_text(goal, obs) for _, goal, obs in queries])
        ranked = recall(store, vectors, store.count())  # ungated: every card, with its cosine
        got = recall(store, vectors, k)  # ungated: the top-k the harness would inject
    hits = []
    for (task, _, _), r in zip(queries, ranked, strict=True):
        for rank, (card, score) in enumerate(r.injected):
            hits.append({"query": task.id, "query_type": task.task, "card_type": card.task, "rank": rank,
                         "cosine": round(float(score), 4), "same_type": card.task == task.task})  # fmt: skip
    top = [h for h in hits if h["rank"] < k]
    same = [h["cosine"] for h in top if h["same_type"]]
    other = [h["cosine"] for h in top if not h["same_type"]]
    tau, j = youden_threshold(same, other)
    if args.tau is not None:
        tau = args.tau
    gated = MemoryConfig(gate_min_similarity=tau)
    per_type = {}
    for tt in args.task_types:
        rows = [(q, r) for q, r in zip(queries, got, strict=True) if q[0].task == tt]
        inj = wh = inj_other = wh_other = 0
        for (task, _, _), r in rows:
            injected, withheld = gate(r.injected, gated)
            inj, wh = inj + len(injected), wh + len(withheld)
            inj_other += sum(c.task != task.task for c, _ in injected)
            wh_other += sum(c.task != task.task for c, _ in withheld)
        per_type[tt] = {"queries": len(rows), "injected": inj, "withheld": wh,
                        "injected_other_type": inj_other, "withheld_other_type": wh_other}  # fmt: skip
    summary = {
        "cards": len(trajs), "queries": len(queries), "k": k, "distiller": args.distiller,
        "same_type": describe(same), "other_type": describe(other),
        "all_pairs": {"same_type": describe([h["cosine"] for h in hits if h["same_type"]]),
                      "other_type": describe([h["cosine"] for h in hits if not h["same_type"]])},
        "tau": tau, "youden_j": round(j, 4), "rule": "max Youden J over top-k hits, lowest tau on ties",
        "per_type": per_type, "play_s": round(play_s, 1), "hits": hits,
    }  # fmt: skip
    results.add(summary)
    return summary


def print_table(s: dict[str, Any]) -> None:
    print(
        f"memory: {s['cards']} train-split cards ({s['distiller']}); {s['queries']} dev queries; top-{s['k']}"
    )
    print("| hits | n | min | p10 | median | p90 | max |")
    print("|---|---|---|---|---|---|---|")
    for name in ("same_type", "other_type"):
        d = s[name]
        if d["n"]:
            print(f"| {name.replace('_', ' ')} | {d['n']} | {d['min']:.3f} | {d['p10']:.3f} | {d['median']:.3f} "
                  f"| {d['p90']:.3f} | {d['max']:.3f} |")  # fmt: skip
        else:
            print(f"| {name.replace('_', ' ')} | 0 | | | | | |")
    for name in ("same_type", "other_type"):
        d = s["all_pairs"][name]
        if d["n"]:
            print(f"| {name.replace('_', ' ')}, all pairs | {d['n']} | {d['min']:.3f} | {d['p10']:.3f} "
                  f"| {d['median']:.3f} | {d['p90']:.3f} | {d['max']:.3f} |")  # fmt: skip
    print(f"\ntau = {s['tau']} (Youden J {s['youden_j']}; rule: {s['rule']})\n")
    print(
        "| query type | queries | injected | withheld | injected of another type | withheld of another type |"
    )
    print("|---|---|---|---|---|---|")
    for tt, r in s["per_type"].items():
        print(f"| {tt} | {r['queries']} | {r['injected']} | {r['withheld']} | {r['injected_other_type']} "
              f"| {r['withheld_other_type']} |")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--task-types", nargs="+", default=TYPES, help="ScienceWorld task types")
    parser.add_argument(
        "--train-per-task", type=int, default=8, help="train variations per type (the memory)"
    )
    parser.add_argument("--dev-per-task", type=int, default=8, help="dev variations per type (the queries)")
    parser.add_argument("--k", type=int, default=2, help="cards retrieved per query (memory.top_k; 0: all)")
    parser.add_argument("--distiller", default="outline", choices=["outline", "outline_general"])
    parser.add_argument("--max-turns", type=int, default=15, help="env.max_turns (gold paths cut there)")
    parser.add_argument("--tau", type=float, default=None, help="apply this threshold instead of the rule's")
    add_json_argument(parser, __file__)
    args = parser.parse_args()
    results = Results(__file__, args, args.json)
    summary = run(args, results)
    print_table(summary)
    print(f"\nwrote {results.finish()}")


if __name__ == "__main__":
    main()
