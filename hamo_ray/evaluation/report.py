"""The learning experiments' report (docs/results.md): tables over seeds and paired differences.

Reads a sweep's tracked results folder (``results:`` in a sweep file; one ``cells/<cell>/`` per finished
cell with its ``config.yaml`` and ``results/metrics.json``) and writes, per experiment, one markdown
section between ``<!-- BEGIN <name> -->`` and ``<!-- END <name> -->`` markers of a document, plus a plot
of the per-stage curves::

    python -m hamo_ray.evaluation.report results/smollm2-within --name smollm2-within --doc docs/results.md

(several results folders make one section: a sweep and its companion of the flat methods).

The section holds: the table method x (cells, stage average, final total, first-domain retention,
forgetting, BWT), each as the mean and its 95% t interval over seeds; the paired differences of
:data:`PAIRS` per seed and as intervals (methods of one seed share the evaluation draws, so a paired
difference removes most of the sampling noise the seeds share), each read by the decision rule
(:func:`reading`: decided when the interval excludes 0), on the stage average and, across
domains, on the first domain's retention and the last domain's score; every method's per-stage scores; and
the finished cells' wall time. A design that decides on one metric names it (``--decide-on "first-domain
retention"``): the other tables then say where their intervals lie and decide nothing. Nothing here runs
an experiment.
"""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

import yaml

from hamo_ray.evaluation.decision import Plan, plan_of, reading
from hamo_ray.evaluation.metrics import fmt, mean_interval, scored

PAIRS = [
    ("hamo", "model_only"),
    ("hamo", "agenttuning"),
    ("hamo", "harness"),
    ("hamo", "base"),
    ("harness", "base"),
    ("hamo", "hamo_no_conditioning"),  # the ablations (rows appear once their cells exist)
    ("hamo_no_conditioning", "model_only"),  # cards at inference to a model trained without them
    ("hamo_release", "hamo"),
]
METHOD_ORDER = [
    "base",
    "harness",
    "model_only",
    "agenttuning",
    "eto",
    "hamo",
    "hamo_no_conditioning",
    "hamo_release",
]


def load_all(folders: list[Path]) -> list[dict[str, Any]]:
    """The finished cells of several results folders of one design (e.g. a sweep and its companion
    sweep of the flat methods), as one list.

    Raises:
        FileNotFoundError: a folder has no ``cells/``.
        ValueError: two folders hold a cell of one name (names both).
    """
    cells: list[dict[str, Any]] = []
    seen: dict[str, Path] = {}
    for folder in folders:
        for cell in load_cells(folder):
            if cell["name"] in seen:
                raise ValueError(f"cell {cell['name']} is in both {seen[cell['name']]} and {folder}")
            seen[cell["name"]] = folder
            cells.append(cell)
    return cells


def load_cells(results_dir: Path) -> list[dict[str, Any]]:
    """Every finished cell of a results folder: method, seed, metrics, wall seconds, from its files.

    Raises:
        FileNotFoundError: the folder has no ``cells/`` (names the path).
    """
    cells_dir = Path(results_dir) / "cells"
    if not cells_dir.is_dir():
        raise FileNotFoundError(f"{cells_dir}: no exported cells (is `results:` set in the sweep file?)")
    cells = []
    for cell in sorted(p for p in cells_dir.iterdir() if p.is_dir() and not p.name.startswith(".")):
        metrics_file, config_file = cell / "results" / "metrics.json", cell / "config.yaml"
        if not (metrics_file.is_file() and config_file.is_file()):
            continue
        config = yaml.safe_load(config_file.read_text())
        state_file = cell / "state.json"
        seconds = 0.0
        if state_file.is_file():
            stages = json.loads(state_file.read_text()).get("stages", [])
            seconds = sum(sum(s.get("seconds", {}).values()) for s in stages)
        cells.append(
            {
                "name": cell.name,
                "method": config["method"]["name"],
                "seed": int(config["run"]["seed"]),
                "metrics": json.loads(metrics_file.read_text()),
                "seconds": seconds,
            }
        )
    return cells


def stage_average(metrics: dict) -> float:
    """The mean over stages (1..T) of the mean over the evaluated domains (test splits: not ``@seen``)."""
    scores = metrics["stage_scores"]
    domains = scored(scores)
    rows = [[scores[d][t] for d in domains if scores[d][t] is not None] for t in range(metrics["num_stages"])]
    return sum(sum(r) / len(r) for r in rows) / len(rows)


def _fmt(r: dict) -> str:
    return fmt(r, digits=1, missing="-")


def _methods(cells: list[dict]) -> list[str]:
    present = {c["method"] for c in cells}
    return [m for m in METHOD_ORDER if m in present] + sorted(present - set(METHOD_ORDER))


def method_table(cells: list[dict]) -> str:
    """Method x (seeds, stage average, final total, first-domain retention, forgetting, BWT)."""
    lines = [
        "| method | seeds | stage average | final total | first-domain retention | forgetting | BWT |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for method in _methods(cells):
        runs = [c["metrics"] for c in cells if c["method"] == method]
        first = runs[0]["first_domain"]
        values = [
            mean_interval([stage_average(r) for r in runs]),
            mean_interval([r["final_total"] for r in runs]),
            mean_interval([r["retention"][-1] for r in runs]),
            mean_interval([r["forgetting"].get(first, 0.0) for r in runs]),
            mean_interval([r["backward_transfer"] for r in runs]),
        ]
        seeds = ", ".join(str(c["seed"]) for c in cells if c["method"] == method)
        lines.append(f"| `{method}` | {seeds} | " + " | ".join(_fmt(v) for v in values) + " |")
    return "\n".join(lines)


def first_domain_retention(metrics: dict) -> float:
    """The first domain's score after the last stage (the paper's cross-domain retention)."""
    return metrics["retention"][-1]


def last_domain_final(metrics: dict) -> float:
    """The last stage's domain, scored after its own stage (what the newest training reached)."""
    return metrics["stage_scores"][metrics["stage_domains"][-1]][-1]


METRICS = {
    "stage average": stage_average,
    "first-domain retention": first_domain_retention,
    "last-domain score": last_domain_final,
}


def paired_table(
    cells: list[dict],
    pairs: list[tuple[str, str]] = PAIRS,
    metric: str = "stage average",
    planned: int | Plan | None = None,
    decides: bool = True,
) -> str:
    """Differences ``a - b`` of one of :data:`METRICS` per seed (both cells finished) and their interval;
    ``planned``: the seeds the design reads the rule at, one count or a :class:`Plan` per method (fewer
    give an interim reading, :func:`reading`); ``decides=False``: a metric the design reports beside the
    one it decides on, whose readings never decide."""
    if metric not in METRICS:
        raise ValueError(f"paired_table: unknown metric {metric!r}; choose one of {sorted(METRICS)}")
    value = METRICS[metric]
    by = {(c["method"], c["seed"]): value(c["metrics"]) for c in cells}
    seeds = sorted({c["seed"] for c in cells})
    lines = [
        f"| difference ({metric}) | " + " | ".join(f"seed {s}" for s in seeds) + " | mean ± 95% | reading |",
        "|---|" + "---:|" * (len(seeds) + 1) + "---|",
    ]
    for a, b in pairs:
        diffs = {s: by[(a, s)] - by[(b, s)] for s in seeds if (a, s) in by and (b, s) in by}
        if not diffs:
            continue
        row = [f"{diffs[s]:+.1f}" if s in diffs else "-" for s in seeds]
        interval = mean_interval(list(diffs.values()))
        lines.append(
            f"| `{a} - {b}` | "
            + " | ".join(row)
            + f" | {_fmt(interval)} | {reading(interval, a, b, plan_of(planned).pair(a, b), decides)} |"
        )
    if len(lines) == 2:  # no pair has both cells of any seed yet (a sweep's first cells)
        return f"No paired difference ({metric}) yet: no seed has both cells of any pair."
    return "\n".join(lines)


def _across_domains(cells: list[dict]) -> bool:
    return any(len(scored(c["metrics"]["stage_scores"])) > 1 for c in cells)


def shown_metrics(cells: list[dict]) -> list[str]:
    """The metrics a section pairs: the stage average and, across domains, what the first domain kept
    against what the last one learnt (within one domain both are the final score: no more tables)."""
    return list(METRICS) if _across_domains(cells) else ["stage average"]


def stage_table(cells: list[dict]) -> str:
    """Each method's score per domain and stage (stage 0: before any training), mean over seeds."""
    domains = sorted({d for c in cells for d in c["metrics"]["stage_scores"]})
    stages = max(c["metrics"]["num_stages"] for c in cells)
    lines = [
        "| method | domain | " + " | ".join(f"stage {t}" for t in range(stages + 1)) + " |",
        "|---|---|" + "---:|" * (stages + 1),
    ]
    for method in _methods(cells):
        runs = [c["metrics"] for c in cells if c["method"] == method]
        for d in domains:
            points = [mean_interval([(r.get("initial") or {}).get(d) for r in runs])]
            points += [mean_interval([r["stage_scores"][d][t] for r in runs]) for t in range(stages)]
            lines.append(f"| `{method}` | {d} | " + " | ".join(_fmt(p) for p in points) + " |")
    return "\n".join(lines)


def curves_plot(cells: list[dict], out: Path) -> Path:
    """Mean score over seeds per stage, one line per method (and domain), to ``out`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    domains = sorted({d for c in cells for d in c["metrics"]["stage_scores"]})
    for method in _methods(cells):
        runs = [c["metrics"] for c in cells if c["method"] == method]
        for d in domains:
            curve = defaultdict(list)
            for r in runs:
                if r.get("initial") and d in r["initial"]:
                    curve[0].append(r["initial"][d])
                for t, v in enumerate(r["stage_scores"][d], start=1):
                    curve[t].append(v)
            xs = sorted(curve)
            label = method if len(domains) == 1 else f"{method} ({d})"
            ax.plot(xs, [sum(curve[x]) / len(curve[x]) for x in xs], marker="o", label=label)
    ax.set_xlabel("stage (0: before training)")
    ax.set_ylabel("test score (mean over seeds)")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def section(
    cells: list[dict],
    name: str,
    plot: Path | None,
    doc_dir: Path | None = None,
    planned: int | Plan | None = None,
    decide_on: list[str] | None = None,
) -> str:
    """The markdown section of one experiment (the tables, the plot link, the cells' wall time);
    ``planned``: the seeds its design reads the decision rule at (:func:`reading`); ``decide_on``: the
    metrics its design decides on (None: every metric shown decides); the other tables are reported
    and decide nothing, since reading the rule on several scores decides more often than its 95%.

    Raises:
        ValueError: ``decide_on`` names a metric the section does not pair (names it and those shown).
    """
    shown = shown_metrics(cells)
    if decide_on is not None and (not decide_on or (extra := [m for m in decide_on if m not in shown])):
        raise ValueError(
            f"--decide-on {', '.join(extra if decide_on else ['(nothing)'])}: not paired in this section; "
            f"it pairs {', '.join(shown)}"
            + (" (one domain: the stage average only)" if shown == ["stage average"] else "")
        )
    hours = sum(c["seconds"] for c in cells) / 3600
    head = (
        f"Finished cells: {len(cells)} ({', '.join(c['name'] for c in cells)}); their stages took "
        f"{hours:.1f} h of wall time in all (phases summed)."
        + (f" {plan}" if (plan := plan_of(planned).describe()) else "")
    )
    if decide_on is not None and set(decide_on) != set(shown):
        head += (
            f" The design decides on {' and '.join(decide_on)} only; the other differences are reported "
            "and decide nothing."
        )
    parts = [head, "", method_table(cells)]
    for metric in shown:
        decides = decide_on is None or metric in decide_on
        parts += ["", paired_table(cells, metric=metric, planned=planned, decides=decides)]
    parts += ["", stage_table(cells)]
    if plot is not None:
        rel = plot.relative_to(doc_dir) if doc_dir is not None else plot
        parts += ["", f"![{name}: per-stage scores]({rel.as_posix()})"]
    return "\n".join(parts)


def update_doc(doc: Path, name: str, text: str) -> None:
    """Replace the text between ``<!-- BEGIN name -->`` and ``<!-- END name -->`` in ``doc``.

    Raises:
        ValueError: the document lacks the two markers (names them).
    """
    begin, end = f"<!-- BEGIN {name} -->", f"<!-- END {name} -->"
    body = doc.read_text()
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.DOTALL)
    if not pattern.search(body):
        raise ValueError(f"{doc}: no '{begin}' ... '{end}' markers to write the {name} section between")
    doc.write_text(pattern.sub(lambda _: f"{begin}\n{text}\n{end}", body))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "results", nargs="+", help="a sweep's tracked results folder (holds cells/); several: one section"
    )
    parser.add_argument("--name", required=True, help="the section's marker name in --doc")
    parser.add_argument("--doc", help="the document to update (else the section is printed)")
    parser.add_argument(
        "--planned-seeds",
        nargs="+",
        default=[],
        metavar="N|METHOD=N",
        help="the seeds the design reads the decision rule at (N: every method; METHOD=N: one method, "
        "e.g. 6 base=3 harness=3); a pair with fewer in reads interim",
    )
    parser.add_argument(
        "--decide-on",
        nargs="+",
        metavar="METRIC",
        help=f"the metrics the design decides on ({'; '.join(METRICS)}; default: every one shown); "
        "the other paired tables are reported and decide nothing",
    )
    args = parser.parse_args(argv)
    if args.decide_on and (unknown := [m for m in args.decide_on if m not in METRICS]):
        print(f"error: --decide-on {', '.join(unknown)}: not a metric; choose from {'; '.join(METRICS)}")
        return 2
    try:
        plan = Plan.parse(args.planned_seeds)
    except ValueError as exc:
        print(f"error: {exc}")
        return 2
    try:
        cells = load_all([Path(f) for f in args.results])
    except (FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}")
        return 1
    if not cells:
        print(f"error: {', '.join(args.results)}: no finished cell yet")
        return 1
    doc = Path(args.doc) if args.doc else None
    out = doc.parent if doc else Path(args.results[0])
    plot = out / "results" / f"{args.name}.png"
    try:
        text = section(
            cells, args.name, plot, doc.parent if doc else None, planned=plan, decide_on=args.decide_on
        )
    except ValueError as exc:  # refused before anything is written
        print(f"error: {exc}")
        return 2
    curves_plot(cells, plot)
    if doc is None:
        print(text)
    else:
        update_doc(doc, args.name, text)
        print(f"{doc}: section {args.name} updated from {len(cells)} cells")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
