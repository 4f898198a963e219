"""The learning experiment (docs/results-toy.md, superseded): its sweeps, their wall time and the methods' table.

A slow benchmark: it runs each sweep file with ``jobs/sweep.py`` (cells already finished in the sweep's
root are skipped, so a rerun only aggregates or finishes what is missing), times it, and prints one row
per (sweep, method): seeds, stage average, the paired difference to ``base``, final total, first-domain
retention and BWT (mean ± 95% t half-width over seeds), plus each domain's score before training.
Measured on the 2-core machine: ~40 min per seed of the within-domain sweep (see the README).

    python benchmarks/learning.py                                   # the three sweeps, ~4-5 h on 2 cores
    python benchmarks/learning.py --sweeps jobs/configs/sweep-learning-cross.yaml
    python benchmarks/learning.py --aggregate-only                  # the table of what has finished
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from common import Results, add_json_argument

ROOT = Path(__file__).resolve().parent.parent
SWEEPS = [
    "jobs/configs/sweep-learning-within.yaml",
    "jobs/configs/sweep-learning-ablation.yaml",
    "jobs/configs/sweep-learning-cross.yaml",
]


def _cell(r: dict | None) -> str:
    if not r or r.get("mean") is None:
        return "-"
    if r.get("ci_high") is None:
        return f"{r['mean']:.1f}"
    return f"{r['mean']:.1f} ± {r['ci_high'] - r['mean']:.1f}"


def _before(method: dict) -> str:
    """Each domain's score before the first stage (when the runs evaluated it), else after stage 1."""
    return ", ".join(f"{d} {curve[0]['mean']:.1f}" for d, curve in sorted(method["stage_scores"].items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sweeps", nargs="+", default=SWEEPS, help="sweep files (default: the three)")
    parser.add_argument("--aggregate-only", action="store_true", help="run nothing; table what finished")
    add_json_argument(parser, __file__)
    args = parser.parse_args()

    sys.path.insert(0, str(ROOT))
    from hamo_ray.sweep import load_sweep

    results = Results(__file__, args)
    header = f"{'sweep':<28} {'method':<12} {'seeds':>5} {'stage avg':>13} {'vs base':>13} "
    header += f"{'final total':>13} {'retention':>13} {'BWT':>12}  before training (first curve point)"
    rows = []
    for path in args.sweeps:
        sweep, _ = load_sweep(path)
        seconds = None
        if not args.aggregate_only:
            start = time.time()
            proc = subprocess.run(
                [sys.executable, str(ROOT / "jobs" / "sweep.py"), "--config", path], cwd=ROOT
            )
            seconds = time.time() - start
            print(f"{path}: exit {proc.returncode} after {seconds / 60:.1f} min", flush=True)
        summary_file = Path(sweep.root) / "results" / "summary.json"
        if not summary_file.exists():
            print(f"{path}: no {summary_file} (no cell finished)")
            continue
        for setting, methods in json.loads(summary_file.read_text()).items():
            for name, m in sorted(methods.items()):
                row = {
                    "sweep": Path(path).stem,
                    "setting": setting,
                    "method": name,
                    "seeds": m["seeds"],
                    "average": m["average"],
                    "vs_base": m["vs_base"],
                    "final_total": m["final_total"],
                    "retention_first": m["retention"][-1],
                    "bwt": m["backward_transfer"],
                    "before": {d: c[0]["mean"] for d, c in m["stage_scores"].items()},
                    "sweep_seconds": seconds,
                }
                results.add(row)
                rows.append(
                    f"{row['sweep']:<28} {name:<12} {m['seeds']:>5} {_cell(m['average']):>13} "
                    f"{_cell(m['vs_base']):>13} {_cell(m['final_total']):>13} "
                    f"{_cell(m['retention'][-1]):>13} {_cell(m['backward_transfer']):>12}  {_before(m)}"
                )
    print(header)
    print("\n".join(rows))
    results.finish()


if __name__ == "__main__":
    main()
