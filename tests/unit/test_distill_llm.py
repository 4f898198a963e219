"""The LLM distiller against a real OpenAI-compatible HTTP endpoint on loopback (no Ray).

The server answers ``POST /v1/chat/completions`` with canned replies chosen by a word in the task
goal: good, empty, runaway, cut by the token limit, flaky (HTTP 500 once, then good) or broken.

Run: pytest tests/unit/test_distill_llm.py -q
"""

from __future__ import annotations

import json
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from hamo_ray.config import MemoryConfig
from hamo_ray.memory import LLMDistiller, get_distiller, outline_from_trajectory
from hamo_ray.memory.distill_llm import InvalidOutline, build_prompt, normalise_outline
from hamo_ray.memory.pipeline import distil_batch
from hamo_ray.types import TaskSpec, Trajectory

GOOD = "1. Navigate to the kitchen.\n2. Pick up the thermometer.\n3. Measure the substance."


class _Handler(BaseHTTPRequestHandler):
    calls: Counter = Counter()

    def log_message(self, *args) -> None:  # keep the test output clean
        pass

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        prompt = body["messages"][-1]["content"]
        kind = next(k for k in ("good", "empty", "runaway", "cut", "flaky", "broken") if f"to {k}" in prompt)
        self.calls[kind] += 1
        if kind == "broken" or (kind == "flaky" and self.calls[kind] == 1):
            self.send_response(500)
            self.end_headers()
            return
        content, finish = {
            "good": (GOOD, "stop"),
            "flaky": (GOOD, "stop"),
            "empty": ("  \n ", "stop"),
            "runaway": ("\n".join(f"{i}. do step {i} again" for i in range(400)), "stop"),
            "cut": ("1. Navigate to", "length"),
        }[kind]
        data = json.dumps(
            {"choices": [{"message": {"role": "assistant", "content": content}, "finish_reason": finish}]}
        ).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture(scope="module")
def endpoint():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()


def _traj(kind: str, variation: int = 0) -> Trajectory:
    actions = ["open door to kitchen", "go to kitchen", "pick up thermometer", "focus on substance"]
    return Trajectory(
        task=TaskSpec(domain="scienceworld", task=kind, variation=variation),
        goal=f"Your task is to {kind} the substance.",
        init_obs="This room is called the hallway.",
        actions=actions,
        observations=["ok"] * len(actions),
        score=100.0,
        source="expert",
    )


def test_normalise_and_validate():
    assert normalise_outline(GOOD, 200) == (
        "1. Navigate to the kitchen.; 2. Pick up the thermometer.; 3. Measure the substance."
    )
    assert normalise_outline("```\n- a\n* b\n```", 200) == "1. a; 2. b"
    assert normalise_outline("1. a; 2. b", 200) == "1. a; 2. b"
    for text, kwargs in [("", {}), ("\n\n", {}), ("1. x", {"truncated": True}), ("y" * 300, {})]:
        with pytest.raises(InvalidOutline):
            normalise_outline(text, 200, **kwargs)
    prompt = build_prompt(_traj("good"))
    assert "Your task is to good" in prompt and "3. pick up thermometer" in prompt


def test_llm_outlines_retries_and_fallback(endpoint):
    _Handler.calls.clear()
    distiller = LLMDistiller(endpoint, concurrency=4, max_retries=2, max_outline_chars=500, backoff_s=0.01)
    kinds = ["good", "empty", "runaway", "cut", "flaky", "broken", "good"]
    trajs = [_traj(k, i) for i, k in enumerate(kinds)]
    outlines, sources = distiller.distill_with_sources(trajs)
    assert sources == ["llm", "fallback", "fallback", "fallback", "llm", "fallback", "llm"]
    assert outlines[0] == outlines[4] == outlines[6] == normalise_outline(GOOD, 500)
    for i in (1, 2, 3, 5):  # the deterministic distiller took over
        assert outlines[i] == outline_from_trajectory(trajs[i]) and outlines[i]
    # Every invalid or failed outline was tried 1 + max_retries times; the flaky one twice.
    assert _Handler.calls == Counter(good=2, empty=3, runaway=3, cut=3, flaky=2, broken=3)
    distiller.close()


def test_llm_distiller_from_config(endpoint):
    with pytest.raises(ValueError, match="llm_base_url"):
        MemoryConfig(distiller="llm")
    mcfg = MemoryConfig(distiller="llm", llm_base_url=endpoint, llm_max_retries=0)
    distiller = get_distiller("llm", mcfg)
    assert isinstance(distiller, LLMDistiller) and distiller.max_retries == 0
    assert distiller.distill([_traj("good")]) == [normalise_outline(GOOD, 1200)]
    assert get_distiller("outline", mcfg).distill([_traj("good")]) == [outline_from_trajectory(_traj("good"))]


def test_bad_rows_are_rejected_with_a_reason():
    """The pipeline's distil step (its public Ray Data UDF, called here without Ray) on raw rows."""
    good = _traj("good")
    data = good.model_dump(mode="json")
    rows = {
        "good": json.dumps(data).encode(),
        "missing": json.dumps({k: v for k, v in data.items() if k != "goal"}).encode(),
        "empty": json.dumps({**data, "actions": [], "observations": []}).encode(),
        "bytes": b'{"goal": "caf\xe9"}',
        # A lone surrogate in a str row: build_cards_dataset encodes it with "surrogateescape".
        "surrogate": '{"goal": "bad \udce9 text"}'.encode("utf-8", errors="surrogateescape"),
        "json": b"{not json",
    }
    batch = {"row": np.arange(len(rows)), "trajectory": np.array(list(rows.values()), dtype=object)}
    out = distil_batch(batch, stage=3, distiller="outline")
    reasons = dict(zip(rows, out["reject_reason"], strict=True))
    ids = dict(zip(rows, out["trajectory_id"], strict=True))
    assert reasons["good"] == "" and ids["good"] == good.id and out["stage"][0] == 3
    assert out["outline"][0] == outline_from_trajectory(good) and out["outline_source"][0] == "outline"
    assert "missing fields ['goal']" in reasons["missing"] and ids["missing"] == good.id
    assert reasons["empty"] == "empty action list" and ids["empty"] == good.id
    assert reasons["bytes"].startswith("not UTF-8")
    assert reasons["surrogate"].startswith("not UTF-8")
    assert reasons["json"].startswith("not JSON")
    assert list(out["row"]) == list(range(len(rows)))
