"""The shared prompt format, the context rule and the action-only loss mask."""

from __future__ import annotations

import pytest

from hamo_ray.config import PromptConfig
from hamo_ray.prompting import (
    build_messages,
    clean_action,
    encode_chat,
    encode_example,
    parse_reply,
    step_example,
)
from hamo_ray.training.examples import Example, length_bucketed_batches, padding_fraction, trajectory_examples
from hamo_ray.types import Card, TaskSpec, Trajectory


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from hamo_ray.training.tiny_lm import make_random_backbone

    path = make_random_backbone(tmp_path_factory.mktemp("bb") / "model")
    return AutoTokenizer.from_pretrained(path)


def _card() -> Card:
    return Card(
        id="c1",
        trajectory_id="t",
        domain="d",
        task="x",
        variation=1,
        stage=0,
        goal="focus on the cat",
        init_obs="a room",
        outline="1. navigate to outside; 2. focus on cat",
        score=100,
    )


def test_messages_follow_the_context_rule():
    pcfg = PromptConfig(history_turns=2, obs_max_chars=10)
    acts, obs = ["a1", "a2", "a3"], ["o1", "o2", "o3 is a very long observation"]
    msgs = build_messages("goal", "start", [_card()], acts, obs, pcfg)
    assert msgs[0]["role"] == "user" and "Task: goal" in msgs[0]["content"]
    assert "Experience from similar tasks" in msgs[0]["content"] and "focus on cat" in msgs[0]["content"]
    assert [m["content"] for m in msgs[1:]] == ["a2", "o2", "a3", "o3 is a..."]
    assert msgs[-1]["role"] == "user"
    no_cards = build_messages("goal", "start", [], [], [], pcfg)
    assert len(no_cards) == 1 and "Experience" not in no_cards[0]["content"]


def test_clean_action_takes_first_line():
    assert clean_action("  go to  kitchen \nextra") == "go to kitchen"
    assert clean_action("\n\n") == ""


def test_loss_mask_covers_exactly_the_action_tokens(tokenizer):
    pcfg = PromptConfig()
    msgs = build_messages("focus on the cat", "a room", [_card()], ["look around"], ["You see a cat."], pcfg)
    ids, labels = encode_example(tokenizer, msgs, "focus on cat")
    assert len(ids) == len(labels)
    target = [t for t, lab in zip(ids, labels) if lab != -100]
    assert tokenizer.decode(target) == "focus on cat<|im_end|>"
    # The masked part is exactly the generation prompt that inference sends.
    prompt_len = labels.index(next(lab for lab in labels if lab != -100))
    assert ids[:prompt_len] == encode_chat(tokenizer, msgs, add_generation_prompt=True)
    assert all(lab == -100 for lab in labels[:prompt_len])
    assert labels[prompt_len:] == ids[prompt_len:]


def test_one_example_per_action(tokenizer):
    traj = Trajectory(
        task=TaskSpec(domain="d", task="x", variation=0),
        goal="g",
        init_obs="o",
        actions=["a", "b", "c"],
        observations=["1", "2", "3"],
        score=100,
        done=True,
        source="expert",
    )
    exs = trajectory_examples(traj, [], tokenizer, PromptConfig(), max_seq_len=4096)
    assert len(exs) == 3
    decoded = [tokenizer.decode([t for t, lab in zip(e.input_ids, e.labels) if lab != -100]) for e in exs]
    assert decoded == ["a<|im_end|>", "b<|im_end|>", "c<|im_end|>"]
    assert trajectory_examples(traj, [], tokenizer, PromptConfig(), max_seq_len=5) == []


def test_length_buckets_reduce_padding():
    lengths = [10, 200, 11, 190, 12, 210, 13, 180] * 20
    batches = length_bucketed_batches(lengths, 4, seed=0, epoch=0)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    exs = [Example([0] * n, [0] * n, "t") for n in lengths]
    assert padding_fraction([[exs[i] for i in b] for b in batches]) < 0.1


# --- Qwen3's official chat template (tests/assets), thinking switch, reply formats, domain prompts ---


@pytest.fixture(scope="module")
def qwen3_tok(qwen3_folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(qwen3_folder)


def _target(tok, ids, labels) -> str:
    return tok.decode([t for t, lab in zip(ids, labels) if lab != -100])


def test_qwen3_thinking_off_trains_the_bare_action(qwen3_tok):
    msgs = build_messages(
        "focus on the cat", "a room", [], ["look around"], ["You see a cat."], PromptConfig()
    )
    off = {"enable_thinking": False}
    ids, labels = encode_example(qwen3_tok, msgs, "focus on cat", off)
    assert _target(qwen3_tok, ids, labels) == "focus on cat<|im_end|>"
    prompt = encode_chat(qwen3_tok, msgs, True, off)
    assert ids[: len(prompt)] == prompt and all(lab == -100 for lab in labels[: len(prompt)])
    # The generation prompt closes an empty think block, so the model starts with the action.
    assert qwen3_tok.decode(prompt).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    # The history's assistant turn carries no think block either.
    assert "<|im_start|>assistant\nlook around<|im_end|>" in qwen3_tok.decode(prompt)
    # The template's default (thinking on) trains every target to start with a think block, so
    # leaving the variables out is an error, not a silent default.
    ids, labels = encode_example(qwen3_tok, msgs, "focus on cat", {})
    assert _target(qwen3_tok, ids, labels) == "<think>\n\n</think>\n\nfocus on cat<|im_end|>"
    with pytest.raises(ValueError, match="enable_thinking"):
        encode_example(qwen3_tok, msgs, "focus on cat")


def test_model_config_template_kwargs():
    from hamo_ray.config import ConfigError, load_config

    assert load_config().model.template_kwargs() == {"enable_thinking": False}
    cfg = load_config(overrides=["model.enable_thinking=true", "model.chat_template_kwargs={x: 1}"])
    assert cfg.model.template_kwargs() == {"enable_thinking": True, "x": 1}
    with pytest.raises(ConfigError, match="model.enable_thinking"):
        load_config(overrides=["model.chat_template_kwargs={enable_thinking: true}"])


def _traj(thoughts: list[str], domain: str = "alfworld") -> Trajectory:
    return Trajectory(
        task=TaskSpec(domain=domain, task="pick_and_place_simple", variation=0),
        goal="Your task is to: put a mug in cabinet.",
        init_obs="You are in the middle of a room.",
        actions=["go to countertop 1", "take mug 1 from countertop 1"],
        observations=["You see a mug 1.", "You pick up the mug 1."],
        thoughts=thoughts,
        score=100,
        done=True,
        source="expert",
    )


def test_react_targets_and_history(qwen3_tok):
    pcfg = PromptConfig(reply_format="react")
    traj = _traj(["The mug may be on the countertop.", ""])
    exs = trajectory_examples(traj, [], qwen3_tok, pcfg, 4096, {"enable_thinking": False})
    targets = [_target(qwen3_tok, e.input_ids, e.labels) for e in exs]
    assert targets == [
        "Thought: The mug may be on the countertop.\nAction: go to countertop 1<|im_end|>",
        "Action: take mug 1 from countertop 1<|im_end|>",  # an empty thought: the action alone
    ]
    messages, reply = step_example(traj, 1, [], pcfg)
    assert messages[1]["content"] == "Thought: The mug may be on the countertop.\nAction: go to countertop 1"
    assert reply == "Action: take mug 1 from countertop 1"
    assert "'Thought: '" in messages[0]["content"]  # the short format's instruction names the reply format
    # Action format: thoughts are not shown or trained.
    messages, reply = step_example(traj, 1, [], PromptConfig())
    assert messages[1]["content"] == "go to countertop 1" and reply == "take mug 1 from countertop 1"


@pytest.mark.parametrize(
    "reply, fmt, expected",
    [
        (
            "<think>\nThe mug is here.\n</think>\n\ntake mug 1 from countertop 1",
            "action",
            ("", "take mug 1 from countertop 1"),
        ),
        ("<think>\nI was cut off mid-thought", "action", ("", "")),
        ("I reason. </think>\ngo to sinkbasin 1", "action", ("", "go to sinkbasin 1")),
        (
            "Thought: a key is here.\nAction: take key\nObservation: invented",
            "react",
            ("a key is here.", "take key"),
        ),
        (
            "Thought: I search.\n\nAction:\nsearch[blue sneakers]",
            "react",
            ("I search.", "search[blue sneakers]"),
        ),
        ("<think>hmm</think>Thought: ok\nAction: look", "react", ("ok", "look")),
        ("Thought: only a thought", "react", ("only a thought", "")),
        ("  go to  kitchen \nextra", "react", ("", "go to kitchen")),
        ("Action: look around", "action", ("", "look around")),
    ],
)
def test_parse_reply(reply, fmt, expected):
    assert parse_reply(reply, fmt) == expected
    assert "<think>" not in clean_action(reply, fmt)


def test_domain_system_prompts():
    from hamo_ray.envs.prompts import DOMAIN_PROMPTS, system_text

    grammar = {
        "scienceworld": ["focus on OBJ", "move OBJ to OBJ", "wait1"],
        "alfworld": ["take OBJ from RECEP", "move OBJ to RECEP", "heat OBJ with RECEP"],
        "webshop": ["search[KEYWORDS]", "click[BUTTON]"],
        "textworld": ["go north", "unlock THING with KEY"],
    }
    assert set(DOMAIN_PROMPTS) == set(grammar)
    pcfg = PromptConfig(system_prompt=True, in_context_example=True, reply_format="react")
    for domain, needles in grammar.items():
        msgs = build_messages("goal", "start", [], [], [], pcfg, domain=domain)
        assert [m["role"] for m in msgs] == ["system", "user"]
        assert all(n in msgs[0]["content"] for n in needles), domain
        assert "Example (another task):" in msgs[0]["content"] and "\nThought: " in msgs[0]["content"]
        assert msgs[1]["content"].startswith("Task: goal")  # the instruction lives in the system message
        short = system_text(domain, "action", example=False)
        assert "Example" not in short and "Thought:" not in short
    with pytest.raises(ValueError, match="domain"):
        build_messages("g", "o", [], [], [], pcfg)
    with pytest.raises(ValueError, match="known"):
        build_messages("g", "o", [], [], [], pcfg, domain="nethack")


def test_training_example_is_the_rollout_prompt(qwen3_tok):
    """step_example's messages are what the rollout worker sends at that step (same call, same args)."""
    pcfg = PromptConfig(system_prompt=True, reply_format="react")
    traj = _traj(["look first", "take it"])
    for k in range(2):
        messages, _ = step_example(traj, k, [_card()], pcfg)
        sent = build_messages(
            traj.goal, traj.init_obs, [_card()], traj.actions[:k], traj.observations[:k], pcfg,
            domain="alfworld", thoughts=traj.thoughts[:k],
        )  # fmt: skip
        assert messages == sent
        kw = {"enable_thinking": False}
        ids, labels = encode_example(qwen3_tok, messages, "Action: x", kw)
        assert ids[: labels.index(next(lab for lab in labels if lab != -100))] == encode_chat(
            qwen3_tok, sent, True, kw
        )


def test_format_fingerprint_follows_the_rendered_text(monkeypatch):
    from hamo_ray.envs import prompts
    from hamo_ray.prompting import format_fingerprint

    short, full = PromptConfig(), PromptConfig(system_prompt=True)
    assert format_fingerprint(short, ["alfworld"]) == format_fingerprint(short, ["alfworld"])
    assert format_fingerprint(short, ["alfworld"]) != format_fingerprint(full, ["alfworld"])
    before = format_fingerprint(full, ["alfworld"])
    changed = prompts.DomainPrompt(**{**prompts.ALFWORLD.__dict__, "tips": "Other tips."})
    monkeypatch.setitem(prompts.DOMAIN_PROMPTS, "alfworld", changed)
    assert format_fingerprint(full, ["alfworld"]) != before  # text changed, settings did not
