"""Training throughput: our Ray Train trainer vs a plain single-process transformers + peft loop.

Same model (a tiny Qwen3 backbone like the embedded default: hidden 128, 2 layers), same LoRA
(r=16 on every projection), same examples (lengths drawn like behavioural-cloning prompts, 64-1000
tokens), same micro-batch, one epoch, float32 on CPU. The baseline shuffles and pads each batch to
its longest example; ours buckets by length (``length_bucketed_batches``). Tokens/s counts real
(non-padding) tokens over the training loop; "wall" adds our Ray Train start-up (worker, process
group, model load), paid once per stage.

    python benchmarks/bench_train.py                      # 512 examples, batch 8
    python benchmarks/bench_train.py --strategy deepspeed # ZeRO-2 on CPU (first run compiles an op)
"""

from __future__ import annotations

import argparse
import logging
import random
import tempfile
import time
from pathlib import Path

import numpy as np

from hamo_ray.config import BackboneConfig, TrainConfig
from hamo_ray.training.examples import Example

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def examples(n: int, vocab: int, seed: int = 0) -> list[Example]:
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(300), 0.5, n), 64, 1000).astype(int)
    out = []
    for i, length in enumerate(lengths):
        ids = rng.integers(3, vocab, length).tolist()
        out.append(Example(ids, [-100] * (length - 8) + ids[-8:], f"t{i}"))
    return out


def plain_loop(
    base: str, data: list[Example], batch: int, lr: float, threads: int
) -> tuple[float, int, float]:
    """(seconds, real tokens, padding fraction) of a plain transformers + peft loop."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from hamo_ray.training.trainer import _collate

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, attn_implementation="sdpa")
    model = get_peft_model(
        model, LoraConfig(r=16, lora_alpha=32, target_modules=TARGETS, task_type="CAUSAL_LM")
    )
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr)
    order = list(range(len(data)))
    random.Random(0).shuffle(order)
    tokens = positions = 0
    model.train()
    start = time.perf_counter()
    for s in range(0, len(order), batch):
        ids, labels, mask = _collate(
            [{"input_ids": data[i].input_ids, "labels": data[i].labels} for i in order[s : s + batch]], 0
        )
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        tokens += int(mask.sum())
        positions += mask.numel()
    return time.perf_counter() - start, tokens, 1 - tokens / positions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--strategy", default="ddp", choices=["ddp", "deepspeed"])
    parser.add_argument("--cpus", type=int, default=2)
    args = parser.parse_args()
    import ray

    from hamo_ray.training.tiny_lm import make_random_backbone
    from hamo_ray.training.trainer import train_model

    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory() as tmp:
        base = str(make_random_backbone(Path(tmp) / "base", cfg=BackboneConfig(vocab_size=2048)))
        from transformers import AutoConfig

        data = examples(args.n, AutoConfig.from_pretrained(base).vocab_size)
        t_plain, tok_plain, pad_plain = plain_loop(base, data, args.batch, 2e-4, args.cpus)
        ray.init(
            address="local",
            num_cpus=args.cpus,
            include_dashboard=False,
            configure_logging=False,
            log_to_driver=False,
        )
        tcfg = TrainConfig(num_workers=args.workers, strategy=args.strategy, target_modules=TARGETS)
        start = time.perf_counter()
        result = train_model(
            base,
            data,
            Path(tmp) / "out",
            tcfg,
            Path(tmp) / "storage",
            pad_id=0,
            epochs=1,
            batch_size=args.batch,
        )
        wall = time.perf_counter() - start
        ray.shutdown()
    ours, plain = result.tokens / result.seconds, tok_plain / t_plain
    print(f"{'trainer':>30} | {'tokens/s (loop)':>15} | {'tokens/s (wall)':>15} | {'padding':>7} | tokens")
    print("-" * 86)
    name = f"ours ({args.strategy}, {args.workers} worker{'s' if args.workers > 1 else ''})"
    print(
        f"{name:>30} | {ours:15.0f} | {result.tokens / wall:15.0f} | {result.padding:7.1%} | {result.tokens}"
    )
    print(
        f"{'plain transformers+peft loop':>30} | {plain:15.0f} | {plain:15.0f} | {pad_plain:7.1%} | {tok_plain}"
    )
    print(f"{'ratio (ours / plain)':>30} | {ours / plain:14.2f}x | {result.tokens / wall / plain:14.2f}x |")


if __name__ == "__main__":
    main()
