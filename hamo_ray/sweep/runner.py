"""The sweep's scheduler: which cells still run, one shared endpoint per backbone, cells as Ray tasks.

``prepare_cells`` validates every cell before any work; ``export_finished`` and ``cells_to_run`` decide
what is left (a cell finished in its run folder, or exported with the same config, is not run again);
``run_cells`` starts one policy endpoint per backbone, runs the cells ``parallel`` at a time as Ray
tasks (``run_cell``), exports each cell as it finishes and records a failed cell's traceback in its
run folder (``error.txt``) while the others go on. ``jobs/sweep.py`` is the command line over these.
"""

from __future__ import annotations

import logging
import math
import time
import traceback
from pathlib import Path

from hamo_ray.config import ConfigError, HamoConfig
from hamo_ray.sweep.export import exported_cell, results_dir, same_file, save_export, stale_keys
from hamo_ray.sweep.grid import SweepConfig, expand_cells
from hamo_ray.sweep.shared import save_shared

logger = logging.getLogger("hamo_ray.sweep")


def prepare_cells(sweep: SweepConfig, base: Path) -> tuple[list[tuple[str, HamoConfig]], dict]:
    """Every cell's config and ``Stream``, each validated before any work (nothing starts here).

    Returns:
        The cells (``expand_cells``) and their streams by cell name.

    Raises:
        ConfigError: a bad cell, a relative ``root`` or ``results`` in a Ray job, or a cell with
            ``serve.adapter_store`` (a shared endpoint loads adapters from the sweep root).
    """
    from hamo_ray.run.cluster import check_cluster_paths
    from hamo_ray.run.stream import Stream

    check_cluster_paths(sweep.root, "root")  # every cell's run folder lives under it
    if sweep.results is not None:  # the driver writes the exports: not into a temporary copy
        check_cluster_paths(sweep.results, "results")
    cells = expand_cells(sweep, base)
    for name, cfg in cells:
        if cfg.serve.adapter_store:
            raise ConfigError(
                f"cell {name}: serve.adapter_store is not supported in a sweep (shared endpoints)"
            )
    return cells, {name: Stream(cfg) for name, cfg in cells}


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
        if exported is not None and same_file(exported / "state.json", folder / "state.json"):
            continue
        if save_export(results, name, folder) is not None:
            done.append(name)
    return done


def start_cluster(first: HamoConfig) -> None:
    """Join or start Ray for the cells, and check the shared endpoints' port (``first``'s ``serve.port``).

    Ray failing to start is logged, not raised: each cell then fails with it, its traceback saved.

    Raises:
        ConfigError: the serve port is taken, or a bad ``ray`` setting.
    """
    from hamo_ray.run.cluster import check_serve_port, start_ray

    try:
        start_ray(first.ray)
        check_serve_port(first)
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - reported per cell below
        logger.warning("sweep: Ray did not start (%s); the cells will try again", exc)


def run_cell(cfg_json: str, base_url: str) -> int:
    """One cell (a Ray task): a stream run against the shared endpoint; returns its committed stages."""
    from hamo_ray.logs import setup_logging
    from hamo_ray.run.stream import Stream

    setup_logging()
    return len(Stream(HamoConfig.model_validate_json(cfg_json)).run(base_url=base_url))


def run_cells(
    sweep: SweepConfig, cells: list[tuple[str, HamoConfig]], streams: dict, todo: list[str]
) -> list[str]:
    """Run the cells ``todo``; returns the names of those that failed (each with ``error.txt`` in its run folder).

    A cell fails alone: when its backbone cannot be built, its endpoint cannot start or its stream
    raises, its traceback goes to ``<cell>/error.txt`` and the other cells go on. With ``results``
    set, a cell that finishes is exported there at once (a failed export is logged, not a failed cell).
    """
    import ray

    from hamo_ray.run.serve_apps import start_shared_policy, stop_shared_policy

    cfgs = dict(cells)
    servers: dict[str, str] = {}  # backbone path -> endpoint
    urls: dict[str, str] = {}  # cell -> endpoint
    first_cfg = cfgs[todo[0]]
    failed: list[str] = []
    # Endpoints asked for, one index per backbone (its app hamo-<sweep>-<index>, hamo_ray.naming): a failed
    # start may leave a partial one to stop, and the next cell on that backbone tries the same name again.
    indexes: dict[str, int] = {}
    try:
        # One endpoint per backbone, shared by the cells that use it (adapters under root/cells).
        for name in todo:
            try:
                path = streams[name].prepare_backbone()
                if path not in servers:
                    index = indexes.setdefault(path, len(indexes))
                    servers[path] = start_shared_policy(cfgs[name], path, index)
                urls[name] = servers[path]
            except Exception as exc:  # this cell cannot start; the others go on
                record_failure(name, streams[name].folder.path, exc, failed)
        task = ray.remote(run_cell).options(
            resources=_custom(sweep.cell_resources),
            num_cpus=sweep.cell_resources.get("CPU", 0),
            num_gpus=sweep.cell_resources.get("GPU", 0),
        )
        pending: dict = {}
        queue = [name for name in todo if name in urls]
        pace = Pace(len(queue), sweep.parallel)
        while queue or pending:
            while queue and len(pending) < sweep.parallel:
                name = queue.pop(0)
                ref = task.remote(cfgs[name].model_dump_json(), urls[name])
                pending[ref] = name
                pace.started(name, _resumed(streams[name].folder))
                logger.info("sweep: started cell %s", name)
            ready, _ = ray.wait(list(pending), num_returns=1)
            for ref in ready:
                name = pending.pop(ref)
                try:
                    ray.get(ref)
                    (streams[name].folder.path / "error.txt").unlink(missing_ok=True)  # an earlier try's
                    logger.info("sweep: cell %s finished; %s", name, pace.finished(name))
                    if sweep.results is not None:  # at once: a later kill loses nothing of it
                        save_export(results_dir(sweep), name, streams[name].folder.path)
                except Exception as exc:  # a failed cell is reported; the others go on
                    pace.failed(name)
                    record_failure(name, streams[name].folder.path, exc, failed)
                try:  # what the cell added to the shared caches, kept with the results (hamo_ray.sweep.shared)
                    save_shared(sweep)
                except OSError as exc:
                    logger.warning("sweep: keeping the shared caches failed: %s", exc)
    finally:
        for n in range(len(indexes)):
            try:
                stop_shared_policy(first_cfg, n)
            except Exception as exc:  # e.g. an endpoint that never came up
                logger.warning("sweep: stopping shared endpoint %d: %s", n, exc)
    return failed


class Pace:
    """A sweep's progress: cells done of those it set out to run, and the time left at the pace so far
    (the mean wall time of the cells run whole, ``parallel`` at once). A cell resumed from its run
    folder's committed stages counts as done, but its time (this attempt's only) is not a cell's pace."""

    def __init__(self, total: int, parallel: int = 1, clock=time.monotonic):
        self.total, self.parallel, self.clock = total, max(1, parallel), clock
        self.starts: dict[str, tuple[float, bool]] = {}
        self.took: list[float] = []  # cells run whole
        self.done = 0

    def started(self, name: str, resumed: bool = False) -> None:
        self.starts[name] = (self.clock(), resumed)

    def failed(self, name: str) -> None:
        """A failed cell is out of the count (its time says nothing of a cell's pace)."""
        self.starts.pop(name, None)
        self.total -= 1

    def finished(self, name: str) -> str:
        start, resumed = self.starts.pop(name, (self.clock(), False))
        took = self.clock() - start
        self.done += 1
        if not resumed:
            self.took.append(took)
        left = self.total - self.done
        head = (
            f"this attempt took {took / 60:.1f} min (resumed: not counted in the pace)"
            if resumed
            else f"it took {took / 60:.1f} min"
        )
        head += f"; {self.done} of {self.total} cells done, {left} left"
        if not self.took:
            return head + " (no cell run whole yet: pace unknown)"
        mean = sum(self.took) / len(self.took)
        eta = math.ceil(left / self.parallel) * mean
        return head + f" (~{eta / 3600:.1f} h at {mean / 60:.1f} min a cell)"


def _resumed(folder) -> bool:
    """Whether a cell's run folder (``RunFolder``) lists committed stages, stage 0 included: its run
    resumes. A torn state says no here; the cell's own run reports it."""
    try:
        return bool(folder.stages())
    except (OSError, ValueError, KeyError):
        return False


def record_failure(name: str, folder: Path, exc: BaseException, failed: list[str]) -> None:
    """Note a failed cell and write its traceback (a RayTaskError's text carries the remote one)."""
    failed.append(name)
    folder.mkdir(parents=True, exist_ok=True)
    text = "".join(traceback.format_exception(exc))
    (folder / "error.txt").write_text(text)
    last = [line for line in text.splitlines() if line.strip()][-1].strip()  # "KeyError: 'x'"
    logger.error("sweep: cell %s failed: %s (traceback in %s)", name, last, folder / "error.txt")


def _custom(resources: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in resources.items() if k not in ("CPU", "GPU")}
