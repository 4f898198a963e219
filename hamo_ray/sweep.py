"""Sweeps: a grid of methods x models x domain orders x seeds, each cell a stream run.

A sweep file (YAML) names a base config and the grid::

    base: jobs/configs/tiny.yaml          # relative to the sweep file
    overrides: [protocol.num_stages=2]    # applied to every cell
    root: runs/sweep-tiny                 # cells under <root>/cells/<cell>, results under <root>/results
    results: results/sweep-tiny           # optional: a tracked folder for the small results (below)
    parallel: 1                           # cells run at once (Ray tasks); 1 on a laptop
    cell_resources: {CPU: 0}              # resources each cell's controller task holds
    grid:
      method: [base, harness, model_only, hamo]
      model: [embedded]                   # model.path values
      order: [[scienceworld]]             # cross_domain orders; [[d]] for a within-domain stream of d
      seed: [0, 1]
      vary:                               # any dotted config key -> its values (optional)
        train.lr: [2.0e-4, 2.0e-3]

Cells that finished earlier are skipped (their run folder holds every stage); a killed sweep
resumes each unfinished cell after its last committed stage. Cells sharing a backbone share one
policy endpoint (adapter names carry the cell's run id). At the end, every cell's
``results/metrics.json`` is aggregated into ``<root>/results/summary.json``, a table and plots.

``results`` (optional; relative to the current directory, like ``root``) keeps a sweep's results when
its run folders are lost with the machine (``runs/`` is not tracked): as soon as a cell finishes, its
small results are exported (``export_cell``) to::

    <results>/cells/<cell>/
        config.yaml  state.json  report.md (if any)
        results/scores.csv  results/metrics.json
        episodes/stage-t-<domain>.jsonl.gz     the evaluation episodes, gzip-compressed
        episodes.csv                           one row per episode: stage, domain, task, variation,
                                               score, turns, done, error, cards_used, policy_tokens

(never adapters, memory, train/, tensorboard/ or trajectories/). An export is written into a temporary
``.<cell>.tmp`` folder and renamed into place last: a killed export does not look finished. A cell
whose export exists (its ``config.yaml`` and ``results/metrics.json``) is finished even without its run
folder (a fresh machine), unless the export's config differs from the cell's in a key that changes
results (anything but the sections ``run``, ``ray``, ``serve``, ``rollout``): such a stale export is
named in a warning and the cell runs again. Cells finished in their run folder but not (or differently)
exported are exported when the sweep starts. The aggregate reads a cell's metrics from its run folder,
else from its export, and is also written to ``<results>/`` (summary.json, table.md, report.md, plots).
"""

from __future__ import annotations

import csv
import gzip
import io
import itertools
import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from hamo_ray.config import ConfigError, HamoConfig, env_sections, load_config, upgrade_saved_config
from hamo_ray.run_folder import _RESUMABLE_KEYS, atomic_write

logger = logging.getLogger(__name__)


class GridConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    method: list[str] = Field(default_factory=lambda: ["hamo"])
    model: list[str] = Field(default_factory=lambda: ["embedded"])
    order: list[list[str]] = Field(default_factory=list)  # empty: the base config's own protocol
    seed: list[int] = Field(default_factory=lambda: [0])
    vary: dict[str, list[Any]] = Field(default_factory=dict)  # any dotted key of HamoConfig -> its values


class SweepConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    base: str
    overrides: list[str] = Field(default_factory=list)
    root: str = "runs/sweep"
    results: str | None = None  # a tracked folder the cells' small results are exported to (see above)
    parallel: int = Field(default=1, ge=1)
    cell_resources: dict[str, float] = Field(default_factory=lambda: {"CPU": 0})
    grid: GridConfig = GridConfig()


def load_sweep(path: str | Path, overrides: list[str] = ()) -> tuple[SweepConfig, Path]:
    """Read a sweep file; ``base`` is resolved relative to the file. Errors name the key or file."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"sweep file {str(p)!r} does not exist")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"sweep file {str(p)!r} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"sweep file {str(p)!r} must hold a mapping at the top level")
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or key not in SweepConfig.model_fields:
            raise ConfigError(
                f"sweep override {item!r}: expected one of {', '.join(SweepConfig.model_fields)}=value"
            )
        try:
            data[key] = yaml.safe_load(raw)
        except yaml.YAMLError:
            data[key] = raw
    try:
        sweep = SweepConfig.model_validate(data)
    except ValidationError as err:
        keys = ", ".join(".".join(str(x) for x in e["loc"]) + f" ({e['msg']})" for e in err.errors())
        raise ConfigError(f"invalid sweep file {str(p)!r}: {keys}") from None
    base = (p.parent / sweep.base) if not Path(sweep.base).is_absolute() else Path(sweep.base)
    if not base.is_file():
        base = Path(sweep.base)
    if not base.is_file():
        raise ConfigError(f"sweep file {str(p)!r}: base config {sweep.base!r} does not exist")
    if sweep.results is not None:
        _check_results(sweep, p)
    return sweep, base


def _check_results(sweep: SweepConfig, path: Path) -> None:
    results = Path(sweep.results).expanduser()
    for folder in (results, *results.parents):  # the folder itself or one above it must not be a file
        if folder.exists():
            if not folder.is_dir():
                raise ConfigError(
                    f"sweep file {str(path)!r}: results: {str(folder)!r} exists and is not a folder"
                )
            break
    if results.resolve() == Path(sweep.root).expanduser().resolve():
        raise ConfigError(
            f"sweep file {str(path)!r}: results: {sweep.results!r} is the sweep's root "
            "(its cells/ would be the run folders); give another folder"
        )


def _tag(text: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in Path(text).name if c)[:40].strip("-") or "x"


def expand_cells(sweep: SweepConfig, base: Path) -> list[tuple[str, HamoConfig]]:
    """One validated ``HamoConfig`` per grid cell, named ``<method>-<model>-<order>-s<seed>``."""
    g = sweep.grid
    root = Path(sweep.root)
    orders: list[list[str] | None] = [list(o) for o in g.order] or [None]
    keys = list(g.vary)
    cells = []
    for method, model, order, seed, *varied in itertools.product(
        g.method, g.model, orders, g.seed, *(g.vary[k] for k in keys)
    ):
        extra = [f"method.name={method}", f"model.path={model}", f"run.seed={seed}"]
        extra += [f"{k}={json.dumps(v)}" for k, v in zip(keys, varied, strict=True)]
        vary_tag = "".join(
            f"-{k.rsplit('.', 1)[-1]}{_tag(str(v))}" for k, v in zip(keys, varied, strict=True)
        )
        order_tag = "default"
        if order is not None:
            order_tag = "".join(d[0].upper() for d in order)
            if len(order) == 1:
                extra += ["protocol.kind=within_domain", f"env.domain={order[0]}"]
            else:
                extra += ["protocol.kind=cross_domain", f"protocol.order=[{','.join(order)}]"]
        name = f"{method}-{_tag(model)}-{order_tag}{vary_tag}-s{seed}"
        cfg = load_config(base, [*sweep.overrides, *extra, f"run.root={root / 'cells'}", f"run.id={name}"])
        cells.append((name, cfg))
    return cells


def setting_of(cfg: HamoConfig, vary: list[str] | tuple[str, ...] = ()) -> str:
    """The group a cell's seeds are aggregated in: backbone, domain order and the varied keys' values."""
    label = f"{_tag(cfg.model.path)}: {'->'.join(cfg.domains())}"
    for key in vary:
        value: Any = cfg
        for part in key.split("."):
            value = getattr(value, part)
        label += f", {key}={value}"
    return label


# -- the tracked results folder (``results``) ---------------------------------------------------------

# What an export copies from a run folder (if there), besides the episodes; never the large outputs.
_EXPORTED_FILES = ("config.yaml", "state.json", "results/scores.csv", "results/metrics.json", "report.md")
EPISODE_COLUMNS = (
    "stage",
    "domain",
    "task",
    "variation",
    "score",
    "turns",
    "done",
    "error",
    "cards_used",
    "policy_tokens",
)


def results_dir(sweep: SweepConfig) -> Path | None:
    """The sweep's tracked results folder, or None when ``results`` is not set."""
    return None if sweep.results is None else Path(sweep.results).expanduser()


def export_dir(results: str | Path, name: str) -> Path:
    """Where cell ``name`` is exported to: ``<results>/cells/<name>`` (whether or not it exists yet)."""
    return Path(results) / "cells" / name


def exported_cell(results: str | Path | None, name: str) -> Path | None:
    """Cell ``name``'s finished export (its ``config.yaml`` and ``results/metrics.json`` there), else None.

    A half-written export lies in a temporary folder beside it and is not found here.
    """
    if results is None:
        return None
    dest = export_dir(results, name)
    if (dest / "config.yaml").is_file() and (dest / "results" / "metrics.json").is_file():
        return dest
    return None


def _episode_order(path: Path) -> tuple[int, str]:
    m = re.match(r"stage-(\d+)-", path.name)
    return (int(m.group(1)) if m else -1, path.name)


def export_cell(run_folder: str | Path, dest: str | Path) -> Path:
    """Copy a finished run folder's small results to ``dest``, replacing an earlier export there.

    Copies ``config.yaml``, ``state.json``, ``results/scores.csv``, ``results/metrics.json`` and
    ``report.md`` (those that exist), the evaluation episodes ``episodes/*.jsonl`` gzip-compressed as
    ``episodes/*.jsonl.gz``, and writes ``episodes.csv`` (one row per episode, ``EPISODE_COLUMNS``).
    Everything is written into ``.<name>.tmp`` beside ``dest`` and renamed into place last, so a killed
    export leaves no ``dest`` that looks finished.

    Returns:
        ``dest``.

    Raises:
        FileNotFoundError: the run folder has no ``config.yaml`` or ``results/metrics.json``.
    """
    src, dest = Path(run_folder), Path(dest)
    for rel in ("config.yaml", "results/metrics.json"):
        if not (src / rel).is_file():
            raise FileNotFoundError(f"run folder {src} has no {rel}: nothing to export")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp, old = dest.with_name(f".{dest.name}.tmp"), dest.with_name(f".{dest.name}.old")
    for leftover in (tmp, old):  # of an export killed before
        if leftover.exists():
            shutil.rmtree(leftover)
    tmp.mkdir()
    for rel in _EXPORTED_FILES:
        if (src / rel).is_file():
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src / rel, tmp / rel)
    buf = io.StringIO()
    writer = csv.writer(buf)
    writer.writerow(EPISODE_COLUMNS)
    for f in sorted((src / "episodes").glob("*.jsonl"), key=_episode_order):
        data = f.read_bytes()
        (tmp / "episodes").mkdir(exist_ok=True)
        # mtime=0: the same episodes give the same bytes (no spurious change in the tracked folder)
        (tmp / "episodes" / f"{f.name}.gz").write_bytes(gzip.compress(data, mtime=0))
        stage = _episode_order(f)[0]
        for line in data.decode().splitlines():
            if not line.strip():
                continue
            t = json.loads(line)
            task = t.get("task", {})
            writer.writerow(
                [
                    "" if stage < 0 else stage,
                    task.get("domain", ""),
                    task.get("task", ""),
                    task.get("variation", ""),
                    t.get("score", 0.0),
                    len(t.get("actions", [])),
                    t.get("done", False),
                    t.get("error") or "",
                    len(t.get("cards_used", [])),
                    t.get("policy_tokens", 0),
                ]
            )
    (tmp / "episodes.csv").write_text(buf.getvalue())
    if dest.exists():  # replace: the old export moves aside, the new one in, then the old one goes
        os.replace(dest, old)
    os.replace(tmp, dest)
    shutil.rmtree(old, ignore_errors=True)
    return dest


def save_export(results: str | Path, name: str, run_folder: str | Path) -> Path | None:
    """``export_cell`` of cell ``name`` into ``results``; a failure is logged (the run folder is intact)."""
    try:
        dest = export_cell(run_folder, export_dir(results, name))
    except Exception as exc:  # noqa: BLE001 - the cell finished; its export is retried at the next start
        logger.error("sweep: exporting cell %s to %s failed: %s", name, export_dir(results, name), exc)
        return None
    logger.info("sweep: cell %s exported to %s", name, dest)
    return dest


def stale_keys(exported: str | Path, cfg: HamoConfig) -> list[str]:
    """The dotted keys in which an export's config differs from ``cfg``, ignoring those a resume may
    change (the sections ``run``, ``ray``, ``serve``, ``rollout``, as in ``RunFolder``).

    Args:
        exported: an export folder (or its ``config.yaml``).

    A key the saved config lacks holds its code default (it was added after the export was made); an
    export in an older layout is read in today's (``upgrade_saved_config``). A domain's settings are
    compared key by key (``env.webshop.ids``).
    """
    f = Path(exported)
    f = f / "config.yaml" if f.is_dir() else f
    try:
        saved = yaml.safe_load(f.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        return [f"config.yaml ({type(exc).__name__})"]
    if not isinstance(saved, dict):
        return ["config.yaml (not a mapping)"]
    saved = upgrade_saved_config(saved)
    defaults = HamoConfig().model_dump(mode="json")
    domains = set(env_sections())
    diffs = []
    for section, values in cfg.model_dump(mode="json").items():
        if section in _RESUMABLE_KEYS or not isinstance(values, dict):
            continue
        got = _mapping(saved.get(section))
        for key, value in values.items():
            if f"{section}.{key}" == "run.root":
                continue
            default = defaults.get(section, {}).get(key)
            if section == "env" and key in domains:  # a domain's settings: one key at a time
                sub, sub_default = _mapping(got.get(key)), _mapping(default)
                diffs += [f"env.{key}.{k}" for k, v in value.items() if sub.get(k, sub_default.get(k)) != v]
            elif got.get(key, default) != value:
                diffs.append(f"{section}.{key}")
    return diffs


def _mapping(value: Any) -> dict:
    return value if isinstance(value, dict) else {}


def cells_to_run(sweep: SweepConfig, cells: list[tuple[str, HamoConfig]], streams: dict) -> list[str]:
    """The cells a sweep still has to run, in grid order.

    A cell is finished when its run folder holds every stage (``streams[name].finished``) or, with
    ``results`` set, when its export exists and was made with the same config (see ``stale_keys``);
    a stale export is named in a warning with its first differing keys, and its cell runs again.
    """
    results = results_dir(sweep)
    todo = []
    for name, cfg in cells:
        if streams[name].finished:
            continue
        exported = exported_cell(results, name)
        if exported is not None:
            diffs = stale_keys(exported, cfg)
            if not diffs:
                continue
            logger.warning(
                "sweep: cell %s: its export %s was made with a different config (%s); running it again",
                name,
                exported,
                ", ".join(diffs[:5]) + (", ..." if len(diffs) > 5 else ""),
            )
        todo.append(name)
    return todo


def export_finished(sweep: SweepConfig, cells: list[tuple[str, HamoConfig]], streams: dict) -> list[str]:
    """Export the cells finished in their run folder whose export is missing or is not of that run
    folder (its ``state.json`` differs), e.g. cells that finished before ``results`` was set.

    Returns:
        The names of the cells exported.
    """
    results = results_dir(sweep)
    if results is None:
        return []
    done = []
    for name, cfg in cells:
        if not streams[name].finished:
            continue
        folder = Path(cfg.run.root) / name
        exported = exported_cell(results, name)
        if exported is not None and _same_file(exported / "state.json", folder / "state.json"):
            continue
        if save_export(results, name, folder) is not None:
            done.append(name)
    return done


def _same_file(a: Path, b: Path) -> bool:
    return a.is_file() and b.is_file() and a.read_bytes() == b.read_bytes()


def _cell_metrics(name: str, cfg: HamoConfig, results: Path | None) -> dict | None:
    """A cell's finished ``metrics.json``: its run folder's, else its (not stale) export's; else None."""
    files = [Path(cfg.run.root) / name / "results" / "metrics.json"]
    exported = exported_cell(results, name)
    if exported is not None:
        diffs = stale_keys(exported, cfg)
        if diffs:
            logger.warning(
                "sweep: cell %s: its export was made with a different config (%s); not aggregated",
                name,
                ", ".join(diffs[:5]),
            )
        else:
            files.append(exported / "results" / "metrics.json")
    partial = None
    for f in files:
        if not f.exists():
            continue
        metrics = json.loads(f.read_text())
        done = min((len(v) for v in metrics.get("stage_scores", {}).values()), default=0)
        if done >= cfg.protocol.stages:
            return metrics
        partial = done if partial is None else partial
    if partial is None:
        logger.warning("sweep: cell %s has no metrics yet; left out of the aggregate", name)
    else:  # a failed or interrupted cell: its partial scores would bias
        logger.warning(
            "sweep: cell %s has %d of %d stages; left out of the aggregate",
            name,
            partial,
            cfg.protocol.stages,
        )
    return None


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
    """
    from hamo_ray.evaluation import plots
    from hamo_ray.evaluation.metrics import mean_interval

    results = None if results is None else Path(results)
    groups: dict[str, dict[str, list[dict]]] = {}
    for name, cfg in cells:
        metrics = _cell_metrics(name, cfg, results)
        if metrics is None:
            continue
        metrics["seed"] = cfg.run.seed  # pairs each method's run with the base run of the same seed
        groups.setdefault(setting_of(cfg, vary), {}).setdefault(cfg.method.name, []).append(metrics)
    out_dir.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {}
    lines = [
        "| setting | method | seeds | stage average | vs base (paired) | final total | first-domain retention "
        "| forgetting (first domain) | BWT |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    figures = []
    for n, (setting, methods) in enumerate(sorted(groups.items())):
        curves, retention, first_stage = {}, {}, 1
        summary[setting] = {}
        base_avg = {r["seed"]: _stage_average(r) for r in methods.get("base", [])}
        for method, runs in sorted(methods.items()):
            domains = sorted(runs[0]["stage_scores"])
            first = runs[0]["first_domain"]
            avg = mean_interval([_stage_average(r) for r in runs])
            # The same seed samples the same way in every method: differences to base cancel that luck.
            paired = mean_interval(
                [_stage_average(r) - base_avg[r["seed"]] for r in runs if r["seed"] in base_avg]
            )
            total = mean_interval([r["final_total"] for r in runs])
            forget = mean_interval([r["forgetting"].get(first, 0.0) for r in runs])
            stages = len(runs[0]["stage_scores"][domains[0]])
            first_stage = 0 if runs[0].get("initial") else 1
            before = (  # the evaluation before training (stage 0), when the runs made one
                {d: [mean_interval([r["initial"][d] for r in runs])] for d in domains}
                if first_stage == 0
                else {d: [] for d in domains}
            )
            curves[method] = {
                d: before[d] + [mean_interval([r["stage_scores"][d][t] for r in runs]) for t in range(stages)]
                for d in domains
            }
            points = len(runs[0]["retention"])
            retention[method] = [mean_interval([r["retention"][i] for r in runs]) for i in range(points)]
            summary[setting][method] = {
                "seeds": len(runs),
                "average": avg,
                "vs_base": paired,
                "final_total": total,
                "forgetting_first": forget,
                "stage_scores": curves[method],
                "retention": retention[method],
                "backward_transfer": mean_interval([r["backward_transfer"] for r in runs]),
                "forward_transfer": mean_interval([r["forward_transfer"] for r in runs]),
            }
            row = [
                avg,
                paired,
                total,
                retention[method][-1],
                forget,
                summary[setting][method]["backward_transfer"],
            ]
            lines.append(f"| {setting} | {method} | {len(runs)} | " + " | ".join(map(_fmt, row)) + " |")
        tag = f"setting{n}"
        figures.append(
            (
                setting,
                [
                    plots.stagewise(
                        curves, out_dir / f"{tag}-stagewise.png", f"Stage-wise scores: {setting}", first_stage
                    ),
                    plots.domain_bars(
                        curves,
                        out_dir / f"{tag}-bars.png",
                        f"Per domain after each stage: {setting}",
                        first_stage,
                    ),
                    plots.retention(retention, out_dir / f"{tag}-retention.png", first, first_stage),
                ],
            )
        )
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    table = "\n".join(lines) + "\n\n" + _LEGEND
    (out_dir / "table.md").write_text(table)
    (out_dir.parent / "report.md").write_text(_report(table, figures, "results/"))
    if results is not None:  # the tracked copy: the plots lie beside its report.md
        results.mkdir(parents=True, exist_ok=True)
        atomic_write(results / "summary.json", json.dumps(summary, indent=1))
        atomic_write(results / "table.md", table)
        for _, pngs in figures:
            for png in pngs:
                shutil.copyfile(png, results / png.name)
        atomic_write(results / "report.md", _report(table, figures, ""))
    return summary


def _report(table: str, figures: list[tuple[str, list[Path]]], prefix: str) -> str:
    """The sweep's report.md: the table, then each setting's plots (linked as ``<prefix><png>``)."""
    report = ["# Sweep report", "", table]
    for setting, pngs in figures:
        report += [f"## {setting}", ""] + [f"![{p.stem}]({prefix}{p.name})" for p in pngs] + [""]
    return "\n".join(report)


_LEGEND = (
    "Mean ± the half-width of the two-sided 95% t interval over seeds (no interval with one seed). "
    "Stage average: the mean over stages of the mean over domains; vs base (paired): the stage average "
    "minus the base method's of the same seed, then mean ± interval over seeds; final total: the sum over domains "
    "after the last stage; first-domain retention: the first domain's score after the last stage; "
    "forgetting: its best score minus its final one; BWT: backward transfer "
    "(hamo_ray/evaluation/metrics.py).\n"
)


def _stage_average(metrics: dict) -> float:
    return sum(metrics["average"].values()) / len(metrics["average"])


def _fmt(r: dict) -> str:
    if r["mean"] is None:
        return "n/a"
    if r["std"] is None:
        return f"{r['mean']:.2f}"
    return f"{r['mean']:.2f} ± {(r['ci_high'] - r['mean']):.2f}"
