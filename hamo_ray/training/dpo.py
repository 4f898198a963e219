"""ETO's exploration-based trajectory optimisation: DPO on (success, failure) trajectory pairs.

After behavioural cloning, the agent explores the stage's training tasks; each task where its own
trajectory scored below the expert's gives a pair (expert = chosen, explored = rejected), and the
adapter is trained with the DPO loss on whole trajectories (Song et al. 2024, "Trial and Error:
Exploration-Based Trajectory Optimization for LLM Agents")::

    L = -log sigmoid(beta * [(log pi(c) - log ref(c)) - (log pi(r) - log ref(r))])

where ``log pi(tau)`` sums the log-probabilities of the trajectory's action tokens (the same
per-step examples and action-only mask as behavioural cloning) and ``ref`` is the behavioural-cloning
adapter, frozen (its log-probabilities are computed once, before the first update).

It runs on the same loop as behavioural cloning (``loop.py``: model loading, packed batches, the
DDP/DeepSpeed step, bf16 on GPU; ``stage.py``: the epochs and per-step figures) and the same long-lived workers (``group.py``); ``beta`` and the
epochs come from ``TrainConfig.dpo_beta`` / ``dpo_epochs``. The workers get a
:class:`~hamo_ray.training.contracts.DpoJob` (``group.train_dpo(job)``)::

    result = train_dpo(base, bc_adapter, encode_pairs(pairs, tok, pcfg, 1024), out_dir, tcfg, pad_id=0)
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hamo_ray.config import PromptConfig, TrainConfig
from hamo_ray.training.contracts import DpoJob, EncodedPair, StageOutput, TrainResult
from hamo_ray.training.examples import trajectory_examples
from hamo_ray.training.trainer import on_group, pack_budget, stage_job
from hamo_ray.types import Trajectory

if TYPE_CHECKING:
    from hamo_ray.training.group import TrainerGroup

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


def _pair_batch(pairs: list[EncodedPair], packed: bool, pad_id: int):
    """One forward's worth of pairs: the collated steps, and per labelled token its trajectory (2k, 2k+1)."""
    import torch

    from hamo_ray.training.packing import collate

    steps, owner = [], []
    for k, pair in enumerate(pairs):
        for side, examples in enumerate((pair.chosen, pair.rejected)):
            steps += examples
            owner += [2 * k + side] * len(examples)
    batch = collate(steps, packed=packed, pad_id=pad_id)
    return batch, torch.tensor(owner, dtype=torch.long)[batch.segments]


def trajectory_logprobs(
    lm: Any, pairs: list[EncodedPair], packed: bool = True, pad_id: int = 0, device: Any = "cpu"
):
    """``[len(pairs), 2]``: summed action-token log-probs (chosen, rejected) under the ``ActionLM`` ``lm``."""
    import torch

    batch, owner = _pair_batch(pairs, packed, pad_id)
    logp = lm(**batch.model_inputs(device))
    sums = torch.zeros(2 * len(pairs), device=logp.device, dtype=logp.dtype)
    return sums.index_add(0, owner.to(logp.device), logp).view(-1, 2)


def dpo_stage(worker: Any, job: DpoJob) -> StageOutput | None:
    """Worker side of a DPO stage: load the BC adapter, reference log-probs, DPO epochs, the saved files."""
    import torch

    from hamo_ray.training.stage import StageRun, begin_stage, make_batches

    t0 = time.perf_counter()
    stage = job.stage
    lm, pairs = begin_stage(worker, stage)
    device, packed, pad = worker.device, stage.spec.packed, stage.pad_id
    lengths = [p.tokens for p in pairs]
    ref = torch.zeros(len(pairs), 2, device=device)
    lm.eval()
    with torch.no_grad():  # the frozen reference: the behavioural-cloning adapter before any update
        for idx in make_batches(lengths, stage, -1):
            ref[idx] = trajectory_logprobs(lm, [pairs[i] for i in idx], packed, pad, device).float()
    run = StageRun(worker, stage, lm, lengths, t0)
    beta = job.beta
    accuracy = []
    for _, batches in run.epochs():
        wins, seen = torch.zeros((), device=device), 0
        for idx in batches:
            batch, owner = _pair_batch([pairs[i] for i in idx], packed, pad)
            logp = run.stepper.model(**batch.model_inputs(device))
            sums = torch.zeros(2 * len(idx), device=device, dtype=logp.dtype)
            sums = sums.index_add(0, owner.to(device, non_blocking=True), logp).view(-1, 2)
            delta = sums - ref[torch.tensor(idx, device=device)]
            margin = beta * (delta[:, 0] - delta[:, 1])
            run.step(-torch.nn.functional.logsigmoid(margin).mean(), batch.tokens)
            wins += (margin.detach() > 0).sum()
            seen += len(idx)
        accuracy.append(wins / max(1, seen))
    out = run.finish()
    if out is None:
        return None
    result = replace(out.result, accuracy=[float(x) for x in accuracy])
    logger.info("dpo: reward accuracy per epoch %s", [round(x, 3) for x in result.accuracy])
    return replace(out, result=result)


def train_dpo(
    base_path: str,
    init_adapter: str,
    pairs: list[EncodedPair],
    out_dir: str | Path,
    tcfg: TrainConfig,
    *,
    pad_id: int,
    beta: float | None = None,
    epochs: int | None = None,
    lr: float | None = None,
    seed: int = 0,
    name: str = "dpo",
    group: TrainerGroup | None = None,
) -> TrainResult:
    """DPO on encoded trajectory pairs, starting from (and referenced to) ``init_adapter``.

    Args:
        base_path: the frozen backbone.
        init_adapter: the behavioural-cloning adapter folder (start and reference).
        pairs: from :func:`encode_pairs`.
        out_dir: where the DPO adapter is written (peft format).
        tcfg: training settings (devices, bf16, strategy, packing; ``dpo_beta``, ``dpo_epochs``).
        pad_id: the padding id (padded batches only).
        beta, epochs, lr: override ``tcfg.dpo_beta``, ``tcfg.dpo_epochs``, ``tcfg.lr``.
        seed: shuffling seed.
        name: the run's name in the logs.
        group: a running ``TrainerGroup`` (kept after); None: one for this call only.

    Returns:
        A ``TrainResult`` (``accuracy``: share of pairs with a positive margin, per epoch).

    Raises:
        ValueError: no pairs.
    """
    import ray

    if not pairs:
        raise ValueError("no DPO pairs")
    lengths = [p.tokens for p in pairs]
    stage = stage_job(
        tcfg, base_path, ray.put(list(pairs)), out_dir, lengths, lr=lr, epochs=epochs or tcfg.dpo_epochs,
        seed=seed, pad_id=pad_id, init_adapter=init_adapter, name=name,
    )  # fmt: skip
    # one pair per step unless train.pack_tokens gives a number
    stage = replace(stage, batch_size=1, pack_tokens=pack_budget(tcfg, lengths, 1, device_auto=False))
    job = DpoJob(stage=stage, beta=beta if beta is not None else tcfg.dpo_beta)
    return on_group(tcfg, group, name, lambda g: g.train_dpo(job))
