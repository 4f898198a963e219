"""Run a sweep: methods x models x domain orders x seeds, each cell a stream run, then aggregate.

On this machine (joins the Ray cluster a ``ray start`` runs here, else starts a private one)::

    python jobs/sweep.py --config jobs/configs/sweep-tiny.yaml [root=runs/other parallel=2]

Against a cluster::

    ray job submit --working-dir . -- python jobs/sweep.py --config jobs/configs/sweep-tiny.yaml \
        root=/mnt/shared/hamo/sweep-tiny

(a relative ``root`` or ``results`` is refused there: it would lie in Ray's temporary copy of the
working dir).

Finished cells are skipped; resubmitting a killed sweep resumes it. Results: ``<root>/results/``
(summary.json, table.md, plots) and ``<root>/report.md``. See hamo_ray/sweep.py for the file format.

With ``results`` set (e.g. ``results=results/learning-smollm2-within``, a tracked folder), each cell's
small results (config, state, scores, metrics, report, gzipped evaluation episodes, episodes.csv) are
exported to ``<results>/cells/<cell>/`` as soon as it finishes, and the aggregate is written there too;
cells finished in their run folder but not exported yet are exported when the sweep starts. A cell
whose export exists is not run again, even on a fresh machine without its run folder, unless the
export was made with a different config (a warning names the keys; the cell runs again).

A cell that fails (its backbone, its endpoint or its stream raises) leaves its traceback in its run
folder (``<root>/cells/<cell>/error.txt``) and the other cells go on; the sweep then exits 1, naming
the failed cells on stderr. ``--print-config`` prints every cell's resolved config and exits.
Exit status 2: a configuration error in the sweep file or any cell, before any work.
"""

from __future__ import annotations

import argparse
import logging
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from hamo_ray.config import ConfigError  # noqa: E402
from hamo_ray.logs import setup_logging  # noqa: E402

logger = logging.getLogger("hamo_ray.jobs.sweep")


def run_cell(cfg_json: str, base_url: str) -> int:
    """One cell: a stream run against the shared endpoint; returns its number of committed stages."""
    from hamo_ray.config import HamoConfig
    from hamo_ray.logs import setup_logging
    from hamo_ray.stream import Stream

    setup_logging()
    return len(Stream(HamoConfig.model_validate_json(cfg_json)).run(base_url=base_url))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", required=True, help="sweep YAML file")
    parser.add_argument(
        "--print-config", action="store_true", help="print every cell's resolved config (YAML) and exit"
    )
    parser.add_argument("overrides", nargs="*", help="sweep-level overrides, e.g. root=runs/x parallel=2")
    args = parser.parse_args(argv)
    setup_logging()
    from hamo_ray.cluster import check_cluster_paths
    from hamo_ray.stream import Stream
    from hamo_ray.sweep import (
        aggregate,
        cells_to_run,
        expand_cells,
        export_finished,
        load_sweep,
        results_dir,
    )

    try:
        sweep, base = load_sweep(args.config, args.overrides)
        check_cluster_paths(sweep.root, "root")  # every cell's run folder lives under it
        if sweep.results is not None:  # the driver writes the exports: not into a temporary copy
            check_cluster_paths(sweep.results, "results")
        cells = expand_cells(sweep, base)
        for name, cfg in cells:  # a shared endpoint loads adapters from the sweep root, not a store
            if cfg.serve.adapter_store:
                raise ConfigError(
                    f"cell {name}: serve.adapter_store is not supported in a sweep (shared endpoints)"
                )
        streams = {name: Stream(cfg) for name, cfg in cells}  # validates every cell before any work
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.print_config:  # every cell's resolved config, as one YAML document each
        for name, cfg in cells:
            print(f"--- # {name}\n{cfg.to_yaml()}", end="")
        return 0
    exported = export_finished(sweep, cells, streams)  # e.g. finished before `results` was set
    if exported:
        logger.info("sweep: %d finished cells exported to %s", len(exported), results_dir(sweep))
    todo = cells_to_run(sweep, cells, streams)  # not finished in their run folder nor exported
    if todo:
        from hamo_ray.cluster import check_serve_port, start_ray

        first = dict(cells)[todo[0]]
        try:  # the cells' shared endpoints listen on the first cell's serve.port
            start_ray(first.ray)
            check_serve_port(first)
        except ConfigError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        except Exception as exc:  # Ray did not start: each cell fails with it below, traceback saved
            logger.warning("sweep: Ray did not start (%s); the cells will try again", exc)
    logger.info("sweep: %d cells, %d to run, %d finished", len(cells), len(todo), len(cells) - len(todo))
    failed = run_cells(sweep, cells, streams, todo) if todo else []
    summary = aggregate(cells, Path(sweep.root) / "results", list(sweep.grid.vary), results_dir(sweep))
    print((Path(sweep.root) / "results" / "table.md").read_text())
    print(f"report: {Path(sweep.root) / 'report.md'}")
    if sweep.results is not None:
        print(f"results: {results_dir(sweep)} (report.md, summary.json, cells/)")
    for name in failed:
        print(
            f"error: cell {name} failed; traceback in {streams[name].folder.path / 'error.txt'}",
            file=sys.stderr,
        )
    return 1 if failed or not summary else 0


def run_cells(sweep, cells, streams, todo) -> list[str]:
    """Run the cells; returns the names of those that failed (each with ``error.txt`` in its run folder).

    A cell fails alone: when its backbone cannot be built, its endpoint cannot start or its stream
    raises, its traceback goes to ``<cell>/error.txt`` and the other cells go on. With ``results``
    set, a cell that finishes is exported there at once (a failed export is logged, not a failed cell).
    """
    import ray

    from hamo_ray.runtime import start_shared_policy, stop_shared_policy
    from hamo_ray.sweep import results_dir, save_export

    cfgs = dict(cells)
    servers: dict[str, str] = {}  # backbone path -> endpoint
    urls: dict[str, str] = {}  # cell -> endpoint
    first_cfg = cfgs[todo[0]]
    failed: list[str] = []
    started = 0  # endpoints asked for (a failed start may leave a partial one to stop)
    try:
        # One endpoint per backbone, shared by the cells that use it (adapters under root/cells).
        for name in todo:
            try:
                path = streams[name].prepare_backbone()
                if path not in servers:
                    started += 1
                    servers[path] = start_shared_policy(cfgs[name], path, started - 1)
                urls[name] = servers[path]
            except Exception as exc:  # this cell cannot start; the others go on
                _record_failure(name, streams[name].folder.path, exc, failed)
        task = ray.remote(run_cell).options(
            resources=_custom(sweep.cell_resources),
            num_cpus=sweep.cell_resources.get("CPU", 0),
            num_gpus=sweep.cell_resources.get("GPU", 0),
        )
        pending: dict = {}
        queue = [name for name in todo if name in urls]
        while queue or pending:
            while queue and len(pending) < sweep.parallel:
                name = queue.pop(0)
                ref = task.remote(cfgs[name].model_dump_json(), urls[name])
                pending[ref] = name
                logger.info("sweep: started cell %s", name)
            ready, _ = ray.wait(list(pending), num_returns=1)
            for ref in ready:
                name = pending.pop(ref)
                try:
                    ray.get(ref)
                    (streams[name].folder.path / "error.txt").unlink(missing_ok=True)  # an earlier try's
                    logger.info("sweep: cell %s finished", name)
                    if sweep.results is not None:  # at once: a later kill loses nothing of it
                        save_export(results_dir(sweep), name, streams[name].folder.path)
                except Exception as exc:  # a failed cell is reported; the others go on
                    _record_failure(name, streams[name].folder.path, exc, failed)
    finally:
        for n in range(started):
            try:
                stop_shared_policy(first_cfg, n)
            except Exception as exc:  # e.g. an endpoint that never came up
                logger.warning("sweep: stopping shared endpoint %d: %s", n, exc)
    return failed


def _record_failure(name: str, folder: Path, exc: BaseException, failed: list[str]) -> None:
    """Note a failed cell and write its traceback (a RayTaskError's text carries the remote one)."""
    failed.append(name)
    folder.mkdir(parents=True, exist_ok=True)
    text = "".join(traceback.format_exception(exc))
    (folder / "error.txt").write_text(text)
    last = [line for line in text.splitlines() if line.strip()][-1].strip()  # "KeyError: 'x'"
    logger.error("sweep: cell %s failed: %s (traceback in %s)", name, last, folder / "error.txt")


def _custom(resources: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in resources.items() if k not in ("CPU", "GPU")}


if __name__ == "__main__":
    sys.exit(main())
