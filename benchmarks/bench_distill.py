"""Distillation + embedding throughput: the Ray Data card pipeline vs a plain single-process loop.

Both turn the same synthetic ScienceWorld-like trajectories into stored cards with the offline
"outline" distiller and the shipped MiniLM embedder, and both include loading the embedding model;
the pipeline's time excludes ``ray.init`` (a stream pays it once) and includes its Embedder actor
start. The pipeline also validates every row (rejections) and skips stored ids.

    python benchmarks/bench_distill.py                   # 2,000 trajectories
    python benchmarks/bench_distill.py --n 5000 --actors 2

Results also go to ``benchmarks/results/bench_distill.json`` (``--json PATH``).
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time

from common import Results, add_json_argument

from hamo_ray.config import MemoryConfig
from hamo_ray.memory import Embedder, MemoryStore, build_cards_dataset, write_cards_report
from hamo_ray.memory.distill import card_from_trajectory, get_distiller
from hamo_ray.memory.schema import CARD_FIELDS
from hamo_ray.types import TaskSpec, Trajectory

TASKS = ["boil", "melt", "use-thermometer", "find-living-thing", "grow-plant", "measure-angle"]
ROOMS = ["hallway", "kitchen", "bedroom", "workshop", "art studio", "greenhouse"]


def trajectories(n: int) -> list[Trajectory]:
    out = []
    for i in range(n):
        task, room, thing = TASKS[i % len(TASKS)], ROOMS[(i // 7) % len(ROOMS)], f"object {i % 97}"
        actions = ["look around", f"open door to {room}", f"go to {room}", f"pick up {thing}"]
        actions += [f"use tool {j} on {thing}" for j in range(i % 9)] + [f"focus on {thing}", "wait1"]
        out.append(
            Trajectory(
                task=TaskSpec(domain="scienceworld", task=task, variation=i),
                goal=f"Your task is to {task} the {thing}. First, focus on the substance.",
                init_obs=f"This room is called the {ROOMS[i % len(ROOMS)]}. In it, you see: a table, a {thing}.",
                actions=actions,
                observations=["ok"] * len(actions),
                score=100.0,
                done=True,
                source="expert",
            )
        )
    return out


def plain_loop(trajs: list[Trajectory], batch: int) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        embedder, distiller = Embedder(), get_distiller("outline")
        store = MemoryStore(tmp, dim=embedder.dim)
        for s in range(0, len(trajs), batch):
            chunk = trajs[s : s + batch]
            cards = [card_from_trajectory(t, 1, o) for t, o in zip(chunk, distiller.distill(chunk))]
            vectors = embedder.embed([c.key_text for c in cards])
            store.add(
                [{**{f: getattr(c, f) for f in CARD_FIELDS}, "vector": v} for c, v in zip(cards, vectors)]
            )
        assert store.count() == len(trajs)
        return time.perf_counter() - start


def pipeline(trajs: list[Trajectory], batch: int, actors: int) -> float:
    mcfg = MemoryConfig(batch_size=batch, embed_actors=actors)
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        store = MemoryStore.from_config(tmp, mcfg, dim=384)
        report = write_cards_report(build_cards_dataset(trajs, 1, mcfg, store=store), store)
        assert report.added == len(trajs) and not report.rejected
        return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=2000)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--actors", type=int, default=1)
    parser.add_argument("--cpus", type=int, default=2)
    add_json_argument(parser, __file__)
    args = parser.parse_args()
    results = Results(__file__, args)
    import ray

    logging.basicConfig(level=logging.WARNING)
    trajs = trajectories(args.n)
    ray.init(
        address="local",
        num_cpus=args.cpus,
        include_dashboard=False,
        configure_logging=False,
        log_to_driver=False,
    )
    ray.data.DataContext.get_current().enable_progress_bars = False
    t_plain = plain_loop(trajs, args.batch)
    t_ours = pipeline(trajs, args.batch, args.actors)
    ray.shutdown()
    r = results.add(
        {
            "trajectories": args.n,
            "pipeline_cards_per_s": args.n / t_ours,
            "pipeline_s": t_ours,
            "plain_cards_per_s": args.n / t_plain,
            "plain_s": t_plain,
            "ratio": t_plain / t_ours,
        }
    )
    print(
        f"{'trajectories':>12} | {'pipeline cards/s':>16} {'s':>6} | {'plain loop cards/s':>18} {'s':>6} | ratio"
    )
    print("-" * 76)
    print(
        f"{r['trajectories']:>12} | {r['pipeline_cards_per_s']:16.1f} {r['pipeline_s']:6.1f} | "
        f"{r['plain_cards_per_s']:18.1f} {r['plain_s']:6.1f} | {r['ratio']:.2f}x"
    )
    results.finish()


if __name__ == "__main__":
    main()
