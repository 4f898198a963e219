"""DeepSpeed ZeRO-2 and ZeRO-3 on CUDA: a LoRA adapter trained with bf16 and gradient checkpointing,
saved (ZeRO-3: gathered first, else the adapter is empty), reloaded with peft; two stages on one
long-lived worker group (ZeRO-3 reloads the model per stage, ZeRO-2 keeps it). What can fail: the loss
falls within a stage and the second stage starts where the first ended; the saved adapter, reloaded,
scores the training data as the last epoch did and well under the backbone.

Auto-skipped without CUDA (tests/conftest.py). Starts its own local Ray when none is running.

    pytest tests/gpu/test_zero.py -q
"""

from __future__ import annotations

import math
import random

import pytest

from hamo_ray.config import TrainConfig
from hamo_ray.training.examples import Example

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def ray_gpu():
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(include_dashboard=False, configure_logging=False)
    yield ray
    if started:
        ray.shutdown()


@pytest.fixture(scope="module")
def backbone(tmp_path_factory):
    from hamo_ray.backbones.tiny_lm import make_random_backbone

    return str(make_random_backbone(tmp_path_factory.mktemp("zero") / "base"))


def _action_loss(model, examples: list[Example]) -> float:
    """Mean cross-entropy of the labelled (action) tokens of ``examples``: the loss training minimises."""
    import torch

    total, count = 0.0, 0
    with torch.no_grad():
        for ex in examples:
            logits = model(torch.tensor([ex.input_ids])).logits[0, :-1].float()
            targets = torch.tensor(ex.labels[1:])
            keep = targets != -100
            total += float(torch.nn.functional.cross_entropy(logits[keep], targets[keep], reduction="sum"))
            count += int(keep.sum())
    return total / count


def _examples(n: int = 64) -> list[Example]:
    rng = random.Random(0)
    out = []
    for i in range(n):
        ids = [rng.randrange(3, 200) for _ in range(rng.randint(32, 128))]
        out.append(Example(ids, [-100] * (len(ids) - 6) + ids[-6:], f"t{i}"))
    return out


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_adapter_round_trip(ray_gpu, backbone, tmp_path, stage):
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from hamo_ray.training.actors import TrainerGroup
    from hamo_ray.training.trainer import train_model

    gpus = int(ray_gpu.cluster_resources().get("GPU", 0))
    tcfg = TrainConfig(
        use_gpu=True,
        num_workers=max(1, min(gpus, 2)),
        strategy="deepspeed",
        zero_stage=stage,
        gradient_checkpointing=True,
        target_modules=TARGETS,
        epochs=2,
        lr=5e-3,
    )
    group = TrainerGroup(tcfg)
    try:  # two stages on one worker group: the second starts from the first's adapter
        first = train_model(backbone, _examples(), tmp_path / "a1", tcfg, pad_id=0, group=group)
        result = train_model(
            backbone, _examples(), tmp_path / "adapter", tcfg, pad_id=0,
            init_adapter=first.path, group=group,
        )  # fmt: skip
    finally:
        group.shutdown()
    assert result.padding == 0.0 and all(map(math.isfinite, first.losses + result.losses))
    assert first.losses[-1] < first.losses[0], first.losses  # it learns within a stage
    # The second stage starts from the first's adapter (not afresh): its first epoch is already lower.
    assert result.losses[0] < first.losses[0], (first.losses, result.losses)
    saved = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    lora_b = [v for k, v in saved.items() if "lora_B" in k]
    assert lora_b and all(v.numel() > 0 for v in lora_b)  # ZeRO-3 without gathering saves empty tensors
    assert sum(float(v.abs().sum()) for v in lora_b) > 0
    model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(backbone, dtype=torch.float32), result.path
    ).eval()
    logits = model(torch.tensor([[5, 6, 7, 8]])).logits
    assert torch.isfinite(logits).all()
    # The saved adapter is the trained one: on the training data, about the last epoch's loss, clearly
    # under the backbone's (margins as in tests/ray/test_train_deepspeed.py; bf16 training, float32 here).
    with model.disable_adapter():
        base = _action_loss(model, _examples())
    tuned = _action_loss(model, _examples())
    assert tuned < result.losses[-1] + 0.1, (tuned, result.losses)
    assert tuned < base - 0.1, (tuned, base)
