"""The fault matrix: the driver SIGKILLed at every phase of a stage, the vLLM engine killed mid-evaluation.

Each fault is followed by submitting the same command again. Whatever the fault, the run ends with the
stages and rows an unfaulted run commits, no duplicate card, no release left by an uncommitted attempt,
and every stage evaluated with the adapter committed for it (the served name carries the content hash
of the adapter's files, and the replica refuses a folder whose files no longer match it).

    bash scripts/test.sh -m slow tests/ray/test_fault_matrix.py     # ~25 min on 2 cores
"""

from __future__ import annotations

import csv
import json
import os
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
    "protocol.test_per_task=2",
    "env.max_turns=4",
    "rollout.num_workers=1",
    "train.epochs=1",
    "serve.port=18473",
    "ray.num_cpus=8",
    "ray.address=local",  # its own Ray: the test kills what the job started, never the session's
]
# Every phase of stage 1 with hamo_release (release included), then the commit between results and state.
KILL_POINTS = ["collect", "distil", "select", "train", "publish", "release", "evaluate", "commit"]


def _start(root: Path, run_id: str, log: Path, *extra: str, kill_at: str | None = None) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "HAMO_KILL_AT")}
    if kill_at:
        env["HAMO_KILL_AT"] = kill_at
    cmd = [
        sys.executable, str(ROOT / "jobs" / "stream.py"), "--config", str(ROOT / "jobs" / "configs" / "tiny.yaml"),
        *OVERRIDES, f"run.root={root}", f"run.id={run_id}", f"backbone.cache_dir={root / 'backbones'}", *extra,
    ]  # fmt: skip
    return subprocess.Popen(cmd, stdout=log.open("a"), stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                            start_new_session=True)  # fmt: skip


def _reap(proc: subprocess.Popen, timeout: float) -> int:
    """Wait for the driver, then kill what is left of its session and wait until its port is free."""
    import socket

    try:
        rc = proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    try:
        os.killpg(proc.pid, 9)  # the job's session: raylet, GCS, workers, the engine
    except ProcessLookupError:
        pass
    deadline = time.time() + 60
    while time.time() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", 18473)) != 0:
                break
        time.sleep(1)
    return rc


def _rows(run: Path) -> list[tuple[str, str, str]]:
    with open(run / "results" / "scores.csv") as f:
        return [(r["stage"], r["domain"], r["score"]) for r in csv.DictReader(f)]


def _check_whole(run: Path) -> dict:
    """The run is whole: its stages, unique cards, releases of committed stages only, each stage evaluated
    with its committed adapter (the name's digest is the folder's)."""
    from hamo_ray.memory.store import MemoryStore
    from hamo_ray.serving.objstore import folder_digest

    state = json.loads((run / "state.json").read_text())
    stages = {s["stage"]: s for s in state["stages"]}
    assert sorted(stages) == [1, 2]
    store = MemoryStore(str(run / "memory"), "cards")
    cards = store.cards()
    trajs = sum(len((run / "trajectories" / f"stage-{t}.jsonl").read_text().splitlines()) for t in (1, 2))
    assert len(cards) == len({c.id for c in cards}) == store.count() == trajs
    import lancedb

    rows = lancedb.connect(str(run / "memory")).open_table(store.table_name).to_arrow().to_pylist()
    released = {r["id"] for r in rows if r.get("released")}
    assert released == {i for s in stages.values() for i in s["released"]}
    for t, s in stages.items():
        digest = folder_digest(run / s["adapter"])
        assert s["adapter_name"] == f"stage-{t}:{digest[:12]}"
        models = {
            json.loads(line).get("model")
            for line in (run / "episodes" / f"stage-{t}-scienceworld.jsonl").read_text().splitlines()
        }
        assert models == {s["adapter_name"]}, (t, models)
    return stages


@pytest.mark.timeout(3600)
@pytest.mark.slow
def test_driver_killed_at_every_phase_ends_as_an_unfaulted_run(tmp_path):
    root, log = tmp_path / "runs", tmp_path / "stream.log"
    release = ["method.name=hamo_release", "memory.release_min_score=0"]  # every solved replay releases
    assert _reap(_start(root, "clean", log, *release), 900) == 0, log.read_text()[-4000:]
    clean = _check_whole(root / "clean")
    for point in KILL_POINTS:
        rc = _reap(_start(root, "faulted", log, *release, kill_at=f"stage-1:{point}"), 900)
        assert rc == -9, f"not killed at {point}:\n{log.read_text()[-3000:]}"
        state = root / "faulted" / "state.json"
        assert not state.exists() or '"stage": 1' not in state.read_text(), point
    assert _reap(_start(root, "faulted", log, *release), 900) == 0, log.read_text()[-4000:]
    faulted = _check_whole(root / "faulted")
    assert _rows(root / "faulted") == _rows(root / "clean")
    for t in (1, 2):  # the same data and selection as the unfaulted run
        for key in ("anchors", "replay", "released", "scores"):
            assert faulted[t][key] == clean[t][key], (t, key)
        # and the same weights, up to what two unfaulted trainings of the same stage differ by on CPU
        # (the names carry their exact hashes, checked against the files above)
        diff = _max_weight_diff(
            root / "clean" / clean[t]["adapter"], root / "faulted" / faulted[t]["adapter"]
        )
        assert diff <= _nondeterminism_bound(t), (t, diff)


LR = 2.0e-3  # jobs/configs/tiny.yaml's train.lr


def _nondeterminism_bound(stage: int) -> float:
    """How far two unfaulted trainings of stage ``stage`` may differ in any adapter weight.

    Measured (2026-12-05, two clean runs of this test's command one after the other): 4.0e-3 at stage 1
    and 8.0e-3 at stage 2, i.e. 2 x lr and 4 x lr, of weights up to 0.09. Adam moves a weight by about
    lr a step whatever its gradient's size, so a near-zero gradient whose sign flips under CPU float
    reordering moves it by 2 x lr the other way; a stage continues the previous adapter, so the spread
    adds up. The bound is 3 x lr a stage: a real difference (other data, other cards, a stale adapter)
    moves many weights by far more, and the rows, anchors and scores above must be equal anyway."""
    return 3 * LR * stage


def _max_weight_diff(a: Path, b: Path) -> float:
    from safetensors.torch import load_file

    wa, wb = load_file(a / "adapter_model.safetensors"), load_file(b / "adapter_model.safetensors")
    assert wa.keys() == wb.keys()
    return max(float((wa[k] - wb[k]).abs().max()) for k in wa)


def _engine_pids(proc: subprocess.Popen) -> list[int]:
    import psutil

    out = []
    for p in psutil.Process(proc.pid).children(recursive=True):
        try:
            if "EngineCore" in " ".join(p.cmdline()) or "EngineCore" in p.name():
                out.append(p.pid)
        except psutil.NoSuchProcess:
            pass
    return out


def _kill_engine_mid_evaluation(proc: subprocess.Popen, log: Path, since: int) -> None:
    """SIGKILL the vLLM engine process once the stage's evaluation has played its first episodes."""
    import re

    deadline = time.time() + 900
    while not re.search(r"episode \S+: score|stage 1 evaluation", log.read_text()[since:]):
        assert proc.poll() is None, log.read_text()[-3000:]
        assert time.time() < deadline, "evaluation never started"
        time.sleep(0.5)
    pids = _engine_pids(proc)
    assert pids, "no vLLM engine process found"
    for pid in pids:
        os.kill(pid, 9)


@pytest.mark.timeout(3600)
@pytest.mark.slow
def test_engine_killed_mid_evaluation_never_commits_the_survivors(tmp_path):
    root, log = tmp_path / "runs", tmp_path / "stream.log"
    # 16 test episodes, two at a time: the engine dies with most of them still to play
    one = ["protocol.num_stages=1", "protocol.train_per_task=2", "protocol.test_per_task=8",
           "rollout.envs_per_worker=2"]  # fmt: skip
    # No replay allowed: the stage fails, naming the cause, and nothing is committed.
    proc = _start(root, "r", log, *one, "eval.retries=0")
    _kill_engine_mid_evaluation(proc, log, 0)
    assert _reap(proc, 900) != 0
    text = log.read_text()
    assert "episodes lost to faults" in text and "not committed" in text, text[-3000:]
    assert not (root / "r" / "state.json").exists()
    # Resubmitted with the defaults and the engine killed again: the lost episodes are played again once
    # Serve has replaced the replica, and the stage commits every episode.
    since = len(text)
    proc = _start(root, "r", log, *one)
    _kill_engine_mid_evaluation(proc, log, since)
    assert _reap(proc, 1200) == 0, log.read_text()[-4000:]
    state = json.loads((root / "r" / "state.json").read_text())
    (stage,) = state["stages"]
    assert stage["evaluation"]["episodes"] == 16 and stage["evaluation"]["failed_episodes"] == 0
    assert "playing them again" in log.read_text()[since:]
