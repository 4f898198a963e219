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

    from hamo_ray.backbones.tiny_lm import make_random_backbone

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


def _abc() -> Trajectory:
    return Trajectory(
        task=TaskSpec(domain="d", task="x", variation=0),
        goal="g",
        init_obs="o",
        actions=["a", "b", "c"],
        observations=["1", "2", "3"],
        score=100,
        done=True,
        source="expert",
    )


def _targets(tok, example) -> list[str]:
    """The labelled spans of an example, decoded one by one."""
    spans, cur = [], []
    for t, lab in zip(example.input_ids, example.labels):
        if lab != -100:
            cur.append(t)
        elif cur:
            spans.append(tok.decode(cur))
            cur = []
    return spans + ([tok.decode(cur)] if cur else [])


def test_one_sequence_per_trajectory(tokenizer):
    traj = _abc()
    (ex,) = trajectory_examples(traj, [], tokenizer, PromptConfig(), max_seq_len=4096)
    assert _targets(tokenizer, ex) == ["a<|im_end|>", "b<|im_end|>", "c<|im_end|>"]
    # Every step's prompt, as the rollout sends it, is a prefix of the sequence, just before its reply.
    for k, span_start in enumerate(
        i for i in range(len(ex.labels)) if ex.labels[i] != -100 and ex.labels[i - 1] == -100
    ):
        messages, _ = step_example(traj, k, [], PromptConfig())
        assert ex.input_ids[:span_start] == encode_chat(tokenizer, messages, True)
    steps = trajectory_examples(traj, [], tokenizer, PromptConfig(), max_seq_len=4096, per_step=True)
    assert [_targets(tokenizer, e) for e in steps] == [["a<|im_end|>"], ["b<|im_end|>"], ["c<|im_end|>"]]
    assert sum(len(e.input_ids) for e in steps) > len(ex.input_ids)
    assert trajectory_examples(traj, [], tokenizer, PromptConfig(), max_seq_len=5) == []


def test_a_sliding_window_gives_one_sequence_per_prefix(tokenizer):
    exs = trajectory_examples(_abc(), [], tokenizer, PromptConfig(history_turns=1), max_seq_len=4096)
    # Before b the window still holds the whole history (one turn); before c it slides.
    assert [_targets(tokenizer, e) for e in exs] == [["a<|im_end|>", "b<|im_end|>"], ["c<|im_end|>"]]
    exs = trajectory_examples(_abc(), [], tokenizer, PromptConfig(history_turns=0), max_seq_len=4096)
    assert len(exs) == 3


def _long_traj(n: int = 12) -> Trajectory:
    return Trajectory(
        task=TaskSpec(domain="scienceworld", task="x", variation=0),
        goal="Your task is to find a living thing and focus on it.",
        init_obs="This room is called the kitchen. " * 5,
        actions=[f"open door to room {i}" for i in range(n)],
        observations=[
            f"The door to room {i} is now open. You see a table, a chair and a lamp." for i in range(n)
        ],
        score=100,
        done=True,
        source="expert",
    )


def test_trimmed_history_fits_the_budget_and_trains_what_inference_sent(tokenizer):
    """Over the budget, the oldest half of the kept turns goes; each segment starts at a trim."""
    from hamo_ray.prompting import ChatRenderer, fit_messages, history_starts

    traj, pcfg = _long_traj(), PromptConfig()
    renderer = ChatRenderer(tokenizer, None, budget=None)
    full = len(renderer.encode(step_example(traj, len(traj.actions) - 1, [], pcfg)[0]))
    budget = full // 2
    renderer = ChatRenderer(tokenizer, None, budget=budget)
    starts = history_starts(traj, [], pcfg, renderer.fits)
    assert starts == sorted(starts) and starts[0] == 0 and starts[-1] > 0  # trimmed, only forward
    # The rollout's turn-by-turn rule gives the same starts, and every prompt fits the budget.
    start = 0
    for k in range(len(traj.actions)):
        start, messages = fit_messages(
            traj.goal, traj.init_obs, [], traj.actions[:k], traj.observations[:k], pcfg,
            domain="scienceworld", start=start, fits=renderer.fits,
        )  # fmt: skip
        assert start == starts[k] and len(renderer.encode(messages)) <= budget
    exs = trajectory_examples(traj, [], tokenizer, pcfg, 4096, budget=budget)
    assert len(exs) == len(set(starts))  # one sequence per kept-history segment
    assert sum(len(_targets(tokenizer, e)) for e in exs) == len(traj.actions)  # every action once
    k = 0
    for ex in exs:
        spans = [i for i in range(1, len(ex.labels)) if ex.labels[i] != -100 and ex.labels[i - 1] == -100]
        for i in spans:
            messages, _ = step_example(traj, k, [], pcfg, start=starts[k])
            assert ex.input_ids[:i] == renderer.encode(messages)  # exactly the prompt the endpoint saw
            k += 1
    # Sliding the window every turn (history_turns) would make every prompt a new prefix.
    window = trajectory_examples(traj, [], tokenizer, PromptConfig(history_turns=2), 4096)
    assert len(window) == len(traj.actions) - 2


def test_cards_are_dropped_when_even_the_first_prompt_does_not_fit(tokenizer):
    """The context rule's second half: lowest-ranked cards go first, once per episode; the last turn stays."""
    from hamo_ray.prompting import ChatRenderer, fit_cards, fit_messages

    traj, pcfg = _long_traj(), PromptConfig()
    long_card = _card().model_copy(update={"id": "c2", "outline": "1. walk around the whole house " * 40})
    cards = [_card(), long_card]

    def length(cs):
        return len(
            ChatRenderer(tokenizer, None).encode(build_messages(traj.goal, traj.init_obs, cs, [], [], pcfg))
        )

    renderer = ChatRenderer(tokenizer, None, budget=length([_card()]) + 5)  # one card fits, two do not
    assert fit_cards(traj.goal, traj.init_obs, cards, pcfg, fits=renderer.fits) == [_card()]
    assert fit_cards(traj.goal, traj.init_obs, cards, pcfg, fits=None) == cards  # no budget: all kept
    tight = ChatRenderer(tokenizer, None, budget=length([]) - 1)  # not even the bare prompt fits
    assert fit_cards(traj.goal, traj.init_obs, cards, pcfg, fits=tight.fits) == []
    # History first: over the budget, the last turn is kept (the observation the action answers).
    start, messages = fit_messages(
        traj.goal, traj.init_obs, [], traj.actions[:5], traj.observations[:5], pcfg, start=0, fits=tight.fits
    )
    assert start == 4 and messages[-1]["content"] == traj.observations[4]
    # Training sees the cards the rollout kept: the same rule inside the example builder.
    (ex,) = trajectory_examples(traj, cards, tokenizer, pcfg, 8192, budget=10**6)
    tight_exs = trajectory_examples(traj, cards, tokenizer, pcfg, 8192, budget=length([_card()]) + 40)
    assert "walk around the whole house" in tokenizer.decode(ex.input_ids)
    assert tight_exs and all(
        "walk around the whole house" not in tokenizer.decode(e.input_ids) for e in tight_exs
    )
    assert all("focus on cat" in tokenizer.decode(e.input_ids) for e in tight_exs)


def _summed_logprob_and_grads(model, examples):
    import torch

    from hamo_ray.training.packing import collate

    model.zero_grad()
    batch = collate(examples, packed=False)
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    picked = logits.reshape(-1, logits.shape[-1]).index_select(0, batch.hidden_index)
    total = -torch.nn.functional.cross_entropy(picked.float(), batch.targets, reduction="sum")
    total.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return float(total.detach()), grads


def test_one_sequence_gives_the_per_step_loss_and_gradients(tokenizer, tmp_path_factory):
    """The paper's sum over actions from one forward pass equals the per-step examples' sum."""
    import torch
    from transformers import AutoModelForCausalLM

    from hamo_ray.backbones.tiny_lm import make_random_backbone

    torch.manual_seed(0)
    path = make_random_backbone(tmp_path_factory.mktemp("grad") / "model")
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").float()
    traj = _long_traj(5)
    seq = trajectory_examples(traj, [_card()], tokenizer, PromptConfig(), 4096)
    steps = trajectory_examples(traj, [_card()], tokenizer, PromptConfig(), 4096, per_step=True)
    assert len(seq) == 1 and len(steps) == 5
    a, ga = _summed_logprob_and_grads(model, seq)
    b, gb = _summed_logprob_and_grads(model, steps)
    assert a == pytest.approx(b, rel=1e-5)
    assert ga.keys() == gb.keys() and ga
    for name in ga:
        torch.testing.assert_close(ga[name], gb[name], rtol=1e-4, atol=1e-6, msg=name)


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
    from hamo_ray.envs.prompts import DOMAIN_PROMPTS
    from hamo_ray.prompting import system_text

    grammar = {
        "scienceworld": ["focus on OBJ", "move OBJ to OBJ", "wait1"],
        "alfworld": ["take OBJ from RECEP", "move OBJ to RECEP", "heat OBJ with RECEP"],
        "webshop": ["search[KEYWORDS]", "click[BUTTON]"],
        "textworld": ["go north", "unlock THING with KEY"],
        "textcraft": ["get N ITEM", "craft N ITEM using N ITEM, N ITEM"],
        "babyai": ["go to OBJ N", "check available actions"],
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


def test_action_regex_admits_exactly_the_listed_commands():
    import re

    from hamo_ray.prompting import action_regex, parse_reply

    actions = [
        "go to cabinet 1",
        "take a.b (1) from shelf|2",
        "search[<keywords>]",
        "click[< Prev]",
        "go to cabinet 1",
    ]
    pattern = action_regex(actions)
    for action in [
        "go to cabinet 1",
        "take a.b (1) from shelf|2",
        "search[red shoes, size 9]",
        "click[< Prev]",
    ]:
        assert re.fullmatch(pattern, action), action
        assert parse_reply(action) == ("", action)
    for other in [
        "go to cabinet 2",
        "take axb (1) from shelf|2",
        "search[]",
        "search[a]b]",
        "search[ a]",
        "search[a\x1cb]",
        "search[" + "a" * 61 + "]",
        "look",
        "click[Next >]",
    ]:
        assert not re.fullmatch(pattern, other), other
    react = action_regex(actions, "react")
    reply = "Thought: the shoes are red\nAction: search[red shoes]"
    assert re.fullmatch(react, reply) and parse_reply(reply, "react") == (
        "the shoes are red",
        "search[red shoes]",
    )
    assert not re.fullmatch(react, "Action: search[red shoes]")
    assert action_regex([]) is None and action_regex(["  "]) is None
    with pytest.raises(ValueError, match="reply_format"):
        action_regex(actions, "json")


def test_action_regex_compiles_for_vllm_structured_outputs(capfd):
    """xgrammar (vLLM's structured-output backend) reads every escape of the pattern as meant."""
    xgrammar = pytest.importorskip("xgrammar")
    from hamo_ray.prompting import action_regex

    pattern = action_regex(["put a-b #1 in/on c.2", "click[Buy Now]", "search[<keywords>]"], "react")
    grammar = str(xgrammar.Grammar.from_regex(pattern))
    assert '"B" "u" "y"' in grammar and '"#"' in grammar
    assert "not recognized" not in capfd.readouterr().err  # re.escape("#") would be
