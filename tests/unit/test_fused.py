"""The fused training kernels (hamo_ray/training/fused.py) compute what they replace, on CPU.

The fused LoRA linear against peft's ``lora.Linear`` (outputs, input and LoRA gradients, float64),
the RMSNorm swap against the model's own, the chunked log-probs against cross-entropy (with the head
trained too), and a whole packed step of ``ActionLM`` with ``ModelSpec.fused`` against the unfused
one. Also the pack budget chosen for a device (``train.pack_tokens: auto``).

    pytest tests/unit/test_fused.py -q
"""

from __future__ import annotations

import random

import pytest

from hamo_ray.training.examples import Example
from hamo_ray.training.packing import collate

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _peft_linear(bias: bool, dropout: float = 0.0, seed: int = 0, lora_bias: bool = False):
    import torch
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    base = torch.nn.Sequential(torch.nn.Linear(24, 40, bias=bias)).double()
    lora = LoraConfig(r=4, lora_alpha=12, target_modules=["0"], lora_dropout=dropout, lora_bias=lora_bias)
    model = get_peft_model(base, lora)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.3)
    return model


def _grads(model, x):
    model.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    y = model(x)
    (y * y.detach().sin()).sum().backward()  # a non-uniform upstream gradient
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return y.detach(), x.grad.clone(), grads


@pytest.mark.parametrize("bias", [False, True])
def test_fused_lora_linear_equals_peft(bias):
    import torch

    from hamo_ray.training.fused import fuse_lora, unfuse

    model = _peft_linear(bias)
    x = torch.randn(3, 7, 24, dtype=torch.float64)
    ref = _grads(model, x)
    assert fuse_lora(model) == 1
    got = _grads(model, x)
    assert torch.allclose(got[0], ref[0], atol=1e-12)
    assert torch.allclose(got[1], ref[1], atol=1e-12)
    assert set(got[2]) == set(ref[2]) and len(got[2]) == 2
    for name, g in got[2].items():
        assert torch.allclose(g, ref[2][name], atol=1e-12), name
    unfuse(model)
    assert "forward" not in vars(model.base_model.model[0])


def test_fused_lora_falls_back_where_it_does_not_apply():
    """Dropout, a disabled adapter and a merged one take peft's own forward (same outputs as unfused)."""
    import torch

    from hamo_ray.training.fused import fuse_lora

    x = torch.randn(5, 24, dtype=torch.float64)
    model = _peft_linear(False, dropout=0.5).train()
    outs = []
    for fused in (False, True):
        if fused:
            fuse_lora(model)
        torch.manual_seed(3)
        drop = model(x)
        with model.disable_adapter():
            off = model(x)
        outs.append((drop, off))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    assert torch.allclose(outs[1][1], model.base_model.model[0].base_layer(x))
    model.eval()
    unmerged = model(x)
    model.merge_adapter()
    assert torch.allclose(model(x), unmerged, atol=1e-12)  # merged: the base layer alone, peft's forward
    with_bias = _peft_linear(False, lora_bias=True)
    with torch.no_grad():
        for n, p in with_bias.named_parameters():
            if "lora_B" in n and n.endswith("bias"):
                p.normal_(0, 1.0)
    ref = with_bias(x)
    fuse_lora(with_bias)
    assert torch.allclose(with_bias(x), ref, atol=1e-12)  # lora_bias: peft's forward, its bias kept


def test_fused_rms_norm_equals_the_models():
    import torch
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    from hamo_ray.training.fused import fuse_rms_norm

    norm = Qwen3RMSNorm(32, eps=1e-6).double()
    with torch.no_grad():
        norm.weight.normal_(1, 0.2)
    x = torch.randn(2, 9, 32, dtype=torch.float64, requires_grad=True)
    ref = norm(x)
    ref.pow(2).sum().backward()
    gref, wref = x.grad.clone(), norm.weight.grad.clone()
    x.grad = norm.weight.grad = None
    holder = torch.nn.Sequential(norm)
    assert fuse_rms_norm(holder) == 1
    out = norm(x)
    out.pow(2).sum().backward()
    # the model's own norm computes in float32 whatever the input: equal to float32 precision
    assert torch.allclose(out, ref, rtol=0, atol=1e-5)
    assert torch.allclose(x.grad, gref, rtol=0, atol=1e-4)
    assert torch.allclose(norm.weight.grad, wref, rtol=0, atol=1e-4)
    exact = norm.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)  # float64 throughout
    assert torch.allclose(out, exact, rtol=0, atol=1e-12)


@pytest.mark.parametrize("train_head", [False, True])
def test_chunked_logprobs_equal_cross_entropy(train_head):
    import torch

    from hamo_ray.training.fused import chunked_logprobs

    torch.manual_seed(0)
    hidden = torch.randn(11, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 16, dtype=torch.float64, requires_grad=train_head)
    targets = torch.randint(0, 50, (11,))
    upstream = torch.randn(11, dtype=torch.float64)
    ref = -torch.nn.functional.cross_entropy(hidden @ weight.t(), targets, reduction="none")
    (ref * upstream).sum().backward()
    gh, gw = hidden.grad.clone(), weight.grad.clone() if train_head else None
    hidden.grad = weight.grad = None
    got = chunked_logprobs(hidden, weight, targets, chunk=4)  # 3 chunks, the last one short
    assert got.dtype == torch.float32
    (got * upstream).sum().backward()
    assert torch.allclose(got.double(), ref.detach(), atol=1e-5)
    # the logits are float32 (as the unfused head's .float()): equal to float32 precision
    assert torch.allclose(hidden.grad, gh, rtol=0, atol=1e-5)
    if train_head:
        assert torch.allclose(weight.grad, gw, rtol=0, atol=1e-5)
    else:
        assert weight.grad is None


def _examples(n: int, seed: int = 0) -> list[Example]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        ids = [rng.randrange(3, 200) for _ in range(rng.randint(12, 60))]
        cut = len(ids) - rng.randint(2, 6)
        out.append(Example(ids, [-100] * cut + ids[cut:], f"t{i}"))
    return out


@pytest.fixture(scope="module")
def backbone(tmp_path_factory):
    from hamo_ray.backbones.tiny_lm import make_random_backbone

    return str(make_random_backbone(tmp_path_factory.mktemp("fused") / "base"))


def _step(backbone: str, fused: bool, packed: bool = True):
    import torch

    from hamo_ray.training.model import ModelSpec, load_model

    spec = ModelSpec(
        backbone, lora_r=8, lora_alpha=16, target_modules=tuple(TARGETS), packed=packed, fused=fused
    )
    lm = load_model(spec)
    lm.reset_adapter(None, seed=0)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in lm.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    batch = collate(_examples(5), packed=packed)
    loss = -lm(**batch.model_inputs("cpu")).mean()
    loss.backward()
    patched = sum("forward" in vars(m) for m in lm.modules())
    return float(loss.detach()), {n: p.grad for n, p in lm.named_parameters() if p.requires_grad}, patched


@pytest.mark.parametrize("packed", [True, False])
def test_fused_action_lm_step_equals_unfused(backbone, packed):
    """A whole step (packed or padded) with ModelSpec.fused: the same loss and LoRA gradients."""
    import torch

    loss_f, grads_f, patched = _step(backbone, True, packed)
    loss_u, grads_u, none = _step(backbone, False, packed)
    assert none == 0 and patched == 2 * len(TARGETS) + 2 * 4 + 1  # LoRA linears; 4 norms per layer + final
    assert loss_f == pytest.approx(loss_u, rel=1e-5)
    for name, g in grads_f.items():
        assert torch.allclose(g, grads_u[name], rtol=1e-4, atol=1e-6), name


def test_device_pack_tokens_on_cpu_is_the_batch_budget():
    from hamo_ray.training.packing import device_pack_tokens

    lengths = [100, 300, 200]
    assert device_pack_tokens(None, lengths, 4, "cpu") == 800
    assert device_pack_tokens(None, [100, 3000], 1, "cpu") == 3000


def test_pack_budget_auto_is_left_to_the_worker_on_gpu():
    from hamo_ray.config import TrainConfig
    from hamo_ray.training.contracts import ModelSpec
    from hamo_ray.training.trainer import pack_budget

    lengths = [100, 300, 200]
    assert pack_budget(TrainConfig(batch_size=4), lengths, 4) == 800  # CPU default: unchanged
    assert pack_budget(TrainConfig(use_gpu=True), lengths, 4) == 0  # GPU default: the worker's choice
    assert pack_budget(TrainConfig(pack_tokens="auto"), lengths, 4) == 0
    assert pack_budget(TrainConfig(use_gpu=True), lengths, 1, device_auto=False) == 300  # DPO: a pair a step
    assert pack_budget(TrainConfig(use_gpu=True, pack_tokens=4096), lengths, 4) == 4096
    assert ModelSpec.from_config(TrainConfig(), "b").fused is False
    assert ModelSpec.from_config(TrainConfig(use_gpu=True), "b").fused is True
    assert ModelSpec.from_config(TrainConfig(fused=True), "b").fused is True
    zero3 = TrainConfig(use_gpu=True, num_workers=2, zero_stage=3)
    assert ModelSpec.from_config(zero3, "b").fused is False
