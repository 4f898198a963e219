"""The training objectives: one loss function per objective, in a registry both engines' workers use.

A stage's job names its objective (``StageJob.objective``); the loop (``loop.run_stage``) looks it up
here and calls it once, after the stage's model and adapter are ready and before the optimizer wraps
the model, with ``(lm, rows, job, device)``. It returns the stage's loss: a function from a
micro-batch of rows to a :class:`Loss`, which the loop steps on::

    @register("bc")
    def behavioural_cloning(lm, rows, job, device) -> LossFn:
        def loss(model, batch: list[Example], idx: list[int]) -> Loss:
            ...                                          # model: the wrapped ActionLM (DDP / DeepSpeed)
            return Loss(-logp.mean(), tokens)
        return loss

A new objective is one such function here, registered under a new name; the driver builds its job
with ``trainer.stage_job(..., objective=name, options={...})`` (``job.options`` are its settings).
What runs before its first step (DPO's frozen reference log-probabilities) runs in the function's
body, on the untouched model. The registry is this module's: workers import it, so an objective is
known to every engine once it is defined here.

- ``bc``: behavioural cloning, the token mean of the action tokens' negative log-likelihood.
- ``dpo``: ETO's DPO on (chosen, rejected) trajectory pairs (``dpo.py``; Song et al. 2024)::

      L = -log sigmoid(beta * [(log pi(c) - log ref(c)) - (log pi(r) - log ref(r))])

  where ``log pi(tau)`` sums the log-probabilities of the trajectory's action tokens and ``ref`` is
  the stage's initial adapter (the behavioural-cloning one), frozen: its log-probabilities are
  computed once, before the first update. ``Loss.correct`` counts the pairs with a positive margin
  (the reward accuracy per epoch, ``TrainResult.accuracy``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hamo_ray.training.contracts import EncodedPair, StageJob


@dataclass
class Loss:
    """One micro-batch's loss and what the loop records of it."""

    value: Any  # the 0-d tensor the optimizer step minimises
    tokens: int  # trained (labelled) tokens
    positions: int = 0  # the batch's positions, padding included (the padding figure); 0: not counted
    correct: Any = None  # rows counted right (tensor or int; DPO: positive margins); None: no accuracy
    counted: int = 0  # rows counted for ``correct``


LossFn = Callable[[Any, list[Any], list[int]], Loss]  # (model, the batch's rows, their indices) -> Loss
Objective = Callable[[Any, list[Any], StageJob, Any], LossFn]  # (lm, rows, job, device) -> the stage's loss

OBJECTIVES: dict[str, Objective] = {}


def register(name: str) -> Callable[[Objective], Objective]:
    """Register the decorated objective under ``name`` (a job's ``objective``).

    Raises:
        ValueError: ``name`` is taken.
    """

    def add(fn: Objective) -> Objective:
        if name in OBJECTIVES:
            raise ValueError(f"training objective {name!r} is taken ({OBJECTIVES[name].__name__})")
        OBJECTIVES[name] = fn
        return fn

    return add


def objective(name: str) -> Objective:
    """The objective registered as ``name``.

    Raises:
        ValueError: no objective has that name (the message names it and the registered ones).
    """
    try:
        return OBJECTIVES[name]
    except KeyError:
        raise ValueError(
            f"unknown training objective {name!r} (registered: {', '.join(sorted(OBJECTIVES))})"
        ) from None


@register("bc")
def behavioural_cloning(lm: Any, rows: list[Any], job: StageJob, device: Any) -> LossFn:
    """Experience-conditioned behavioural cloning: the mean NLL of the action tokens (``Example`` rows)."""
    import torch

    from hamo_ray.training.packing import collate

    torch.manual_seed(job.seed)
    packed, pad_id = job.spec.packed, job.pad_id

    def loss(model: Any, batch_rows: list[Any], idx: list[int]) -> Loss:
        batch = collate(batch_rows, packed=packed, pad_id=pad_id)
        logp = model(**batch.model_inputs(device))
        value = -logp.mean() if batch.targets.numel() else logp.sum() * 0.0
        return Loss(value, batch.tokens, batch.positions)

    return loss


@register("dpo")
def dpo(lm: Any, rows: list[EncodedPair], job: StageJob, device: Any) -> LossFn:
    """DPO on trajectory pairs against the initial adapter, frozen (``job.options["beta"]``)."""
    import torch

    from hamo_ray.training.batches import make_batches

    packed, pad_id, beta = job.spec.packed, job.pad_id, job.options["beta"]
    ref = torch.zeros(len(rows), 2, device=device)
    lm.eval()
    with torch.no_grad():  # the frozen reference: the initial adapter before any update
        for idx in make_batches([p.tokens for p in rows], job, -1):
            ref[idx] = trajectory_logprobs(lm, [rows[i] for i in idx], packed, pad_id, device).float()

    def loss(model: Any, batch_rows: list[EncodedPair], idx: list[int]) -> Loss:
        batch, owner = pair_batch(batch_rows, packed, pad_id)
        logp = model(**batch.model_inputs(device))
        sums = torch.zeros(2 * len(idx), device=device, dtype=logp.dtype)
        sums = sums.index_add(0, owner.to(device, non_blocking=True), logp).view(-1, 2)
        delta = sums - ref[torch.tensor(idx, device=device)]
        margin = beta * (delta[:, 0] - delta[:, 1])
        value = -torch.nn.functional.logsigmoid(margin).mean()
        return Loss(value, batch.tokens, correct=(margin.detach() > 0).sum(), counted=len(idx))

    return loss


def pair_batch(pairs: list[EncodedPair], packed: bool, pad_id: int):
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

    batch, owner = pair_batch(pairs, packed, pad_id)
    logp = lm(**batch.model_inputs(device))
    sums = torch.zeros(2 * len(pairs), device=logp.device, dtype=logp.dtype)
    return sums.index_add(0, owner.to(logp.device), logp).view(-1, 2)
