"""``hamo_ray.run.cluster.start_ray`` joins a running ``ray start`` cluster with ``ray.address=auto`` only: by default
(no ``RAY_ADDRESS``) it starts a private Ray, as ``ray.address=local`` always does.

A real head node (``ray start --head --block``) runs with its own Ray temp folder (``RAY_TMPDIR``),
so the address file it writes is the one ``ray.init()`` would find on a machine where a cluster
runs, without touching ``/tmp/ray`` of other Ray instances on this machine. The drivers are
subprocesses, as ``python jobs/stream.py`` on a head node would be. A driver started by ``ray job
submit`` with a working_dir refuses a relative ``run.root`` (it would land in Ray's copy of the
working_dir on the head node).

    pytest tests/ray/test_runtime_cluster.py -x -q
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

import pytest

ROOT = Path(__file__).resolve().parents[2]
DRIVER = """
import json, sys
import ray
from hamo_ray.config import RayConfig
from hamo_ray.run.cluster import start_ray
address = sys.argv[1] or None
start_ray(RayConfig(address=address, num_cpus=2))

@ray.remote(num_cpus=0)
def quiet():  # did this worker run the private Ray's setup hook (hamo_ray.logs.ray_worker_setup)?
    import logging
    from hamo_ray.logs import REPEATED_WARNINGS, FirstOnly
    return all(any(isinstance(f, FirstOnly) for f in logging.getLogger(n).filters) for n in REPEATED_WARNINGS)

print("RESULT", json.dumps({"gcs": ray.get_runtime_context().gcs_address,
                            "cpus": ray.cluster_resources().get("CPU"), "quiet": ray.get(quiet.remote())}))
ray.shutdown()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def head():
    """A 3-CPU head node in its own temp folder: ``(env for drivers, gcs port)``."""
    tmp = tempfile.mkdtemp(prefix="hrt", dir="/tmp")  # short: Ray's socket paths must stay short
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_TMPDIR=tmp, RAY_AUTH_MODE="disabled", PYTHONPATH=str(ROOT))
    port = _free_port()
    ray_bin = Path(sys.executable).with_name("ray")
    cmd = [
        str(ray_bin),
        "start",
        "--head",
        "--block",
        f"--port={port}",
        "--num-cpus=3",
        "--include-dashboard=false",
    ]
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    address_file = Path(tmp) / "ray" / "ray_current_cluster"
    deadline = time.monotonic() + 180
    while not address_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"ray start failed: {proc.stdout.read().decode()[-2000:]}")
        time.sleep(1)
    try:
        yield env, port
    finally:
        # SIGTERM to `ray start` alone: it stops its own processes in 2-3 s. Sent to the whole group, the
        # GCS dies first and `ray start` waits 30 s trying to drain the node through it.
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


def _driver(env: dict, address: str = "") -> dict:
    out = subprocess.run(
        [sys.executable, "-c", DRIVER, address], env=env, capture_output=True, text=True, timeout=300
    )
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    assert out.returncode == 0 and lines, out.stdout[-2000:] + out.stderr[-3000:]
    return json.loads(lines[-1].removeprefix("RESULT "))


@pytest.mark.timeout(600)
def test_auto_joins_the_running_cluster_and_the_default_never_does(head):
    env, port = head
    joined = _driver(env, "auto")
    assert joined["gcs"].endswith(f":{port}") and joined["cpus"] == 3
    assert not joined["quiet"]  # a joined cluster's logging is its owner's
    # The `ray start` may be another user's: not joined unasked (RAY_ADDRESS, which `ray job submit` sets,
    # or ray.address); the default starts a private Ray, as ray.address=local always does.
    for address in ("", "local"):
        private = _driver(env, address)
        assert not private["gcs"].endswith(f":{port}") and private["cpus"] == 2
        assert private["quiet"]  # the private Ray (no dashboard) hides Ray Train's repeated cleaner warning
    submitted = _driver(env | {"RAY_ADDRESS": f"127.0.0.1:{port}"})  # what a submitted job's driver sees
    assert submitted["gcs"].endswith(f":{port}") and submitted["cpus"] == 3


def test_a_submitted_job_refuses_a_relative_run_root(tmp_path):
    """In a job with a working_dir the driver runs in Ray's temporary copy of it on the head node."""
    job_config = {"runtime_env": {"working_dir": "gcs://_ray_pkg_0123456789abcdef.zip"}, "metadata": {}}
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env |= {"RAY_JOB_CONFIG_JSON_ENV_VAR": json.dumps(job_config), "PYTHONPATH": str(ROOT)}
    stream = [
        sys.executable,
        str(ROOT / "jobs" / "stream.py"),
        "--config",
        str(ROOT / "jobs/configs/tiny.yaml"),
    ]
    # model.path is missing too: were run.root let through, the Stream would fail on it (exit 2, no Ray).
    bad = [*stream, "run.root=runs", "model.path=/nonexistent/model"]
    out = subprocess.run(bad, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and "run.root: 'runs' is relative" in out.stderr, out.stderr[-2000:]
    assert "e.g. run.root=/mnt/shared/hamo/runs" in out.stderr
    absolute = [*stream, f"run.root={tmp_path / 'runs'}", "model.path=/nonexistent/model"]
    out = subprocess.run(absolute, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and "model.path" in out.stderr and "run.root" not in out.stderr, out.stderr[
        -2000:
    ]
    # A sweep's root holds every cell's run folder: the same rule, naming the sweep's key.
    sweep = [
        sys.executable,
        str(ROOT / "jobs" / "sweep.py"),
        "--config",
        str(ROOT / "jobs/configs/sweep-tiny.yaml"),
    ]
    out = subprocess.run(sweep, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and "root: 'runs/sweep-tiny' is relative" in out.stderr, out.stderr[-2000:]


def test_a_taken_serve_port_is_refused_before_any_work(tmp_path):
    """A second run or sweep on one machine, on a port another process holds: exit 2 naming serve.port,
    before the backbone is built (minutes) and before anything is written into a run folder's stages."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"PYTHONPATH": str(ROOT)}
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        common = [f"serve.port={port}", "ray.address=local", "ray.num_cpus=2"]
        common.append(f"backbone.cache_dir={tmp_path / 'backbones'}")
        stream = [sys.executable, "jobs/stream.py", "--config", "jobs/configs/tiny.yaml"]
        out = subprocess.run(
            [*stream, f"run.root={tmp_path / 'runs'}", *common],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert out.returncode == 2 and f"serve.port={port}: " in out.stderr, out.stderr[-2000:]
        assert "Traceback" not in out.stderr
        sweep_file = tmp_path / "sweep.yaml"
        sweep_file.write_text(
            json.dumps(
                {
                    "base": str(ROOT / "jobs" / "configs" / "tiny.yaml"),
                    "root": str(tmp_path / "sweep"),
                    "overrides": common,
                    "grid": {"method": ["base"]},
                }
            )
        )
        sweep = [sys.executable, "jobs/sweep.py", "--config", str(sweep_file)]
        out = subprocess.run(sweep, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 2 and f"serve.port={port}: " in out.stderr, out.stderr[-2000:]
    assert not (tmp_path / "backbones").exists()  # no build was started
