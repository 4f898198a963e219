"""ETO's exploration-based trajectory optimisation: DPO on (success, failure) trajectory pairs.

After behavioural cloning, the agent explores the stage's training tasks; each task where its own
trajectory scored below the expert's gives a pair (expert = chosen, explored = rejected), and the
adapter is trained with the DPO loss on whole trajectories (Song et al. 2024, "Trial and Error:
Exploration-Based Trajectory Optimization for LLM Agents")::

    L = -log sigmoid(beta * [(log pi(c) - log ref(c)) - (log pi(r) - log ref(r))])

where ``log pi(tau)`` sums the log-probabilities of the trajectory's action tokens (the same
per-step examples and action-only mask as behavioural cloning) and ``ref`` is the behavioural-cloning
adapter, frozen (its log-probabilities are computed once, before the first update).
"""

from __future__ import annotations

import logging
import math
import os
import tempfile
from pathlib import Path
from typing import Any

from hamo_ray.config import PromptConfig, TrainConfig
from hamo_ray.training.deepspeed import use_bf16
from hamo_ray.training.examples import trajectory_examples
from hamo_ray.training.trainer import fit_to_folder
from hamo_ray.types import Trajectory

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


def encode_pairs(pairs, tokenizer, pcfg: PromptConfig, max_seq_len: int) -> list[dict[str, list[dict]]]:
    out = []
    for chosen, rejected in pairs:
        c = trajectory_examples(chosen, [], tokenizer, pcfg, max_seq_len)
        r = trajectory_examples(rejected, [], tokenizer, pcfg, max_seq_len)
        if c and r:
            out.append(
                {
                    "chosen": [{"input_ids": e.input_ids, "labels": e.labels} for e in c],
                    "rejected": [{"input_ids": e.input_ids, "labels": e.labels} for e in r],
                }
            )
    return out


def _sequence_logprob(model, steps: list[dict], pad_id: int):
    """Sum of the action-token log-probabilities over all steps of one trajectory."""
    import torch

    from hamo_ray.training.trainer import _collate

    ids, labels, mask = _collate(steps, pad_id)
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
    target = labels[:, 1:]
    keep = target != -100
    logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (logp * keep).sum()


def dpo_loop_per_worker(config: dict[str, Any]) -> None:
    import ray.train
    import torch
    from ray.train import Checkpoint

    from hamo_ray.logs import setup_logging
    from hamo_ray.training.trainer import _load_model

    setup_logging()
    torch.manual_seed(config["seed"])
    torch.set_num_threads(config["threads"])
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    model = _load_model(config)
    pairs = config["pairs"][rank::world]
    pad = config["pad_id"]
    model.eval()
    with torch.no_grad():  # the frozen reference: the behavioural-cloning adapter before any update
        ref = [
            (
                float(_sequence_logprob(model, p["chosen"], pad)),
                float(_sequence_logprob(model, p["rejected"], pad)),
            )
            for p in pairs
        ]
    model = ray.train.torch.prepare_model(model)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config["lr"])
    steps = max(1, math.ceil(len(config["pairs"]) / world))
    losses, accuracy = [], []
    for epoch in range(config["epochs"]):
        order = torch.randperm(
            steps, generator=torch.Generator().manual_seed(config["seed"] + epoch)
        ).tolist()
        epoch_loss, wins = 0.0, 0
        for i in order:
            j = i % max(1, len(pairs))
            if not pairs:
                break
            lc = _sequence_logprob(model, pairs[j]["chosen"], pad) - ref[j][0]
            lr_ = _sequence_logprob(model, pairs[j]["rejected"], pad) - ref[j][1]
            margin = config["beta"] * (lc - lr_)
            loss = -torch.nn.functional.logsigmoid(margin)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            epoch_loss += float(loss.detach())
            wins += int(float(margin.detach()) > 0)
        losses.append(epoch_loss / steps)
        accuracy.append(wins / steps)
        if rank == 0:
            logger.info(
                "dpo epoch %d/%d loss %.4f reward accuracy %.2f",
                epoch + 1,
                config["epochs"],
                losses[-1],
                accuracy[-1],
            )
    metrics = {"loss": losses[-1] if losses else float("nan"), "losses": losses, "accuracy": accuracy}
    if rank == 0:
        with tempfile.TemporaryDirectory() as tmp:
            getattr(model, "module", model).save_pretrained(tmp, safe_serialization=True)
            ray.train.report(metrics, checkpoint=Checkpoint.from_directory(tmp))
    else:
        ray.train.report(metrics)


def train_dpo(
    base_path: str,
    init_adapter: str,
    pairs: list[dict[str, list[dict]]],
    out_dir: str | Path,
    tcfg: TrainConfig,
    storage_path: str | Path,
    *,
    pad_id: int,
    beta: float = 0.1,
    epochs: int = 1,
    lr: float | None = None,
    seed: int = 0,
    name: str = "dpo",
) -> dict:
    """DPO on encoded trajectory pairs with Ray Train, starting from (and referenced to) ``init_adapter``.

    Returns:
        ``{"path", "loss", "losses", "accuracy"}``.
    """
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    if not pairs:
        raise ValueError("no DPO pairs")
    workers = min(tcfg.num_workers, len(pairs))
    config = {
        "base_path": base_path,
        "init_adapter": init_adapter,
        "lora": True,
        "pairs": pairs,
        "pad_id": pad_id,
        "beta": beta,
        "epochs": epochs,
        "lr": lr if lr is not None else tcfg.lr,
        "seed": seed,
        "threads": max(1, (os.cpu_count() or 1) // workers),
        "bf16": use_bf16(tcfg),  # the same rule as behavioural cloning (train.bf16, else GPU only)
        "gradient_checkpointing": tcfg.gradient_checkpointing,
        "lora_r": tcfg.lora_r,
        "lora_alpha": tcfg.lora_alpha,
        "lora_dropout": tcfg.lora_dropout,
        "target_modules": list(tcfg.target_modules),
    }
    trainer = TorchTrainer(
        dpo_loop_per_worker,
        train_loop_config=config,
        torch_config=TorchConfig(backend="nccl" if tcfg.use_gpu else "gloo"),
        scaling_config=ScalingConfig(
            num_workers=workers, use_gpu=tcfg.use_gpu, resources_per_worker={"CPU": tcfg.cpus_per_worker}
        ),
        run_config=RunConfig(name=name, storage_path=str(Path(storage_path).resolve())),
    )
    m = fit_to_folder(trainer, out_dir, name)
    return {"path": str(out_dir), "loss": float(m["loss"]), "losses": m["losses"], "accuracy": m["accuracy"]}
