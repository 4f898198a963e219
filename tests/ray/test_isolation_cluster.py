"""Two streams with different run ids on one ``ray start`` cluster at the same time (issue 41, item 4).

One head node (``ray start --head --block``, its own ``--temp-dir`` and GCS port, ``RAY_AUTH_MODE=disabled``
for the head and every driver) runs a bystander Serve app that neither stream created. Two 1-stage tiny
streams (``run.id=iso-a`` and ``iso-b``, seeds 0 and 1) join it with ``ray.address=<its address>``, on one
``serve.port`` (Serve's single proxy, shared), one ``serve.adapter_store`` and one ``memory.uri``. Both
must finish, each with its own endpoint (both answer at once, at ``/iso-a`` and ``/iso-b``), its own
adapters (``<store>/<run id>/``) and its own cards (table ``cards-<run id>``); the bystander still runs.
A third stream whose app name (``hamo-iso-c``) is already taken on the cluster is refused, naming it,
and leaves that app alone.

The head is stopped by SIGTERM to its own ``ray start`` process (never ``ray stop``, which stops every Ray
instance of this user on the machine: other tests' and other users' sessions).

    bash scripts/test.sh -m slow tests/ray/test_isolation_cluster.py
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]

OVERRIDES = [  # a small 1-stage tiny stream (as tests/ray/test_resume.py's, one stage)
    "protocol.num_stages=1",
    "backbone.per_task=6",
    "backbone.epochs=2",
    "protocol.train_per_task=4",
    "protocol.test_per_task=1",
    "env.max_turns=4",
    "rollout.num_workers=1",
    "train.epochs=1",
]

BYSTANDER = """
import sys, ray
from ray import serve
ray.init(address=sys.argv[1])

@serve.deployment(ray_actor_options={"num_cpus": 0})
class Bystander:
    def __call__(self, request):
        return "still here"

serve.start(http_options={"host": "127.0.0.1", "port": int(sys.argv[2])})
serve.run(Bystander.bind(), name=sys.argv[3], route_prefix=sys.argv[4], blocking=False)
"""

APPS = """
import json, sys, ray
from ray import serve
ray.init(address=sys.argv[1])
print("APPS", json.dumps(sorted(serve.status().applications)))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def head():
    """A head node in its own temp folder: ``(env for drivers, its GCS address)``."""
    tmp = tempfile.mkdtemp(prefix="hiso", dir="/tmp")  # short: Ray's socket paths must stay short
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_TMPDIR=tmp, RAY_AUTH_MODE="disabled", PYTHONPATH=str(ROOT))
    port = _free_port()
    cmd = [
        str(Path(sys.executable).with_name("ray")), "start", "--head", "--block", f"--port={port}",
        f"--temp-dir={tmp}", "--num-cpus=16", "--include-dashboard=false", "--object-store-memory=500000000",
    ]  # fmt: skip
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    address_file = Path(tmp) / "ray_current_cluster"
    deadline = time.monotonic() + 180
    while not (address_file.exists() or (Path(tmp) / "ray" / "ray_current_cluster").exists()):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"ray start failed: {proc.stdout.read().decode()[-2000:]}")
        time.sleep(1)
    try:
        yield env, f"127.0.0.1:{port}"
    finally:  # SIGTERM to this head's `ray start` alone: it stops its own processes (see test_runtime_cluster)
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever is left of this head's process group
        except ProcessLookupError:
            pass
        proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)


def _driver(env: dict, script: str, *args: str) -> str:
    out = subprocess.run(
        [sys.executable, "-c", script, *args], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out.stdout


def _apps(env: dict, address: str) -> list[str]:
    line = next(x for x in _driver(env, APPS, address).splitlines() if x.startswith("APPS "))
    return json.loads(line.removeprefix("APPS "))


def _stream(env, address, tmp_path, run_id, seed, port, log):
    cmd = [
        sys.executable, str(ROOT / "jobs" / "stream.py"), "--config", str(ROOT / "jobs/configs/tiny.yaml"),
        *OVERRIDES, f"ray.address={address}", f"run.root={tmp_path / 'runs'}", f"run.id={run_id}",
        f"run.seed={seed}", f"serve.port={port}", f"backbone.cache_dir={tmp_path / 'backbones'}",
        f"memory.uri={tmp_path / 'memory'}", f"serve.adapter_store={tmp_path / 'store'}",
    ]  # fmt: skip
    return subprocess.Popen(
        cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True
    )


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.mark.timeout(2400)
@pytest.mark.slow
def test_two_streams_on_one_cluster_keep_to_their_own(head, tmp_path):
    from hamo_ray.serving.objstore import DIGEST_FILE, folder_digest

    env, address = head
    port = _free_port()
    _driver(env, BYSTANDER, address, str(port), "bystander", "/bystander")  # someone else's app
    logs = {run: tmp_path / f"{run}.log" for run in ("iso-a", "iso-b")}
    procs: dict[str, subprocess.Popen] = {}
    urls = {run: f"http://127.0.0.1:{port}/{run}" for run in logs}
    both_up = False
    t0 = time.monotonic()
    try:
        procs["iso-a"] = _stream(env, address, tmp_path, "iso-a", 0, port, logs["iso-a"])
        # The second starts once the first's endpoint is up: the backbone is then built (its cache is
        # shared), and the two run side by side from there on.
        deadline = time.monotonic() + 900
        while not _healthy(urls["iso-a"]):
            assert procs["iso-a"].poll() is None, logs["iso-a"].read_text()[-4000:]
            assert time.monotonic() < deadline, logs["iso-a"].read_text()[-4000:]
            time.sleep(2)
        procs["iso-b"] = _stream(env, address, tmp_path, "iso-b", 1, port, logs["iso-b"])
        deadline = time.monotonic() + 1500
        while any(p.poll() is None for p in procs.values()):
            assert time.monotonic() < deadline, {r: x.read_text()[-3000:] for r, x in logs.items()}
            both_up = both_up or all(_healthy(u) for u in urls.values())
            time.sleep(2)
        for run, proc in procs.items():
            assert proc.returncode == 0, f"{run}:\n{logs[run].read_text()[-5000:]}"
    finally:
        for proc in procs.values():  # only the streams this test started
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    print(f"two streams: {time.monotonic() - t0:.0f} s")
    assert both_up  # both endpoints answered at the same time, on the one shared proxy

    runs = tmp_path / "runs"
    digests = {}
    for run in ("iso-a", "iso-b"):
        text = logs[run].read_text()
        assert f"healthy at {urls[run]} " in text  # its own app, at its own route
        state = json.loads((runs / run / "state.json").read_text())
        assert [s["stage"] for s in state["stages"]] == [1]
        episodes = [json.loads(x) for x in (runs / run / "episodes" / "stage-1-scienceworld.jsonl").open()]
        assert {e["model"] for e in episodes} == {state["stages"][0]["adapter_name"]}
        # Its adapters under its own prefix of the shared store, with its own weights and registry.
        stored = tmp_path / "store" / run / "stage-1"
        digests[run] = folder_digest(runs / run / "adapters" / "stage-1")
        assert (stored / DIGEST_FILE).read_text() == digests[run]
        registry = json.loads((tmp_path / "store" / run / "served_adapters.json").read_text())
        assert registry and all(name.startswith("stage-1") for name in registry)
    assert digests["iso-a"] != digests["iso-b"]  # two seeds, two adapters: neither overwrote the other
    assert sorted(p.name for p in (tmp_path / "store").iterdir()) == ["iso-a", "iso-b"]

    # Their cards in two tables of the shared memory, none merged.
    import lancedb

    db = lancedb.connect(str(tmp_path / "memory"))
    for run in ("iso-a", "iso-b"):
        state = json.loads((runs / run / "state.json").read_text())
        cards = db.open_table(f"cards-{run}").to_arrow()
        assert cards.num_rows == sum(s["num_trajectories"] for s in state["stages"]) > 0
        assert set(cards.column("stage").to_pylist()) == {1}
    with pytest.raises((ValueError, FileNotFoundError)):
        db.open_table("cards")

    # Each deleted its own apps only: the bystander still runs and answers.
    apps = _apps(env, address)
    assert "bystander" in apps and not [a for a in apps if a.startswith("hamo-iso-")], apps
    assert httpx.get(f"http://127.0.0.1:{port}/bystander", timeout=30).text == "still here"

    # An app of the name a stream derives, not created by it: refused, naming it, and left running.
    _driver(env, BYSTANDER, address, str(port), "hamo-iso-c", "/squatter")
    log = tmp_path / "iso-c.log"
    third = _stream(env, address, tmp_path, "iso-c", 0, port, log)
    try:
        assert third.wait(timeout=600) == 2, log.read_text()[-4000:]
    finally:
        if third.poll() is None:
            os.killpg(third.pid, signal.SIGKILL)
    assert "'hamo-iso-c' already runs on this Ray cluster" in log.read_text(), log.read_text()[-3000:]
    assert "hamo-iso-c" in _apps(env, address)
    assert httpx.get(f"http://127.0.0.1:{port}/squatter", timeout=30).text == "still here"
    assert not (runs / "iso-c" / "state.json").exists()
