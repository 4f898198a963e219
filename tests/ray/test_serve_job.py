"""``jobs/serve.py`` as a real subprocess over a small run folder, driven by the official ``openai`` client.

The run folder is built here: a random tiny backbone, ``adapters/stage-1`` committed in
``state.json``, a LanceDB memory of a few cards (random unit vectors of the embedding width: the
retrieval is real, its ranking arbitrary). The job starts its own local Ray with an API key; the
tests check the models listed, chat and streaming, 401/404/413/400 answers, the harness route, the
client-side prompt (harness cards into ``prompting.build_messages``, as rollout workers do), and
that a stage committed while the job runs becomes servable without a restart.

The adapters go through an object store: ``serve.adapter_store`` is an ``s3://`` URI on a real S3
protocol server (moto, on a local port). The job uploads the run's stage folders there and the
replica downloads them into its own cache (``HAMO_ADAPTER_CACHE``), as replicas on other nodes would.

    pytest tests/ray/test_serve_job.py -x -q
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from hamo_ray.config import PromptConfig
from hamo_ray.prompting import build_messages, first_user_message
from hamo_ray.types import Card

ROOT = Path(__file__).resolve().parents[2]
KEY = "test-key-123"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _adapter(base: Path, path: Path, seed: int) -> None:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS, init_lora_weights=False)
    get_peft_model(model, config).save_pretrained(path)


def _stage(stage: int) -> dict:
    return {
        "stage": stage,
        "method": "hamo",
        "num_trajectories": 2,
        "num_cards": 2,
        "budget": 1,
        "anchors": [],
        "replay": [],
        "adapter": f"adapters/stage-{stage}",
        "adapter_name": f"stage-{stage}",
        "train_loss": 0.5,
        "scores": {"scienceworld": 10.0},
        "seconds": {},
    }


def _cards(memory: Path) -> None:
    import numpy as np

    from hamo_ray.memory.store import MemoryStore

    rng = np.random.default_rng(0)
    rows = []
    for i in range(4):
        vector = rng.normal(size=384).astype("float32")
        card = Card(
            id=f"c{i}",
            trajectory_id=f"t{i}",
            domain="scienceworld",
            task="find-living-thing",
            variation=i,
            stage=1 + i % 2,
            goal=f"Your task is to find a living thing number {i}.",
            init_obs="This room is called the kitchen.",
            outline=f"open door to hallway; go to hallway; focus on animal {i}",
            score=100.0,
        )
        rows.append({**card.model_dump(), "vector": (vector / np.linalg.norm(vector)).tolist()})
    MemoryStore(str(memory), "cards").add(rows)


S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}


@pytest.fixture(scope="module")
def adapter_store():
    """An ``s3://`` adapter store URI on a moto S3 server (its bucket created)."""
    from moto.server import ThreadedMotoServer

    from hamo_ray.serving.objstore import ObjectStore

    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    query = f"endpoint_override=127.0.0.1:{port}&scheme=http&region=us-east-1"
    saved = {k: os.environ.get(k) for k in S3_ENV}
    os.environ.update(S3_ENV)
    try:
        ObjectStore(f"s3://hamo-adapters?{query}&allow_bucket_creation=true").fs.create_dir("hamo-adapters")
        yield f"s3://hamo-adapters/serve-job?{query}"
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
        server.stop()


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, adapter_store) -> Path:
    from hamo_ray.backbones.tiny_lm import make_random_backbone

    root = tmp_path_factory.mktemp("serve_job")
    base = make_random_backbone(root / "base")
    run = root / "run"
    _adapter(base, run / "adapters" / "stage-1", seed=1)
    _adapter(base, root / "later" / "stage-2", seed=2)
    _cards(run / "memory")
    config = {
        "model": {"path": str(base), "name": "base", "max_model_len": 512},
        "serve": {
            "port": _free_port(),
            "app_name": "hamo-serve-job-test",
            "max_num_seqs": 8,
            "num_cpus": 1,
            "poll_interval_s": 1.0,
            "max_request_bytes": 100_000,
            "max_tokens_limit": 64,
            "adapter_store": adapter_store,
        },
        "ray": {"num_cpus": 4, "address": "local"},  # its own Ray, not a `ray start` cluster here
    }
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    (run / "state.json").write_text(json.dumps({"stages": [_stage(1)], "timings": {}}))
    return run


@pytest.fixture(scope="module")
def job(run_dir):
    """The running job: ``{"url", "proc", "log"}``; stopped with SIGINT at the end (it must exit 0)."""
    port = yaml.safe_load((run_dir / "config.yaml").read_text())["serve"]["port"]
    log = open(run_dir.parent / "serve.log", "w")  # noqa: SIM115 (closed at teardown)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["HAMO_API_KEY"] = KEY
    env.update(S3_ENV, HAMO_ADAPTER_CACHE=str(run_dir.parent / "replica-cache"))
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "jobs" / "serve.py"), "--run", str(run_dir)],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        cwd=str(ROOT),
    )
    url = f"http://127.0.0.1:{port}/{run_dir.name}"  # the route is named after the run id (hamo_ray.naming)
    deadline = time.monotonic() + 420
    try:
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"jobs/serve.py exited {proc.returncode}: {_tail(run_dir)}")
            if time.monotonic() > deadline:
                raise AssertionError(f"jobs/serve.py not ready: {_tail(run_dir)}")
            if "serving run" in (run_dir.parent / "serve.log").read_text():
                break
            time.sleep(2)
        yield {"url": url, "proc": proc}
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            code = proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
        log.close()
    assert code == 0, _tail(run_dir)


def _tail(run_dir: Path) -> str:
    return (run_dir.parent / "serve.log").read_text()[-3000:]


@pytest.fixture(scope="module")
def client(job):
    return openai.OpenAI(base_url=f"{job['url']}/v1", api_key=KEY, max_retries=0, timeout=60)


def test_models_chat_and_stream(client):
    assert [m.id for m in client.models.list().data] == ["base", "stage-1"]
    messages = [{"role": "user", "content": "open door to hallway"}]
    full = client.chat.completions.create(model="stage-1", messages=messages, temperature=0, max_tokens=8)
    assert full.model == "stage-1" and full.usage.completion_tokens <= 8
    chunks = list(
        client.chat.completions.create(
            model="stage-1", messages=messages, temperature=0, max_tokens=8, stream=True
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full.choices[0].message.content
    text = client.completions.create(model="base", prompt="open door", max_tokens=4, stream=True)
    assert sum(1 for _ in text) >= 1


def test_errors(client, job):
    url = job["url"]
    for key in ("wrong", ""):
        bad = openai.OpenAI(base_url=f"{url}/v1", api_key=key or "x", max_retries=0, timeout=30)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
    assert httpx.get(f"{url}/health").status_code == 200  # probes stay open (serve.auth_probes: false)
    assert httpx.get(f"{url}/v1/models").status_code == 401
    assert httpx.post(f"{url}/harness/retrieve", json={"goal": "x"}).status_code == 401
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="stage-9", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.chat.completions.create(
            model="base", messages=[{"role": "user", "content": "x"}], max_tokens=65
        )
    headers = {"Authorization": f"Bearer {KEY}", "content-type": "application/json"}
    big = json.dumps({"model": "base", "messages": [{"role": "user", "content": "x" * 200_000}]})
    r = httpx.post(f"{url}/v1/chat/completions", content=big, headers=headers)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    r = httpx.post(f"{url}/v1/chat/completions", content=b"{oops", headers=headers)
    assert r.status_code == 400 and "error" in r.json()
    r = httpx.post(
        f"{url}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "../base"}, headers=headers
    )
    assert r.status_code == 400


def test_harness_cards_in_the_training_format(client, job):
    """An external client does what rollout workers do: cards from the harness, then build_messages."""
    goal, obs = "Your task is to find a living thing.", "This room is called the kitchen."
    r = httpx.post(
        f"{job['url']}/harness/retrieve",
        json={"goal": goal, "init_obs": obs, "k": 2},
        headers={"Authorization": f"Bearer {KEY}"},
    )
    assert r.status_code == 200 and len(r.json()["cards"]) == 2
    cards = [Card.model_validate(c) for c in r.json()["cards"]]
    messages = build_messages(goal, obs, cards, ["look around"], ["You see a cat."], PromptConfig())
    assert messages[0]["content"] == first_user_message(goal, obs, cards, PromptConfig())
    assert cards[0].outline in messages[0]["content"]
    reply = client.chat.completions.create(model="stage-1", messages=messages, temperature=0, max_tokens=8)
    assert reply.choices[0].finish_reason in ("stop", "length")


def test_stage_committed_while_serving_becomes_usable(client, run_dir):
    import shutil

    shutil.copytree(run_dir.parent / "later" / "stage-2", run_dir / "adapters" / "stage-2")
    state = {"stages": [_stage(1), _stage(2)], "timings": {}}
    (run_dir / "state.json").write_text(json.dumps(state))
    deadline = time.monotonic() + 90
    while "stage-2" not in {m.id for m in client.models.list().data}:
        assert time.monotonic() < deadline, "stage-2 not published"
        time.sleep(1)
    r = client.chat.completions.create(
        model="stage-2", messages=[{"role": "user", "content": "open door"}], max_tokens=4
    )
    assert r.model == "stage-2"


def test_adapters_went_through_the_object_store(client, run_dir, adapter_store):
    from hamo_ray.naming import store_prefix
    from hamo_ray.serving.objstore import ObjectStore

    assert {"stage-1", "stage-2"} <= {m.id for m in client.models.list().data}
    store = ObjectStore(store_prefix(adapter_store, run_dir.name))  # the run's own prefix in the store
    assert store.exists("stage-1") and store.exists("stage-2")
    assert json.loads(store.read_text("served_adapters.json")) == {"stage-1": "stage-1", "stage-2": "stage-2"}
    cached = {p.name for p in (run_dir.parent / "replica-cache").glob("*/*") if p.is_dir()}
    assert cached == {"stage-1", "stage-2"}  # the replica loaded its downloads, not the run folder
