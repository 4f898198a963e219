"""``model.chat_template: qwen3-keep-think``: Qwen3's official template (tests/assets) renders earlier replies
without the think block their prompt opened, so a conversation is not a prefix of the next turn's; the
variant (hamo_ray/templates/qwen3_keep_think.jinja) keeps it, token for token, and renders everything else
as the official one does. Training (examples, the trainer's tokenizer), the rollout actors' renderer, the
dry run and the server's frontend arguments all render with it.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
from pathlib import Path

import pytest

from hamo_ray.chat import CHAT_TEMPLATES, TEMPLATES_DIR, chat_template_text, encode_chat, set_chat_template
from hamo_ray.config import ConfigError, ModelConfig, PromptConfig, load_config
from hamo_ray.prompting import step_example
from hamo_ray.training import examples as examples_module
from hamo_ray.training.examples import trajectory_examples
from hamo_ray.types import Card, TaskSpec, Trajectory

ROOT = Path(__file__).resolve().parents[2]
OFFICIAL = ROOT / "tests" / "assets" / "qwen3_chat_template.jinja"
VARIANT = TEMPLATES_DIR / CHAT_TEMPLATES["qwen3-keep-think"]
OFF = {"enable_thinking": False}
# The paper presets' prompt: the domain's agent prompt with its worked example, ReAct replies.
PAPER = PromptConfig(system_prompt=True, in_context_example=True, reply_format="react")


@pytest.fixture(scope="module")
def official(qwen3_folder):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(qwen3_folder)
    assert tok.chat_template == OFFICIAL.read_text()
    return tok


@pytest.fixture(scope="module")
def variant(qwen3_folder):
    from transformers import AutoTokenizer

    return set_chat_template(AutoTokenizer.from_pretrained(qwen3_folder), VARIANT.read_text())


def _traj(n: int = 4) -> Trajectory:
    return Trajectory(
        task=TaskSpec(domain="alfworld", task="pick_and_place_simple", variation=0),
        goal="Your task is to: put a mug in cabinet.",
        init_obs="You are in the middle of a room. You see a cabinet 1, a countertop 1 and a sinkbasin 1.",
        actions=[f"go to countertop {i + 1}" for i in range(n)],
        observations=[f"On the countertop {i + 1}, you see a mug {i + 1}." for i in range(n)],
        thoughts=[f"The mug may be on countertop {i + 1}." if i % 2 == 0 else "" for i in range(n)],
        score=100,
        done=True,
        source="expert",
    )


def _card() -> Card:
    return Card(id="c1", trajectory_id="t", domain="alfworld", task="pick_and_place_simple", variation=1,
                stage=0, goal="put a cup in cabinet", init_obs="a room", outline="1. take cup; 2. put it",
                score=100)  # fmt: skip


def _turns(traj: Trajectory, pcfg: PromptConfig = PAPER) -> list[tuple[list[dict], str]]:
    """(the messages before step k, its reply) for every step, the whole history kept."""
    return [step_example(traj, k, [_card()], pcfg, start=0) for k in range(len(traj.actions))]


def _extends(tok, kwargs) -> list[bool]:
    """For each turn but the last: whether the conversation up to its reply (prompt + reply + ``<|im_end|>\\n``)
    is a token prefix of the next turn's generation prompt."""
    turns = _turns(_traj())
    out = []
    for (messages, reply), (following, _) in zip(turns, turns[1:]):
        done = encode_chat(tok, [*messages, {"role": "assistant", "content": reply}], False, kwargs)
        assert tok.decode(done).endswith(reply + "<|im_end|>\n")
        nxt = encode_chat(tok, following, True, kwargs)
        out.append(nxt[: len(done)] == done)
    return out


# --- (a), (b): the prefix property -----------------------------------------------------------------


def test_the_official_template_is_not_a_prefix_of_the_next_turn(official):
    assert _extends(official, OFF) == [False, False, False]
    messages, reply = _turns(_traj())[1]
    text = official.decode(encode_chat(official, messages, True, OFF))
    # the model saw its reply after an empty think block; the next turn's history shows it without one
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert "<|im_start|>assistant\nThought: The mug may be on countertop 1." in text


def test_the_variant_extends_every_turn_with_thinking_off(variant):
    assert _extends(variant, OFF) == [True, True, True]
    turns = _turns(_traj())
    prompts = [encode_chat(variant, m, True, OFF) for m, _ in turns]
    for a, b in zip(prompts, prompts[1:]):  # each generation prompt is a prefix of the next one
        assert b[: len(a)] == a
    text = variant.decode(prompts[-1])
    assert text.count("<|im_start|>assistant\n<think>\n\n</think>\n\n") == len(turns)
    assert "<|im_start|>assistant\n<think>\n\n</think>\n\nThought: The mug may be on countertop 1." in text


# --- (c): the rest renders as the official template does ------------------------------------------


def test_the_variant_renders_the_first_prompt_and_the_last_turn_as_the_official(official, variant):
    messages, reply = _turns(_traj())[0]
    with_reply = [*messages, {"role": "assistant", "content": reply}]
    for kwargs in (OFF, {"enable_thinking": True}, {}):
        assert encode_chat(variant, messages, True, kwargs) == encode_chat(official, messages, True, kwargs)
        # one assistant reply: the last turn, rendered alike (with its think block)
        assert encode_chat(variant, with_reply, False, kwargs) == encode_chat(
            official, with_reply, False, kwargs
        )


@pytest.mark.parametrize("kwargs", [{"enable_thinking": True}, {}], ids=["thinking-on", "thinking-absent"])
def test_with_thinking_on_the_variant_is_the_official_template(official, variant, kwargs):
    for messages, reply in _turns(_traj()):
        for msgs, gen in ((messages, True), ([*messages, {"role": "assistant", "content": reply}], False)):
            assert encode_chat(variant, msgs, gen, kwargs) == encode_chat(official, msgs, gen, kwargs)


def test_tools_system_and_reasoning_render_sanely(official, variant):
    tools = [{"type": "function", "function": {"name": "look", "parameters": {"type": "object"}}}]
    chat = [
        {"role": "system", "content": "You are an agent."},
        {"role": "user", "content": "Find the mug."},
        {"role": "assistant", "content": "look around"},
        {"role": "user", "content": "You see a mug."},
    ]

    def render(tok, msgs, **kw):
        return tok.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=True, **kw)

    first = chat[:2]
    for kw in (OFF, {}):  # the tools' system block and the generation prompt: the official ones
        assert render(variant, first, **kw) == render(official, first, **kw)
    text = render(variant, chat, **OFF)
    assert text.startswith(render(official, first, **OFF).rsplit("<|im_start|>user", 1)[0])
    assert "<|im_start|>assistant\n<think>\n\n</think>\n\nlook around<|im_end|>\n" in text
    # a reply with its own reasoning keeps it, as it was generated
    reasoned = [
        *chat[:2],
        {"role": "assistant", "content": "look around", "reasoning_content": "\nI look.\n"},
    ]
    text = variant.apply_chat_template(
        [*reasoned, chat[3]], tokenize=False, add_generation_prompt=True, **OFF
    )
    assert "<|im_start|>assistant\n<think>\nI look.\n</think>\n\nlook around<|im_end|>" in text


# --- (d): training examples: one sequence per trajectory ---------------------------------------------


def _spans(example) -> list[list[int]]:
    spans, cur = [], []
    for t, lab in zip(example.input_ids, example.labels):
        if lab != -100:
            assert lab == t
            cur.append(t)
        elif cur:
            spans.append(cur)
            cur = []
    return spans + ([cur] if cur else [])


@pytest.mark.parametrize("history_turns", [None, 2])
def test_the_variant_trains_one_sequence_per_trajectory(variant, caplog, monkeypatch, history_turns):
    monkeypatch.setattr(examples_module, "_warned", set())
    pcfg = PAPER.model_copy(update={"history_turns": history_turns})
    traj = _traj(5)
    with caplog.at_level(logging.WARNING, logger="hamo_ray.training.examples"):
        seqs = trajectory_examples(traj, [_card()], variant, pcfg, 10**6, OFF, budget=8192 - 256)
        steps = trajectory_examples(
            traj, [_card()], variant, pcfg, 10**6, OFF, budget=8192 - 256, per_step=True
        )
    assert "cannot train as one sequence" not in caplog.text
    # the whole history: one sequence; a window of 2 turns: steps 0-2 keep turn 0, then one per step
    assert len(seqs) == (1 if history_turns is None else 3) and len(steps) == 5
    # the labelled tokens are exactly the per-step examples' targets, in order
    assert [s for e in seqs for s in _spans(e)] == [s for e in steps for s in _spans(e)]
    # every step's example (prompt + target) is a prefix of its sequence
    seq_of = [0, 0, 0, 1, 2] if history_turns == 2 else [0] * 5
    for k, step in enumerate(steps):
        assert seqs[seq_of[k]].input_ids[: len(step.input_ids)] == step.input_ids
    assert sum(e.tokens for e in seqs) < sum(e.tokens for e in steps)


def test_the_official_template_falls_back_to_one_example_per_step(official, caplog, monkeypatch):
    monkeypatch.setattr(examples_module, "_warned", set())
    traj = _traj(3)
    with caplog.at_level(logging.WARNING, logger="hamo_ray.training.examples"):
        got = trajectory_examples(traj, [_card()], official, PAPER, 10**6, OFF)
    assert "cannot train as one sequence" in caplog.text and "qwen3-keep-think" in caplog.text
    assert len(got) == 3
    steps = trajectory_examples(traj, [_card()], official, PAPER, 10**6, OFF, per_step=True)
    assert [e.input_ids for e in got] == [e.input_ids for e in steps]


# --- (e): the config ----------------------------------------------------------------------------------


def test_config_names_a_built_in_or_a_file(tmp_path, monkeypatch):
    assert load_config().model.chat_template is None and load_config().model.template_text() is None
    cfg = load_config(overrides=["model.chat_template=qwen3-keep-think"])
    assert cfg.model.chat_template == "qwen3-keep-think" and cfg.model.template_text() == VARIANT.read_text()
    assert chat_template_text(cfg.model) == VARIANT.read_text()
    (tmp_path / "mine.jinja").write_text("{{ messages }}")
    monkeypatch.chdir(tmp_path)  # a relative path: against the current directory, kept absolute
    cfg = load_config(overrides=["model.chat_template=mine.jinja"])
    assert cfg.model.chat_template == str(tmp_path / "mine.jinja")
    assert cfg.model.template_text() == "{{ messages }}"


@pytest.mark.parametrize(
    "override, expected",
    [
        ("model.chat_template=qwen3-keep-thinking", "qwen3-keep-thinking"),
        ("model.chat_template=templates/none.jinja", "templates/none.jinja"),
    ],
)
def test_config_refuses_an_unknown_name_or_a_missing_file(tmp_path, monkeypatch, override, expected):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="model.chat_template") as err:
        load_config(overrides=[override])
    assert expected in str(err.value) and str(tmp_path / expected) in str(err.value)


def test_config_refuses_the_template_elsewhere():
    with pytest.raises(ConfigError, match="model.chat_template does not apply to model.path=embedded"):
        load_config(overrides=["model.path=embedded", "model.chat_template=qwen3-keep-think"])
    with pytest.raises(ConfigError, match="serve.engine_kwargs.chat_template: set model.chat_template"):
        load_config(overrides=["serve.engine_kwargs={chat_template: x}"])


# --- (f): every place that renders prompts renders with it ---------------------------------------------


def test_the_frontend_args_carry_the_template():
    from hamo_ray.serving.engine import frontend_defaults

    plain = frontend_defaults(ModelConfig())
    assert "chat_template" not in plain
    assert plain == {"chat_template_content_format": "string", "default_chat_template_kwargs": OFF}
    front = frontend_defaults(ModelConfig(chat_template="qwen3-keep-think"))
    assert front == {**plain, "chat_template": VARIANT.read_text()}
    # vLLM (not started) takes the value as the template's text: what validate_parsed_serve_args and
    # init_app_state call on --chat-template
    chat_utils = pytest.importorskip("vllm.renderers.chat_utils")
    chat_utils.validate_chat_template(front["chat_template"])
    assert chat_utils.load_chat_template(front["chat_template"]) == VARIANT.read_text()


def test_the_trainer_and_the_rollout_actors_render_with_it(qwen3_folder):
    from hamo_ray.rollout.client import PolicySpec
    from hamo_ray.rollout.worker import EnvWorker
    from hamo_ray.training.driver import StageTrainer

    cfg = load_config(overrides=["model.chat_template=qwen3-keep-think"])
    assert StageTrainer(cfg, str(qwen3_folder), None).tokenizer.chat_template == VARIANT.read_text()
    assert (
        StageTrainer(load_config(), str(qwen3_folder), None).tokenizer.chat_template == OFFICIAL.read_text()
    )

    class Domain:  # the actor's renderer needs no environment
        thread_safe = True

    worker = EnvWorker(Domain(), cfg.env, PAPER, n_envs=1)
    for template, expected in ((None, OFFICIAL), (cfg.model.template_text(), VARIANT)):
        spec = PolicySpec("http://127.0.0.1:9", "base", chat_template=template, chat_template_kwargs=OFF,
                          tokenizer=str(qwen3_folder), prompt_budget=100)  # fmt: skip
        fits = asyncio.run(worker._fits(spec))
        assert fits.__self__.tokenizer.chat_template == expected.read_text()
        assert "chat_template=" not in repr(spec)  # the text stays out of logs


# --- (g): the dry run of a paper preset -----------------------------------------------------------------


def _cli():
    spec = importlib.util.spec_from_file_location("stream_job", ROOT / "jobs" / "stream.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


@pytest.mark.timeout(300)
def test_the_paper_preset_dry_run_trains_one_sequence(qwen3_folder, tmp_path, monkeypatch, capsys, caplog):
    """paper-qwen3-8b-within (faked expert file, the tiny Qwen3 folder): the trajectory format, one example."""
    from expert_formats import eto_item, write

    monkeypatch.setenv("HAMO_API_KEY", "preset-test-key")
    monkeypatch.setattr(examples_module, "_warned", set())
    actions = ["look around", "teleport to kitchen", "pick up pot", "move pot to sink"]
    experts = write(tmp_path / "sciworld_sft.json", [eto_item("0_3", "Your task is to boil water.", actions,
                    ["This room is called the hallway.", "You teleport.", "You pick up the pot.", "Moved."])])  # fmt: skip
    preset = ROOT / "jobs" / "configs" / "paper-qwen3-8b-within.yaml"
    cfg = load_config(preset)
    assert (cfg.model.chat_template, cfg.train.example_format, cfg.prompt.history_turns) == (
        "qwen3-keep-think",
        "trajectory",
        10,
    )
    over = [f"model.path={qwen3_folder}", f"env.expert_files={{scienceworld: {experts}}}"]
    with caplog.at_level(logging.WARNING, logger="hamo_ray.training.examples"):
        rc = _cli()(["--config", str(preset), "--dry-run", *over])
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert (
        f"tokenizer: {qwen3_folder}" in out.out
        and "chat template: model.chat_template qwen3-keep-think" in out.out
    )
    assert "--- training example 1/1 (trajectory format)" in out.out
    assert "cannot train as one sequence" not in caplog.text
    assert out.out.count("--- inference prompt") == 1 and "<|im_start|>user" in out.out
    # ETO's ScienceWorld items open with look around (the initial observation): three actions, all labelled
    turn = "<|im_start|>assistant\n<think>\n\n</think>\n\nThought: step 1 of the plan.\nAction: teleport to kitchen<|im_end|>"
    assert turn in out.out
    loss = next(line for line in out.out.splitlines() if line.startswith("--- (loss on"))
    assert loss.count("<|im_end|>") == 3 and "Action: move pot to sink<|im_end|>" in loss
    # the same preset in the step format: one example per action
    rc = _cli()(["--config", str(preset), "--dry-run", *over, "train.example_format=step"])
    assert rc == 0 and "--- training example 3/3 (step format)" in capsys.readouterr().out
