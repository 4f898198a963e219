"""Sweeps through the real CLI: a tiny 4 methods x 2 seeds sweep (aggregated table and plots; slow), and
a sweep whose cell fails at run time (non-zero exit, the traceback in the cell's folder)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


def _sweep(tmp_path: Path, timeout: int, **sweep) -> tuple[subprocess.CompletedProcess, list[str], dict]:
    """Run ``jobs/sweep.py`` on a sweep file over the tiny config rooted at ``tmp_path/sweep``.

    Returns:
        The finished process, and the command and environment (without RAY_ADDRESS) to run it again.
    """
    f = tmp_path / "sweep.yaml"
    base = {"base": str(ROOT / "jobs" / "configs" / "tiny.yaml"), "root": str(tmp_path / "sweep")}
    f.write_text(yaml.safe_dump({**base, **sweep}))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    cmd = [sys.executable, str(ROOT / "jobs" / "sweep.py"), "--config", str(f)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=timeout)
    return proc, cmd, env


@pytest.mark.slow  # 8 stream runs: ~10 min on 2 cores; run with `bash scripts/test.sh -m slow`
@pytest.mark.timeout(1500)
def test_tiny_sweep_aggregates(tmp_path):
    overrides = [
        "protocol.eval_initial=true",
        "protocol.train_per_task=2",
        "protocol.test_per_task=1",
        "env.max_turns=3",
        "backbone.per_task=4",
        "backbone.epochs=1",
        f"backbone.cache_dir={tmp_path / 'backbones'}",
        "train.epochs=1",
        "rollout.num_workers=1",
        "serve.port=18473",
        "serve.app_name=hamo-sweep-test",
        "ray.num_cpus=8",  # logical CPUs (the default rule): the training workers stay up across stages
        "ray.address=local",  # its own Ray, not a `ray start` cluster that may run here
    ]
    grid = {"method": ["base", "harness", "model_only", "hamo"], "seed": [0, 1]}
    proc, cmd, env = _sweep(tmp_path, 1400, overrides=overrides, grid=grid)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    results = tmp_path / "sweep" / "results"
    summary = json.loads((results / "summary.json").read_text())
    (setting,) = summary
    assert set(summary[setting]) == {"base", "harness", "model_only", "hamo"}
    for method, row in summary[setting].items():
        assert row["seeds"] == 2, method
        assert (
            row["average"]["n"] == 2
            and row["average"]["ci_low"] <= row["average"]["mean"] <= row["average"]["ci_high"]
        )
        assert len(row["stage_scores"]["scienceworld"]) == 3  # stage 0 (initial evaluation), 1, 2
        assert len(row["retention"]) == 3  # stage 0 (initial evaluation), 1, 2
    table = (results / "table.md").read_text()
    assert all(f"| {m} |" in table for m in ("base", "harness", "model_only", "hamo"))
    pngs = sorted(p.name for p in results.glob("*.png"))
    assert pngs == ["setting0-bars.png", "setting0-retention.png", "setting0-stagewise.png"]
    assert all((results / p).stat().st_size > 5000 for p in pngs)
    report = (tmp_path / "sweep" / "report.md").read_text()
    assert "setting0-stagewise.png" in report
    # share_experts (the default): the cells of one seed trained on the very same expert trajectories.
    cells = tmp_path / "sweep" / "cells"
    for seed in (0, 1):
        for stage in (1, 2):
            files = sorted(cells.glob(f"*-s{seed}/trajectories/stage-{stage}.jsonl"))
            assert len(files) >= 2 and len({f.read_text() for f in files}) == 1, (seed, stage, files)
    assert len(list((tmp_path / "sweep" / "experts").glob("scienceworld-*.jsonl"))) >= 2
    # share_initial (the default): each seed's stage 0 was played by one cell and copied by the others.
    for seed in (0, 1):
        states = {p.parent.name: json.loads(p.read_text()) for p in cells.glob(f"*-s{seed}/state.json")}
        sources = {name: state["stages"][0].get("initial_from") for name, state in states.items()}
        (player,) = [name for name, source in sources.items() if source is None]
        assert set(sources.values()) == {None, player} and len(sources) == 4, sources
        assert len({json.dumps(s["stages"][0]["scores"]) for s in states.values()}) == 1
        files = sorted(cells.glob(f"*-s{seed}/episodes/stage-0-scienceworld.jsonl"))
        assert len(files) == 4 and len({f.read_text() for f in files}) == 1
    # A second submission finds every cell finished and only aggregates again.
    again = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert again.returncode == 0 and "8 finished" in (again.stdout + again.stderr)


@pytest.mark.timeout(600)
def test_a_failing_cell_exits_non_zero_with_its_traceback_saved(tmp_path):
    """The real CLI: a cell whose value passes validation but fails at run time (its backbone cache is
    a file, not a folder) leaves ``error.txt`` with the traceback in its folder; the sweep exits 1."""
    not_a_folder = tmp_path / "cache-is-a-file"
    not_a_folder.write_text("not a folder\n")
    proc, _, _ = _sweep(
        tmp_path,
        500,
        overrides=["ray.address=local", "ray.num_cpus=2", "serve.port=18475"],
        grid={"method": ["hamo"], "seed": [0], "vary": {"backbone.cache_dir": [str(not_a_folder)]}},
    )
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    (cell,) = (tmp_path / "sweep" / "cells").iterdir()
    error = (cell / "error.txt").read_text()
    assert error.startswith("Traceback") and "FileExistsError" in error and str(not_a_folder) in error
    assert "ensure_backbone" in error  # the frame that raised, not only the message
    assert f"error: cell {cell.name} failed; traceback in {cell / 'error.txt'}" in proc.stderr
    assert json.loads((tmp_path / "sweep" / "results" / "summary.json").read_text()) == {}
