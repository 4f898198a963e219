"""DPO on trajectory pairs through Ray Train moves the policy toward the chosen trajectories."""

from __future__ import annotations

import torch

from hamo_ray.config import PromptConfig, TrainConfig
from hamo_ray.training.dpo import _sequence_logprob, encode_pairs, train_dpo
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


def test_dpo_raises_the_chosen_margin(ray_session, tmp_path):
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hamo_ray.training.tiny_lm import make_random_backbone

    base = make_random_backbone(tmp_path / "base")
    tok = AutoTokenizer.from_pretrained(base)
    tcfg = TrainConfig(lr=5e-3)
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

    def margin(adapter: str) -> float:
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter).eval()
        with torch.no_grad():
            return sum(
                float(_sequence_logprob(model, p["chosen"], tok.pad_token_id))
                - float(_sequence_logprob(model, p["rejected"], tok.pad_token_id))
                for p in encoded
            )

    result = train_dpo(
        str(base),
        str(tmp_path / "bc"),
        encoded,
        tmp_path / "dpo",
        tcfg,
        tmp_path / "train",
        pad_id=tok.pad_token_id,
        epochs=3,
    )
    assert (tmp_path / "dpo" / "adapter_model.safetensors").exists()
    assert margin(str(tmp_path / "dpo")) > margin(str(tmp_path / "bc"))
    assert len(result["losses"]) == 3
