"""A sweep's aggregate: the cells' metrics summarised (``sweep.stats``), as a table, plots and a report.

``aggregate`` writes ``<root>/results/summary.json``, ``table.md`` and the plots, and ``<root>/report.md``
(and a copy of each into the tracked results folder, when the sweep has one).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from hamo_ray.config import HamoConfig
from hamo_ray.evaluation.metrics import fmt
from hamo_ray.run.folder import atomic_write
from hamo_ray.sweep.export import cell_metrics
from hamo_ray.sweep.grid import setting_of
from hamo_ray.sweep.stats import SettingStats, sweep_stats, table_values

TABLE_HEADER = (
    "| setting | method | seeds | stage average | vs base (paired) | final total | first-domain retention "
    "| forgetting (first domain) | BWT |",
    "|---|---|---|---|---|---|---|---|---|",
)

LEGEND = (
    "Mean ± the half-width of the two-sided 95% t interval over seeds (no interval with one seed). "
    "Stage average: the mean over stages of the mean over domains; vs base (paired): the stage average "
    "minus the base method's of the same seed, then mean ± interval over seeds; final total: the sum over domains "
    "after the last stage; first-domain retention: the first domain's score after the last stage; "
    "forgetting: its best score minus its final one; BWT: backward transfer "
    "(hamo_ray/evaluation/metrics.py).\n"
)


def collect(
    cells: list[tuple[str, HamoConfig]], vary: list[str] | tuple[str, ...] = (), results: Path | None = None
) -> dict[str, dict[str, list[dict]]]:
    """The finished cells' metrics by setting and method (each with its ``seed``); others are left out."""
    groups: dict[str, dict[str, list[dict]]] = {}
    for name, cfg in cells:
        metrics = cell_metrics(name, cfg, results)
        if metrics is None:
            continue
        metrics["seed"] = cfg.run.seed  # pairs each method's run with the base run of the same seed
        groups.setdefault(setting_of(cfg, vary), {}).setdefault(cfg.method.name, []).append(metrics)
    return groups


def table(stats: dict[str, SettingStats]) -> str:
    """The markdown table: one row per (setting, method), then the legend."""
    lines = list(TABLE_HEADER)
    for setting, s in stats.items():
        for method, summary in s.methods.items():
            row = " | ".join(map(fmt, table_values(summary)))
            lines.append(f"| {setting} | {method} | {summary['seeds']} | {row} |")
    return "\n".join(lines) + "\n\n" + LEGEND


def plot_setting(stats: SettingStats, setting: str, tag: str, out_dir: Path) -> list[Path]:
    """One setting's plots in ``out_dir``: stage-wise scores, per-domain bars, first-domain retention."""
    from hamo_ray.evaluation import plots

    curves, first_stage = stats.curves, stats.first_stage
    return [
        plots.stagewise(
            curves, out_dir / f"{tag}-stagewise.png", f"Stage-wise scores: {setting}", first_stage
        ),
        plots.domain_bars(
            curves, out_dir / f"{tag}-bars.png", f"Per domain after each stage: {setting}", first_stage
        ),
        plots.retention(stats.retention, out_dir / f"{tag}-retention.png", stats.first_domain, first_stage),
    ]


def report(table_md: str, figures: list[tuple[str, list[Path]]], prefix: str) -> str:
    """The sweep's report.md: the table, then each setting's plots (linked as ``<prefix><png>``)."""
    lines = ["# Sweep report", "", table_md]
    for setting, pngs in figures:
        lines += [f"## {setting}", ""] + [f"![{p.stem}]({prefix}{p.name})" for p in pngs] + [""]
    return "\n".join(lines)


def summary_json(stats: dict[str, SettingStats]) -> dict[str, Any]:
    """``summary.json``: setting -> method -> its summary."""
    return {setting: s.methods for setting, s in stats.items()}


def aggregate(
    cells: list[tuple[str, HamoConfig]],
    out_dir: Path,
    vary: list[str] | tuple[str, ...] = (),
    results: str | Path | None = None,
) -> dict[str, Any]:
    """Mean and 95% interval over seeds per (setting, method): summary.json, table.md and plots.

    Args:
        cells: the sweep's cells (``expand_cells``).
        out_dir: ``<root>/results``: summary.json, table.md and plots; report.md goes beside it.
        vary: the grid's varied keys (part of each setting).
        results: the sweep's tracked results folder, or None: a cell's metrics come from its run
            folder, else from its export there, and summary.json, table.md, report.md and the plots
            are written there too.

    Returns:
        The summary (setting -> method -> figures), as written to summary.json.
    """
    results = None if results is None else Path(results)
    stats = sweep_stats(collect(cells, vary, results))
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = summary_json(stats)
    figures = [
        (setting, plot_setting(s, setting, f"setting{n}", out_dir))
        for n, (setting, s) in enumerate(stats.items())
    ]
    table_md = table(stats)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    (out_dir / "table.md").write_text(table_md)
    (out_dir.parent / "report.md").write_text(report(table_md, figures, "results/"))
    if results is not None:  # the tracked copy: the plots lie beside its report.md
        results.mkdir(parents=True, exist_ok=True)
        atomic_write(results / "summary.json", json.dumps(summary, indent=1))
        atomic_write(results / "table.md", table_md)
        for _, pngs in figures:
            for png in pngs:
                shutil.copyfile(png, results / png.name)
        atomic_write(results / "report.md", report(table_md, figures, ""))
    return summary
