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
from hamo_ray.memory.distill_llm import (
    MAX_OBS_CHARS,
    MAX_STEP_OBS_CHARS,
    InvalidOutline,
    bind_policy,
    build_prompt,
    normalise_outline,
)
from hamo_ray.memory.pipeline import distil_batch
from hamo_ray.types import TaskSpec, Trajectory

GOOD = "1. Navigate to the kitchen.\n2. Pick up the thermometer.\n3. Measure the substance."


class _Handler(BaseHTTPRequestHandler):
    calls: Counter = Counter()

    def log_message(self, *args) -> None:  # keep the test output clean
        pass

    bodies: list = []

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.bodies.append(body)
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
    assert "Your task is to good" in prompt and "3. > pick up thermometer" in prompt
    # A reasoning model's think block is not part of the outline.
    assert normalise_outline("<think>first the door</think>\n1. a\n2. b", 200) == "1. a; 2. b"


def test_prompt_shows_observations_clipped_and_asks_for_purpose():
    """Strategy-level cards: the distiller sees what each action produced, and is asked for purpose and rules."""
    actions = [f"go to room {i}" for i in range(50)]
    observations = [f"You see the room {i}. " + "x" * 400 for i in range(50)]
    traj = Trajectory(
        task=TaskSpec(domain="scienceworld", task="find", variation=0), goal="Find an animal.",
        init_obs="Hallway. " + "y" * 2000, actions=actions, observations=observations, score=100.0,
        source="expert",
    )  # fmt: skip
    prompt = build_prompt(traj)
    assert "1. > go to room 0\n   You see the room 0." in prompt  # the observation under its action
    assert "x" * (MAX_STEP_OBS_CHARS - 30) in prompt and "x" * (MAX_STEP_OBS_CHARS + 1) not in prompt
    assert "y" * (MAX_OBS_CHARS + 1) not in prompt
    assert "go to room 19\n" in prompt and "go to room 20\n" not in prompt and "go to room 49" in prompt
    assert "10 steps left out" in prompt
    assert "purpose" in prompt and "how it was chosen" in prompt  # strategy, not the variation's names


def test_policy_endpoint_is_bound_at_start():
    mcfg = MemoryConfig(distiller="llm", llm_base_url="policy")
    with pytest.raises(ValueError, match="policy"):
        LLMDistiller.from_config(mcfg)
    bound = bind_policy(mcfg, "http://127.0.0.1:8000/", "smollm2", None, {"enable_thinking": False})
    assert bound.llm_base_url == "http://127.0.0.1:8000/v1" and bound.llm_model == "smollm2"
    assert bound.llm_api_key == "EMPTY" and bound.llm_chat_template_kwargs == {"enable_thinking": False}
    other = MemoryConfig(distiller="llm", llm_base_url="http://teacher:9000/v1")
    assert bind_policy(other, "http://127.0.0.1:8000", "smollm2", "k", {}) is other
    assert bind_policy(MemoryConfig(), "http://x", "m", None, {}).distiller == "outline"


def test_llm_outlines_retries_and_fallback(endpoint):
    _Handler.calls.clear()
    distiller = LLMDistiller(
        MemoryConfig(llm_base_url=endpoint, llm_concurrency=4, llm_max_retries=2, llm_max_outline_chars=500),
        backoff_s=0.01,
    )
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
    assert "chat_template_kwargs" not in _Handler.bodies[-1]
    mcfg = mcfg.model_copy(update={"llm_chat_template_kwargs": {"enable_thinking": False}})
    get_distiller("llm", mcfg).distill([_traj("good")])
    assert _Handler.bodies[-1]["chat_template_kwargs"] == {"enable_thinking": False}
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


def test_stage_distil_binds_the_policy_endpoint_and_counts_fallbacks(monkeypatch):
    """stage.distil: 'policy' becomes the run's endpoint (base model); the report's fallbacks are counted."""
    from types import SimpleNamespace

    from hamo_ray.config import load_config
    from hamo_ray.memory.pipeline import WriteReport
    from hamo_ray.run import stage

    seen = {}

    def fake_add(store, trajs, stage, mcfg):
        seen["mcfg"] = mcfg
        return WriteReport(added=3, seen=3, sources={"llm": 2, "fallback": 1})

    monkeypatch.setattr(stage, "add_stage_cards", fake_add)
    cfg = load_config("jobs/configs/tiny.yaml", ["memory.distiller=llm", "memory.llm_base_url=policy"])
    folder = SimpleNamespace(store=lambda cfg: "store")
    endpoint = SimpleNamespace(base_url="http://127.0.0.1:8123", api_key="k")
    store, figures = stage.distil(cfg, folder, 1, [], endpoint)
    assert store == "store" and figures == {
        "cards_added": 3, "rejected": 0, "llm_outlines": 2, "fallback_outlines": 1
    }  # fmt: skip
    assert (
        seen["mcfg"].llm_base_url == "http://127.0.0.1:8123/v1" and seen["mcfg"].llm_model == cfg.model.name
    )
    assert seen["mcfg"].llm_api_key == "k"
    with pytest.raises(ValueError, match="policy"):
        stage.distil(cfg, folder, 1, [], None)
    base = load_config("jobs/configs/tiny.yaml", ["method.name=base"])
    assert stage.distil(base, folder, 1, [], endpoint) == (None, {})
