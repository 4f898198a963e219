"""The optimizer step of a stage: DDP or a DeepSpeed engine around the ``ActionLM``, AdamW, the schedule.

::

    stepper = Stepper(lm, step_config, total_steps, device) # DDP or DeepSpeed, AdamW, schedule
    logp = stepper.model(**batch.model_inputs(device))      # forward through DDP / the engine
    stepper.step(-logp.mean())                              # backward, clipping, optimizer, schedule
    state = stepper.trainable_state()                       # the trained weights (collective under ZeRO-3)
    stepper.close()

With bf16 LoRA weights the optimizer keeps float32 master copies (``MasterAdamW``). ``StepConfig``
travels to the workers inside the stage's job (``contracts.py``).
"""

from __future__ import annotations

import logging
import math
from typing import Any

from hamo_ray.training.contracts import StepConfig

__all__ = ["StepConfig", "Stepper"]

logger = logging.getLogger(__name__)


def _master_weights():
    import torch

    class MasterAdamW:
        """AdamW on float32 copies of low-precision trainable weights (copied back after each step)."""

        def __init__(self, params: list, lr: float, weight_decay: float, fused: bool):
            self.params = params
            self.master = [p.detach().float().clone().requires_grad_(True) for p in params]
            kw = {"fused": True} if fused else {}
            self.inner = torch.optim.AdamW(self.master, lr=lr, weight_decay=weight_decay, **kw)
            self.param_groups = self.inner.param_groups

        def step(self) -> None:
            for p, m in zip(self.params, self.master):
                m.grad = None if p.grad is None else p.grad.float()
            self.inner.step()
            with torch.no_grad():
                torch._foreach_copy_(self.params, self.master)

        def zero_grad(self, set_to_none: bool = True) -> None:
            for p in self.params:
                p.grad = None
            self.inner.zero_grad(set_to_none=set_to_none)

    return MasterAdamW


class Stepper:
    """Wraps an ``ActionLM`` for one stage: DDP or a DeepSpeed engine, AdamW, linear warm-up/decay.

    ``stepper.model(**inputs)`` forwards (through DDP/DeepSpeed, so gradients synchronise);
    ``stepper.step(loss)`` does backward, clipping (1.0), the optimizer and the schedule.
    """

    def __init__(self, lm: Any, cfg: StepConfig, total_steps: int, device: Any):
        import torch
        import torch.distributed as dist

        self.lm = lm
        self.deepspeed = cfg.strategy == "deepspeed"
        self.params = [p for p in lm.parameters() if p.requires_grad]
        accum = cfg.grad_accum_steps if self.deepspeed else 1
        total = max(1, math.ceil(total_steps / accum))
        warmup = max(1, int(0.05 * total))
        low_precision = any(p.dtype != torch.float32 for p in self.params)
        cuda = torch.device(device).type == "cuda"
        if self.deepspeed or not low_precision:
            kw = {"fused": True} if cuda and not self.deepspeed else {}
            self.optimizer = torch.optim.AdamW(self.params, lr=cfg.lr, weight_decay=cfg.weight_decay, **kw)
            inner = self.optimizer
        else:  # bf16 LoRA weights, float32 optimizer state and master weights
            self.optimizer = _master_weights()(self.params, cfg.lr, cfg.weight_decay, fused=cuda)
            inner = self.optimizer.inner
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            inner, lambda s: min((s + 1) / warmup, max(0.0, (total - s) / max(1, total - warmup)))
        )
        if self.deepspeed:
            from hamo_ray.training.deepspeed import initialize_engine

            self.model = initialize_engine(lm, self.optimizer, cfg.ds_config, self.scheduler)
        elif dist.is_initialized() and dist.get_world_size() > 1:
            ids = [torch.device(device).index or 0] if cuda else None
            self.model = torch.nn.parallel.DistributedDataParallel(lm, device_ids=ids)
        else:
            self.model = lm

    def step(self, loss: Any) -> None:
        import torch

        if self.deepspeed:  # clipping, accumulation and the LR schedule are the engine's
            self.model.backward(loss)
            self.model.step()
            return
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0, foreach=True)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()

    @property
    def lr(self) -> float:
        """The learning rate the next step uses."""
        return float(self.scheduler.get_last_lr()[0])

    def trainable_state(self) -> dict[str, Any]:
        """The trainable weights as float32 CPU tensors (collective under ZeRO-3: call on every rank)."""
        if self.deepspeed:
            from hamo_ray.training.deepspeed import trainable_state_dict

            state = trainable_state_dict(self.model)
            return {k.removeprefix("model."): v for k, v in state.items()}
        return {
            n.removeprefix("model."): p.detach().float().cpu()
            for n, p in self.lm.named_parameters()
            if p.requires_grad
        }

    def close(self) -> None:
        """Drop the engine/optimizer so the next stage starts clean (the loaded model stays).

        A DeepSpeed engine is destroyed first: that removes the gradient hooks ZeRO put on the
        parameters, which would otherwise outlive it on the kept model.
        """
        self.hooks_left = False
        if self.deepspeed and self.model is not None:
            try:
                self.model.destroy()
            except Exception as e:  # hooks may remain on the parameters: the caller reloads the model
                logger.warning("DeepSpeed engine destroy failed (%s); the model will be reloaded", e)
                self.hooks_left = True
        self.model = self.optimizer = self.scheduler = None
