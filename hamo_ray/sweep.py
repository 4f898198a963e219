"""Sweeps: a grid of methods x models x domain orders x seeds, each cell a stream run.

A sweep file (YAML) names a base config and the grid::

    base: jobs/configs/tiny.yaml          # relative to the sweep file
    overrides: [protocol.num_stages=2]    # applied to every cell
    root: runs/sweep-tiny                 # cells under <root>/cells/<cell>, results under <root>/results
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
"""

from __future__ import annotations

import itertools
import json
import logging
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from hamo_ray.config import ConfigError, HamoConfig, load_config

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
    return sweep, base


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


def aggregate(
    cells: list[tuple[str, HamoConfig]], out_dir: Path, vary: list[str] | tuple[str, ...] = ()
) -> dict[str, Any]:
    """Mean and 95% interval over seeds per (setting, method): summary.json, table.md and plots."""
    from hamo_ray.evaluation import plots
    from hamo_ray.evaluation.metrics import mean_interval

    groups: dict[str, dict[str, list[dict]]] = {}
    for name, cfg in cells:
        f = Path(cfg.run.root) / name / "results" / "metrics.json"
        if not f.exists():
            logger.warning("sweep: cell %s has no metrics yet; left out of the aggregate", name)
            continue
        metrics = json.loads(f.read_text())
        done = min((len(v) for v in metrics.get("stage_scores", {}).values()), default=0)
        if done < cfg.protocol.stages:  # a failed or interrupted cell: its partial scores would bias
            logger.warning(
                "sweep: cell %s has %d of %d stages; left out of the aggregate",
                name,
                done,
                cfg.protocol.stages,
            )
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
    report = ["# Sweep report", "", table]
    for setting, pngs in figures:
        report += [f"## {setting}", ""] + [f"![{p.stem}](results/{p.name})" for p in pngs] + [""]
    (out_dir.parent / "report.md").write_text("\n".join(report))
    return summary


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
