"""Experience-conditioned behavioural-cloning examples from trajectories.

The loss of docs/method.md step 4 is ``sum_k log pi(a_k | g, o0, h_k, E)`` over the actions of a
trajectory, where the prompt before ``a_k`` is what the policy saw at that step
(``hamo_ray.prompting.build_messages``: goal, initial observation, injected experience ``E``, the
history ``h_k`` kept by the context rule). Two formats compute it (``train.example_format``):

- ``trajectory`` (default): with the whole history, each step's prompt extends the previous step's
  prompt and reply, so the conversation up to the last action holds every step's prompt as a prefix.
  One sequence per trajectory carries the labels of every reply: all action losses from one forward
  pass. When the context rule trims the history, a new sequence starts at the trim (one per
  kept-history segment), so every labelled reply still follows exactly the prompt the endpoint saw.
- ``step``: one example per action, the prompt re-encoded each time.

The labels cover the reply tokens only (up to the end-of-turn token); both formats give the same
summed loss when no history is trimmed (tested token for token). A chat template that renders an
earlier reply differently once later turns follow it (Qwen3's official one drops the think block its
prompt opened) cannot give one sequence; ``model.chat_template: qwen3-keep-think`` renders Qwen3's
replies as generated, on both sides, so it can (docs/prompting.md).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from hamo_ray.config import PromptConfig
from hamo_ray.prompting import ChatRenderer, encode_example, fit_cards, history_starts, step_example
from hamo_ray.types import Card, Trajectory

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Example:
    input_ids: list[int]
    labels: list[int]
    trajectory_id: str

    @property
    def tokens(self) -> int:
        """Its length in tokens (what batching counts; ``EncodedPair.tokens`` for a DPO pair)."""
        return len(self.input_ids)


def trajectory_examples(
    traj: Trajectory,
    cards: list[Card],
    tokenizer,
    pcfg: PromptConfig,
    max_seq_len: int,
    chat_template_kwargs: dict | None = None,
    *,
    budget: int | None = None,
    per_step: bool = False,
) -> list[Example]:
    """The behavioural-cloning examples of one trajectory, conditioned on ``cards``.

    Args:
        traj: an expert (or explored) trajectory.
        cards: the experience injected into its prompts.
        tokenizer: the model's tokenizer (its chat template renders the prompts).
        pcfg: the prompt format and context rule.
        max_seq_len: longer examples are dropped (and logged): the context rule makes them rare; a
            silent truncation would train on a prompt inference never sends.
        chat_template_kwargs: the template variables the server renders with
            (``ModelConfig.template_kwargs()``).
        budget: the prompt-token budget of the context rule (``model.max_model_len -
            rollout.max_tokens``); None: only ``pcfg.history_turns`` trims.
        per_step: one example per action (``train.example_format=step``) instead of one sequence per
            kept-history segment.

    Returns:
        The examples (one per segment, or one per action).

    A chat template that renders an earlier reply differently once later turns follow it (Qwen3's
    official one: its think blocks) cannot hold every step's prompt in one sequence: such a trajectory
    falls back to one example per action, with a warning (``model.chat_template: qwen3-keep-think``
    is Qwen3's template without that difference).
    """
    renderer = ChatRenderer(tokenizer, chat_template_kwargs, budget)
    if budget is not None:  # the cards the rollout would have kept (the context rule's second half)
        cards = fit_cards(traj.goal, traj.init_obs, cards, pcfg, domain=traj.task.domain, fits=renderer.fits)
    starts = history_starts(traj, cards, pcfg, renderer.fits if budget is not None else None)
    steps = []
    for k, start in enumerate(starts):
        messages, reply = step_example(traj, k, cards, pcfg, start=start)
        steps.append((start, *encode_example(tokenizer, messages, reply, chat_template_kwargs)))
    rows = None if per_step else _segments(steps)
    if rows is None:
        if not per_step:
            _warn_once(
                "the chat template renders an earlier reply differently once later turns follow it (Qwen3's "
                "think blocks, for one), so a trajectory cannot train as one sequence: one example per action "
                "instead (set train.example_format=step to say so; for Qwen3, model.chat_template: "
                "qwen3-keep-think renders replies as generated and trains one sequence)"
            )
        rows = [(ids, labels, f"step {k}") for k, (_, ids, labels) in enumerate(steps)]
    out = []
    for ids, labels, what in rows:
        if len(ids) > max_seq_len:
            logger.warning(
                "dropping %s of %s: %d tokens > max_seq_len %d", what, traj.id, len(ids), max_seq_len
            )
            continue
        out.append(Example(ids, labels, traj.id))
    return out


def _segments(steps: list[tuple[int, list[int], list[int]]]) -> list[tuple[list, list, str]] | None:
    """Merge consecutive steps that keep the same history into one sequence with every reply labelled.

    Returns None when a step's prompt and reply are not a prefix of its segment's last step (the
    template renders history differently from the reply it generated).
    """
    rows: list[tuple[list, list, str]] = []
    k = 0
    while k < len(steps):
        end = k
        while end + 1 < len(steps) and steps[end + 1][0] == steps[k][0]:
            end += 1
        ids, labels = list(steps[end][1]), [-100] * len(steps[end][1])
        for j in range(k, end + 1):
            step_ids, step_labels = steps[j][1], steps[j][2]
            if ids[: len(step_ids)] != step_ids:
                return None
            for p, label in enumerate(step_labels):
                if label != -100:
                    labels[p] = label
        rows.append((ids, labels, f"steps {k}-{end}"))
        k = end + 1
    return rows


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        logger.warning(message)


def build_examples(
    trajectories: list[Trajectory],
    experience: dict[str, list[Card]],
    tokenizer,
    pcfg: PromptConfig,
    max_seq_len: int,
    chat_template_kwargs: dict | None = None,
    *,
    budget: int | None = None,
    per_step: bool = False,
) -> list[Example]:
    """Examples of many trajectories (see ``trajectory_examples``); ``experience[traj.id]`` holds the
    cards injected into that trajectory's prompts (may be empty)."""
    examples: list[Example] = []
    for traj in trajectories:
        examples.extend(
            trajectory_examples(
                traj, experience.get(traj.id, []), tokenizer, pcfg, max_seq_len, chat_template_kwargs,
                budget=budget, per_step=per_step,
            )
        )  # fmt: skip
    return examples


def example_options(cfg: Any) -> dict[str, Any]:
    """``build_examples``'s ``budget`` and ``per_step`` for a run's config (``HamoConfig``)."""
    return {
        "budget": cfg.model.max_model_len - cfg.rollout.max_tokens,
        "per_step": cfg.train.example_format == "step",
    }


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
