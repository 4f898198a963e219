"""The prompt format shared by training and inference, the reply format, and the context rule.

Messages: an optional system message (``prompt.system_prompt``; ``system_text``: the domain's role,
action grammar and tips, texts of ``hamo_ray.envs.prompts``, then the reply rule and optionally the
domain's worked example, both rendered here in the reply format); then the first user turn = task
request + initial observation + injected experience (the retrieved cards, as text); then
alternating assistant reply / user observation turns. Training examples
(``step_example``) and rollout requests are both built by ``build_messages``, so the model sees at
inference exactly the format it was trained on; both render them with the tokenizer's chat
template and the same template variables (``model.enable_thinking``, ``model.chat_template_kwargs``:
``encode_chat`` here, the server's renderer in ``hamo_ray.serving.app``).

Reply format (``prompt.reply_format``): ``action`` (the reply is one command) or ``react``
(``Thought: ...`` then ``Action: ...``, as AgentGym and ETO data are written). ``parse_reply``
reads either, after removing a reasoning block (``<think>...</think>``, also one left open by a
reply cut off at ``max_tokens``), so an action is never ``<think>``.

Context rule (keeps long episodes inside the context window), the same in training and inference:
- the initial observation is cut to ``prompt.init_obs_max_chars`` characters, each later
  observation to ``prompt.obs_max_chars``, each injected card to ``prompt.card_max_chars``;
- the whole history follows the first user turn (``prompt.history_turns``, when set, caps it at the
  last N turns: a sliding window);
- when the rendered prompt would exceed the token budget (``model.max_model_len -
  rollout.max_tokens``), the oldest half of the kept history turns is dropped, again until it fits
  (``fit_messages``). The first kept turn only moves forward within an episode, so every prompt of an
  episode extends the previous one until the next trim: the endpoint's prefix cache keeps hitting, and a
  trajectory trains as one sequence per kept-history segment (``hamo_ray.training.examples``). The
  last turn (the observation the next action answers) is always kept;
- when even the first prompt (no history) would exceed the budget, the lowest-ranked cards are dropped
  until it fits, once per episode (``fit_cards``), so every turn carries the same cards;
- a prompt that still does not fit is refused by the endpoint: the episode is recorded as failed and
  evaluation counts it apart from the scores, never as a 0.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from hamo_ray.chat import (
    action_regex,
    clean_action,
    encode_chat,
    encode_example,
    parse_reply,
    strip_reasoning,
)
from hamo_ray.config import PromptConfig
from hamo_ray.envs.prompts import DomainPrompt, get_prompt
from hamo_ray.types import Card, Trajectory

logger = logging.getLogger(__name__)

__all__ = [
    "INSTRUCTION",
    "action_regex",
    "build_messages",
    "clean_action",
    "encode_chat",
    "encode_example",
    "first_user_message",
    "fit_cards",
    "fit_messages",
    "history_starts",
    "ChatRenderer",
    "format_fingerprint",
    "format_reply",
    "system_text",
    "parse_reply",
    "step_example",
    "strip_reasoning",
]

# The one-sentence instruction of the short format (no system prompt), per reply format.
INSTRUCTION = "You are an agent in a text environment. Reply with exactly one action per turn."
INSTRUCTIONS = {
    "action": INSTRUCTION,
    "react": (
        "You are an agent in a text environment. Each turn reply with 'Thought: ' and your reasoning, "
        "then 'Action: ' and exactly one action."
    ),
}

# The reply rule of the system prompt, per reply format.
REPLY_RULES = {
    "action": "Reply with exactly one command per turn, on one line, and nothing else.",
    "react": (
        "Reply each turn in two lines: 'Thought: ' followed by your short reasoning, then "
        "'Action: ' followed by exactly one command."
    ),
}


def format_reply(action: str, thought: str, reply_format: str) -> str:
    """The assistant text of one step in ``reply_format``: the action, or ``Thought: ...\\nAction: ...``.

    A react step without a thought is ``Action: ...`` alone (imported data and simulator experts
    may have none; a made-up thought would be worse than none).
    """
    if reply_format == "action":
        return action
    if reply_format != "react":
        raise ValueError(f"prompt.reply_format must be 'action' or 'react', got {reply_format!r}")
    thought = " ".join(thought.split())
    return f"Thought: {thought}\nAction: {action}" if thought else f"Action: {action}"


def example_text(prompt: DomainPrompt, reply_format: str) -> str:
    """The worked example as text, each reply in ``reply_format``."""
    lines = [f"Task: {prompt.example_goal}", f"Observation: {prompt.example_obs}"]
    for step in prompt.example:
        reply = format_reply(step.action, step.thought, reply_format)
        lines.append(reply if reply_format == "react" else f"Action: {reply}")
        lines.append(f"Observation: {step.observation}")
    return "\n".join(lines)


def system_text(domain: str, reply_format: str, example: bool) -> str:
    """The system message of ``domain``: role, grammar, tips, the reply rule, optionally the example.

    Args:
        domain: a key of ``hamo_ray.envs.prompts.DOMAIN_PROMPTS``.
        reply_format: ``"action"`` or ``"react"`` (``prompt.reply_format``).
        example: append the worked example (``prompt.in_context_example``).

    Raises:
        ValueError: unknown domain or reply format.
    """
    prompt = get_prompt(domain)
    if reply_format not in REPLY_RULES:
        raise ValueError(f"prompt.reply_format must be 'action' or 'react', got {reply_format!r}")
    text = f"{prompt.system}\n\n{REPLY_RULES[reply_format]}"
    if example:
        text += f"\n\nExample (another task):\n{example_text(prompt, reply_format)}"
    return text


def clip(text: str, max_chars: int) -> str:
    """Cut ``text`` to ``max_chars`` characters, whitespace normalised."""
    text = " ".join(text.split())
    return text if len(text) <= max_chars else text[: max_chars - 3].rstrip() + "..."


def format_experience(cards: list[Card], max_chars: int) -> str:
    """The injected-experience block: one numbered entry per card (goal and solution outline)."""
    lines = []
    for n, card in enumerate(cards, 1):
        lines.append(clip(f"[{n}] Task: {card.goal} Outline: {card.outline}", max_chars))
    return "\n".join(lines)


def first_user_message(goal: str, init_obs: str, cards: list[Card], pcfg: PromptConfig) -> str:
    """The first user turn: instruction (short format only), task, initial observation, experience."""
    parts = [] if pcfg.system_prompt else [INSTRUCTIONS[pcfg.reply_format]]
    parts.append(f"Task: {clip(goal, pcfg.init_obs_max_chars)}")
    parts.append(f"Observation: {clip(init_obs, pcfg.init_obs_max_chars)}")
    if cards:
        parts.append("Experience from similar tasks:\n" + format_experience(cards, pcfg.card_max_chars))
    return "\n".join(parts)


def build_messages(
    goal: str,
    init_obs: str,
    cards: list[Card],
    actions: list[str],
    observations: list[str],
    pcfg: PromptConfig,
    *,
    domain: str | None = None,
    thoughts: list[str] | None = None,
    start: int | None = None,
) -> list[dict[str, str]]:
    """Chat messages for choosing the next action after ``actions``/``observations`` so far.

    Args:
        goal: the task request.
        init_obs: the initial observation.
        cards: injected experience (empty for methods without retrieval).
        actions: the actions taken so far.
        observations: the environment's answers to ``actions`` (same length).
        pcfg: the context rule, reply format and prompt switches.
        domain: the task's domain; required with ``pcfg.system_prompt`` (its agent prompt).
        thoughts: the thought before each action (react format; empty or None: none recorded).
        start: the first history turn kept (``fit_messages`` decides it); None: the whole history,
            or the last ``pcfg.history_turns`` turns when that is set.

    Returns:
        OpenAI-style messages ending with a user turn.

    Raises:
        ValueError: lengths differ, or the system prompt is on without a known ``domain``.
    """
    if len(actions) != len(observations):
        raise ValueError(f"{len(actions)} actions but {len(observations)} observations")
    thoughts = list(thoughts or [])
    if thoughts and len(thoughts) != len(actions):
        raise ValueError(f"{len(thoughts)} thoughts but {len(actions)} actions")
    messages = []
    if pcfg.system_prompt:
        if domain is None:
            raise ValueError("prompt.system_prompt is on: build_messages needs the task's domain")
        text = system_text(domain, pcfg.reply_format, pcfg.in_context_example)
        messages.append({"role": "system", "content": text})
    messages.append({"role": "user", "content": first_user_message(goal, init_obs, cards, pcfg)})
    if start is None:
        start = window_start(len(actions), pcfg)
    for k in range(min(start, len(actions)), len(actions)):
        thought = thoughts[k] if thoughts else ""
        reply = format_reply(clean_action(actions[k]), thought, pcfg.reply_format)
        messages.append({"role": "assistant", "content": reply})
        messages.append(
            {"role": "user", "content": clip(observations[k], pcfg.obs_max_chars) or "(no output)"}
        )
    return messages


def window_start(n_done: int, pcfg: PromptConfig) -> int:
    """The first history turn ``prompt.history_turns`` allows after ``n_done`` actions (0: all)."""
    return 0 if pcfg.history_turns is None else max(0, n_done - pcfg.history_turns)


def fit_messages(
    goal: str,
    init_obs: str,
    cards: list[Card],
    actions: list[str],
    observations: list[str],
    pcfg: PromptConfig,
    *,
    domain: str | None = None,
    thoughts: list[str] | None = None,
    start: int = 0,
    fits: Callable[[list[dict[str, str]]], bool] | None = None,
) -> tuple[int, list[dict[str, str]]]:
    """The context rule: the messages for the next action, history trimmed oldest-first to fit.

    Args:
        goal, init_obs, cards, actions, observations, pcfg, domain, thoughts: as ``build_messages``.
        start: the first turn the previous prompt of this episode kept (the start never moves back).
        fits: whether rendered messages fit the prompt budget (``ChatRenderer.fits``); None: no limit
            but ``pcfg.history_turns``.

    Returns:
        ``(start, messages)``: the first history turn kept and the messages. The last turn (the
        observation the next action answers) is always kept; when even that does not fit, the
        messages are returned anyway (the endpoint then refuses the prompt as too long, and the
        episode is counted as failed, apart from the scores). Cards are fitted once per episode,
        before the first turn (:func:`fit_cards`).
    """
    n = len(actions)
    start = max(start, window_start(n, pcfg))
    while True:
        messages = build_messages(
            goal, init_obs, cards, actions, observations, pcfg, domain=domain, thoughts=thoughts, start=start
        )
        if fits is None or start >= n - 1 or fits(messages):
            return start, messages
        start = min(n - 1, start + (n - start + 1) // 2)  # drop the oldest half of the kept turns


def fit_cards(
    goal: str,
    init_obs: str,
    cards: list[Card],
    pcfg: PromptConfig,
    *,
    domain: str | None = None,
    fits: Callable[[list[dict[str, str]]], bool] | None = None,
) -> list[Card]:
    """The cards an episode carries: the retrieved ones, lowest-ranked dropped until the first prompt fits.

    The second half of the context rule (history is trimmed first, turn by turn, by
    :func:`fit_messages`): decided once per episode, so every turn carries the same cards, in
    rollouts and in the training examples alike. Each card is already clipped to
    ``prompt.card_max_chars``.
    """
    kept = list(cards)
    while (
        kept
        and fits is not None
        and not fits(build_messages(goal, init_obs, kept, [], [], pcfg, domain=domain))
    ):
        kept.pop()
    if len(kept) < len(cards):
        logger.debug("context: %d of %d cards kept for %r", len(kept), len(cards), goal[:60])
    return kept


def history_starts(
    traj: Trajectory, cards: list[Card], pcfg: PromptConfig, fits: Callable | None = None
) -> list[int]:
    """The first history turn kept before each action of ``traj``, as a rollout computes it turn by turn."""
    starts, start, thoughts = [], 0, list(traj.thoughts)
    for k in range(len(traj.actions)):
        start, _ = fit_messages(
            traj.goal, traj.init_obs, cards, traj.actions[:k], traj.observations[:k], pcfg,
            domain=traj.task.domain, thoughts=thoughts[:k], start=start, fits=fits,
        )  # fmt: skip
        starts.append(start)
    return starts


class ChatRenderer:
    """Renders messages to token ids with a tokenizer's chat template, as the server does.

    Args:
        tokenizer: a Hugging Face tokenizer with a chat template.
        chat_template_kwargs: the template variables (``ModelConfig.template_kwargs()``).
        budget: prompt tokens allowed (``model.max_model_len - rollout.max_tokens``); None: no limit.
    """

    def __init__(
        self, tokenizer: Any, chat_template_kwargs: dict[str, Any] | None, budget: int | None = None
    ):
        self.tokenizer = tokenizer
        self.kwargs = chat_template_kwargs
        self.budget = budget

    def encode(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        return encode_chat(self.tokenizer, messages, add_generation_prompt, self.kwargs)

    def fits(self, messages: list[dict[str, str]]) -> bool:
        """Whether the generation prompt of ``messages`` stays within the budget."""
        return self.budget is None or len(self.encode(messages)) <= self.budget


def step_example(
    traj: Trajectory, k: int, cards: list[Card], pcfg: PromptConfig, start: int | None = None
) -> tuple[list[dict[str, str]], str]:
    """The messages before step ``k`` of ``traj`` and the reply to train on (in ``pcfg.reply_format``).

    The messages are what a rollout would have sent at step ``k`` (same ``build_messages`` call,
    with the trajectory's domain, its thoughts so far, ``cards`` and the history kept from turn
    ``start``, see ``history_starts``); the reply is the action, or
    ``Thought: ...\\nAction: ...`` (``Action: ...`` alone where the step has no thought).
    """
    thoughts = list(traj.thoughts)
    messages = build_messages(
        traj.goal,
        traj.init_obs,
        cards,
        traj.actions[:k],
        traj.observations[:k],
        pcfg,
        domain=traj.task.domain,
        thoughts=thoughts[:k],
        start=start,
    )
    reply = format_reply(clean_action(traj.actions[k]), thoughts[k] if thoughts else "", pcfg.reply_format)
    return messages, reply


def format_fingerprint(pcfg: PromptConfig, domains: list[str]) -> str:
    """A short hash of the prompt text a config renders for ``domains`` (instruction, system prompts).

    Caches of artefacts trained on the prompt format (the embedded backbone) put it in their key,
    so a changed prompt text, not only a changed setting, rebuilds them.
    """
    import hashlib

    parts = [pcfg.model_dump_json(), INSTRUCTIONS[pcfg.reply_format]]
    if pcfg.system_prompt:
        parts += [system_text(d, pcfg.reply_format, pcfg.in_context_example) for d in sorted(domains)]
    return hashlib.sha1("\n".join(parts).encode()).hexdigest()[:12]
