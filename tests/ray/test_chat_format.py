"""Training and serving agree on Qwen3's official chat template, token for token, and a trained model acts.

A tiny Qwen3 folder with the official template (``qwen3_folder``, tests/conftest.py) is served by
the project's endpoint (Ray Serve + vLLM CPU) with ``model.enable_thinking: false``:

- for every step of expert trajectories, in both reply formats and with the domain's system
  prompt, the prompt ids of the training example equal the ids the server renders for the same
  messages (``return_token_ids``), whether the client sends ``chat_template_kwargs`` or relies on
  the server's defaults from the config; sending ``enable_thinking: true`` changes them;
- the model trained a few epochs (``train_model``, every parameter: LoRA on random weights learns
  too slowly for a test) on those examples and served, asked greedily through the rollout client,
  answers each step with a valid ALFWorld command - the expert's - and never with ``<think>``.

    flock /tmp/hamo-ray-tests.lock timeout 1500 bash scripts/test.sh tests/ray/test_chat_format.py -x -q
"""

from __future__ import annotations

import asyncio
import socket

import openai
import pytest

from hamo_ray.config import ModelConfig, PromptConfig, ServeConfig, TrainConfig
from hamo_ray.prompting import encode_example, parse_reply, step_example
from hamo_ray.types import TaskSpec, Trajectory


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


MODEL = ModelConfig(name="qwen3-tiny", max_model_len=2048, dtype="float32", enable_thinking=False)
SERVE = ServeConfig(max_num_seqs=8, num_cpus=1, port=_free_port(), app_name="hamo-chat-format-test")
KWARGS = MODEL.template_kwargs()
ACTION = PromptConfig(system_prompt=True)
SHORT = PromptConfig()  # the trained model's format: short prompts train fast on 2 CPU cores
REACT = PromptConfig(system_prompt=True, in_context_example=True, reply_format="react")


def _traj(variation: int, goal: str, steps: list[tuple[str, str, str]]) -> Trajectory:
    return Trajectory(
        task=TaskSpec(domain="alfworld", task="pick_and_place_simple", variation=variation),
        goal=goal,
        init_obs="You are in the middle of a room. Looking quickly around you, you see a cabinet 1, a "
        "countertop 1, a drawer 1, and a sinkbasin 1.",
        thoughts=[t for t, _, _ in steps],
        actions=[a for _, a, _ in steps],
        observations=[o for _, _, o in steps],
        score=100,
        done=True,
        source="expert",
    )


TRAJS = [
    _traj(
        0,
        "Your task is to: put a mug in cabinet.",
        [
            (
                "The mug is probably on the countertop.",
                "go to countertop 1",
                "On the countertop 1, you see a mug 1.",
            ),
            ("", "take mug 1 from countertop 1", "You pick up the mug 1 from the countertop 1."),
            ("Now the cabinet.", "go to cabinet 1", "The cabinet 1 is open. In it, you see nothing."),
            ("Put it in.", "move mug 1 to cabinet 1", "You move the mug 1 to the cabinet 1."),
        ],
    ),
    _traj(
        1,
        "Your task is to: put a spoon in drawer.",
        [
            ("Spoons lie near the sink.", "go to sinkbasin 1", "On the sinkbasin 1, you see a spoon 1."),
            ("Take it.", "take spoon 1 from sinkbasin 1", "You pick up the spoon 1 from the sinkbasin 1."),
            ("", "go to drawer 1", "The drawer 1 is open. In it, you see nothing."),
            ("Done soon.", "move spoon 1 to drawer 1", "You move the spoon 1 to the drawer 1."),
        ],
    ),
]


@pytest.fixture(scope="module")
def tokenizer(qwen3_folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(qwen3_folder)


@pytest.fixture(scope="module")
def trained(ray_session, qwen3_folder, tokenizer, tmp_path_factory):
    """The tiny Qwen3 trained on the action-format examples of ``TRAJS``, as a model folder."""
    from hamo_ray.training.examples import build_examples
    from hamo_ray.training.trainer import train_model

    out = tmp_path_factory.mktemp("chat_trained") / "model"
    examples = build_examples(TRAJS, {}, tokenizer, SHORT, 2048, KWARGS)
    assert len(examples) == 8
    result = train_model(
        str(qwen3_folder), examples, out,
        TrainConfig(max_seq_len=2048, engine="actors", epochs=40, lr=3e-3, batch_size=1),  # engine: not the subject
        pad_id=tokenizer.pad_token_id, lora=False, name="chat-format",
    )  # fmt: skip
    tokenizer.save_pretrained(out)
    assert result.losses[-1] < 0.2 * result.losses[0], result.losses
    return out


@pytest.fixture(scope="module")
def server(ray_session, trained):
    from hamo_ray.serving import shutdown_policy_server, start_policy_server

    url = start_policy_server(trained, MODEL, SERVE, trained.parent / "adapters", timeout_s=300)
    yield url
    shutdown_policy_server(SERVE)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="EMPTY", max_retries=0, timeout=120)


def _served_prompt(client, messages, **extra) -> list[int]:
    r = client.chat.completions.create(
        model=MODEL.name,
        messages=messages,
        max_tokens=1,
        temperature=0,
        extra_body={"return_token_ids": True, **extra},
    )
    return list(r.model_extra["prompt_token_ids"])


@pytest.mark.parametrize("pcfg", [ACTION, REACT], ids=["action", "react"])
def test_training_prompt_equals_served_prompt(client, tokenizer, pcfg):
    for traj in TRAJS:
        for k in range(traj.num_turns):
            messages, reply = step_example(traj, k, [], pcfg)
            ids, labels = encode_example(tokenizer, messages, reply, KWARGS)
            n = next(i for i, lab in enumerate(labels) if lab != -100)
            assert _served_prompt(client, messages, chat_template_kwargs=KWARGS) == ids[:n], (traj.id, k)
            assert _served_prompt(client, messages) == ids[:n]  # the server's default is the config's
            target = tokenizer.decode(ids[n:])
            assert target == reply + "<|im_end|>" and "<think>" not in target
    # The client's template variables are forwarded: thinking on drops the closed think block.
    messages, _ = step_example(TRAJS[0], 1, [], pcfg)
    thinking = _served_prompt(client, messages, chat_template_kwargs={"enable_thinking": True})
    assert tokenizer.decode(_served_prompt(client, messages)).endswith("<think>\n\n</think>\n\n")
    assert not tokenizer.decode(thinking).endswith("</think>\n\n")


def test_trained_model_acts_through_the_rollout_client(server):
    from hamo_ray.prompting import build_messages
    from hamo_ray.rollout.client import PolicyClient, PolicySpec

    spec = PolicySpec(server, MODEL.name, temperature=0.0, max_tokens=24, chat_template_kwargs=KWARGS)

    async def run() -> list[tuple[str, str, str]]:
        policy = PolicyClient(spec)
        out = []
        try:
            for traj in TRAJS:
                for k in range(traj.num_turns):
                    messages = build_messages(
                        traj.goal, traj.init_obs, [], traj.actions[:k], traj.observations[:k], SHORT,
                        domain=traj.task.domain,
                    )  # fmt: skip
                    reply, _ = await policy.act(messages, seed=0)
                    out.append((reply, parse_reply(reply, "action")[1], traj.actions[k]))
        finally:
            await policy.aclose()
        return out

    results = asyncio.run(run())
    valid = {a for t in TRAJS for a in t.actions}  # ALFWorld commands (take/move/go to ...)
    for reply, action, _ in results:
        assert "<think>" not in reply and "</think>" not in reply, reply
        assert action in valid, results
    correct = sum(action == expected for _, action, expected in results)
    assert correct >= len(results) - 1, results  # the expert's action at (almost) every step
