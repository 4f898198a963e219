"""Behavioural cloning on Ray Train: one LoRA adapter per stage (or the full backbone, once).

``train_model`` runs a ``TorchTrainer`` over tokenised examples and writes the result in Hugging
Face / peft format. One loop, two strategies (``TrainConfig.strategy``):

- ``deepspeed`` (the default on GPU): DeepSpeed ZeRO-2, or ZeRO-3 with ``zero_stage=3``, bf16, the
  DeepSpeed config generated from ``TrainConfig`` (``hamo_ray.training.deepspeed``); under ZeRO-3
  the LoRA weights are gathered before saving. Also runs on CPU (gloo) as a smoke test.
- ``ddp`` (the default on CPU): ``ray.train.torch.prepare_model`` (DDP over gloo or NCCL).

Gradient checkpointing works with LoRA (the frozen embeddings get ``enable_input_require_grads``).
Batches are length-bucketed (``training.examples``), so padding stays small. Multi-node: the
workers are placed by ``ScalingConfig`` (``num_workers``, ``placement_strategy``)::

    result = train_model(base_path, examples, out_dir, tcfg, storage_path, init_adapter=prev)
    # out_dir now holds adapter_config.json + adapter_model.safetensors (peft format)

The adapter of stage t starts from the adapter of stage t-1 (``init_adapter``); the backbone stays
frozen. With ``lora=False`` the same loop trains every parameter (used once to build the embedded
default backbone).
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hamo_ray.config import TrainConfig
from hamo_ray.training.examples import Example, length_bucketed_batches

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainResult:
    path: str
    loss: float  # mean loss of the last epoch
    losses: list[float]  # mean loss per epoch
    tokens: int  # trained (non-padding) tokens over all epochs
    seconds: float
    padding: float  # fraction of padded positions


def _collate(examples: list[dict[str, list[int]]], pad_id: int):
    import torch

    longest = max(len(e["input_ids"]) for e in examples)
    ids = torch.full((len(examples), longest), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), longest), -100, dtype=torch.long)
    mask = torch.zeros((len(examples), longest), dtype=torch.long)
    for row, e in enumerate(examples):
        n = len(e["input_ids"])
        ids[row, :n] = torch.tensor(e["input_ids"])
        labels[row, :n] = torch.tensor(e["labels"])
        mask[row, :n] = 1
    return ids, labels, mask


def _load_model(config: dict[str, Any]):
    import torch
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if config["bf16"] else torch.float32
    model = AutoModelForCausalLM.from_pretrained(config["base_path"], dtype=dtype, attn_implementation="sdpa")
    if config["gradient_checkpointing"]:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
        if config["lora"]:
            # The frozen embeddings give no grad-requiring input to the checkpointed blocks otherwise.
            model.enable_input_require_grads()
    if not config["lora"]:
        return model
    from peft import LoraConfig, PeftModel, get_peft_model

    if config["init_adapter"]:
        return PeftModel.from_pretrained(model, config["init_adapter"], is_trainable=True)
    lora = LoraConfig(
        r=config["lora_r"],
        lora_alpha=config["lora_alpha"],
        lora_dropout=config["lora_dropout"],
        target_modules=config["target_modules"],
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, lora)


def train_loop_per_worker(config: dict[str, Any]) -> None:
    """The Ray Train worker loop: DDP over the examples, AdamW, linear warm-up/decay, then save."""
    import time

    import ray.train
    import torch
    from ray.train import Checkpoint

    from hamo_ray.logs import setup_logging

    setup_logging()
    torch.manual_seed(config["seed"])
    torch.set_num_threads(config["threads"])
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()

    model = _load_model(config)
    device = ray.train.torch.get_device()
    use_ds = config["strategy"] == "deepspeed"
    examples = config["examples"]
    lengths = [len(e["input_ids"]) for e in examples]
    pool = config["bucket_pool"]
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config["lr"], weight_decay=config["weight_decay"])
    steps_per_epoch = math.ceil(
        len(length_bucketed_batches(lengths, config["batch_size"], 0, 0, pool)) / world
    )
    accum = config["grad_accum_steps"] if use_ds else 1
    total = max(1, math.ceil(steps_per_epoch / accum) * config["epochs"])
    warmup = max(1, int(0.05 * total))
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min((s + 1) / warmup, max(0.0, (total - s) / max(1, total - warmup)))
    )
    if use_ds:
        from hamo_ray.training.deepspeed import initialize_engine

        model = initialize_engine(model.to(device), optimizer, config["ds_config"], scheduler)
    else:
        model = ray.train.torch.prepare_model(model)
    model.train()
    losses, tokens, padded, positions = [], 0, 0, 0
    start = time.time()
    for epoch in range(config["epochs"]):
        batches = length_bucketed_batches(lengths, config["batch_size"], config["seed"], epoch, pool)
        # Every rank takes the same number of batches (DDP needs matched collectives).
        mine = batches[rank::world][:steps_per_epoch]
        while len(mine) < steps_per_epoch:
            mine.append(batches[len(mine) % len(batches)])
        epoch_loss = 0.0
        for batch in mine:
            ids, labels, mask = _collate([examples[i] for i in batch], config["pad_id"])
            ids, labels, mask = ids.to(device), labels.to(device), mask.to(device)
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            if use_ds:  # clipping, accumulation and the LR schedule are the engine's
                model.backward(loss)
                model.step()
            else:
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                optimizer.step()
                scheduler.step()
            epoch_loss += float(loss.detach())
            tokens += int(mask.sum())
            positions += mask.numel()
            padded += int(mask.numel() - mask.sum())
        losses.append(epoch_loss / max(1, len(mine)))
        if rank == 0:
            logger.info("epoch %d/%d loss %.4f", epoch + 1, config["epochs"], losses[-1])
    metrics = {
        "loss": losses[-1] if losses else float("nan"),
        "losses": losses,
        "tokens": tokens * world,
        "seconds": time.time() - start,
        "padding": padded / max(1, positions),
    }
    state = None
    if use_ds:
        from hamo_ray.training.deepspeed import trainable_state_dict

        state = trainable_state_dict(model)  # collective: ZeRO-3 shards are gathered on every rank
    if rank == 0:
        with tempfile.TemporaryDirectory() as tmp:
            unwrapped = getattr(model, "module", model)
            if state is not None and config["lora"]:
                unwrapped.save_pretrained(tmp, safe_serialization=True, state_dict=state)
            elif state is not None:
                full = {k: v.float() for k, v in unwrapped.state_dict().items()}
                unwrapped.save_pretrained(tmp, safe_serialization=True, state_dict={**full, **state})
            else:
                unwrapped.save_pretrained(tmp, safe_serialization=True)
            ray.train.report(metrics, checkpoint=Checkpoint.from_directory(tmp))
    else:
        ray.train.report(metrics)


def fit_to_folder(trainer, out_dir: str | Path, name: str) -> dict:
    """Run a Ray ``trainer`` and copy its final checkpoint to ``out_dir`` whole; returns its metrics.

    Raises:
        RuntimeError: the run ended without a checkpoint.
    """
    result = trainer.fit()
    if result.checkpoint is None:
        raise RuntimeError(f"training run {name!r} finished without a checkpoint: {result.error}")
    out_dir = Path(out_dir)
    tmp_out = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp_out, ignore_errors=True)
    result.checkpoint.to_directory(str(tmp_out))
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp_out.rename(out_dir)  # the adapter folder appears whole or not at all
    return result.metrics


def train_model(
    base_path: str,
    examples: list[Example],
    out_dir: str | Path,
    tcfg: TrainConfig,
    storage_path: str | Path,
    *,
    pad_id: int,
    init_adapter: str | None = None,
    lora: bool = True,
    epochs: int | None = None,
    lr: float | None = None,
    batch_size: int | None = None,
    seed: int = 0,
    name: str = "train",
    strategy: str | None = None,
) -> TrainResult:
    """Train on ``examples`` with Ray Train and write the weights to ``out_dir``.

    Args:
        base_path: the frozen backbone (HF folder or hub id).
        examples: tokenised behavioural-cloning examples.
        out_dir: where the adapter (or, with ``lora=False``, the full model) is written.
        tcfg: training settings (LoRA rank/alpha, lr, epochs, workers).
        storage_path: Ray Train's storage for checkpoints (a shared path on a cluster).
        pad_id: the tokenizer's padding id.
        init_adapter: start from this adapter folder (the previous stage's) instead of a fresh LoRA.
        lora: train a LoRA adapter (True) or every parameter (False).
        epochs, lr, batch_size: override ``tcfg``'s values.
        seed: shuffling and initialisation seed.
        name: the Ray Train run name.
        strategy: "ddp" or "deepspeed"; default from ``tcfg.strategy`` ("auto": DeepSpeed on GPU,
            DDP on CPU).

    Returns:
        A ``TrainResult`` with the output path and the loss per epoch.

    Raises:
        ValueError: no examples.
    """
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    if not examples:
        raise ValueError("no training examples")
    from hamo_ray.training.deepspeed import deepspeed_config, use_bf16

    strategy = strategy or tcfg.strategy
    if strategy == "auto":
        strategy = "deepspeed" if tcfg.use_gpu else "ddp"
    if strategy not in ("ddp", "deepspeed"):
        raise ValueError(f"unknown training strategy {strategy!r}")
    micro = batch_size if batch_size is not None else tcfg.batch_size
    threads = max(1, (os.cpu_count() or 1) // tcfg.num_workers)
    config = {
        "base_path": base_path,
        "init_adapter": init_adapter,
        "lora": lora,
        "lora_r": tcfg.lora_r,
        "lora_alpha": tcfg.lora_alpha,
        "lora_dropout": tcfg.lora_dropout,
        "target_modules": list(tcfg.target_modules),
        "epochs": epochs if epochs is not None else tcfg.epochs,
        "lr": lr if lr is not None else tcfg.lr,
        "batch_size": micro,
        "weight_decay": tcfg.weight_decay,
        "seed": seed,
        "threads": threads if not tcfg.use_gpu else 4,
        "bf16": use_bf16(tcfg),
        "gradient_checkpointing": tcfg.gradient_checkpointing,
        "strategy": strategy,
        "ds_config": deepspeed_config(tcfg, tcfg.num_workers, micro),
        "grad_accum_steps": tcfg.grad_accum_steps,
        "bucket_pool": tcfg.bucket_pool,
        "pad_id": pad_id,
        "examples": [{"input_ids": e.input_ids, "labels": e.labels} for e in examples],
    }
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config=config,
        torch_config=TorchConfig(backend="nccl" if tcfg.use_gpu else "gloo"),
        scaling_config=ScalingConfig(
            num_workers=tcfg.num_workers,
            use_gpu=tcfg.use_gpu,
            resources_per_worker={"CPU": tcfg.cpus_per_worker},
            placement_strategy=tcfg.placement_strategy,
        ),
        run_config=RunConfig(name=name, storage_path=str(Path(storage_path).resolve())),
    )
    logger.info("train %s: %s on %d workers, %d examples", name, strategy, tcfg.num_workers, len(examples))
    m = fit_to_folder(trainer, out_dir, name)
    out_dir = Path(out_dir)
    return TrainResult(
        path=str(out_dir),
        loss=float(m["loss"]),
        losses=[float(x) for x in m["losses"]],
        tokens=int(m["tokens"]),
        seconds=float(m["seconds"]),
        padding=float(m["padding"]),
    )
