"""Experience-conditioned behavioural-cloning examples from trajectories.

One example per action ``a_k`` of a trajectory: the messages that the policy would have seen
before acting (``hamo_ray.prompting.build_messages``: goal, initial observation, injected
experience ``E_i``, the last turns ``h_k``) and the action as the target. The loss covers the
action tokens only, so summing over the examples of a trajectory gives
``sum_k log pi(a_k | g, o0, h_k, E)`` of docs/method.md step 4.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from hamo_ray.config import PromptConfig
from hamo_ray.prompting import encode_example, step_example
from hamo_ray.types import Card, Trajectory

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Example:
    input_ids: list[int]
    labels: list[int]
    trajectory_id: str


def trajectory_examples(
    traj: Trajectory,
    cards: list[Card],
    tokenizer,
    pcfg: PromptConfig,
    max_seq_len: int,
    chat_template_kwargs: dict | None = None,
) -> list[Example]:
    """The behavioural-cloning examples of one trajectory, conditioned on ``cards``.

    Each is ``prompting.step_example`` (the rollout's messages, the reply in ``pcfg.reply_format``)
    rendered with the model's template variables ``chat_template_kwargs``
    (``ModelConfig.template_kwargs()``, the ones the server renders with).
    Examples longer than ``max_seq_len`` are dropped (and logged): the context rule should
    make them rare; a silent truncation would train on a prompt inference never sends.
    """
    out = []
    for k in range(len(traj.actions)):
        messages, reply = step_example(traj, k, cards, pcfg)
        ids, labels = encode_example(tokenizer, messages, reply, chat_template_kwargs)
        if len(ids) > max_seq_len:
            logger.warning(
                "dropping step %d of %s: %d tokens > max_seq_len %d", k, traj.id, len(ids), max_seq_len
            )
            continue
        out.append(Example(ids, labels, traj.id))
    return out


def build_examples(
    trajectories: list[Trajectory],
    experience: dict[str, list[Card]],
    tokenizer,
    pcfg: PromptConfig,
    max_seq_len: int,
    chat_template_kwargs: dict | None = None,
) -> list[Example]:
    """Examples of many trajectories; ``experience[traj.id]`` holds its injected cards (may be empty)."""
    examples: list[Example] = []
    for traj in trajectories:
        cards = experience.get(traj.id, [])
        examples.extend(trajectory_examples(traj, cards, tokenizer, pcfg, max_seq_len, chat_template_kwargs))
    return examples


def padding_fraction(batches: list[list[Example]]) -> float:
    """Share of padded positions when each batch is padded to its longest example."""
    total = real = 0
    for batch in batches:
        longest = max(len(e.input_ids) for e in batch)
        total += longest * len(batch)
        real += sum(len(e.input_ids) for e in batch)
    return 0.0 if total == 0 else 1.0 - real / total


def length_bucketed_batches(
    lengths: list[int], batch_size: int, seed: int, epoch: int, pool_batches: int = 50
) -> list[list[int]]:
    """Shuffled batches of indices of similar length, so padding stays small.

    Indices are shuffled, cut into pools of ``pool_batches * batch_size``, sorted by length inside
    each pool, cut into batches, and the batches shuffled again.
    """
    import random

    rng = random.Random(seed * 100_003 + epoch)
    idx = list(range(len(lengths)))
    rng.shuffle(idx)
    pool = pool_batches * batch_size
    batches = []
    for start in range(0, len(idx), pool):
        chunk = sorted(idx[start : start + pool], key=lambda i: lengths[i])
        batches += [chunk[i : i + batch_size] for i in range(0, len(chunk), batch_size)]
    rng.shuffle(batches)
    return batches
