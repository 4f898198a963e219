"""A sweep's tracked results folder (``results:``): cells exported as they finish, and read back.

An export holds a finished cell's small results (see ``hamo_ray/sweep.py``); ``stale_keys`` tells an
export made with another config, and ``cell_metrics`` reads a cell's metrics from its run folder, else
from its export.
"""

from __future__ import annotations

import csv
import gzip
import io
import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

import yaml

from hamo_ray.config import HamoConfig, env_sections, mask_secrets, upgrade_saved_config
from hamo_ray.run.folder import committed_stage_count, compared
from hamo_ray.sweep.grid import SweepConfig

logger = logging.getLogger("hamo_ray.sweep")


# What an export copies from a run folder (if there), besides the episodes; never the large outputs.
_EXPORTED_FILES = ("config.yaml", "state.json", "results/scores.csv", "results/metrics.json", "report.md")
# One row per evaluation episode. ``domain`` is the score column the episode counts towards, as the
# report labels it (``alfworld@seen`` for ALFWorld's dev games, the seen rooms; ``protocol.eval_seen``),
# ``split`` the split its task was drawn from (``test``, or ``dev`` for the seen rooms).
EPISODE_COLUMNS = (
    "stage",
    "domain",
    "split",
    "task",
    "variation",
    "score",
    "turns",
    "done",
    "error",
    "cards_used",
    "policy_tokens",
    "cards_withheld",  # by the gate (memory.gate_*); 0 in episodes recorded before it was counted
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


def _episode_column(path: Path) -> str | None:
    """The score column of an episodes file ``stage-<t>-<column>.jsonl[.gz]`` (``alfworld@seen``), or None."""
    m = re.match(r"stage-\d+-(.+?)\.jsonl(\.gz)?$", path.name)
    return m.group(1) if m else None


def episode_rows(path: Path, data: bytes) -> list[list[Any]]:
    """The ``episodes.csv`` rows (``EPISODE_COLUMNS``) of one episodes file's content ``data``.

    The domain is the file's score column (``alfworld@seen``), as the report (``hamo_ray.evaluation.metrics``,
    ``hamo_ray.evaluation.report``) labels its scores; the split is the task's.
    """
    stage, column, rows = _episode_order(path)[0], _episode_column(path), []
    for line in data.decode().splitlines():
        if not line.strip():
            continue
        t = json.loads(line)
        task = t.get("task", {})
        rows.append(
            [
                "" if stage < 0 else stage,
                column or task.get("domain", ""),
                task.get("split", ""),
                task.get("task", ""),
                task.get("variation", ""),
                t.get("score", 0.0),
                len(t.get("actions", [])),
                t.get("done", False),
                t.get("error") or "",
                len(t.get("cards_used", [])),
                t.get("policy_tokens", 0),
                t.get("cards_withheld", 0),
            ]
        )
    return rows


def write_episodes_csv(export: str | Path) -> Path:
    """Write an export's ``episodes.csv`` again from its ``episodes/*.jsonl.gz`` (an export made before
    the ``split`` column and the ``@seen`` labels gets them). Returns the file."""
    export = Path(export)
    buf = io.StringIO()
    writer = csv.writer(buf)
    writer.writerow(EPISODE_COLUMNS)
    for f in sorted((export / "episodes").glob("*.jsonl.gz"), key=_episode_order):
        writer.writerows(episode_rows(f, gzip.decompress(f.read_bytes())))
    out = export / "episodes.csv"
    out.write_text(buf.getvalue())
    return out


def export_cell(run_folder: str | Path, dest: str | Path) -> Path:
    """Copy a finished run folder's small results to ``dest``, replacing an earlier export there.

    Copies ``config.yaml`` (its secrets masked), ``state.json``, ``results/scores.csv``,
    ``results/metrics.json`` and ``report.md`` (those that exist), the evaluation episodes
    ``episodes/*.jsonl`` gzip-compressed as
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
    _mask_saved_config(tmp / "config.yaml")
    buf = io.StringIO()
    writer = csv.writer(buf)
    writer.writerow(EPISODE_COLUMNS)
    for f in sorted((src / "episodes").glob("*.jsonl"), key=_episode_order):
        data = f.read_bytes()
        (tmp / "episodes").mkdir(exist_ok=True)
        # mtime=0: the same episodes give the same bytes (no spurious change in the tracked folder)
        (tmp / "episodes" / f"{f.name}.gz").write_bytes(gzip.compress(data, mtime=0))
        writer.writerows(episode_rows(f, data))
    (tmp / "episodes.csv").write_text(buf.getvalue())
    if dest.exists():  # replace: the old export moves aside, the new one in, then the old one goes
        os.replace(dest, old)
    os.replace(tmp, dest)
    shutil.rmtree(old, ignore_errors=True)
    return dest


def _mask_saved_config(path: Path) -> None:
    """Mask the secrets of an exported ``config.yaml`` (``***``): a run folder written before secrets
    were masked may hold a key, and the export lands in a git-tracked folder. A masked file is kept as is.
    """
    try:
        saved = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return
    masked = mask_secrets(saved)
    if masked != saved:
        path.write_text(yaml.safe_dump(masked, sort_keys=False))


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
    change (the sections ``run``, ``ray``, ``serve``, ``rollout`` but ``rollout.constrain_actions``, as in
    ``RunFolder``; ``run.folder.compared``).

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
        if not isinstance(values, dict):
            continue
        got = _mapping(saved.get(section))
        for key, value in values.items():
            if not compared(section, key):
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


def same_file(a: Path, b: Path) -> bool:
    return a.is_file() and b.is_file() and a.read_bytes() == b.read_bytes()


def cell_metrics(name: str, cfg: HamoConfig, results: Path | None) -> dict | None:
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
        committed = committed_stage_count(f.parent.parent)  # results run ahead of an uncommitted stage
        if committed is not None:
            done = min(done, committed)
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
