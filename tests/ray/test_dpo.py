"""DPO on trajectory pairs (the shared loop and workers) moves the policy toward the chosen trajectories.

pytest tests/ray/test_dpo.py -q
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from hamo_ray.config import PromptConfig, TrainConfig
from hamo_ray.training.contracts import TrainResult
from hamo_ray.training.dpo import encode_pairs, train_dpo
from hamo_ray.training.objectives import trajectory_logprobs
from hamo_ray.types import TaskSpec, Trajectory


def _traj(v: int, actions: list[str], score: float) -> Trajectory:
    return Trajectory(
        task=TaskSpec(domain="d", task="t", variation=v),
        goal="focus on the animal",
        init_obs="a room",
        actions=actions,
        observations=["ok"] * len(actions),
        score=score,
        source="expert",
    )


# The actor group here; DPO through a Ray Train run with -m slow (and in the slow ETO stream).
@pytest.mark.parametrize("engine", [pytest.param("ray_train", marks=pytest.mark.slow), "actors"])
def test_dpo_raises_the_chosen_margin(ray_session, tmp_path, engine):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hamo_ray.backbones.tiny_lm import make_random_backbone
    from hamo_ray.training.group import make_group
    from hamo_ray.training.model import ModelSpec, load_model

    base = make_random_backbone(tmp_path / "base")
    tok = AutoTokenizer.from_pretrained(base)
    tcfg = TrainConfig(lr=5e-3, dpo_epochs=3, dpo_beta=0.2, engine=engine)
    init = get_peft_model(
        AutoModelForCausalLM.from_pretrained(base),
        LoraConfig(r=16, lora_alpha=32, target_modules=list(tcfg.target_modules)),
    )
    init.save_pretrained(tmp_path / "bc")
    pairs = [
        (_traj(i, ["go to outside", "focus on elephant"], 100), _traj(i, ["look around", "open door"], 0))
        for i in range(3)
    ]
    encoded = encode_pairs(pairs, tok, PromptConfig(), 1024)
    lm = load_model(ModelSpec.from_config(tcfg, str(base)))

    def margin(adapter: str) -> float:
        lm.reset_adapter(adapter, seed=0)
        with torch.no_grad():
            sums = trajectory_logprobs(lm.eval(), encoded)
        return float((sums[:, 0] - sums[:, 1]).sum())

    group = make_group(tcfg, storage=tmp_path / "ray_train")
    try:
        result = train_dpo(
            str(base),
            str(tmp_path / "bc"),
            encoded,
            tmp_path / "dpo",
            tcfg,
            pad_id=tok.pad_token_id,
            group=group,
        )
        # The same group runs a second DPO stage without reloading the base model.
        again = train_dpo(
            str(base),
            str(tmp_path / "dpo"),
            encoded,
            tmp_path / "dpo2",
            tcfg.model_copy(update={"dpo_epochs": 1}),
            pad_id=0,
            group=group,
        )
    finally:
        group.shutdown()
    assert isinstance(result, TrainResult) and (tmp_path / "dpo" / "adapter_model.safetensors").exists()
    assert margin(str(tmp_path / "dpo")) > margin(str(tmp_path / "bc"))
    assert len(result.losses) == 3 and len(result.accuracy) == 3 and result.tokens > 0
    # Per-step figures (the stream writes them as dpo/loss, dpo/lr, dpo/tokens_per_s).
    assert len(result.step_metrics) == result.steps > 1
    assert all(
        math.isfinite(m["loss"]) and m["lr"] > 0 and m["tokens_per_s"] > 0 for m in result.step_metrics
    )
    per_epoch = result.steps // 3
    first = [m["loss"] for m in result.step_metrics[:per_epoch]]
    assert result.losses[0] == pytest.approx(sum(first) / per_epoch)
    assert len(again.losses) == 1 and again.losses[0] == again.losses[0]


def test_packed_and_padded_trajectory_logprobs_agree(tmp_path):
    from transformers import AutoTokenizer

    from hamo_ray.backbones.tiny_lm import make_random_backbone
    from hamo_ray.training.model import ModelSpec, load_model

    base = make_random_backbone(tmp_path / "base")
    tok = AutoTokenizer.from_pretrained(base)
    pairs = [(_traj(0, ["go to outside", "focus on elephant"], 1), _traj(0, ["look around"], 0))]
    encoded = encode_pairs(pairs, tok, PromptConfig(), 1024)
    spec = ModelSpec.from_config(TrainConfig(), str(base))
    with torch.no_grad():
        packed = trajectory_logprobs(load_model(spec).eval(), encoded, packed=True)
        padded = trajectory_logprobs(load_model(replace(spec, packed=False)).eval(), encoded, packed=False)
    assert torch.allclose(packed, padded, atol=1e-4)
