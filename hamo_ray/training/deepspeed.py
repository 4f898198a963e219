"""DeepSpeed ZeRO for the training loop (``stepper.Stepper``): the strategy rule, the generated config,
engine set-up, saving.

No hand-kept JSON: :func:`deepspeed_config` derives every field from ``TrainConfig`` (ZeRO stage,
bf16, micro-batch, accumulation, clipping, offload), so the DeepSpeed config cannot drift from the
run's config::

    cfg = deepspeed_config(tcfg, world_size=8)            # a dict, as deepspeed.initialize wants it
    engine = initialize_engine(model, optimizer, cfg)     # inside a training worker (stepper.py)
    state = trainable_state_dict(engine)                  # ZeRO-3: gathers the sharded LoRA weights

``deepspeed`` is imported only by :func:`initialize_engine` and :func:`trainable_state_dict`. The
first ``deepspeed.initialize`` on a machine compiles C++ ops (~200-350 s on 2 CPU cores);
:func:`extensions_dir` points ``TORCH_EXTENSIONS_DIR`` at a cached folder so later runs skip it.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from hamo_ray.config import TrainConfig

logger = logging.getLogger(__name__)

DEFAULT_EXTENSIONS_DIR = "~/.cache/hamo_ray/torch_extensions"


def extensions_dir() -> str:
    """Set ``TORCH_EXTENSIONS_DIR`` (kept if already set) to a cached folder and return it."""
    path = os.environ.get("TORCH_EXTENSIONS_DIR") or str(Path(DEFAULT_EXTENSIONS_DIR).expanduser())
    os.environ["TORCH_EXTENSIONS_DIR"] = path
    Path(path).mkdir(parents=True, exist_ok=True)
    return path


def resolve_strategy(tcfg: TrainConfig, strategy: str | None = None) -> str:
    """ "ddp" or "deepspeed": ``auto`` is DeepSpeed ZeRO only with several GPU workers (see the README).

    Raises:
        ValueError: an unknown strategy name.
    """
    strategy = strategy or tcfg.strategy
    if strategy == "auto":
        strategy = "deepspeed" if tcfg.use_gpu and tcfg.num_workers > 1 else "ddp"
    if strategy not in ("ddp", "deepspeed"):
        raise ValueError(f"unknown training strategy {strategy!r} (train.strategy: auto, ddp, deepspeed)")
    return strategy


def use_bf16(tcfg: TrainConfig) -> bool:
    """bf16 when configured; by default on GPU only (CPU training stays float32)."""
    return tcfg.use_gpu if tcfg.bf16 is None else tcfg.bf16


def deepspeed_config(tcfg: TrainConfig, world_size: int, batch_size: int | None = None) -> dict[str, Any]:
    """The DeepSpeed config of a training run, generated from ``tcfg``.

    Args:
        tcfg: training settings (``zero_stage``, ``bf16``, ``batch_size``, ``grad_accum_steps``,
            ``offload_optimizer``).
        world_size: data-parallel workers.
        batch_size: per-worker micro-batch; ``tcfg.batch_size`` by default.

    Returns:
        A dict for ``deepspeed.initialize(config=...)``. The optimizer and schedule stay in the
        training loop (a torch AdamW and a LambdaLR), so ``zero_allow_untested_optimizer`` is set.
    """
    micro = batch_size if batch_size is not None else tcfg.batch_size
    zero: dict[str, Any] = {
        "stage": tcfg.zero_stage,
        "overlap_comm": tcfg.use_gpu,
        "contiguous_gradients": True,
        "reduce_bucket_size": 5e7,
    }
    if tcfg.zero_stage == 2:
        zero["allgather_bucket_size"] = 5e7
    else:
        # Gather full weights on rank 0 at save time only for the trainable (LoRA) parameters;
        # the frozen backbone is never re-saved.
        zero["stage3_gather_16bit_weights_on_model_save"] = False
        zero["stage3_param_persistence_threshold"] = 1e4
    if tcfg.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": tcfg.use_gpu}
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": tcfg.grad_accum_steps,
        "train_batch_size": micro * tcfg.grad_accum_steps * world_size,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": use_bf16(tcfg)},
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def initialize_engine(model: Any, optimizer: Any, config: dict[str, Any], scheduler: Any = None) -> Any:
    """Wrap ``model`` and ``optimizer`` in a DeepSpeed engine (inside an initialised process group).

    Args:
        model: the torch module (peft-wrapped for LoRA).
        optimizer: a torch optimizer over the trainable parameters.
        config: from :func:`deepspeed_config`.
        scheduler: a torch LR scheduler; the engine steps it at accumulation boundaries.

    Returns:
        The engine: ``engine(**batch)`` forwards, ``engine.backward(loss)``, ``engine.step()``.
    """
    extensions_dir()
    import deepspeed

    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, lr_scheduler=scheduler, config=config
    )
    return engine


def trainable_state_dict(engine: Any) -> dict[str, Any]:
    """The trainable parameters (the LoRA weights) as full CPU tensors, keyed like ``named_parameters``.

    Under ZeRO-3 every parameter is a shard; without gathering, ``save_pretrained`` writes empty
    adapters. Collective: every rank must call it.
    """
    import contextlib

    import deepspeed
    import torch

    named = [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad]
    sharded = [p for _, p in named if hasattr(p, "ds_id")]
    gather = (
        deepspeed.zero.GatheredParameters(sharded, modifier_rank=None)
        if sharded
        else contextlib.nullcontext()
    )
    with gather:
        return {name: param.detach().to("cpu", torch.float32).clone() for name, param in named}
