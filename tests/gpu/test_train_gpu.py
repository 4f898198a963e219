"""Training on CUDA: packed bf16 batches equal padded ones, the fused kernels and compiled layers equal the
plain ones, the device's pack budget, BC and ETO's DPO on the shared loop on the GPU.

Auto-skipped without CUDA (tests/conftest.py). Starts its own local Ray when none is running.

    pytest tests/gpu/test_train_gpu.py -q
"""

from __future__ import annotations

import random

import pytest

from hamo_ray.config import PromptConfig, TrainConfig
from hamo_ray.training.examples import Example
from hamo_ray.types import TaskSpec, Trajectory

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

    return str(make_random_backbone(tmp_path_factory.mktemp("train_gpu") / "base"))


def _examples(n: int, seed: int = 0) -> list[Example]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        ids = [rng.randrange(3, 200) for _ in range(rng.randint(24, 160))]
        out.append(Example(ids, [-100] * (len(ids) - 8) + ids[-8:], f"t{i}"))
    return out


def _lm(backbone: str, packed: bool, bf16: bool, fused: bool = False, compile: bool = False):
    import torch

    from hamo_ray.training.model import ModelSpec, load_model

    spec = ModelSpec(
        backbone, lora_r=8, lora_alpha=16, target_modules=tuple(TARGETS), bf16=bf16, packed=packed,
        fused=fused, compile=compile,
    )  # fmt: skip
    lm = load_model(spec, "cuda")
    lm.reset_adapter(None, seed=0)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in lm.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    return lm


@pytest.mark.parametrize("bf16", [False, True])
def test_packed_equals_padded_on_cuda(backbone, bf16):
    """Loss and LoRA gradients of one packed row equal the padded batch's (bf16: the varlen kernel)."""
    import torch

    from hamo_ray.training import packing

    exs = _examples(6)
    results = []
    for packed in (True, False):
        lm = _lm(backbone, packed, bf16)
        batch = packing.collate(exs, packed=packed)
        loss = -lm(**batch.model_inputs("cuda")).mean()
        loss.backward()
        grads = {n: p.grad.float() for n, p in lm.named_parameters() if p.requires_grad}
        assert all(
            p.dtype == (torch.bfloat16 if bf16 else torch.float32) for p in lm.parameters() if p.requires_grad
        )
        results.append((float(loss), grads))
    (lp, gp), (ld, gd) = results
    tol = 2e-2 if bf16 else 1e-4
    assert lp == pytest.approx(ld, rel=tol)
    for name, g in gp.items():
        err = float((g - gd[name]).norm() / (gd[name].norm() + 1e-12))
        assert err < (5e-2 if bf16 else 1e-3), (name, err)
    if bf16:
        assert packing.prepare_varlen(), "torch's varlen flash attention is unusable here (per-sequence SDPA)"


def _step(lm, exs, packed: bool = True):
    from hamo_ray.training import packing

    batch = packing.collate(exs, packed=packed)
    loss = -lm(**batch.model_inputs("cuda")).mean()
    lm.zero_grad(set_to_none=True)
    loss.backward()
    return float(loss.detach()), {n: p.grad.float() for n, p in lm.named_parameters() if p.requires_grad}


def _close(a, b, tol_loss: float, tol_grad: float) -> None:
    (la, ga), (lb, gb) = a, b
    assert la == pytest.approx(lb, rel=tol_loss)
    assert set(ga) == set(gb)
    for name, g in ga.items():
        err = float((g - gb[name]).norm() / (gb[name].norm() + 1e-12))
        assert err < tol_grad, (name, err)


@pytest.mark.parametrize("bf16", [False, True])
def test_fused_kernels_equal_unfused_on_cuda(backbone, bf16):
    """ModelSpec.fused (the GPU default: fused LoRA linears, torch.rms_norm, chunked loss): same loss and grads."""
    exs = _examples(6)
    fused = _step(_lm(backbone, True, bf16, fused=True), exs)
    plain = _step(_lm(backbone, True, bf16), exs)
    _close(fused, plain, 2e-2 if bf16 else 1e-5, 5e-2 if bf16 else 1e-4)


def test_compiled_layers_equal_eager_without_recompiling(backbone):
    """train.compile: each decoder layer compiled once with dynamic shapes; packs of other sizes reuse it."""
    import torch

    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    lm = _lm(backbone, True, True, fused=True, compile=True)
    eager = _lm(backbone, True, True, fused=True)
    graphs = []
    for seed, n in ((0, 6), (1, 9), (2, 4)):  # three pack sizes
        exs = _examples(n, seed)
        _close(_step(lm, exs), _step(eager, exs), 2e-2, 5e-2)
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[0] > 0 and graphs[1:] == [graphs[0]] * 2, (graphs, dict(counters["stats"]))


def test_device_pack_tokens_on_cuda(backbone):
    """train.pack_tokens auto on a GPU: from its memory, a multiple of 1,024, at least the longest example."""
    import torch

    from hamo_ray.training.packing import AUTO_MAX_TOKENS, device_pack_tokens

    lm = _lm(backbone, True, True)
    lengths = [len(e.input_ids) for e in _examples(4000)]  # ~370k tokens: the memory or the cap decides
    budget = device_pack_tokens(lm, lengths, 4, torch.device("cuda"))
    assert budget % 1024 == 0 and max(lengths) <= budget <= AUTO_MAX_TOKENS
    small = [len(e.input_ids) for e in _examples(40)]  # a small stage: still 8 packs or more
    assert max(small) <= device_pack_tokens(lm, small, 4, torch.device("cuda")) <= -(-sum(small) // 8)
    assert device_pack_tokens(lm, [5000], 4, torch.device("cuda")) == 5000  # never below the longest


@pytest.mark.parametrize("engine", ["ray_train", "actors"])
def test_bc_stages_on_one_gpu_group(ray_gpu, backbone, tmp_path, engine):
    """Two behavioural-cloning stages (DDP strategy, bf16, packed) on one group: the second starts fast.

    ``ray_train``: one long-lived Ray Train run (NCCL process group, Ray Train's device); ``actors``: the
    Ray Core actor group."""
    from hamo_ray.training.group import make_group
    from hamo_ray.training.trainer import train_model

    tcfg = TrainConfig(use_gpu=True, target_modules=TARGETS, batch_size=4, cpus_per_worker=1, engine=engine)
    group = make_group(tcfg, storage=tmp_path / "ray_train")
    try:
        r1 = train_model(
            backbone,
            _examples(32),
            tmp_path / "s1",
            tcfg.model_copy(update={"epochs": 2, "lr": 2e-3}),
            pad_id=0,
            group=group,
        )
        r2 = train_model(
            backbone,
            _examples(32, 1),
            tmp_path / "s2",
            tcfg.model_copy(update={"epochs": 1}),
            pad_id=0,
            init_adapter=r1.path,
            group=group,
        )
    finally:
        group.shutdown()
    assert r1.losses[1] < r1.losses[0] and r1.padding == 0.0 and r1.peak_gib > 0
    assert r1.steps >= 2 * 8  # the GPU default packs (chosen on the worker) keep >= 8 steps per epoch
    assert r2.startup_s < 5.0, r2.startup_s
    assert (tmp_path / "s2" / "adapter_model.safetensors").exists()


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


@pytest.mark.parametrize("strategy", ["ddp", "deepspeed"])
def test_dpo_on_cuda(ray_gpu, tmp_path, strategy):
    """ETO's DPO on the GPU (bf16, batches on the device) raises the chosen-over-rejected margin."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hamo_ray.backbones.tiny_lm import make_random_backbone
    from hamo_ray.training.dpo import encode_pairs, train_dpo
    from hamo_ray.training.model import ModelSpec, load_model
    from hamo_ray.training.objectives import trajectory_logprobs

    base = make_random_backbone(tmp_path / "base")
    tok = AutoTokenizer.from_pretrained(base)
    tcfg = TrainConfig(
        use_gpu=True, lr=5e-3, dpo_epochs=3, dpo_beta=0.2, strategy=strategy, cpus_per_worker=1
    )
    init = get_peft_model(
        AutoModelForCausalLM.from_pretrained(base),
        LoraConfig(r=16, lora_alpha=32, target_modules=list(tcfg.target_modules)),
    )
    init.save_pretrained(tmp_path / "bc")
    pairs = [
        (_traj(i, ["go to outside", "focus on elephant"], 100), _traj(i, ["look around", "open door"], 0))
        for i in range(4)
    ]
    encoded = encode_pairs(pairs, tok, PromptConfig(), 1024)
    result = train_dpo(
        str(base), str(tmp_path / "bc"), encoded, tmp_path / "dpo", tcfg, pad_id=tok.pad_token_id
    )
    lm = load_model(ModelSpec.from_config(TrainConfig(), str(base)), "cuda")  # float32 check

    def margin(adapter: str) -> float:
        lm.reset_adapter(adapter, seed=0)
        with torch.no_grad():
            sums = trajectory_logprobs(lm.eval(), encoded, device="cuda")
        return float((sums[:, 0] - sums[:, 1]).sum())

    assert len(result.losses) == 3 and all(x == x for x in result.losses)
    assert margin(str(tmp_path / "dpo")) > margin(str(tmp_path / "bc"))
