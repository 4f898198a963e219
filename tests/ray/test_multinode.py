"""The cluster path on one machine: a 3-node Ray cluster (`ray start` processes) with token authentication,
the tiny stream submitted with ``ray job submit``, rollout actors, Serve replicas and training workers
placed on different nodes by custom resources, and a rollout node killed mid-stage: the stream finishes
in its first submission, the lost actors' episodes replayed on actors Ray restarted on the surviving
rollout node, with every task accounted for and no card written twice.

Nodes (one machine, each node its own Ray temp dir as on separate machines): the head (job driver,
Serve's policy replica: ``serve_node``), ``rollout`` (``rollout_node``; SIGKILLed as stage 1's
evaluation starts) and ``train`` (``train_node`` and ``rollout_node``: the training workers, and the
rollout actors that replace the lost ones). Storage every node sees: the run folder on this machine's
disk; in the ``s3`` variant the run's memory (LanceDB) and adapters on an S3 protocol server (moto),
the credentials in every node's environment.

Slow (a backbone build and a 2-stage stream over 3 raylets on 2 cores, ~11 min per variant):
``bash scripts/test.sh -m slow tests/ray/test_multinode.py``. On failure every node's Ray logs are
kept under the test's ``tmp_path/ray-logs``.
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
from collections.abc import Callable
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
HEAD = {"serve_node": 1}
WORKERS = {  # worker node -> (CPUs, custom resources)
    "rollout": (2, {"rollout_node": 1}),
    "train": (3, {"train_node": 1, "rollout_node": 1}),
}
S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}
BUCKET = "hamo-mn"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _node_args(name: str, resources: dict) -> list[str]:
    """Ports that must differ between Ray nodes sharing one machine, a small object store, the resources."""
    names = ["dashboard-agent-listen-port", "dashboard-agent-grpc-port", "metrics-export-port"]
    ports = [f"--{n}={_free_port()}" for n in [*names, "runtime-env-agent-port"]]
    marker = {**resources, f"node_{name}": 1}  # tells the nodes apart in `ray list nodes`
    return [*ports, "--object-store-memory=300000000", f"--resources={json.dumps(marker)}", "--block"]


def _ray(env: dict, *args: str, timeout: float = 120) -> str:
    out = subprocess.run([RAY, *args], env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"ray {' '.join(args)}: {out.stderr[-2000:]}"
    return out.stdout + out.stderr  # the job commands print their status and logs through Ray's CLI logger


def _json(text: str):
    """The JSON document in a ``ray list`` output (notices may come first)."""
    starts = [i for i in (text.find("["), text.find("{")) if i >= 0]
    return json.loads(text[min(starts) :]) if starts else []


def _start(args: list[str], env: dict, log: Path) -> subprocess.Popen:
    """``ray start <args> --block`` in its own process group, its output in ``log`` (for a post-mortem)."""
    with log.open("w") as out:
        return subprocess.Popen([RAY, "start", *args], env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip


def _driver_log(temp: str, job: str) -> str:
    """The job driver's log, read from the head's session folder (cheaper than `ray job logs` on 2 cores)."""
    path = Path(temp) / "session_latest" / "logs" / f"job-driver-{job}.log"
    return path.read_text(errors="replace") if path.exists() else ""


@pytest.fixture
def s3_endpoint(monkeypatch):
    """A moto S3 server on a local port (every node reaches it), its bucket made; credentials set here."""
    from moto.server import ThreadedMotoServer

    from hamo_ray.serving.objstore import ObjectStore

    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    for key, value in S3_ENV.items():
        monkeypatch.setenv(key, value)
    try:
        query = f"endpoint_override=127.0.0.1:{port}&scheme=http&region=us-east-1"
        ObjectStore(f"s3://{BUCKET}?{query}&allow_bucket_creation=true").fs.create_dir(BUCKET)
        yield f"127.0.0.1:{port}"
    finally:
        server.stop()


@pytest.mark.slow
@pytest.mark.timeout(2400)
@pytest.mark.parametrize("storage", ["folder", "s3"])
def test_stream_across_nodes_survives_a_lost_rollout_node(tmp_path, request, storage):
    # Secure by default: every node and every client shares one token (RAY_AUTH_TOKEN); the cluster has
    # its own temp dirs, so nothing else on this machine joins it by accident.
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env |= {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16)}
    extra, store, lance_options = [], None, None
    if storage == "s3":  # memory and adapters on the S3 server; the nodes hold the credentials
        endpoint = request.getfixturevalue("s3_endpoint")
        env |= S3_ENV
        lance_options = {"endpoint": f"http://{endpoint}", "allow_http": "true", "region": "us-east-1"}
        store = f"s3://{BUCKET}/mn/adapters?endpoint_override={endpoint}&scheme=http&region=us-east-1"
        extra = [f"memory.uri=s3://{BUCKET}/mn/memory", f"memory.storage_options={json.dumps(lance_options)}",
                 f"serve.adapter_store={store}"]  # fmt: skip
    temp = tempfile.mkdtemp(prefix="hamo-mn-", dir="/tmp")  # short: Ray's socket paths have a length limit
    gcs, dash = _free_port(), _free_port()
    procs: dict[str, subprocess.Popen] = {}
    passed = False
    try:
        # `ray start` output goes to ray-start-<node>.log; the client server's fixed default port (10001)
        # would clash with another head on this machine.
        procs["head"] = _start(
            ["--head", f"--port={gcs}", "--num-cpus=4", f"--temp-dir={temp}", "--include-dashboard=true",
             "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}", f"--ray-client-server-port={_free_port()}",
             *_node_args("head", HEAD)],
            env, tmp_path / "ray-start-head.log",
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
                for name, proc in procs.items():  # a `ray start --block` that exited: its node is gone
                    if proc.poll() is not None:
                        log = (tmp_path / f"ray-start-{name}.log").read_text(errors="replace")
                        raise AssertionError(f"`ray start` of the {name} node exited: {log[-3000:]}")
                time.sleep(3)
            raise AssertionError(f"only {len(alive())} of {count} Ray nodes came up")

        nodes = wait_for(1)
        # One node at a time: raylets started together on one machine time out during start-up.
        for n, (name, (cpus, resources)) in enumerate(WORKERS.items(), start=2):
            # Each node its own temp dir, as on separate machines: a worker node otherwise uses the head's,
            # and its runtime-env agent re-extracts the job's working_dir (rmtree, then unzip) into the
            # folder that is the running driver's cwd (ModuleNotFoundError, FileNotFoundError on resolve()).
            procs[name] = _start(
                [f"--address=127.0.0.1:{gcs}", f"--num-cpus={cpus}", f"--temp-dir={temp}/{name[0]}",
                 *_node_args(name, resources)],
                env, tmp_path / f"ray-start-{name}.log",
            )  # fmt: skip
            nodes = wait_for(n)
        node_of = {  # node name -> node id, by each node's own marker resource
            name: next(n["node_id"] for n in nodes if f"node_{name}" in n.get("resources_total", {}))
            for name in ["head", *WORKERS]
        }
        root = tmp_path / "runs"
        entry = [sys.executable, "jobs/stream.py", "--config", "jobs/configs/tiny.yaml",
                 *OVERRIDES, *extra, f"run.root={root}", "run.id=mn",
                 f"backbone.cache_dir={tmp_path / 'backbones'}"]  # fmt: skip
        runtime_env = {"working_dir": str(ROOT), "excludes": [".venv", "runs", ".gpu", "benchmarks/results"]}

        def submit() -> str:
            out = _ray(env, "job", "submit", "--address", address, "--no-wait",
                       "--runtime-env-json", json.dumps(runtime_env), "--", *entry)  # fmt: skip
            return next(w.strip("'") for w in out.split() if w.strip("'").startswith("raysubmit_"))

        def placement() -> dict[str, set[str]]:
            """Actor class -> the nodes its actors are on (a restarted actor: its latest node)."""
            actors = _json(_ray(env, "list", "actors", "--address", address, "--detail", "--format", "json",
                                "--limit", "10000"))  # fmt: skip
            names = {nid: name for name, nid in node_of.items()}
            where: dict[str, set[str]] = {}
            for a in actors:  # a Serve replica's class name is ServeReplica:<app>:PolicyServer
                for cls in ("EnvWorker", "PolicyServer", "TrainWorker"):
                    if cls in (a.get("class_name") or ""):
                        where.setdefault(cls, set()).add(names.get(a["node_id"], a["node_id"]))
            return where

        def wait_job(job: str, events: dict[str, Callable[[], None]]) -> str:
            """Poll until the job ends; run each event's action once, when the driver first logs its text."""
            pending, deadline = dict(events), time.time() + 2000
            while time.time() < deadline:
                # The CLI says "Job '<id>' succeeded" / "failed" / "was stopped", else "Status ...: RUNNING".
                status = _ray(env, "job", "status", "--address", address, job)
                if any(f"Job '{job}' {word}" in status for word in ("succeeded", "failed", "was stopped")):
                    return status
                for _ in range(10):  # the log file every second, the CLI (a Python start-up each) less
                    log = _driver_log(temp, job) if pending else ""
                    for text in [t for t in pending if t in log]:
                        pending.pop(text)()
                    time.sleep(1)
            raise AssertionError(f"job {job} still running: {_driver_log(temp, job)[-4000:]}")

        seen: dict[str, dict[str, set[str]]] = {}

        def kill_rollout_node() -> None:  # raylet and agents die at once; the node's workers follow
            os.killpg(procs["rollout"].pid, signal.SIGKILL)
            seen["killed"] = {}

        job = submit()
        status = wait_job(
            job,
            {  # the rollout actors' placement while every node is up (they serve the whole stream), then
                # the kill as stage 1's evaluation starts: its first episodes take over 10 s here
                "=== stage 1/2": lambda: seen.update(placement=placement()),
                "adapter 'stage-1' live": kill_rollout_node,
            },
        )
        logs = _ray(env, "job", "logs", "--address", address, job)
        assert "killed" in seen, f"the stream ended before the rollout node could be killed: {logs[-4000:]}"
        before = seen["placement"]
        assert before.get("EnvWorker") == {"rollout", "train"}, before  # SPREAD over the rollout_node nodes
        # One outcome: the node loss costs no resubmission (the rollout actors are restarted elsewhere,
        # rollout.max_actor_restarts, and the evaluation goes on).
        assert f"Job '{job}' succeeded" in status, logs[-4000:]
        after = placement()
        print(logs[-2000:], "\nplacement before the kill:", before, "at the end:", after)
        # Placement on three nodes, each role where its resources put it (training workers: the backbone
        # build's and the stages' kept group; none of these nodes was lost, so nothing of theirs moved).
        assert after.get("PolicyServer") == {"head"}, after
        assert after.get("TrainWorker") == {"train"}, after
        assert after.get("EnvWorker") == {"train"}, after  # the lost node's rollout actors restarted there
        # Episodes in flight on the lost node were played again elsewhere (EnvPool.run logs each replay).
        assert "replaying them on actor" in logs, logs[-4000:]

        # Every task accounted for, no duplicate cards, despite the lost node.
        run = root / "mn"
        state = json.loads((run / "state.json").read_text())
        assert [s["stage"] for s in state["stages"]] == [1, 2]
        tested = {}
        for stage in (1, 2):
            episodes = (run / "episodes" / f"stage-{stage}-scienceworld.jsonl").read_text().splitlines()
            tasks = [json.loads(line)["task"] for line in episodes]
            tested[stage] = sorted((t["task"], t["variation"]) for t in tasks)
            assert len(set(tested[stage])) == len(tasks) == 3 * 2  # test_per_task x task types, once each
        assert tested[1] == tested[2]  # the same test set after every stage, none lost with the node
        import lancedb

        table = "cards"  # the run folder's own memory
        if store is None:
            memory = lancedb.connect(str(run / "memory"))
        else:  # the memory and the adapters went to the S3 server, not to the shared disk
            from hamo_ray.naming import store_prefix
            from hamo_ray.serving.objstore import ObjectStore

            assert not (run / "memory").exists()
            # Each under the run's own name there (hamo_ray.naming): the adapters' prefix, the cards' table.
            assert all(ObjectStore(store_prefix(store, "mn")).exists(f"stage-{stage}") for stage in (1, 2))
            memory = lancedb.connect(f"s3://{BUCKET}/mn/memory", storage_options=lance_options)
            table = "cards-mn"
        ids = memory.open_table(table).to_arrow().column("id").to_pylist()
        assert len(ids) == len(set(ids)) > 0
        passed = True
    finally:
        if not passed:  # keep every node's logs for a post-mortem (the temp dir goes below)
            for name, node_temp in [("head", Path(temp)), *[(n, Path(temp) / n[0]) for n in WORKERS]]:
                if (node_temp / "session_latest" / "logs").is_dir():
                    shutil.copytree(node_temp / "session_latest" / "logs", tmp_path / "ray-logs" / name,
                                    ignore_dangling_symlinks=True, dirs_exist_ok=True)  # fmt: skip
        for proc in procs.values():  # only this cluster's processes (never `ray stop`: other Rays run here)
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        shutil.rmtree(temp, ignore_errors=True)
