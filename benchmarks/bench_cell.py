"""A whole learning cell evaluated through the LoRA adapter vs on merged weights, side by side in one run.

    python benchmarks/bench_cell.py [--config jobs/configs/learning-smollm2-within.yaml]
        [--method hamo] [--seed 0] [--modes adapter,merged] [override ...]

Runs ``jobs/stream.py`` once per mode (default: ``adapter``, the adapter through LoRA, then ``merged``,
merged weights loaded in place into one running engine; ``merged-restart``: an engine started per
stage from the merged folder, ``serve.merged_swap=false``; ``auto``), one after the other, each in a fresh run folder under ``--root`` and its own Ray,
with the same config, method and seed. Prints each run's wall time (the whole process: Ray's start,
the backbone, every stage), the phases summed over stages from the run's ``state.json`` (evaluation,
training, the rest) and the stage scores, then the ratio merged / adapter. Extra arguments are passed
to the stream as overrides (e.g. ``protocol.test_per_task=8``).

Scores of the two runs need not be equal: training is not bit-reproducible on CPU (two clean runs'
adapters differ by about the learning rate per stage; docs/testing.md), and a different adapter plays
a greedy episode differently. The greedy agreement of merged and LoRA weights on one adapter is
``bench_eval_weights.py``'s and ``tests/ray/test_merged_eval.py``'s.

Results also go to ``benchmarks/results/bench_cell.json`` (``--json PATH``). Each mode's run takes
about half an hour for the default config on 2 cores: run it alone on the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import Results, add_json_argument  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
EVAL_PHASES = ("evaluate",)
# Each mode's overrides: merged weights loaded into one running engine in place (serve.merged_swap, the
# default with merged), or an engine started per stage from its merged folder (the earlier route).
MODES = {
    "adapter": ["serve.eval_weights=adapter"],
    "merged": ["serve.eval_weights=merged", "serve.merged_swap=true"],
    "merged-restart": ["serve.eval_weights=merged", "serve.merged_swap=false"],
    "auto": ["serve.eval_weights=auto"],
}
SETUP = re.compile(r"merged weights of '[^']*' (?:served at \S+ after|loaded in place at \S+ in) ([0-9.]+)s")
TRAIN_PHASES = ("train",)


def phase_totals(state: dict) -> dict[str, float]:
    """Seconds per phase summed over the stages of a run's ``state.json``, plus the run's own timings."""
    totals: dict[str, float] = {}
    for stage in state.get("stages", []):
        for phase, sec in (stage.get("seconds") or {}).items():
            totals[phase] = totals.get(phase, 0.0) + float(sec)
    for phase, sec in (state.get("timings") or {}).items():
        totals[f"run:{phase}"] = float(sec)
    return totals


def stage_scores(state: dict) -> list[float]:
    """The mean test score after each stage (stage 0: before training), from ``state.json``."""
    out = []
    for stage in state.get("stages", []):
        scores = stage.get("scores") or {}
        values = [float(v) for v in scores.values() if isinstance(v, (int, float))]
        out.append(sum(values) / len(values) if values else float("nan"))
    return out


def run_mode(args, mode: str) -> dict:
    run_root = args.root / mode
    if run_root.exists():
        shutil.rmtree(run_root)
    run_root.mkdir(parents=True)
    run_id = f"bench-cell-{args.method}-s{args.seed}-{mode}"
    cmd = [
        sys.executable,
        str(ROOT / "jobs" / "stream.py"),
        "--config",
        str(args.config),
        f"method.name={args.method}",
        f"run.seed={args.seed}",
        f"run.root={run_root}",
        f"run.id={run_id}",
        *MODES[mode],
        *args.overrides,
    ]
    print(f"[{mode}] {' '.join(cmd)}", flush=True)
    log = args.root / f"{mode}.log"
    env = dict(os.environ)
    start = time.perf_counter()
    with open(log, "w") as fh:
        rc = subprocess.call(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    wall = time.perf_counter() - start
    state_path = run_root / run_id / "state.json"
    if rc != 0 or not state_path.exists():
        raise SystemExit(f"[{mode}] the stream failed (exit status {rc}); its log: {log}")
    state = json.loads(state_path.read_text())
    totals = phase_totals(state)
    evaluate = sum(v for k, v in totals.items() if k in EVAL_PHASES)
    train = sum(v for k, v in totals.items() if k in TRAIN_PHASES)
    row = {
        "mode": mode,
        "wall_s": wall,
        "evaluate_s": evaluate,
        "train_s": train,
        "other_s": wall - evaluate - train,
        "stages": len(state.get("stages", [])),
        "scores": stage_scores(state),
        "phases": totals,
        "merged_setup_s": [float(x) for x in SETUP.findall(log.read_text(errors="replace"))],
        "log": str(log),
    }
    print(
        f"[{mode}] wall {wall:.0f} s, evaluate {evaluate:.0f} s, train {train:.0f} s, "
        f"scores {[round(s, 1) for s in row['scores']]}, merged set-up s {row['merged_setup_s']}",
        flush=True,
    )
    return row


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", type=Path, default=ROOT / "jobs/configs/learning-smollm2-within.yaml")
    parser.add_argument("--method", default="hamo")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--modes", default="adapter,merged", help="serve.eval_weights values, in order")
    parser.add_argument("--root", type=Path, default=Path("/tmp/hamo-bench-cell"))
    parser.add_argument("overrides", nargs="*", help="dotted overrides passed to jobs/stream.py")
    add_json_argument(parser, __file__)
    args = parser.parse_args()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        parser.error(f"--modes: {bad or modes} (each one of {', '.join(MODES)})")
    if not args.config.is_file():
        parser.error(f"--config: no such file: {args.config}")
    args.root.mkdir(parents=True, exist_ok=True)
    results = Results(__file__, args)
    rows = []
    for mode in modes:
        row = run_mode(args, mode)
        rows.append(row)
        results.add(row)
    base = rows[0]
    print()
    print(f"{args.config.name}, method {args.method}, seed {args.seed}, {base['stages']} evaluations")
    print(
        f"{'mode':<10} {'wall s':>8} {'evaluate s':>11} {'train s':>8} {'other s':>8} {'wall ratio':>11}  scores"
    )
    for row in rows:
        ratio = row["wall_s"] / base["wall_s"]
        scores = " ".join(f"{s:.1f}" for s in row["scores"])
        print(
            f"{row['mode']:<10} {row['wall_s']:>8.0f} {row['evaluate_s']:>11.0f} {row['train_s']:>8.0f} "
            f"{row['other_s']:>8.0f} {ratio:>10.2f}x  {scores}"
        )
    results.finish()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
