"""``GET /metrics`` of a policy endpoint with two replicas answers for both, whichever replica it reaches.

Two vLLM (CPU) engines on a random tiny backbone behind Serve's proxy; requests go through the real
``openai`` client, metrics are scraped over HTTP and parsed with ``prometheus_client``'s parser.

    pytest tests/ray/test_serving_replicas.py -x -q
"""

from __future__ import annotations

import socket
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from hamo_ray.config import ModelConfig, ServeConfig
from hamo_ray.serving import shutdown_policy_server, start_policy_server
from hamo_ray.serving.metrics import PUBLISH_EVERY_S, merge_replicas


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SERVE = ServeConfig(
    num_replicas=2, max_num_seqs=8, kv_cache_gib=1, num_cpus=0.5, port=_free_port(), app_name="hamo-replicas"
)
MODEL = ModelConfig(name="base", max_model_len=256, dtype="float32")
REQUESTS = 12


def _samples(text: str, name: str) -> list:
    return [s for f in text_string_to_metric_families(text) for s in f.samples if s.name == name]


@pytest.fixture(scope="module")
def server(ray_session, tmp_path_factory):
    from hamo_ray.backbones.tiny_lm import make_random_backbone

    root = tmp_path_factory.mktemp("replicas")
    url = start_policy_server(
        make_random_backbone(root / "base"), MODEL, SERVE, root / "adapters", timeout_s=600
    )
    yield url
    shutdown_policy_server(SERVE)


def test_metrics_cover_every_replica(server):
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="EMPTY", max_retries=0, timeout=120)
    for i in range(REQUESTS):
        client.chat.completions.create(
            model="base", messages=[{"role": "user", "content": f"go to room {i}"}], max_tokens=4, seed=i
        )
    # Every replica publishes every PUBLISH_EVERY_S: within a few periods any scrape sees both, and the
    # finished requests summed over the replicas equal the requests sent, whichever replica answered.
    deadline, seen, total = time.monotonic() + 20 * PUBLISH_EVERY_S, set(), 0.0
    while time.monotonic() < deadline:
        text = httpx.get(f"{server}/metrics", timeout=30).text
        seen = {s.labels["replica"] for s in _samples(text, "vllm:num_requests_running")}
        total = sum(s.value for s in _samples(text, "vllm:request_success_total"))
        if len(seen) == 2 and total == REQUESTS:
            break
        time.sleep(1.0)
    assert len(seen) == 2, f"replicas seen in /metrics: {seen}"
    assert total == REQUESTS
    assert all("replica" in s.labels for f in text_string_to_metric_families(text) for s in f.samples)


def test_merge_keeps_one_family_per_name():
    """Logic only: families repeat per replica in, once out; every sample gains its replica's label."""
    a = '# HELP g A gauge.\n# TYPE g gauge\ng{model_name="base"} 3.0\n'
    merged = merge_replicas({"r1": a, "r2": a.replace("3.0", "5.0")})
    assert merged.count("# TYPE g gauge") == 1
    values = {s.labels["replica"]: s.value for s in _samples(merged, "g")}
    assert values == {"r1": 3.0, "r2": 5.0}
