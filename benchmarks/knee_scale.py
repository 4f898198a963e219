"""The knee at the paper's scale: selection only (gold paths, distil, embed, select; no training).

ScienceWorld stages of hundreds of expert trajectories over all 30 task types, built as a
within-domain run builds them (``run.resources.stage_tasks``: the first ``--stages x --per-task`` train
variations of every type, split round-robin into sample-disjoint stages; a type with fewer train
variations gives what it has). Per stage:

1. **gold paths**: the simulator's expert plans played offline (``domain.make_env()``,
   ``expert_actions()``), cut at ``env.max_turns`` as the rollout pool cuts them, kept as
   ``play_experts`` keeps them (no error, score > 0); ``--workers`` processes, one JVM each;
2. **distil**: the project's deterministic distiller (``memory.distiller``, default ``outline``) through
   ``memory.pipeline.distil_batch``, the function the stage's Ray Data pipeline maps, called here
   in-process (no Ray) so that each phase has its own time;
3. **embed**: ``memory.embed.Embedder`` (all-MiniLM-L6-v2, the shipped package) on the same batches:
   ``vector`` (the key: goal + first observation) and ``card_vector`` (the whole card, outline
   included); the rows are written to a LanceDB ``MemoryStore`` in a temporary folder;
4. **select**: ``run.stage.select`` (the stage's own step) with ``selection.min_fraction=0`` and
   ``selection.min_budget=--min-budget``, so the knee decides, once per ``selection.embed`` (``card``,
   ``key``); the coverage curve comes from ``selection.coverage_select`` on the same vectors, checked
   to give the same budget.

Reported per stage and embedding: trajectories, greedy picks to saturation, the knee's budget (and as
a share of the stage), the coverage the knee keeps, how many task types get an anchor, and the seconds
of each phase. The JSON (one row per stage and embedding, with the curve and the anchors per type) is
what ``--report`` turns into the figure and the section of docs/results.md::

    python benchmarks/knee_scale.py --stages 1 --per-task 1            # a quick look (~1-2 min)
    python benchmarks/knee_scale.py --stages 3 --per-task 10 --plot docs/results/knee-scale.png   # ~236 a stage
    python benchmarks/knee_scale.py --stages 2 --per-task 25 --json docs/results/knee-scale-large.json \\
        --plot docs/results/knee-scale-large.png                      # ~544 a stage (the committed runs)
    python benchmarks/knee_scale.py --report docs/results/knee-scale.json --plot docs/results/knee-scale.png \\
        --doc docs/results.md --section knee-scale                    # figure and section from saved JSON
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from common import Results, add_json_argument, play_gold

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_JSON = ROOT / "docs" / "results" / "knee-scale.json"
SECTION = "knee-scale"  # default --section: the <!-- BEGIN knee-scale --> ... <!-- END --> markers in --doc
FLOOR = 0.5  # the floor the committed learning experiments set (selection.min_fraction)
EMBEDS = ("card", "key")


# -- pure parts (tests/unit/test_knee_scale.py) -----------------------------------------------------
def anchors_per_type(types: Sequence[str], picks: Sequence[int], all_types: Sequence[str]) -> dict[str, int]:
    """Anchors of every task type (0 for a type none was picked from), in ``all_types`` order.

    Args:
        types: the task type of each card of the stage.
        picks: the chosen card indices.
        all_types: every task type of the stage (the order of the result).
    """
    counts = Counter(types[i] for i in picks)
    return {t: counts.get(t, 0) for t in all_types}


def curve_summary(curve: Sequence[int], n: int, budget: int, floor: float = FLOOR) -> dict[str, Any]:
    """What a stage's coverage curve says: saturation, the knee's budget and coverage, the floor's.

    Args:
        curve: coverage after each greedy pick, to saturation (``SelectionResult.curve``).
        n: the stage's cards (queries).
        budget: the knee's budget (anchors kept).
        floor: the floor's share of the stage (``selection.min_fraction`` of the experiments).

    Returns:
        ``saturation_picks``, ``budget``, ``budget_fraction`` (of ``n``), ``covered_at_knee`` (share of
        the queries the knee's picks cover), ``floor_budget`` (``ceil(floor * n)``) and
        ``knee_below_floor``.
    """
    covered = curve[budget - 1] / n if budget and curve and n else 0.0
    floor_budget = math.ceil(floor * n)
    return {
        "saturation_picks": len(curve),
        "budget": budget,
        "budget_fraction": budget / n if n else 0.0,
        "covered_at_knee": covered,
        "floor_budget": floor_budget,
        "knee_below_floor": budget < floor_budget,
    }


def type_spread(per_type: dict[str, int]) -> dict[str, Any]:
    """How anchors spread over task types: types covered, min / median / max anchors, types left out."""
    values = list(per_type.values())
    return {
        "types": len(values),
        "types_covered": sum(v > 0 for v in values),
        "anchors_min": min(values, default=0),
        "anchors_median": statistics.median(values) if values else 0,
        "anchors_max": max(values, default=0),
        "types_without_anchor": [t for t, v in per_type.items() if v == 0],
    }


def table_lines(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The printed table: one line per (stage, embedding)."""
    header = (
        f"{'stage':>5} | {'embed':>5} | {'trajs':>5} | {'types':>5} | {'saturation':>10} | {'knee':>4} | "
        f"{'share':>6} | {'covered':>7} | {'types w/ anchor':>15} | {'gold s':>7} {'distil s':>8} "
        f"{'embed s':>7} {'select s':>8}"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(
            f"{r['stage']:>5} | {r['embed']:>5} | {r['trajectories']:>5} | {r['types']:>5} | "
            f"{r['saturation_picks']:>10} | {r['budget']:>4} | {100 * r['budget_fraction']:5.1f}% | "
            f"{100 * r['covered_at_knee']:6.1f}% | {r['types_covered']:>7}/{r['types']:<7} | "
            f"{r['gold_s']:7.1f} {r['distil_s']:8.2f} {r['embed_s']:7.2f} {r['select_s']:8.3f}"
        )
    return lines


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def render_section(data: dict[str, Any], figure: str | None = None) -> str:
    """The docs/results.md section's generated part, from a results file's content (``Results.to_dict``).

    Args:
        data: the JSON of a run of this script.
        figure: the figure's path relative to the document, or None for no image line.
    """
    rows, args = data["rows"], data["args"]
    stages = sorted({r["stage"] for r in rows})
    by = {(r["stage"], r["embed"]): r for r in rows}
    machine = data.get("machine", {})
    out = [
        f"Generated by `python benchmarks/knee_scale.py --report {_rel(args.get('json'))}` from the run "
        f"`python benchmarks/knee_scale.py --stages {args['stages']} --per-task {args['per_task']} "
        f"--workers {args['workers']} --max-turns {args.get('max_turns', 50)} --min-budget {args['min_budget']}` "
        f"({machine.get('cpu_count', '?')} CPUs, started {data.get('started_at', '?')}, "
        f"{data.get('seconds', 0) / 60:.1f} min in all; commit {(data.get('git') or {}).get('commit', '?')[:10]}).",
        "",
        "| stage | embed | trajectories | greedy picks to saturation | knee budget | share of stage | "
        "queries covered at the knee | 50% floor | task types with an anchor | anchors per type (min / median / max) |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for s in stages:
        for e in EMBEDS:
            r = by.get((s, e))
            if r is None:
                continue
            out.append(
                f"| {s} | {e} | {r['trajectories']} | {r['saturation_picks']} | {r['budget']} | "
                f"{_pct(r['budget_fraction'])} | {_pct(r['covered_at_knee'])} | {r['floor_budget']} | "
                f"{r['types_covered']} of {r['types']} | {r['anchors_min']} / {r['anchors_median']:g} / "
                f"{r['anchors_max']} |"
            )
    out += [
        "",
        "Seconds per phase (gold paths on "
        f"{args['workers']} processes; distil and embed in-process; select is `run.stage.select`, "
        "reading the vectors from LanceDB):",
        "",
        "| stage | tasks played | gold paths kept | gold paths s | distil s | embed s | store s | "
        "select s (card) | select s (key) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in stages:
        c, k = by.get((s, "card")), by.get((s, "key"))
        r = c or k
        out.append(
            f"| {s} | {r['tasks']} | {r['trajectories']} | {r['gold_s']:.0f} | {r['distil_s']:.2f} | "
            f"{r['embed_s']:.1f} | {r['store_s']:.2f} | "
            f"{c['select_s'] if c else float('nan'):.3f} | {k['select_s'] if k else float('nan'):.3f} |"
        )
    first = rows[0]
    out += [
        "",
        f"Once per run: the simulators' start {first.get('jvm_start_s', 0):.1f} s, the embedding model's load "
        f"{first.get('embedder_load_s', 0):.1f} s.",
    ]
    missing = {
        e: sorted({t for s in stages for t in by[(s, e)]["types_without_anchor"]})
        for e in EMBEDS
        if all((s, e) in by for s in stages)
    }
    for e, types in missing.items():
        out.append(
            f"Task types without an anchor in some stage ({e}): "
            + (", ".join(f"`{t}`" for t in types) if types else "none")
            + "."
        )
    s0 = stages[0]
    if (s0, "card") in by and (s0, "key") in by:
        c, k = by[(s0, "card")], by[(s0, "key")]
        out += [
            "",
            f"Anchors per task type at stage {s0} (trajectories of the type in the stage; anchors with card "
            "and with key embeddings):",
            "",
            "| task type | trajectories | anchors (card) | anchors (key) |",
            "|---|---:|---:|---:|",
        ]
        for t, n in c["trajectories_per_type"].items():
            out.append(f"| `{t}` | {n} | {c['anchors_per_type'][t]} | {k['anchors_per_type'][t]} |")
    if figure:
        out += ["", f"![The coverage curves and their knees]({figure})"]
    return "\n".join(out)


def replace_section(doc: str, name: str, body: str) -> str:
    """``doc`` with the text between ``<!-- BEGIN name -->`` and ``<!-- END name -->`` replaced by ``body``.

    Raises:
        ValueError: the document lacks the markers (names them).
    """
    begin, end = f"<!-- BEGIN {name} -->", f"<!-- END {name} -->"
    i, j = doc.find(begin), doc.find(end)
    if i < 0 or j < i:
        raise ValueError(f"no '{begin}' ... '{end}' markers to write the section between")
    return doc[: i + len(begin)] + "\n" + body.strip("\n") + "\n" + doc[j:]


def _rel(path: Any) -> str:
    if path is None:
        return "?"
    try:
        return str(Path(path).resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


# -- the figure -------------------------------------------------------------------------------------
def plot(data: dict[str, Any], path: Path) -> Path:
    """Coverage (share of the stage's queries) against picks (share of the stage), one panel per
    embedding, one line per stage, the knee marked (a dot; its budget in the legend), the 50% floor
    drawn (house style: plots.py)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = data["rows"]
    fig, axes = plt.subplots(1, len(EMBEDS), figsize=(5 * len(EMBEDS), 3.8), squeeze=False)
    for ax, embed in zip(axes[0], EMBEDS, strict=True):
        for r in (r for r in rows if r["embed"] == embed):
            n, curve = r["trajectories"], r["curve"]
            xs = [0.0] + [(i + 1) / n for i in range(len(curve))]
            ys = [0.0] + [c / n for c in curve]
            label = f"stage {r['stage']} ({n} cards): knee {r['budget']} ({_pct(r['budget_fraction'])})"
            (line,) = ax.plot(xs, ys, label=label)
            ax.plot(
                [r["budget"] / n], [r["covered_at_knee"]], marker="o", color=line.get_color(), markersize=7
            )
        ax.axvline(FLOOR, color="grey", linestyle="--", linewidth=1, label="50% floor")
        ax.set_xlim(0, 0.6)
        ax.set_ylim(0, 1.02)
        ax.set_title(f"selection.embed: {embed}")
        ax.set_xlabel("greedy picks (share of the stage's cards)")
        ax.set_ylabel("queries covered (share)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    fig.suptitle("Leave-one-out coverage (k=3) on ScienceWorld stages, 30 task types")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# -- gold paths, in worker processes ---------------------------------------------------------------
_ENV: Any = None
_DOMAIN: Any = None
_MAX_TURNS = 50


def _worker_init(max_turns: int) -> None:
    global _DOMAIN, _MAX_TURNS
    from hamo_ray.config import EnvConfig
    from hamo_ray.envs import get_domain

    _DOMAIN, _MAX_TURNS = get_domain("scienceworld", EnvConfig()), max_turns


def _start(_: int) -> float:
    """Start this worker's simulator (one JVM); its seconds."""
    global _ENV
    t0 = time.perf_counter()
    if _ENV is None:
        _ENV = _DOMAIN.make_env()
    time.sleep(0.5)  # keep this worker busy so that the other start call lands on another one
    return time.perf_counter() - t0


def _play(item: tuple[int, dict]) -> tuple[int, str | None, str | None]:
    """One expert episode as the rollout worker plays it (``rollout.worker._play`` with no client).

    Returns:
        ``(index, trajectory JSON or None, error or None)``.
    """
    global _ENV
    from hamo_ray.types import TaskSpec

    index, spec = item
    task = TaskSpec.model_validate(spec)
    try:
        if _ENV is None:
            _ENV = _DOMAIN.make_env()
        traj = play_gold(_ENV, task, _MAX_TURNS)
    except Exception as exc:  # noqa: BLE001 - recorded; the simulator is replaced
        try:
            _ENV.close()
        except Exception:  # noqa: BLE001
            pass
        _ENV = None
        return index, None, f"{type(exc).__name__}: {exc}"
    return index, traj.model_dump_json(), None


def _stop(_: int) -> None:
    global _ENV
    if _ENV is not None:
        _ENV.close()
        _ENV = None
    time.sleep(0.5)


# -- one stage --------------------------------------------------------------------------------------
def gold_paths(pool, tasks, workers: int) -> tuple[list, list[str], float]:
    """The stage's usable expert trajectories (in task order), the errors, and the seconds."""
    from hamo_ray.types import Trajectory

    t0 = time.perf_counter()
    items = [(i, t.model_dump(mode="json")) for i, t in enumerate(tasks)]
    got: dict[int, Any] = {}
    errors: list[str] = []
    if pool is None:
        results = map(_play, items)
    else:
        results = pool.imap_unordered(_play, items, chunksize=1)
    for index, raw, error in results:
        if error is not None:
            errors.append(f"{tasks[index].id}: {error}")
        else:
            got[index] = Trajectory.model_validate_json(raw)
    seconds = time.perf_counter() - t0
    trajs = [got[i] for i in sorted(got)]
    ok = [t for t in trajs if t.error is None and t.actions and t.score > 0]  # as play_experts keeps them
    errors += [f"{t.task.id}: scored 0" for t in trajs if t not in ok]
    return ok, errors, seconds


def distil_and_embed(trajs, stage: int, mcfg, embedder, store) -> dict[str, float]:
    """The stage's cards distilled, embedded and stored in batches of ``memory.batch_size``; seconds per phase."""
    from hamo_ray.memory.pipeline import distil_batch, encode_input

    seconds = {"distil_s": 0.0, "embed_s": 0.0, "store_s": 0.0}
    rejected = 0
    for start in range(0, len(trajs), mcfg.batch_size):
        chunk = trajs[start : start + mcfg.batch_size]
        batch = {
            "row": np.arange(start, start + len(chunk)),
            "trajectory": np.array([encode_input(t) for t in chunk], dtype=object),
        }
        t0 = time.perf_counter()
        cards = distil_batch(batch, stage, mcfg.distiller, mcfg)
        t1 = time.perf_counter()
        ok = cards["reject_reason"] == ""
        rejected += int((~ok).sum())
        cards = {name: column[ok] for name, column in cards.items()}
        rows = embedder(cards)
        t2 = time.perf_counter()
        store.add(rows)
        t3 = time.perf_counter()
        seconds["distil_s"] += t1 - t0
        seconds["embed_s"] += t2 - t1
        seconds["store_s"] += t3 - t2
    if rejected:
        raise RuntimeError(f"stage {stage}: {rejected} trajectories rejected by the distiller")
    return seconds


def select_both(cfg, trajs, store, stage: int) -> list[dict[str, Any]]:
    """``run.stage.select`` once per embedding, with the curve from ``coverage_select``; one dict each."""
    from hamo_ray.run.resources import process_seed
    from hamo_ray.run.stage import select
    from hamo_ray.selection import coverage_select

    types = [t.task.task for t in trajs]
    all_types = list(dict.fromkeys(types))
    out = []
    for embed in EMBEDS:
        c = cfg.model_copy(update={"selection": cfg.selection.model_copy(update={"embed": embed})})
        t0 = time.perf_counter()
        anchors, budget = select(c, trajs, store, stage)
        seconds = time.perf_counter() - t0
        column = "card_vector" if embed == "card" else "vector"
        vectors = store.vectors([t.card_id for t in trajs], column)
        sc = c.selection
        floor = max(sc.min_budget, math.ceil(sc.min_fraction * len(trajs)))
        result = coverage_select(
            vectors, k=sc.k, min_budget=floor, batch_size=sc.batch_size,
            groups=[(t.task.domain, t.task.task) for t in trajs], seed=process_seed(c, stage, "select"),
        )  # fmt: skip
        ids = {t.id for t in anchors}
        if result.budget != budget or {trajs[i].id for i in result.order} != ids:
            raise RuntimeError(f"stage {stage} ({embed}): coverage_select disagrees with run.stage.select")
        per_type = anchors_per_type(types, result.order, all_types)
        out.append(
            {
                "embed": embed,
                "select_s": seconds,
                **curve_summary(result.curve, len(trajs), budget),
                **type_spread(per_type),
                "anchors_per_type": per_type,
                "greedy_types_covered": sum(
                    v > 0 for v in anchors_per_type(types, result.full_order, all_types).values()
                ),
                "curve": result.curve,
                "n_hits_max": max(result.n_hits, default=0),
                "n_hits_zero": sum(h == 0 for h in result.n_hits),
            }
        )
    return out


def run(args: argparse.Namespace, results: Results) -> None:
    from hamo_ray.config import HamoConfig
    from hamo_ray.envs import get_domain
    from hamo_ray.memory.embed import Embedder
    from hamo_ray.memory.store import MemoryStore
    from hamo_ray.run.resources import stage_tasks

    domain = get_domain("scienceworld", HamoConfig().env)
    types = args.task_types or domain.task_types()
    cfg = HamoConfig.model_validate(
        {
            "env": {"domain": "scienceworld", "task_types": types, "max_turns": args.max_turns},
            "protocol": {"num_stages": args.stages, "train_per_task": args.stages * args.per_task},
            "selection": {"min_fraction": 0.0, "min_budget": args.min_budget},
        }
    )
    stages = stage_tasks(cfg, {"scienceworld": domain})
    print(
        f"{len(types)} task types, {args.stages} stages of {[len(s) for s in stages]} tasks, "
        f"{args.workers} gold-path workers",
        flush=True,
    )
    pool, jvm_start = None, 0.0
    if args.workers > 1:
        pool = mp.get_context("spawn").Pool(
            args.workers, initializer=_worker_init, initargs=(args.max_turns,)
        )
        t0 = time.perf_counter()
        pool.map(_start, range(args.workers), chunksize=1)
        jvm_start = time.perf_counter() - t0
    else:
        _worker_init(args.max_turns)
        jvm_start = _start(0)
    t0 = time.perf_counter()
    embedder = Embedder(cfg.memory.embedding_model, batch_size=cfg.memory.batch_size)
    embedder_load = time.perf_counter() - t0
    print(f"simulators started in {jvm_start:.1f} s, embedder loaded in {embedder_load:.1f} s", flush=True)
    lines = table_lines([])
    print("\n".join(lines), flush=True)
    try:
        with tempfile.TemporaryDirectory(prefix="knee-scale-") as tmp:
            store = MemoryStore.from_config(tmp, cfg.memory)
            for stage, tasks in enumerate(stages, start=1):
                trajs, errors, gold_s = gold_paths(pool, tasks, args.workers)
                for e in errors[:5]:
                    print(f"  stage {stage}: left out {e}", flush=True)
                phase = distil_and_embed(trajs, stage, cfg.memory, embedder, store)
                per_type = dict(Counter(t.task.task for t in trajs))
                shared = {
                    "stage": stage,
                    "tasks": len(tasks),
                    "trajectories": len(trajs),
                    "left_out": len(errors),
                    "left_out_examples": errors[:10],
                    "gold_s": gold_s,
                    **phase,
                    "jvm_start_s": jvm_start,
                    "embedder_load_s": embedder_load,
                    "actions_mean": statistics.mean(len(t.actions) for t in trajs),
                    "trajectories_per_type": {t: per_type.get(t, 0) for t in types},
                }
                for sel in select_both(cfg, trajs, store, stage):
                    row = results.add({**shared, **sel})
                    print(table_lines([row])[-1], flush=True)
    finally:
        if pool is not None:
            pool.map(_stop, range(args.workers), chunksize=1)
            pool.close()
            pool.join()
        elif _ENV is not None:
            _stop(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=2, help="sample-disjoint stages (protocol.num_stages)")
    parser.add_argument("--per-task", type=int, default=10, help="train variations per task type per stage")
    parser.add_argument("--task-types", nargs="+", default=[], help="task types (default: all 30)")
    parser.add_argument("--workers", type=int, default=2, help="gold-path processes (one JVM each)")
    parser.add_argument("--max-turns", type=int, default=50, help="env.max_turns: expert plans are cut here")
    parser.add_argument("--min-budget", type=int, default=1, help="selection.min_budget (min_fraction is 0)")
    parser.add_argument("--plot", type=Path, default=None, metavar="PNG", help="write the figure here")
    parser.add_argument(
        "--doc", type=Path, default=None, help="rewrite the knee-scale section of this document"
    )
    parser.add_argument("--section", default=SECTION, help="the marker name of the section in --doc")
    parser.add_argument(
        "--report",
        type=Path,
        default=None,
        metavar="JSON",
        help="no run: --plot and --doc from this results file",
    )
    add_json_argument(parser, __file__)
    parser.set_defaults(json=DEFAULT_JSON)
    args = parser.parse_args()
    if args.report is not None:
        data = json.loads(args.report.read_text())
        print("\n".join(table_lines(data["rows"])))
    else:
        results = Results(__file__, args)
        run(args, results)
        results.finish()
        data = results.to_dict()
    if args.plot is not None:
        print(f"figure: {_rel(plot(data, args.plot))}")
    if args.doc is not None:
        figure = None
        if args.plot is not None:
            figure = (
                str(Path(_rel(args.plot)).relative_to("docs"))
                if _rel(args.plot).startswith("docs/")
                else None
            )
        args.doc.write_text(replace_section(args.doc.read_text(), args.section, render_section(data, figure)))
        print(f"section {args.section}: {_rel(args.doc)}")


if __name__ == "__main__":
    main()
