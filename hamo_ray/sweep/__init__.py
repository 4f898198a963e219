"""Sweeps: a grid of methods x models x domain orders x seeds, each cell a stream run.

A sweep file (YAML) names a base config and the grid::

    base: jobs/configs/tiny.yaml          # relative to the sweep file
    overrides: [protocol.num_stages=2]    # applied to every cell
    root: runs/sweep-tiny                 # cells under <root>/cells/<cell>, results under <root>/results
    results: results/sweep-tiny           # optional: a tracked folder for the small results (below)
    parallel: 1                           # cells run at once (Ray tasks); 1 on a laptop
    cell_resources: {CPU: 0}              # resources each cell's controller task holds
    share_experts: true                   # cells on the same tasks share expert trajectories (below)
    share_initial: true                   # cells of a seed play stage 0 once (below)
    run_order: grid                       # grid (method-major) or seed: every cell of a seed, then the next
    shared: null                          # where the shared caches are kept; null: <results>/shared (below)
    grid:
      method: [base, harness, model_only, hamo]
      model: [embedded]                   # model.path values
      order: [[scienceworld]]             # cross_domain orders; [[d]] for a within-domain stream of d
      seed: [0, 1]
      vary:                               # any dotted config key -> its values (optional)
        train.lr: [2.0e-4, 2.0e-3]

With ``share_experts`` (the default) every cell gets ``env.expert_cache=<root>/experts``
(``hamo_ray/envs/expert_cache.py``): the first cell that plays a stage's tasks stores the simulator's
expert trajectories, and every other cell on the same tasks (the other methods of that seed) trains on
exactly those, not on a replay of the expert that may take another route. An override of
``env.expert_cache`` wins; ``share_experts: false`` lets each cell play its own. With ``share_initial``
(the default) every cell gets ``eval.initial_cache=<root>/initial`` (``hamo_ray/run/initial.py``): stage 0,
the base model before any stage, is the same evaluation for every method of a seed, so the first cell
plays it and the others copy its result and episodes (``initial_from`` in their ``state.json``).

Cells that finished earlier are skipped (their run folder holds every stage); a killed sweep
resumes each unfinished cell after its last committed stage. Cells sharing a backbone share one
policy endpoint, a Serve app named after the sweep (its root folder's name: ``hamo-sweep-tiny-0`` at
``/sweep-tiny/0``; adapter names and each cell's harness app carry the cell's run id; ``hamo_ray.naming``),
so two sweeps on one cluster do not meet. At the end, every cell's
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
The shared caches (``<root>/experts``, ``<root>/initial``) are kept there too, under ``<results>/shared/``
(or the folder ``shared:`` names, relative to the current directory: two sweeps over one root, such as
an experiment's trained and flat methods, name one folder), and restored when a sweep starts
(``hamo_ray/sweep/shared.py``), so the cells of a seed run on another machine share the experts and
stage 0 of those exported before.

Where the parts live (every name is importable from here):

- ``sweep.grid``: the sweep file (``SweepConfig``, ``load_sweep``) and its cells (``expand_cells``,
  ``setting_of``);
- ``sweep.export``: the results folder (``export_cell``, ``exported_cell``, ``stale_keys``, ``cell_metrics``);
- ``sweep.shared``: the shared caches kept with the results (``save_shared``, ``restore_shared``);
- ``sweep.runner``: the scheduler (``prepare_cells``, ``export_finished``, ``cells_to_run``,
  ``start_cluster``, ``run_cells``, ``record_failure``); ``jobs/sweep.py`` is its command line;
- ``sweep.stats``: the statistics over the cells' metrics (pure functions);
- ``sweep.report``: the table, the plots and the report (``aggregate`` writes them).
"""

from __future__ import annotations

from hamo_ray.sweep.export import (
    EPISODE_COLUMNS,
    cell_metrics,
    export_cell,
    export_dir,
    exported_cell,
    results_dir,
    save_export,
    stale_keys,
)
from hamo_ray.sweep.grid import GridConfig, SweepConfig, expand_cells, load_sweep, setting_of
from hamo_ray.sweep.report import aggregate, report, table
from hamo_ray.sweep.runner import (
    cells_to_run,
    export_finished,
    prepare_cells,
    record_failure,
    run_cells,
    start_cluster,
)
from hamo_ray.sweep.shared import restore_shared, save_shared
from hamo_ray.sweep.stats import SettingStats, method_summary, setting_stats, stage_average, sweep_stats

__all__ = [
    "EPISODE_COLUMNS",
    "GridConfig",
    "SettingStats",
    "SweepConfig",
    "aggregate",
    "cell_metrics",
    "cells_to_run",
    "expand_cells",
    "export_cell",
    "export_dir",
    "export_finished",
    "exported_cell",
    "load_sweep",
    "method_summary",
    "prepare_cells",
    "record_failure",
    "report",
    "restore_shared",
    "results_dir",
    "run_cells",
    "save_export",
    "save_shared",
    "setting_of",
    "setting_stats",
    "stage_average",
    "stale_keys",
    "start_cluster",
    "sweep_stats",
    "table",
]
