"""Training throughput: our trainer (packed batches, long-lived workers) vs a plain transformers + peft loop.

Same model, same LoRA (r=16 on every projection), same examples, one epoch. The plain loop shuffles,
pads each micro-batch to its longest example and takes transformers' own loss (full logits); ours
packs examples without padding up to ``batch x mean length`` tokens per micro-batch and runs the LM
head on the labelled tokens only. Ours runs as stages on one long-lived worker group: stage 1 pays
for the workers and the model load, stage 2 (same examples, starting from stage 1's adapter) shows
the per-stage start-up of every later stage.

CPU mode (default): a tiny Qwen3 (hidden 128, 2 layers), float32, 512 examples of 64-1000 tokens
(log-normal around 300), the last 8 labelled, micro-batch 8.

GPU mode (``--device cuda``): a Qwen3-shaped model with random weights (``--preset qwen3-1.7b``,
``qwen3-4b``, ``qwen3-8b``), bf16, examples like behavioural cloning (log-normal, mean ~1,000
tokens, max 4,096, the last 16 labelled), micro-batch 4 (the plain loop's batch; ours packs). MFU counts the model FLOPs of a frozen
base with LoRA: 4 x parameters per token (forward plus the input gradients) plus causal attention
(QK^T and AV over each example's own prefix, forward and backward), over 989 TFLOP/s (H100/H200
dense bf16). Ours runs with the defaults (on GPU: packs sized for the device, ``train.pack_tokens``
auto, and the fused kernels, ``train.fused``). Extra rows (``--variants``): ``before`` (the earlier
defaults: batch x mean-length packs, no fused kernels), ``unfused`` (device-sized packs, no fused
kernels), ``compile`` (``train.compile``: each decoder layer through torch.compile), ``pack16k``
(16,384-token packs), ``zero2`` (DeepSpeed ZeRO-2 instead of DDP), ``liger`` (Liger's
RMSNorm/SwiGLU/RoPE kernels).

    python benchmarks/bench_train.py                                     # CPU
    python benchmarks/bench_train.py --device cuda --preset qwen3-1.7b --variants before unfused pack16k
    python benchmarks/bench_train.py --n 64 --gpu-lengths   # the GPU mode's code path, on CPU
    python benchmarks/bench_train.py --startup --stages 4   # per-stage start-up of the training engines
    python benchmarks/bench_train.py --device cuda --skip-plain --loop fused unfused compile before fused:16384 \
        --profile kernels.txt                               # the loop in-process (no Ray), per variant

``--startup`` measures, side by side in one run, each stage's start-up (the stage's wall time outside
its training steps: workers, process group, model load, adapter reset, moving the job and the
adapter) of three engines over ``--stages`` stages of 1 epoch on ``--n`` examples (default 32), two
workers: one long-lived Ray Train run for all stages (``train.engine=ray_train``, the default), the
long-lived Ray Core actor group (``train.engine=actors``), and one ``TorchTrainer.fit`` per stage
(``train.keep_workers=false``, the pattern the long-lived run replaces).

The table is printed and its rows written as JSON (``--json``, default
``benchmarks/results/bench_train.json``, see ``benchmarks/common.py``), one row per loop, each with
the set-up it was measured in.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from hamo_ray.config import TrainConfig
from hamo_ray.training.examples import Example

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PEAK_FLOPS = 989e12  # H100/H200 SXM dense bf16
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, vocab_size=2048, tie_word_embeddings=True),
    "qwen3-1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True),
    "qwen3-4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True),
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False),
}  # fmt: skip


def build_model(preset: str, path: Path, device: str, bf16: bool) -> tuple[Any, int]:
    """Save a randomly initialised Qwen3 of ``preset``'s shape to ``path``; (config, parameter count)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(**PRESETS[preset], max_position_embeddings=8192, pad_token_id=0)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM(cfg).to(torch.bfloat16 if bf16 else torch.float32)
    model.save_pretrained(path, safe_serialization=True)
    n_params = sum(p.numel() for p in model.parameters())
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return cfg, n_params


def make_examples(n: int, vocab: int, gpu_lengths: bool, seed: int = 0) -> list[Example]:
    """Random token examples: BC-like lengths (GPU mode) or the CPU mode's shorter ones."""
    rng = np.random.default_rng(seed)
    if gpu_lengths:
        lengths, labelled = np.clip(rng.lognormal(np.log(900), 0.6, n), 128, 4096).astype(int), 16
    else:
        lengths, labelled = np.clip(rng.lognormal(np.log(300), 0.5, n), 64, 1000).astype(int), 8
    out = []
    for i, length in enumerate(lengths):
        ids = rng.integers(3, vocab, length).tolist()
        out.append(Example(ids, [-100] * (length - labelled) + ids[-labelled:], f"t{i}"))
    return out


def model_flops(cfg: Any, n_params: int, data: list[Example]) -> float:
    """Model FLOPs of one epoch: 4 x params per token plus causal attention (forward + input gradients)."""
    d_attn = cfg.num_attention_heads * cfg.head_dim
    tokens = sum(len(e.input_ids) for e in data)
    attn_fwd = sum(
        4 * cfg.num_hidden_layers * d_attn * len(e.input_ids) * (len(e.input_ids) + 1) / 2 for e in data
    )
    return 2 * (2 * n_params * tokens + attn_fwd)


def plain_loop(base: str, data: list[Example], batch: int, device: str, bf16: bool, warmup: int) -> dict:
    """A plain transformers + peft loop: shuffled padded batches, ``model(labels=...).loss``, AdamW."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    dtype = torch.bfloat16 if bf16 else torch.float32
    model = AutoModelForCausalLM.from_pretrained(base, dtype=dtype, attn_implementation="sdpa").to(device)
    model = get_peft_model(
        model, LoraConfig(r=16, lora_alpha=32, target_modules=TARGETS, task_type="CAUSAL_LM")
    )
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=2e-4)
    order = list(range(len(data)))
    random.Random(0).shuffle(order)
    batches = [order[s : s + batch] for s in range(0, len(order), batch)]
    cuda = device == "cuda"
    model.train()
    tokens = positions = 0
    start = time.perf_counter()
    for step, idx in enumerate(batches):
        if step == warmup:  # timing starts after the warm-up steps (allocator, kernels)
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            start, tokens, positions = time.perf_counter(), 0, 0
        rows = [data[i] for i in idx]
        width = max(len(e.input_ids) for e in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        labels = torch.full((len(rows), width), -100, dtype=torch.long)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        for r, e in enumerate(rows):
            ids[r, : len(e.input_ids)] = torch.tensor(e.input_ids)
            labels[r, : len(e.labels)] = torch.tensor(e.labels)
            mask[r, : len(e.input_ids)] = 1
        loss = model(input_ids=ids.to(device), attention_mask=mask.to(device), labels=labels.to(device)).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        tokens += int(mask.sum())
        positions += mask.numel()
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0
    timed = len(batches) - min(warmup, len(batches) - 1)
    del model, opt, params
    if cuda:
        torch.cuda.empty_cache()
    return {"tokens": tokens, "seconds": seconds, "padding": 1 - tokens / positions, "peak_gib": peak,
            "steps": timed, "examples_timed": sum(len(b) for b in batches[-timed:])}  # fmt: skip


def ours(base: str, data: list[Example], args, tmp: Path, emit: Callable[[str, dict], None]) -> None:
    """Our trainer as stages on one long-lived group: cold stage, warm stage, then the variants.

    Each finished stage is passed to ``emit(name, row)`` at once (a run cut short keeps it).
    """
    from hamo_ray.training.actors import TrainerGroup
    from hamo_ray.training.trainer import train_model

    gpu = args.device == "cuda"
    common = dict(num_workers=1, target_modules=TARGETS, batch_size=args.batch, use_gpu=gpu, strategy="ddp")
    common["cpus_per_worker"] = 4 if gpu else args.cpus
    base_cfg = TrainConfig(**common)
    stages = [("ours (cold stage)", base_cfg), ("ours", base_cfg)]
    lengths = [len(e.input_ids) for e in data]
    before = max(max(lengths), -(-args.batch * sum(lengths) // len(lengths)))  # the old default budget
    extra = {
        "before": TrainConfig(**common, fused=False, pack_tokens=before),
        "unfused": TrainConfig(**common, fused=False),
        "compile": TrainConfig(**common, compile=True),
        "pack16k": TrainConfig(**common, pack_tokens=16384),
        "zero2": TrainConfig(**{**common, "strategy": "deepspeed"}),
        "liger": TrainConfig(**common, liger=True),
        "padded": TrainConfig(**common, packing=False),
    }
    stages += [(f"ours + {v}", extra[v]) for v in args.variants]
    start = time.perf_counter()
    group = TrainerGroup(base_cfg)
    group_s = time.perf_counter() - start
    prev = None
    try:
        for k, (name, tcfg) in enumerate(stages):
            t = time.perf_counter()
            try:
                r = train_model(base, data, tmp / f"stage{k}", tcfg.model_copy(update={"epochs": 1}), pad_id=0,
                                init_adapter=prev, seed=k, name=name, group=group)  # fmt: skip
            except Exception as e:  # a variant that fails (say, liger missing) leaves the others
                logging.exception("%s failed", name)
                emit(name, {"error": repr(e)[:300]})
                continue
            wall = time.perf_counter() - t + (group_s if k == 0 else 0.0)
            prev = r.path if name != "ours + liger" else prev
            emit(name, {"tokens": r.tokens, "seconds": r.seconds, "padding": r.padding, "steps": r.steps,
                        "peak_gib": r.peak_gib, "startup_s": wall - r.seconds, "loss": r.loss})  # fmt: skip
    finally:
        group.shutdown()


LOOP_VARIANTS = ("fused", "unfused", "compile", "before")


def loop_steps(base: str, data: list[Example], args, tmp: Path, emit: Callable[[str, dict], None]) -> None:
    """``--loop``: the training loop in this process (no Ray), one model load per variant, timed per step.

    Variants: ``fused`` (the GPU defaults: fused kernels, device-sized packs), ``unfused`` (the same
    packs without them), ``compile`` (fused + ``train.compile``), ``before`` (the earlier defaults:
    no fused kernels, batch x mean-length packs); a ``:N`` suffix sets the pack budget to N tokens.
    Each runs ``--warmup`` steps (compilation included), then times ``--steps`` steps between device
    synchronisations. ``--profile PATH`` writes the first variant's kernel table for one step.
    """
    import math

    import torch

    from hamo_ray.training.contracts import ModelSpec, StepConfig
    from hamo_ray.training.model import load_model
    from hamo_ray.training.packing import collate, device_pack_tokens, pack_batches
    from hamo_ray.training.stepper import Stepper

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    lengths = [len(e.input_ids) for e in data]
    batch_budget = max(max(lengths), math.ceil(args.batch * sum(lengths) / len(lengths)))

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    for k, variant in enumerate(args.loop):
        name, _, fixed = variant.partition(":")
        t0 = time.perf_counter()
        try:
            if name not in LOOP_VARIANTS:
                raise ValueError(f"unknown --loop variant {name!r} (one of {', '.join(LOOP_VARIANTS)})")
            spec = ModelSpec(base, target_modules=tuple(TARGETS), bf16=cuda, packed=True,
                             fused=name in ("fused", "compile"), compile=name == "compile")  # fmt: skip
            lm = load_model(spec, device)
            lm.reset_adapter(None, seed=0)
            if fixed:
                budget = int(fixed)
            elif name == "before":
                budget = batch_budget
            else:
                budget = device_pack_tokens(lm, lengths, args.batch, device)
            packs = pack_batches(lengths, budget, 0, 0)
            need = args.warmup + args.steps + (1 if args.profile and k == 0 else 0)
            packs = (packs * math.ceil(need / len(packs)))[:need]
            stepper = Stepper(lm, StepConfig(), len(packs), device)
            lm.train()

            def step(idx: list[int], stepper: Any = stepper) -> int:
                batch = collate([data[i] for i in idx], packed=True)
                stepper.step(-stepper.model(**batch.model_inputs(device)).mean())
                return batch.tokens

            for idx in packs[: args.warmup]:
                step(idx)
            sync()
            warm = time.perf_counter() - t0
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            t = time.perf_counter()
            tokens = sum(step(idx) for idx in packs[args.warmup : args.warmup + args.steps])
            sync()
            seconds = time.perf_counter() - t
            if args.profile and k == 0:
                from torch.profiler import ProfilerActivity, profile

                acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
                with profile(activities=acts) as prof:
                    step(packs[-1])
                    sync()
                table = prof.key_averages().table(
                    sort_by="cuda_time_total" if cuda else "cpu_time_total",
                    row_limit=40,
                    max_name_column_width=70,
                )
                Path(args.profile).write_text(table)
            peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0
            del stepper, lm, step
            if cuda:
                torch.cuda.empty_cache()
            emit(f"loop {variant} ({budget:,}-token packs)", {"tokens": tokens, "seconds": seconds, "padding": 0.0, "steps": args.steps,
                                     "peak_gib": peak, "startup_s": warm, "pack_tokens": budget,
                                     "ms_per_step": seconds / args.steps * 1e3})  # fmt: skip
        except Exception as e:  # one variant failing (say, compile) leaves the others
            logging.exception("%s failed", variant)
            emit(f"loop {variant}", {"error": repr(e)[:300]})


def startup(base: str, data: list[Example], args, tmp: Path, emit: Callable[[str, dict], None]) -> None:
    """Per-stage start-up of the training engines: the first stage and the later ones, side by side."""
    from hamo_ray.training.group import KeptGroup
    from hamo_ray.training.trainer import train_model

    common = dict(num_workers=2, cpus_per_worker=0.5, target_modules=TARGETS, batch_size=args.batch, epochs=1)
    engines = [
        ("ray_train, one run", TrainConfig(**common, engine="ray_train")),
        ("actors, one group", TrainConfig(**common, engine="actors")),
        ("ray_train, fit per stage", TrainConfig(**common, engine="ray_train", keep_workers=False)),
    ]
    for name, tcfg in engines:
        kept = KeptGroup(tcfg, storage=tmp / "ray_train")
        prev, times, train_s = None, [], []
        try:
            for k in range(args.stages):
                t = time.perf_counter()
                r = train_model(base, data, tmp / f"{name[:6]}{k}", tcfg, pad_id=0, init_adapter=prev,
                                seed=k, name=f"{name} {k}", group=kept.get())  # fmt: skip
                times.append(time.perf_counter() - t - r.seconds)
                train_s.append(r.seconds)
                prev = r.path
        finally:
            kept.close()
        later = times[1:] or [float("nan")]
        emit(name, {"first_startup_s": times[0], "later_startup_s": float(np.mean(later)),
                    "later_max_s": float(np.max(later)), "train_s": float(np.mean(train_s)),
                    "stages": args.stages})  # fmt: skip


def main() -> None:
    from common import Results, add_json_argument

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument(
        "--preset", default=None, choices=sorted(PRESETS), help="default: tiny on CPU, qwen3-1.7b on GPU"
    )
    parser.add_argument("--n", type=int, default=None, help="examples (default 512 CPU, 384 GPU)")
    parser.add_argument("--batch", type=int, default=None, help="micro-batch (default 8 CPU, 4 GPU)")
    parser.add_argument("--gpu-lengths", action="store_true", help="BC-like lengths on CPU too")
    parser.add_argument(
        "--variants", nargs="*", default=[],
        choices=["before", "unfused", "compile", "pack16k", "zero2", "liger", "padded"],
    )  # fmt: skip
    parser.add_argument("--cpus", type=int, default=2)
    parser.add_argument("--skip-plain", action="store_true")
    parser.add_argument("--startup", action="store_true", help="per-stage start-up of the training engines")
    parser.add_argument("--stages", type=int, default=4, help="--startup: stages per engine")
    parser.add_argument(
        "--loop",
        nargs="*",
        default=None,
        metavar="VARIANT[:TOKENS]",
        help=f"time the loop in-process instead (no Ray): {', '.join(LOOP_VARIANTS)}",
    )
    parser.add_argument("--warmup", type=int, default=3, help="--loop: untimed steps per variant")
    parser.add_argument("--steps", type=int, default=5, help="--loop: timed steps per variant")
    parser.add_argument("--profile", default=None, help="--loop: write the first variant's kernel table here")
    add_json_argument(parser, __file__)
    args = parser.parse_args()
    gpu = args.device == "cuda"
    args.preset = args.preset or ("qwen3-1.7b" if gpu else "tiny")
    args.n = args.n or (32 if args.startup else 384 if gpu else 512)
    args.batch = args.batch or (4 if gpu else 8)
    results = Results(__file__, args)
    logging.basicConfig(level=logging.WARNING)
    import torch

    torch.set_num_threads(args.cpus if not gpu else 8)
    setup: dict[str, Any] = {"device": args.device, "preset": args.preset}
    rows: dict[str, dict] = {}

    def emit(name: str, row: dict) -> None:  # every row carries the set-up it was measured in
        if "tokens" in row and row.get("seconds"):
            row["tok_s"] = row["tokens"] / row["seconds"]
            row["mfu"] = row["tok_s"] * setup["flops_per_token"] / PEAK_FLOPS if gpu else None
        rows[name] = row
        results.add({"loop": name, **row, **setup})
        print(name, json.dumps(row), flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        cfg, n_params = build_model(args.preset, Path(tmp) / "base", args.device, bf16=gpu)
        print(
            f"built {args.preset}: {n_params / 1e9:.3f}B parameters in {time.perf_counter() - t:.0f}s",
            flush=True,
        )
        data = make_examples(args.n, cfg.vocab_size, gpu or args.gpu_lengths)
        lengths = [len(e.input_ids) for e in data]
        setup.update(
            n_params=n_params, examples=len(data), tokens=sum(lengths), mean_len=float(np.mean(lengths))
        )
        setup.update(max_len=max(lengths), flops_per_token=model_flops(cfg, n_params, data) / sum(lengths))
        if not args.skip_plain and not args.startup:
            warmup = 3 if gpu else 0
            emit(
                "plain transformers+peft",
                plain_loop(str(Path(tmp) / "base"), data, args.batch, args.device, gpu, warmup),
            )
        if args.loop is not None:
            loop_steps(str(Path(tmp) / "base"), data, args, Path(tmp), emit)
        else:
            import ray

            ray.init(address="local", num_cpus=max(args.cpus, 4 if gpu else 1), num_gpus=1 if gpu else 0,
                     include_dashboard=False, configure_logging=False, log_to_driver=True)  # fmt: skip
            try:
                (startup if args.startup else ours)(str(Path(tmp) / "base"), data, args, Path(tmp), emit)
            finally:
                ray.shutdown()
    if args.startup:
        print(f"\nstart-up per stage, {args.stages} stages of {args.n} examples, 2 workers on {args.device}")
        print(
            "| engine | first stage s | later stages s (mean) | later max s | training s per stage | first/later |"
        )
        print("|---|---:|---:|---:|---:|---:|")
        for name, r in rows.items():
            ratio = r["first_startup_s"] / r["later_startup_s"] if r["later_startup_s"] > 0 else float("nan")
            print(f"| {name} | {r['first_startup_s']:.1f} | {r['later_startup_s']:.2f} | {r['later_max_s']:.2f} | {r['train_s']:.1f} | {ratio:.1f} |")  # fmt: skip
        base_later = rows.get("ray_train, fit per stage", {}).get("later_startup_s")
        ours_later = rows.get("ray_train, one run", {}).get("later_startup_s")
        if base_later and ours_later:
            print(f"later-stage start-up: one run {ours_later:.2f}s vs fit per stage {base_later:.2f}s "
                  f"({base_later / ours_later:.1f}x)")  # fmt: skip
        results.finish()
        return
    plain = rows.get("plain transformers+peft", {}).get("tok_s")
    where = torch.cuda.get_device_name(0) if gpu else "CPU"
    print(
        f"\n{args.preset} on {where}: {args.n} examples, mean {setup['mean_len']:.0f} tokens, "
        f"micro-batch {args.batch}"
    )
    print("| loop | tokens/s | x plain | padding | MFU | peak GiB | steps | start-up s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, r in rows.items():
        if "error" in r:
            print(f"| {name} | failed: {r['error'][:80]} |||||||")
            continue
        ratio = f"{r['tok_s'] / plain:.2f}x" if plain else "-"
        mfu = f"{r['mfu']:.1%}" if r.get("mfu") is not None else "-"
        start = f"{r['startup_s']:.1f}" if "startup_s" in r else "-"
        print(f"| {name} | {r['tok_s']:,.0f} | {ratio} | {r['padding']:.1%} | {mfu} | {r['peak_gib']:.1f} | {r['steps']} | {start} |")  # fmt: skip
    results.finish()


if __name__ == "__main__":
    main()
