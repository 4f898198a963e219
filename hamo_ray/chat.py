"""A model's side of the chat: its replies parsed into actions, messages rendered to token ids.

``parse_reply`` / ``clean_action`` read an action (and a ReAct thought) from a reply, reasoning
blocks stripped; ``encode_chat`` renders messages with the tokenizer's chat template exactly as the
server does; ``encode_example`` gives one training example's ids and its label mask (the reply's tokens
only). ``hamo_ray.prompting`` builds the messages and re-exports these names.

``model.chat_template`` replaces the model's own template on both sides: ``chat_template_text`` reads it
(a built-in of ``hamo_ray/templates``, ``CHAT_TEMPLATES``, or a Jinja file), ``set_chat_template`` puts
it on every tokenizer that renders prompts, and the server gets it as vLLM's ``chat_template``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

_THINK_BLOCK = re.compile(r"<think>.*?</think>", re.S)


def strip_reasoning(text: str) -> str:
    """``text`` without reasoning: closed ``<think>`` blocks, text before a lone ``</think>`` (a block
    the prompt opened), and everything from an unclosed ``<think>`` on (a reply cut off mid-thought)."""
    text = _THINK_BLOCK.sub("", text)
    if "</think>" in text:
        text = text.rsplit("</think>", 1)[1]
    if "<think>" in text:
        text = text.split("<think>", 1)[0]
    return text


def _first_line(text: str) -> str:
    for line in text.strip().splitlines():
        line = " ".join(line.split())
        if line:
            return line
    return ""


def parse_reply(text: str, reply_format: str = "action") -> tuple[str, str]:
    """The (thought, action) of a model reply.

    Reasoning blocks are removed first (``strip_reasoning``). Then, in either format, when the
    reply has an ``Action:`` marker the action is the first non-empty line after its last one,
    and the thought is what precedes it, less a leading ``Thought:``; otherwise the action is the
    first non-empty line (in ``react`` format a reply holding only ``Thought: ...`` has no action:
    ``""``, which the environment answers as an invalid action). Whitespace is normalised.

    Args:
        text: the raw reply.
        reply_format: ``"action"`` or ``"react"`` (``prompt.reply_format``).

    Returns:
        ``(thought, action)``; ``thought`` is ``""`` when there is none.
    """
    if reply_format not in ("action", "react"):
        raise ValueError(f"prompt.reply_format must be 'action' or 'react', got {reply_format!r}")
    text = strip_reasoning(text)
    cut = text.rfind("Action:")
    if cut >= 0:
        head, action = text[:cut], _first_line(text[cut + len("Action:") :])
        thought = head.split("Thought:", 1)[1] if "Thought:" in head else head
        return " ".join(thought.split()), action
    stripped = text.strip()
    if stripped.startswith("Thought:"):
        return " ".join(stripped[len("Thought:") :].split()), ""
    return "", _first_line(text)


_REGEX_SPECIAL = frozenset("\\.^$*+?{}[]()|")
# A template slot in a listed action, e.g. WebShop's ``search[<keywords>]``: up to 60 characters of
# words (letters, digits, spaces, ``,.&'/+-``), so a search ends well within a reply's token limit
# and reads back unchanged (no control or odd whitespace characters that ``parse_reply`` would cut).
_SLOT = re.compile(r"<[A-Za-z][A-Za-z _-]*>")
SLOT_PATTERN = r"[A-Za-z0-9][A-Za-z0-9 ,.&'/+-]{0,59}"
THOUGHT_PATTERN = r"[^\n]{0,400}"


def _escape(text: str) -> str:
    return "".join("\\" + c if c in _REGEX_SPECIAL else c for c in text)


def action_regex(actions: list[str], reply_format: str = "action") -> str | None:
    """A regular expression a reply in ``reply_format`` must match to hold one of ``actions``.

    ``actions``: the environment's admissible commands now (``Env.valid_actions()``); a template slot
    in one (``<keywords>``) matches up to 60 characters of words (``SLOT_PATTERN``). ``react``: ``Thought: `` and
    one line, then ``Action: `` and a command. The reply is what ``parse_reply`` reads back to that
    command (no reasoning block). None when ``actions`` is empty (nothing to constrain to).
    """
    if reply_format not in ("action", "react"):
        raise ValueError(f"prompt.reply_format must be 'action' or 'react', got {reply_format!r}")
    alternatives = []
    for action in dict.fromkeys(" ".join(a.split()) for a in actions):
        if action:
            alternatives.append(SLOT_PATTERN.join(_escape(part) for part in _SLOT.split(action)))
    if not alternatives:
        return None
    choice = "(" + "|".join(alternatives) + ")"
    return f"Thought: {THOUGHT_PATTERN}\nAction: {choice}" if reply_format == "react" else choice


def clean_action(text: str, reply_format: str = "action") -> str:
    """The action in a model reply (see ``parse_reply``): never a reasoning tag, never multi-line."""
    return parse_reply(text, reply_format)[1]


def encode_chat(
    tokenizer,
    messages: list[dict[str, str]],
    add_generation_prompt: bool,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """Token ids of ``messages`` under the tokenizer's chat template (the server renders the same way).

    ``chat_template_kwargs`` (``ModelConfig.template_kwargs()``, e.g. ``enable_thinking``) are the
    template variables; templates that do not use a variable ignore it.

    Raises:
        ValueError: ``chat_template_kwargs`` is None while the template has a thinking switch: the
            caller must decide it (``{}`` keeps the template's default), since a default-on switch
            would train every target to start with a think block.
    """
    if chat_template_kwargs is None and "enable_thinking" in (
        getattr(tokenizer, "chat_template", None) or ""
    ):
        raise ValueError(
            "the chat template has an enable_thinking switch: pass chat_template_kwargs "
            "(ModelConfig.template_kwargs(), the variables the server renders with)"
        )
    ids = tokenizer.apply_chat_template(
        messages,
        add_generation_prompt=add_generation_prompt,
        tokenize=True,
        return_dict=False,
        **(chat_template_kwargs or {}),
    )
    return list(ids)


def encode_example(
    tokenizer,
    messages: list[dict[str, str]],
    reply: str,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> tuple[list[int], list[int]]:
    """Token ids and labels of one behavioural-cloning example.

    The ids are the generation prompt (exactly what the server renders for ``messages``) followed
    by the tokens the template puts after it for the assistant ``reply``, up to and including the
    end-of-turn token that stops generation. The labels equal the ids on those reply tokens and
    are -100 on the prompt: the loss covers the reply only. With Qwen3's template and thinking
    off, the prompt ends with the empty think block and the target is ``REPLY<|im_end|>``.

    Raises:
        ValueError: as ``encode_chat``; or the template renders the conversation with the reply so that it does not
            start with the generation prompt (training would then see another prompt than inference).
    """
    kwargs = chat_template_kwargs
    prompt = encode_chat(tokenizer, messages, True, kwargs)
    full = encode_chat(tokenizer, [*messages, {"role": "assistant", "content": reply.strip()}], False, kwargs)
    if full[: len(prompt)] != prompt:
        raise ValueError(
            "the chat template does not extend the generation prompt with the reply "
            f"(template variables {kwargs}): training would not see the inference prompt"
        )
    target = full[len(prompt) :]
    eos = tokenizer.eos_token_id
    if eos is not None and eos in target:
        target = target[: target.index(eos) + 1]  # drop template whitespace after the end-of-turn token
    ids = prompt + target
    labels = [-100] * len(prompt) + target
    return ids, labels


# Built-in chat templates (model.chat_template: NAME), package data under hamo_ray/templates.
TEMPLATES_DIR = Path(__file__).parent / "templates"
CHAT_TEMPLATES = {
    # Qwen3's official template, every earlier reply rendered with the think block its prompt opened.
    "qwen3-keep-think": "qwen3_keep_think.jinja",
}


def chat_template_file(value: str) -> Path:
    """The file of a ``model.chat_template`` value: a built-in's (``CHAT_TEMPLATES``), else ``value`` as a
    path (``~`` expanded, a relative one against the current directory). Whether it exists is not checked."""
    if value in CHAT_TEMPLATES:
        return TEMPLATES_DIR / CHAT_TEMPLATES[value]
    return Path(value).expanduser().absolute()


def chat_template_text(model_cfg: Any) -> str | None:
    """The chat template ``model_cfg`` (a ``ModelConfig``) renders with: the text of its ``chat_template``
    (a built-in name or a Jinja file); None: the model's own template (the tokenizer's)."""
    value = getattr(model_cfg, "chat_template", None)
    return None if value is None else chat_template_file(value).read_text()


def set_chat_template(tokenizer: Any, text: str | None) -> Any:
    """``tokenizer`` rendering with ``text`` (``chat_template_text``); None leaves its own template."""
    if text is not None:
        tokenizer.chat_template = text
    return tokenizer
