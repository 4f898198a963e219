"""Run a sweep: methods x models x domain orders x seeds, each cell a stream run, then aggregate.

On this machine (joins the Ray cluster a ``ray start`` runs here, else starts a private one)::

    python jobs/sweep.py --config jobs/configs/sweep-tiny.yaml [root=runs/other parallel=2]

Against a cluster::

    ray job submit --working-dir . -- python jobs/sweep.py --config jobs/configs/sweep-tiny.yaml \
        root=/mnt/shared/hamo/sweep-tiny

(a relative ``root`` or ``results`` is refused there: it would lie in Ray's temporary copy of the
working dir).

Finished cells are skipped; resubmitting a killed sweep resumes it. Results: ``<root>/results/``
(summary.json, table.md, plots) and ``<root>/report.md``. See hamo_ray/sweep.py for the file format;
the scheduler is ``hamo_ray.sweep.runner``, this file only its command line.

With ``results`` set (e.g. ``results=results/learning-smollm2-within``, a tracked folder), each cell's
small results (config, state, scores, metrics, report, gzipped evaluation episodes, episodes.csv) are
exported to ``<results>/cells/<cell>/`` as soon as it finishes, and the aggregate is written there too;
cells finished in their run folder but not exported yet are exported when the sweep starts. A cell
whose export exists is not run again, even on a fresh machine without its run folder, unless the
export was made with a different config (a warning names the keys; the cell runs again).

A cell that fails (its backbone, its endpoint or its stream raises) leaves its traceback in its run
folder (``<root>/cells/<cell>/error.txt``) and the other cells go on; the sweep then exits 1, naming
the failed cells on stderr. ``--print-config`` prints every cell's resolved config and exits
(secrets as ``***``; keys come from the environment as for jobs/stream.py: ``HAMO_API_KEY``, ...).
Exit status 2: a configuration error in the sweep file or any cell, before any work.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from hamo_ray.config import ConfigError  # noqa: E402
from hamo_ray.logs import setup_logging  # noqa: E402
from hamo_ray.sweep import (  # noqa: E402
    aggregate,
    cells_to_run,
    export_finished,
    load_sweep,
    prepare_cells,
    restore_shared,
    results_dir,
    run_cells,
    save_shared,
    start_cluster,
)

logger = logging.getLogger("hamo_ray.jobs.sweep")


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
    try:
        sweep, base = load_sweep(args.config, args.overrides)
        cells, streams = prepare_cells(sweep, base)  # validates every cell before any work
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.print_config:  # every cell's resolved config, as one YAML document each
        for name, cfg in cells:
            print(f"--- # {name}\n{cfg.to_yaml()}", end="")
        return 0
    try:  # the shared caches kept with the results (experts, stage 0): cells on other machines share them
        restore_shared(sweep)
        save_shared(sweep)
    except (OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    exported = export_finished(sweep, cells, streams)  # e.g. finished before `results` was set
    if exported:
        logger.info("sweep: %d finished cells exported to %s", len(exported), results_dir(sweep))
    todo = cells_to_run(sweep, cells, streams)  # not finished in their run folder nor exported
    if todo:
        try:  # the cells' shared endpoints listen on the first cell's serve.port
            start_cluster(dict(cells)[todo[0]])
        except ConfigError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
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


if __name__ == "__main__":
    sys.exit(main())
