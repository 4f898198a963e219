"""ETO's exploration-based trajectory optimisation: DPO on (success, failure) trajectory pairs.

After behavioural cloning, the agent explores the stage's training tasks; each task where its own
trajectory scored below the expert's gives a pair (expert = chosen, explored = rejected), and the
adapter is trained with the DPO loss on whole trajectories (Song et al. 2024, "Trial and Error:
Exploration-Based Trajectory Optimization for LLM Agents")::

    L = -log sigmoid(beta * [(log pi(c) - log ref(c)) - (log pi(r) - log ref(r))])

where ``log pi(tau)`` sums the log-probabilities of the trajectory's action tokens (the same
per-step examples and action-only mask as behavioural cloning) and ``ref`` is the behavioural-cloning
adapter, frozen (its log-probabilities are computed once, before the first update).

This module is the driver's side: the pairs, their tokens, the stage's job. The loss itself is the
``dpo`` objective (``objectives.py``), run by the same loop as behavioural cloning (``loop.py``: the
model, packed batches, the DDP/DeepSpeed step, the epochs and per-step figures) on the same
long-lived workers (``group.py``); ``beta`` and the epochs come from ``TrainConfig.dpo_beta`` /
``dpo_epochs``::

    result = train_dpo(base, bc_adapter, encode_pairs(pairs, tok, pcfg, 1024), out_dir, tcfg, pad_id=0)
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hamo_ray.config import PromptConfig, TrainConfig
from hamo_ray.training.contracts import EncodedPair, TrainResult
from hamo_ray.training.examples import trajectory_examples
from hamo_ray.training.trainer import on_group, pack_budget, stage_job
from hamo_ray.types import Trajectory

if TYPE_CHECKING:
    from hamo_ray.training.group import Engine

logger = logging.getLogger(__name__)


def build_pairs(expert: list[Trajectory], explored: list[Trajectory]) -> list[tuple[Trajectory, Trajectory]]:
    """(chosen, rejected) pairs: the expert trajectory and the agent's worse one on the same task."""
    by_task = {t.task.id: t for t in expert}
    pairs = []
    for t in explored:
        best = by_task.get(t.task.id)
        if best is not None and t.error is None and t.actions and t.score < best.score:
            pairs.append((best, t))
    return pairs


def encode_pairs(
    pairs,
    tokenizer,
    pcfg: PromptConfig,
    max_seq_len: int,
    chat_template_kwargs: dict | None = None,
    **options: Any,
) -> list[EncodedPair]:
    """Tokenise (chosen, rejected) pairs as behavioural-cloning examples (same template variables and
    format as training: ``options`` are ``trajectory_examples``'s ``budget`` and ``per_step``).

    Returns:
        One ``EncodedPair`` per pair; a pair with a side left empty is dropped.
    """
    out = []
    for chosen, rejected in pairs:
        c = trajectory_examples(chosen, [], tokenizer, pcfg, max_seq_len, chat_template_kwargs, **options)
        r = trajectory_examples(rejected, [], tokenizer, pcfg, max_seq_len, chat_template_kwargs, **options)
        if c and r:
            out.append(EncodedPair(chosen=tuple(c), rejected=tuple(r)))
    return out


def train_dpo(
    base_path: str,
    init_adapter: str,
    pairs: list[EncodedPair],
    out_dir: str | Path,
    tcfg: TrainConfig,
    *,
    pad_id: int,
    seed: int = 0,
    name: str = "dpo",
    group: Engine | None = None,
) -> TrainResult:
    """DPO on encoded trajectory pairs, starting from (and referenced to) ``init_adapter``.

    Args:
        base_path: the frozen backbone.
        init_adapter: the behavioural-cloning adapter folder (start and reference).
        pairs: from :func:`encode_pairs`.
        out_dir: where the DPO adapter is written (peft format).
        tcfg: the training settings, whole (devices, bf16, strategy, packing, ``lr``; ``dpo_beta``,
            ``dpo_epochs``); a stage's own values in a copy, ``tcfg.model_copy(update={"dpo_epochs": 1})``.
        pad_id: the padding id (padded batches only).
        seed: shuffling seed.
        name: the run's name in the logs.
        group: a running engine (``group.make_group``; kept after); None: one for this call only.

    Returns:
        A ``TrainResult`` (``accuracy``: share of pairs with a positive margin, per epoch).

    Raises:
        ValueError: no pairs.
    """
    import ray

    if not pairs:
        raise ValueError("no DPO pairs")
    lengths = [p.tokens for p in pairs]
    job = stage_job(
        tcfg.model_copy(update={"epochs": tcfg.dpo_epochs}), base_path, ray.put(list(pairs)), out_dir, lengths,
        objective="dpo", options={"beta": tcfg.dpo_beta}, seed=seed, pad_id=pad_id, init_adapter=init_adapter,
        name=name,
    )  # fmt: skip
    # one pair per step unless train.pack_tokens gives a number
    job = replace(job, batch_size=1, pack_tokens=pack_budget(tcfg, lengths, 1, device_auto=False))
    return on_group(tcfg, group, job, name)
