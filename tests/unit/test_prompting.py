"""The shared prompt format, the context rule and the action-only loss mask."""

from __future__ import annotations

import pytest

from hamo_ray.config import PromptConfig
from hamo_ray.prompting import build_messages, clean_action, encode_chat, encode_example
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
