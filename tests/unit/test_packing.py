"""Padding-free packing: the packed loss and LoRA gradients equal the padded ones; packs respect the budget.

A tiny random Qwen3 (real transformers + peft) in float32 on CPU: the same examples as one packed
row (attention kept per example by ``hamo_packed``) and as a padded batch (SDPA + attention mask),
both through ``ActionLM`` (LM head on the labelled positions only), and through the plain
``model(labels=...).loss`` of transformers as the reference.

    pytest tests/unit/test_packing.py -q
"""

from __future__ import annotations

import random

import pytest

from hamo_ray.training.examples import Example
from hamo_ray.training.packing import collate, pack_batches

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


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

    return str(make_random_backbone(tmp_path_factory.mktemp("pack") / "base"))


def _lm(backbone: str, packed: bool):
    import torch

    from hamo_ray.training.model import ModelSpec, load_model

    spec = ModelSpec(backbone, lora_r=8, lora_alpha=16, target_modules=tuple(TARGETS), packed=packed)
    lm = load_model(spec)
    lm.reset_adapter(None, seed=0)
    torch.manual_seed(1)
    with torch.no_grad():  # non-zero B so that every LoRA matrix gets a gradient
        for name, p in lm.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    return lm


def _loss_and_grads(lm, batch):
    logp = lm(**batch.model_inputs("cpu"))
    loss = -logp.mean()
    lm.zero_grad(set_to_none=True)
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in lm.named_parameters() if p.requires_grad}


def test_packed_loss_and_lora_grads_equal_padded(backbone):
    import torch

    exs = _examples(5)
    packed_lm, padded_lm = _lm(backbone, True), _lm(backbone, False)
    packed = collate(exs, packed=True)
    padded = collate(exs, packed=False, pad_id=0)
    assert packed.input_ids.shape == (1, sum(len(e.input_ids) for e in exs))
    assert packed.positions == packed.tokens and padded.positions > padded.tokens
    assert packed.targets.tolist() == padded.targets.tolist()  # the same labelled tokens, same order
    loss_p, grads_p = _loss_and_grads(packed_lm, packed)
    loss_d, grads_d = _loss_and_grads(padded_lm, padded)
    assert loss_p == pytest.approx(loss_d, rel=1e-5)
    assert len(grads_p) == len(grads_d) == 2 * len(TARGETS) * 2  # A and B, 7 targets, 2 layers
    for name, g in grads_p.items():
        assert torch.allclose(g, grads_d[name], rtol=1e-4, atol=1e-6), name
    # The reference: transformers' own loss on the padded batch (full logits, shifted labels).
    labels = torch.full_like(padded.input_ids, -100)
    for r, e in enumerate(exs):
        labels[r, : len(e.labels)] = torch.tensor(e.labels)
    ref = padded_lm.model(input_ids=padded.input_ids, attention_mask=padded.attention_mask, labels=labels)
    assert float(ref.loss) == pytest.approx(loss_d, rel=1e-5)


def test_packed_attention_stays_within_each_example(backbone):
    """An example's log-probs do not change with what is packed before it."""
    import torch

    lm = _lm(backbone, True)
    a, b = _examples(2, seed=3)
    with torch.no_grad():
        alone = lm(**collate([b], packed=True).model_inputs("cpu"))
        after_a = lm(**collate([a, b], packed=True).model_inputs("cpu"))
    n_a = len(collate([a]).targets)
    assert torch.allclose(after_a[n_a:], alone, atol=1e-5)


def test_pack_batches_respects_the_budget_and_covers_every_example():
    rng = random.Random(0)
    lengths = [rng.randint(10, 500) for _ in range(300)] + [900]
    packs = pack_batches(lengths, token_budget=800, seed=0, epoch=0)
    flat = sorted(i for p in packs for i in p)
    assert flat == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in p) <= 800 or len(p) == 1 for p in packs)
    fill = sum(lengths) / (800 * len(packs))
    assert fill > 0.9  # first-fit-decreasing packs nearly full
    assert pack_batches(lengths, 800, seed=0, epoch=1) != packs  # a new order each epoch
    with pytest.raises(ValueError, match="token_budget"):
        pack_batches(lengths, 0, 0, 0)


def test_collate_rejects_mismatched_labels():
    with pytest.raises(ValueError, match="example 0"):
        collate([{"input_ids": [1, 2, 3], "labels": [-100, 2]}])
