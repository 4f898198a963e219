"""The prompt format shared by training and inference, and the context rule.

First user turn = task request + initial observation + injected experience (the retrieved cards,
as text). Then alternating assistant action / user observation turns. Training examples and
rollout requests are both built by ``build_messages``, so the model sees at inference exactly the
format it was trained on.

Context rule (keeps long episodes inside the context window):
- the initial observation is cut to ``prompt.init_obs_max_chars`` characters, each later
  observation to ``prompt.obs_max_chars``, each injected card to ``prompt.card_max_chars``;
- only the last ``prompt.history_turns`` (action, observation) turns follow the first user turn.
"""

from __future__ import annotations

from hamo_ray.config import PromptConfig
from hamo_ray.types import Card

INSTRUCTION = "You are an agent in a text environment. Reply with exactly one action per turn."


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
    parts = [INSTRUCTION, f"Task: {clip(goal, pcfg.init_obs_max_chars)}"]
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
) -> list[dict[str, str]]:
    """Chat messages for choosing the next action after ``actions``/``observations`` so far.

    Args:
        goal: the task request.
        init_obs: the initial observation.
        cards: injected experience (empty for methods without retrieval).
        actions: the actions taken so far.
        observations: the environment's answers to ``actions`` (same length).
        pcfg: the context rule.

    Returns:
        OpenAI-style messages ending with a user turn.
    """
    if len(actions) != len(observations):
        raise ValueError(f"{len(actions)} actions but {len(observations)} observations")
    messages = [{"role": "user", "content": first_user_message(goal, init_obs, cards, pcfg)}]
    start = max(0, len(actions) - pcfg.history_turns)
    for action, obs in zip(actions[start:], observations[start:], strict=True):
        messages.append({"role": "assistant", "content": clean_action(action)})
        messages.append({"role": "user", "content": clip(obs, pcfg.obs_max_chars) or "(no output)"})
    return messages


def clean_action(text: str) -> str:
    """The action in a model reply: its first non-empty line, whitespace normalised."""
    for line in text.strip().splitlines():
        line = " ".join(line.split())
        if line:
            return line
    return ""


def encode_chat(tokenizer, messages: list[dict[str, str]], add_generation_prompt: bool) -> list[int]:
    """Token ids of ``messages`` under the tokenizer's chat template (the serving path does the same)."""
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
    )
    return list(ids)


def encode_example(tokenizer, messages: list[dict[str, str]], action: str) -> tuple[list[int], list[int]]:
    """Token ids and labels of one behavioural-cloning example.

    The labels equal the ids on the assistant action tokens (the action text and the end-of-turn
    token that stops generation) and are -100 everywhere else: the loss covers action tokens only.
    """
    prompt = encode_chat(tokenizer, messages, add_generation_prompt=True)
    full = encode_chat(tokenizer, [*messages, {"role": "assistant", "content": clean_action(action)}], False)
    if full[: len(prompt)] != prompt:
        raise ValueError("the chat template does not extend the generation prompt with the reply")
    target = full[len(prompt) :]
    eos = tokenizer.eos_token_id
    if eos is not None and eos in target:
        target = target[: target.index(eos) + 1]  # drop template whitespace after the end-of-turn token
    ids = prompt + target
    labels = [-100] * len(prompt) + target
    return ids, labels
