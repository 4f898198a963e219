"""Per-step figures of a stage on one worker: loss, learning rate, tokens/s; rank 0's progress lines.

The loop (``loop.py``) records every optimizer step in a :class:`StepRecord`; rank 0 returns the
rows with its result (``TrainResult.step_metrics``), and the stream writes them to TensorBoard as
``train/loss``, ``train/lr``, ``train/tokens_per_s`` (``dpo/...`` for DPO), numbered on across
stages (``tracking.Tracker.log_steps``). Rank 0 also logs a progress line (step/total, loss,
tokens/s, ETA) every tenth of the stage: a worker's output is never a terminal.

Losses stay on the device until :meth:`StepRecord.rows` (one synchronisation) or a progress line.
The clock is the host's: on a GPU a step's time is when the host got past it, so single steps
jitter while their sum is the stage's time; the tokens are rank 0's times the world size.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from hamo_ray.logs import Progress

logger = logging.getLogger(__name__)


class StepRecord:
    """The steps of one stage on one worker; only rank 0 logs progress lines.

    Args:
        total_steps: the steps this rank will take (all epochs).
        desc: the stage's name in the progress lines.
        rank, world: this worker's rank and the group's size.
    """

    def __init__(self, total_steps: int, desc: str, rank: int, world: int) -> None:
        self.world = world
        self.losses: list[Any] = []  # 0-d device tensors
        self.lrs: list[float] = []
        self.tokens: list[int] = []  # all ranks' tokens of the step (rank 0's x world)
        self.times: list[float] = []  # host clock after each step
        self.epoch_ends: list[int] = []  # steps done at the end of each epoch
        self.start = time.perf_counter()
        self._shown = 0  # steps already summarised in a progress line
        self.progress = Progress(total_steps, desc, unit="step", log=logger, enabled=rank == 0)

    def begin(self) -> None:
        """Start the clock (after the device is synchronised, just before the first step)."""
        self.start = self.progress.start = time.perf_counter()

    def step(self, loss: Any, lr: float, tokens: int) -> None:
        """Record one optimizer step: its loss (a tensor, kept on the device), learning rate, tokens."""
        self.losses.append(loss.detach())
        self.lrs.append(float(lr))
        self.tokens.append(tokens * self.world)
        self.times.append(time.perf_counter())
        self.progress.update(1, figures=self._figures)

    def end_epoch(self) -> None:
        self.epoch_ends.append(len(self.losses))

    def _figures(self) -> dict[str, Any]:
        """The steps since the last line: mean loss (one synchronisation), tokens/s, learning rate."""
        import torch

        first, last = self._shown, len(self.losses)
        self._shown = last
        before = self.times[first - 1] if first else self.start
        seconds = max(self.times[-1] - before, 1e-9)
        loss = float(torch.stack(self.losses[first:last]).float().mean())
        return {"loss": round(loss, 4), "tok/s": sum(self.tokens[first:last]) / seconds, "lr": self.lrs[-1]}

    def close(self) -> None:
        self.progress.close()

    def rows(self) -> list[dict[str, float]]:
        """One dict per step: ``loss``, ``lr``, ``tokens_per_s`` (the one synchronisation of the losses)."""
        import torch

        self.close()
        if not self.losses:
            return []
        losses = torch.stack(self.losses).float().cpu().tolist()
        out, before = [], self.start
        for loss, lr, tokens, t in zip(losses, self.lrs, self.tokens, self.times, strict=True):
            out.append({"loss": loss, "lr": lr, "tokens_per_s": tokens / max(t - before, 1e-9)})
            before = t
        return out

    def epoch_losses(self, rows: list[dict[str, float]]) -> list[float]:
        """The mean loss of each epoch, from :meth:`rows`."""
        out, begin = [], 0
        for end in self.epoch_ends:
            chunk = [r["loss"] for r in rows[begin:end]]
            out.append(sum(chunk) / max(1, len(chunk)))
            begin = end
        return out
