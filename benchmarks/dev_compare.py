"""The dev-split comparisons that set defaults (issue 43, items 3 and 5): tables from exported cells.

Reads the cells a sweep exported (``<results>/cells/<cell>/``: ``results/scores.csv`` and the
evaluation episodes ``episodes/stage-<t>-<domain>.jsonl.gz``), groups them into arms by the cell name
without its seed (``hamo-smollm2-135m-instruct-default-distilleroutline-s0`` -> ``distilleroutline``),
and prints, for the dev split (``scienceworld@seen``) after the last stage:

- per arm: seeds, the score's mean ± 95% t-interval over seeds, episodes, and the cards injected at
  inference (``cards_used`` of the episodes) and withheld (``top_k`` per episode minus those injected:
  the harness retrieves ``memory.top_k`` cards, the gate withholds the rest);
- per ``--pair B A``: B - A paired by seed, mean ± 95% interval, and the decision (decided when the
  interval excludes 0).

With ``--runs`` (the run root, e.g. ``runs/smollm2-dev``) it also counts, from the cell's memory, how many
injected cards were of another task type than the episode's; with ``--logs`` (the sweeps' console logs)
the cards injected and withheld in training (the ``training experience: ...`` line that
``hamo_ray.memory.recall.training_experience`` logs after ``sweep: started cell <cell>``; the stage's
result does not record them).

    python benchmarks/dev_compare.py results/smollm2-dev-cards results/smollm2-dev-gate \\
        --pair distilleroutline-general distilleroutline --pair gate-min-similarity0-5 distilleroutline
"""

from __future__ import annotations

import argparse
import csv
import gzip
import json
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

from hamo_ray.evaluation.metrics import mean_interval

DEV = "scienceworld@seen"
STARTED = re.compile(r"sweep: started cell (\S+)")
CELL = re.compile(r"^(?P<method>[^-]+)-(?P<model>.+?)-default-?(?P<arm>.*)-s(?P<seed>\d+)$")
TRAIN_LOG = re.compile(r"training experience: (\d+) cards injected, (\d+) withheld by the gate, (\d+) of")


def fmt(iv: dict[str, Any]) -> str:
    if iv["mean"] is None:
        return "n/a"
    if iv["std"] is None:
        return f"{iv['mean']:.1f}"
    return f"{iv['mean']:.1f} ± {iv['ci_high'] - iv['mean']:.1f}"


def card_types(run_dir: Path) -> dict[str, str]:
    """Card id -> task type, from the cell's memory (empty when its run folder is gone)."""
    mem = run_dir / "memory"
    if not mem.is_dir():
        return {}
    from hamo_ray.memory.store import MemoryStore

    try:
        return {c.id: c.task for c in MemoryStore(str(mem)).cards()}
    except Exception:  # noqa: BLE001 - a missing or other table: no types
        return {}


def training_counts(logs: list[Path]) -> dict[str, tuple[int, int]]:
    """Cell -> (cards injected, withheld) in training, from the sweeps' console logs."""
    out: dict[str, tuple[int, int]] = {}
    cell = None
    for path in logs:
        for line in path.open(errors="replace"):
            if m := STARTED.search(line):
                cell = m[1]
            elif (m := TRAIN_LOG.search(line)) and cell is not None:
                a, b = out.get(cell, (0, 0))
                out[cell] = (a + int(m[1]), b + int(m[2]))
    return out


def cell_row(
    cell: Path, top_k: int, runs: Path | None, train: dict[str, tuple[int, int]]
) -> dict[str, Any] | None:
    m = CELL.match(cell.name)
    scores = cell / "results" / "scores.csv"
    if m is None or not scores.is_file():
        return None
    rows = [r for r in csv.DictReader(scores.open()) if r["domain"] == DEV]
    if not rows:
        return None
    last = max(rows, key=lambda r: int(r["stage"]))
    stage = int(last["stage"])
    eps = [json.loads(line) for line in gzip.open(cell / "episodes" / f"stage-{stage}-{DEV}.jsonl.gz", "rt")]
    injected = sum(len(e["cards_used"]) for e in eps)
    row = {
        "cell": cell.name, "arm": m["arm"] or m["method"], "seed": int(m["seed"]), "stage": stage,
        "dev": float(last["score"]), "episodes": len(eps), "injected": injected,
        "withheld": top_k * len(eps) - injected,
    }  # fmt: skip
    test = [
        r for r in csv.DictReader(scores.open()) if r["domain"] == "scienceworld" and int(r["stage"]) == stage
    ]
    row["test_unread"] = float(test[0]["score"]) if test else None
    if runs is not None:
        run_dir = runs / "cells" / cell.name
        types = card_types(run_dir)
        if types:
            row["injected_other_type"] = sum(
                types.get(c, e["task"]["task"]) != e["task"]["task"] for e in eps for c in e["cards_used"]
            )
    if cell.name in train:
        row["train_injected"], row["train_withheld"] = train[cell.name]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("results", nargs="+", type=Path, help="results folders (with cells/)")
    parser.add_argument(
        "--pair", nargs=2, action="append", default=[], metavar=("B", "A"), help="arm B - arm A"
    )
    parser.add_argument("--top-k", type=int, default=2, help="memory.top_k of the cells")
    parser.add_argument(
        "--runs", type=Path, default=None, help="the run root (card types of the injected cards)"
    )
    parser.add_argument("--logs", nargs="*", type=Path, default=[], help="the sweeps' console logs")
    parser.add_argument("--json", type=Path, default=None, help="write the rows and tables here")
    args = parser.parse_args()
    train = training_counts(args.logs)

    rows = [
        r
        for folder in args.results
        for cell in sorted((folder / "cells").iterdir())
        if cell.is_dir() and not cell.name.startswith(".")
        if (r := cell_row(cell, args.top_k, args.runs, train))
    ]
    by_arm: dict[str, dict[int, dict]] = defaultdict(dict)
    for r in rows:
        by_arm[r["arm"]][r["seed"]] = r
    print("| arm | seeds | dev score (mean ± 95%) | per seed | episodes | cards injected | withheld | "
          "injected of another type | training: injected / withheld |")  # fmt: skip
    print("|---|---|---:|---|---:|---:|---:|---:|---:|")
    arms = {}
    for arm, seeds in sorted(by_arm.items()):
        rs = [seeds[s] for s in sorted(seeds)]
        iv = mean_interval([r["dev"] for r in rs])
        arms[arm] = {"dev": iv, "seeds": sorted(seeds)}
        other = (
            sum(r.get("injected_other_type", 0) for r in rs)
            if all("injected_other_type" in r for r in rs)
            else "n/a"
        )
        train = (f"{sum(r['train_injected'] for r in rs)} / {sum(r['train_withheld'] for r in rs)}"
                 if all("train_injected" in r for r in rs) else "n/a")  # fmt: skip
        per_seed = ", ".join(f"{r['dev']:.1f}" for r in rs)
        print(f"| `{arm}` | {', '.join(map(str, sorted(seeds)))} | {fmt(iv)} | "
              f"{per_seed} | {sum(r['episodes'] for r in rs)} | "
              f"{sum(r['injected'] for r in rs)} | {sum(r['withheld'] for r in rs)} | {other} | {train} |")  # fmt: skip
    pairs = []
    if args.pair:
        print("\n| difference (dev) | seeds | per seed | mean ± 95% | decision |")
        print("|---|---|---|---:|---|")
    for b, a in args.pair:
        common = sorted(set(by_arm.get(b, {})) & set(by_arm.get(a, {})))
        diffs = [by_arm[b][s]["dev"] - by_arm[a][s]["dev"] for s in common]
        iv = mean_interval(diffs)
        decided = iv["ci_low"] is not None and (iv["ci_low"] > 0 or iv["ci_high"] < 0)
        winner = (b if iv["mean"] > 0 else a) if decided else None
        decision = f"decided: `{winner}`" if decided else "undecided"
        pairs.append({"b": b, "a": a, "seeds": common, "diffs": diffs, "interval": iv, "decision": decision})
        print(f"| `{b} - {a}` | {', '.join(map(str, common))} | {', '.join(f'{d:+.1f}' for d in diffs)} | "
              f"{fmt(iv)} | {decision} |")  # fmt: skip
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"rows": rows, "arms": arms, "pairs": pairs}, indent=2) + "\n")


if __name__ == "__main__":
    main()
