"""SIGKILL the stream's driver mid-stage, resubmit the same command, and check the run is whole."""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

OVERRIDES = [
    "backbone.per_task=6",
    "backbone.epochs=2",
    "protocol.train_per_task=4",
    "protocol.test_per_task=1",
    "env.max_turns=4",
    "rollout.num_workers=1",
    "train.epochs=1",
    "serve.port=18472",
    "serve.app_name=hamo-resume-test",
    "ray.num_cpus=8",  # logical CPUs (the default rule): the training workers stay up across stages
    "ray.address=local",  # its own Ray, never the session's (the test SIGKILLs what the job started)
]


def _command(root: Path, overrides: list[str] = OVERRIDES) -> list[str]:
    return [
        sys.executable,
        str(ROOT / "jobs" / "stream.py"),
        "--config",
        str(ROOT / "jobs" / "configs" / "tiny.yaml"),
        *overrides,
        f"run.root={root}",
        "run.id=r",
        f"backbone.cache_dir={root / 'backbones'}",
    ]


def _start(root: Path, log: Path, overrides: list[str] = OVERRIDES, **env_vars: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | env_vars
    return subprocess.Popen(
        _command(root, overrides),
        stdout=log.open("a"),
        stderr=subprocess.STDOUT,
        env=env,
        cwd=ROOT,
        start_new_session=True,
    )


def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL the driver first (the job dies mid-stage), then what it had started (its local Ray).

    Only this driver's own descendants are killed: ``ray stop`` would also take down the Ray instance
    of the test session itself.
    """
    import psutil

    descendants = psutil.Process(proc.pid).children(recursive=True)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    for child in descendants:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(descendants, timeout=30)


@pytest.mark.timeout(900)
@pytest.mark.slow  # ~5.5 min on 2 cores: bash scripts/test.sh -m slow tests/ray/test_resume.py (resume logic: tests/unit/test_stream_setup.py)
def test_killed_stream_resumes_without_duplicates(tmp_path):
    root = tmp_path / "runs"
    log = tmp_path / "stream.log"
    proc = _start(root, log)
    run = root / "r"
    marker = run / "trajectories" / "stage-2.jsonl"  # stage 1 committed, stage 2 in progress
    deadline = time.time() + 600
    try:
        while not marker.exists():
            assert proc.poll() is None, f"stream ended early:\n{log.read_text()[-3000:]}"
            assert time.time() < deadline, f"stage 2 never started:\n{log.read_text()[-3000:]}"
            time.sleep(0.5)
        time.sleep(2)  # into the stage: distillation / training
        _kill_tree(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    state_before = (run / "state.json").read_text()
    assert '"stage": 1' in state_before and '"stage": 2' not in state_before
    # Resubmit the same command.
    second = _start(root, log)
    assert second.wait(timeout=700) == 0, log.read_text()[-4000:]

    with open(run / "results" / "scores.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["stage"], r["domain"]) for r in rows] == [("1", "scienceworld"), ("2", "scienceworld")]
    adapters = sorted(p.name for p in (run / "adapters").iterdir() if p.is_dir())
    assert adapters == ["stage-1", "stage-2"]
    from hamo_ray.memory.store import MemoryStore

    store = MemoryStore(str(run / "memory"), "cards")
    cards = store.cards()
    assert len(cards) == len({c.id for c in cards}) == store.count()
    trajs = sum(len((run / "trajectories" / f"stage-{s}.jsonl").read_text().splitlines()) for s in (1, 2))
    assert store.count() == trajs
    assert "resuming" in log.read_text()
