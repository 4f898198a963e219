"""The cluster path on one machine: a 5-node Ray cluster (`ray start` processes) with token authentication, the tiny stream
submitted with ``ray job submit``, rollout actors, Serve replicas and training workers placed on different
nodes by custom resources, and a rollout node killed mid-stage: the stream finishes with every task
accounted for and no card written twice.

Slow (a backbone build and a 2-stage stream over 5 raylets on 2 cores): ``bash scripts/test.sh -m slow
tests/ray/test_multinode.py``.
"""

from __future__ import annotations

import json
import os
import secrets
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
RAY = str(Path(sys.executable).parent / "ray")

OVERRIDES = [
    "backbone.per_task=6",
    "backbone.epochs=2",
    "protocol.train_per_task=6",
    "protocol.test_per_task=3",
    "env.max_turns=6",
    "rollout.num_workers=2",
    "rollout.envs_per_worker=2",
    "rollout.scheduling=SPREAD",
    "rollout.resources={rollout_node: 0.01}",
    "serve.resources={serve_node: 0.01}",
    "train.resources={train_node: 0.01}",
    "train.epochs=1",
    "serve.port=18493",
    "serve.app_name=hamo-multinode",
]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _node_ports() -> list[str]:
    """Ports that must differ between Ray nodes sharing one machine."""
    names = ["dashboard-agent-listen-port", "dashboard-agent-grpc-port", "metrics-export-port"]
    ports = [f"--{name}={_free_port()}" for name in names] + [f"--runtime-env-agent-port={_free_port()}"]
    return [*ports, "--object-store-memory=300000000"]  # five nodes' default stores would not fit in /dev/shm


def _ray(env: dict, *args: str, timeout: float = 120) -> str:
    out = subprocess.run([RAY, *args], env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"ray {' '.join(args)}: {out.stderr[-2000:]}"
    return out.stdout + out.stderr  # the job commands print their status and logs through Ray's CLI logger


def _json(text: str):
    """The JSON document in a ``ray list`` output (notices may come first)."""
    starts = [i for i in (text.find("["), text.find("{")) if i >= 0]
    return json.loads(text[min(starts) :]) if starts else []


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_stream_across_nodes_survives_a_lost_rollout_node(tmp_path):
    # Secure by default: every node and every client shares one token (RAY_AUTH_TOKEN); the cluster has
    # its own temp dir, so nothing else on this machine joins it by accident.
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env |= {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16)}
    temp = tempfile.mkdtemp(prefix="hamo-mn-", dir="/tmp")  # short: Ray's socket paths have a length limit
    gcs, dash = _free_port(), _free_port()
    roles = {  # node -> its custom resource
        "serve": ("serve_node", 4),
        "train": ("train_node", 2),
        "rollout_a": ("rollout_node", 2),
        "rollout_b": ("rollout_node", 2),
    }
    procs: dict[str, subprocess.Popen] = {}
    try:
        procs["head"] = subprocess.Popen(
            [RAY, "start", "--head", f"--port={gcs}", "--num-cpus=6", f"--temp-dir={temp}", "--block",
             "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}", *_node_ports()],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        address = f"http://127.0.0.1:{dash}"

        def alive() -> list[dict]:
            try:
                nodes = _json(_ray(env, "list", "nodes", "--address", address, "--format", "json"))
            except (AssertionError, ValueError):  # the dashboard is not up yet
                return []
            return [n for n in nodes if n["state"] == "ALIVE"]

        def wait_for(count: int) -> list[dict]:
            deadline = time.time() + 180
            while time.time() < deadline:
                if len(nodes := alive()) >= count:
                    return nodes
                time.sleep(2)
            raise AssertionError(f"only {len(alive())} of {count} Ray nodes came up")

        wait_for(1)
        # One node at a time: raylets started together on one machine time out during start-up.
        for n, (name, (resource, cpus)) in enumerate(roles.items(), start=2):
            procs[name] = subprocess.Popen(
                [RAY, "start", f"--address=127.0.0.1:{gcs}", f"--num-cpus={cpus}", "--block",
                 f"--resources={json.dumps({resource: 1, f'node_{name}': 1})}", *_node_ports()],
                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
            )  # fmt: skip
            nodes = wait_for(n)
        node_of = {  # role -> node id, by each node's own marker resource
            name: next(n["node_id"] for n in nodes if f"node_{name}" in n.get("resources_total", {}))
            for name in roles
        }
        root = tmp_path / "runs"
        entry = [sys.executable, "jobs/stream.py", "--config", "jobs/configs/tiny.yaml",
                 *OVERRIDES, f"run.root={root}", "run.id=mn",
                 f"backbone.cache_dir={tmp_path / 'backbones'}"]  # fmt: skip
        runtime_env = {"working_dir": str(ROOT), "excludes": [".venv", "runs", ".gpu", "benchmarks/results"]}
        submitted = _ray(env, "job", "submit", "--address", address, "--no-wait",
                         "--runtime-env-json", json.dumps(runtime_env), "--", *entry)  # fmt: skip
        job = next(
            w.strip("'")
            for line in submitted.splitlines()
            for w in line.split()
            if w.strip("'").startswith("raysubmit_")
        )
        killed, status = False, ""
        deadline = time.time() + 2100
        while time.time() < deadline:
            status = _ray(env, "job", "status", "--address", address, job)
            if any(word in status for word in ("SUCCEEDED", "FAILED", "STOPPED")):
                break
            if not killed and "stage 1 evaluation" in _ray(env, "job", "logs", "--address", address, job):
                os.killpg(procs["rollout_a"].pid, signal.SIGKILL)  # the node dies with episodes in flight
                killed = True
            time.sleep(3)
        logs = _ray(env, "job", "logs", "--address", address, job)
        assert "SUCCEEDED" in status, logs[-4000:]
        assert killed, "the stream finished before the rollout node could be killed"

        # Placement: each role ran on its own node(s).
        actors = json.loads(
            _ray(
                env,
                "list",
                "actors",
                "--address",
                address,
                "--detail",
                "--format",
                "json",
                "--limit",
                "10000",
            )
        )

        def roles_of(fragment: str) -> set[str]:
            ids = {a["node_id"] for a in actors if fragment in (a.get("class_name") or "")}
            return {name for name, nid in node_of.items() if nid in ids}

        assert roles_of("EnvWorker") == {"rollout_a", "rollout_b"}
        assert roles_of("PolicyServer") == {"serve"}
        assert roles_of("TrainWorker") == {"train"}

        # Every task accounted for, no duplicate cards, despite the lost node.
        run = root / "mn"
        state = json.loads((run / "state.json").read_text())
        assert [s["stage"] for s in state["stages"]] == [1, 2]
        for stage in (1, 2):
            episodes = (run / "episodes" / f"stage-{stage}-scienceworld.jsonl").read_text().splitlines()
            assert len(episodes) == 3 * 2  # test_per_task x task types, one episode each
        import lancedb

        ids = lancedb.connect(str(run / "memory")).open_table("cards").to_arrow().column("id").to_pylist()
        assert len(ids) == len(set(ids)) > 0
    finally:
        for proc in procs.values():  # only this cluster's processes (never `ray stop`: other Rays run here)
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        shutil.rmtree(temp, ignore_errors=True)
