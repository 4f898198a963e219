"""The GPU plan of a run: which GPUs serve and which train, and a memory estimate per GPU.

Printed by ``jobs/stream.py --dry-run`` and checked against the card size before any work, so a preset
that would run out of memory says so on a laptop instead of an hour into a cluster job::

    plan = gpu_plan(cfg, card_gib=80)
    print(format_plan(plan))          # serve: 2 replicas x 1 GPU ... train: 6 workers ... fits: yes

The estimate is arithmetic on the model's shape (read from ``config.json`` under ``model.path`` when it is
there, else from the known Qwen3 shapes by ``model.name``), not a measurement: expect it to be within
about 20% of what ``torch.cuda.max_memory_allocated`` reports, plus the CUDA context (~1 GiB) and
allocator fragmentation. Its parts, per training GPU:

- base weights: 2 bytes per parameter in bf16 (4 in float32); ZeRO-3 shards them over the workers;
- LoRA: parameters, gradients and AdamW's two moments in float32 (16 bytes per LoRA parameter);
- activations for a micro-batch of ``batch_size x max_seq_len`` tokens (the packed token budget's worst
  case): every layer keeps its projections' inputs for the backward pass; with gradient checkpointing
  only each layer's input is kept, plus one layer recomputed at a time. Attention runs through fused
  kernels (SDPA / flash), so no ``seq x seq`` score matrix is kept;
- logits: the loss is computed on the labelled (action) positions only, so the vocabulary-sized
  logits of every position are never materialised (see ``hamo_ray.training``).

Per serving GPU vLLM takes ``serve.gpu_memory_utilization`` of the card; the weights (split over the
tensor-parallel group) must fit in it, and what is left holds the KV cache, reported in tokens.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from hamo_ray.config import HamoConfig

GIB = 2**30


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a decoder-only transformer (Qwen3 / Llama layout: GQA attention, SwiGLU MLP)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    qk_norm: bool = True  # Qwen3 normalises queries and keys per head (two head_dim-sized weights a layer)

    @property
    def params(self) -> int:
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h
        mlp = 3 * h * self.intermediate
        embed = self.vocab * h * (1 if self.tied else 2)
        norms = 2 * h + (2 * self.head_dim if self.qk_norm else 0)
        return self.layers * (attn + mlp + norms) + embed + h

    def lora_params(self, r: int, targets: list[str]) -> int:
        """LoRA parameters of rank ``r`` on the named projections of every layer."""
        h, q, kv, i = (
            self.hidden,
            self.heads * self.head_dim,
            self.kv_heads * self.head_dim,
            self.intermediate,
        )
        dims = {
            "q_proj": (h, q),
            "k_proj": (h, kv),
            "v_proj": (h, kv),
            "o_proj": (q, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }
        return self.layers * sum(r * (a + b) for t, (a, b) in dims.items() if t in targets)


# The published Qwen3 configurations (config.json of the released checkpoints).
KNOWN_SHAPES = {
    "qwen3-1.7b": ModelShape(2048, 28, 16, 8, 128, 6144, 151936, True),
    "qwen3-4b": ModelShape(2560, 36, 32, 8, 128, 9728, 151936, True),
    "qwen3-8b": ModelShape(4096, 36, 32, 8, 128, 12288, 151936, False),
    "qwen3-14b": ModelShape(5120, 40, 40, 8, 128, 17408, 151936, False),
}


def shape_from_config(config: dict) -> ModelShape:
    """A ``ModelShape`` from a Hugging Face ``config.json`` dict.

    Raises:
        KeyError: a size the estimate needs is missing.
    """
    heads = config["num_attention_heads"]
    return ModelShape(
        hidden=config["hidden_size"],
        layers=config["num_hidden_layers"],
        heads=heads,
        kv_heads=config.get("num_key_value_heads", heads),
        head_dim=config.get("head_dim") or config["hidden_size"] // heads,
        intermediate=config["intermediate_size"],
        vocab=config["vocab_size"],
        tied=bool(config.get("tie_word_embeddings", False)),
        qk_norm=str(config.get("model_type", "")).startswith("qwen3"),
    )


def model_shape(cfg: HamoConfig) -> tuple[ModelShape | None, str]:
    """The backbone's shape and where it came from: ``model.path``'s config.json, else ``model.name``."""
    from hamo_ray.backbones.sources import is_model_source, source_config

    if is_model_source(cfg.model.path):  # a GGUF source: its converted config.json, else its metadata
        try:
            return shape_from_config(source_config(cfg.model.path, cfg.model.cache_dir)), cfg.model.path
        except (KeyError, ValueError):  # ConfigError is a ValueError: fall back to the known shapes
            pass
    config_file = Path(cfg.model.path).expanduser() / "config.json"
    if cfg.model.path != "embedded" and config_file.is_file():
        try:
            return shape_from_config(json.loads(config_file.read_text())), str(config_file)
        except (KeyError, ValueError):
            pass
    for key in (cfg.model.name.lower(), Path(cfg.model.path).name.lower()):
        if key in KNOWN_SHAPES:
            return KNOWN_SHAPES[key], f"known shape {key}"
    return None, "unknown shape"


@dataclass
class GpuPlan:
    """How a run uses GPUs, and whether each role fits on a card of ``card_gib``."""

    serve_gpus: int
    train_gpus: int
    card_gib: float
    shape_source: str
    params: int = 0
    train_gib: dict[str, float] = field(default_factory=dict)  # part -> GiB per training GPU
    serve_weights_gib: float = 0.0  # per serving GPU
    serve_budget_gib: float = 0.0  # what vLLM may take per serving GPU
    kv_cache_tokens: int = 0  # per replica
    problems: list[str] = field(default_factory=list)

    @property
    def total_gpus(self) -> int:
        return self.serve_gpus + self.train_gpus

    @property
    def train_total_gib(self) -> float:
        return sum(self.train_gib.values())

    @property
    def fits(self) -> bool:
        return not self.problems


def train_memory(shape: ModelShape, cfg: HamoConfig) -> dict[str, float]:
    """The estimated memory of one training GPU, by part, in GiB (see the module docstring)."""
    t = cfg.train
    bf16 = t.use_gpu if t.bf16 is None else t.bf16
    width = 2 if bf16 else 4
    weights = shape.params * width
    if t.strategy != "ddp" and t.zero_stage == 3:
        weights /= max(1, t.num_workers)
    lora = shape.lora_params(t.lora_r, list(t.target_modules)) * 16
    tokens = t.batch_size * t.max_seq_len
    h, kv = shape.hidden, shape.kv_heads * shape.head_dim
    per_layer_token = width * (6 * h + 2 * kv + 4 * shape.intermediate)  # inputs kept for the backward
    if t.gradient_checkpointing:
        activations = tokens * (shape.layers * h * width + per_layer_token)
    else:
        activations = tokens * shape.layers * per_layer_token
    return {
        "weights": weights / GIB,
        "lora+optimizer": lora / GIB,
        "activations": activations / GIB,
        "context": 1.0,  # CUDA context, NCCL buffers, allocator slack
    }


def gpu_plan(cfg: HamoConfig, card_gib: float = 80.0) -> GpuPlan:
    """The GPU plan of ``cfg`` on cards of ``card_gib`` GiB; ``problems`` lists what does not fit."""
    s, t = cfg.serve, cfg.train
    serve_gpus = int(round(s.num_replicas * s.num_gpus))
    train_gpus = t.num_workers if t.use_gpu else 0
    shape, source = model_shape(cfg)
    plan = GpuPlan(serve_gpus=serve_gpus, train_gpus=train_gpus, card_gib=card_gib, shape_source=source)
    if shape is None:
        return plan
    plan.params = shape.params
    if train_gpus:
        plan.train_gib = train_memory(shape, cfg)
        if plan.train_total_gib > card_gib:
            hint = "" if t.gradient_checkpointing else " (try train.gradient_checkpointing=true)"
            plan.problems.append(
                f"training needs ~{plan.train_total_gib:.0f} GiB per GPU, more than the {card_gib:.0f} GiB card{hint}"
            )
    if serve_gpus:
        width = 4 if cfg.model.dtype in ("float32", "fp32") else 2
        tp = max(1, s.tensor_parallel_size)
        plan.serve_weights_gib = shape.params * width / tp / GIB
        plan.serve_budget_gib = s.gpu_memory_utilization * card_gib
        kv_per_token = 2 * shape.layers * shape.kv_heads * shape.head_dim * width / tp
        free = (plan.serve_budget_gib - plan.serve_weights_gib - 1.0) * GIB
        plan.kv_cache_tokens = max(0, int(free / kv_per_token))
        if plan.kv_cache_tokens < cfg.model.max_model_len:
            plan.problems.append(
                f"serving: {plan.serve_weights_gib:.0f} GiB of weights per GPU leave KV cache for "
                f"{plan.kv_cache_tokens} tokens, less than model.max_model_len={cfg.model.max_model_len}"
            )
    return plan


def format_plan(plan: GpuPlan) -> str:
    """The plan as a few readable lines."""
    lines = [
        f"GPUs: {plan.total_gpus} ({plan.serve_gpus} serving, {plan.train_gpus} training), "
        f"card {plan.card_gib:.0f} GiB; model {plan.params / 1e9:.2f}B parameters ({plan.shape_source})"
    ]
    if plan.train_gib:
        parts = ", ".join(f"{k} {v:.1f}" for k, v in plan.train_gib.items())
        lines.append(f"  train, per GPU: ~{plan.train_total_gib:.1f} GiB ({parts})")
    if plan.serve_gpus and plan.params:
        lines.append(
            f"  serve, per GPU: weights {plan.serve_weights_gib:.1f} GiB of a {plan.serve_budget_gib:.1f} GiB "
            f"budget; KV cache ~{plan.kv_cache_tokens:,} tokens per replica"
        )
    lines += [f"  DOES NOT FIT: {p}" for p in plan.problems] or ["  fits: yes"]
    return "\n".join(lines)
