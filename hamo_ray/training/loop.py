"""The one training loop: model loading, the action-token forward, the optimizer step, the epoch.

Behavioural cloning (``trainer.py``) and ETO's DPO (``dpo.py``) are two losses over the same
parts, run by the same long-lived workers (``group.py``)::

    spec = ModelSpec.from_config(tcfg, base_path)          # what to load (LoRA, dtype, attention)
    lm = load_model(spec, device)                           # an ActionLM: peft model + action head
    lm.reset_adapter(init_adapter=prev, seed=0)             # a new stage: LoRA weights only
    stepper = Stepper(lm, step_config, total_steps, device) # DDP or DeepSpeed, AdamW, schedule
    logp = stepper.model(**batch.model_inputs(device))      # log-probs of the labelled tokens
    stepper.step(-logp.mean())

A stage on a worker (both losses) runs these parts through ``stage.py`` (``begin_stage``,
``StageRun``: the epochs, per-step figures, progress lines and the saved files). ``ModelSpec`` and
``StepConfig`` travel to the workers inside the stage's job; they are defined in ``contracts.py``.

:class:`ActionLM` runs the decoder and applies the LM head only at the positions whose next token
is labelled (gathered with indices computed on the host), so the ``tokens x vocabulary`` logits
never exist (with ``ModelSpec.fused``, the default on GPU, those rows' logits are computed chunk by
chunk and recomputed in the backward pass, and the LoRA linears and RMSNorms run fused: ``fused.py``); with bf16 the LoRA weights are bf16 too (no per-layer casts) and the optimizer keeps
float32 master copies (:class:`Stepper`). Losses and token counts stay on the device until the
epoch ends: no host synchronisation per step.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

from hamo_ray.training.contracts import ModelSpec, StepConfig

__all__ = ["ModelSpec", "StepConfig", "Stepper", "load_model", "rank_share"]

logger = logging.getLogger(__name__)


def _action_lm_class():
    import torch

    from hamo_ray.training.packing import packed_on_device

    class ActionLM(torch.nn.Module):
        """A causal LM (peft-wrapped for LoRA) whose forward returns the labelled tokens' log-probs."""

        def __init__(self, model: Any, spec: ModelSpec):
            super().__init__()
            self.model = model
            self.spec = spec

        def _decoder_and_head(self):
            causal = self.model.get_base_model() if self.spec.lora else self.model
            return causal.model, causal.lm_head

        def forward(self, input_ids, hidden_index, targets, **kwargs):
            """Log-probabilities (float32) of ``targets`` predicted at ``hidden_index``.

            Args:
                input_ids: ``[rows, columns]`` token ids.
                hidden_index: positions into the flattened ``[rows * columns]`` hidden states.
                targets: the token each of those positions predicts.
                **kwargs: ``attention_mask`` (padded) or ``position_ids`` + the packed-sequence
                    arguments (see ``packing.Batch.model_inputs``).
            """
            decoder, head = self._decoder_and_head()
            if self.spec.compile and self.spec.bf16 and input_ids.is_cuda and packed_on_device():
                kwargs.pop("seq_lens", None)  # a host list: every new one would recompile the layers
            hidden = decoder(input_ids=input_ids, use_cache=False, **kwargs).last_hidden_state
            picked = hidden.reshape(-1, hidden.shape[-1]).index_select(0, hidden_index)
            if self.spec.fused and type(head) is torch.nn.Linear and head.bias is None:
                from hamo_ray.training.fused import chunked_logprobs

                return chunked_logprobs(picked, head.weight, targets)
            logits = head(picked).float()
            return -torch.nn.functional.cross_entropy(logits, targets, reduction="none")

        def reset_adapter(self, init_adapter: str | None, seed: int) -> None:
            """Start a stage: LoRA weights from ``init_adapter`` (a peft folder) or freshly initialised."""
            from peft import set_peft_model_state_dict

            if init_adapter:
                weights = _read_adapter(init_adapter, self.spec)
                result = set_peft_model_state_dict(self.model, weights)
                missing = [k for k in getattr(result, "unexpected_keys", []) if "lora" in k]
                if missing:
                    raise ValueError(f"adapter {init_adapter}: keys not in the model: {missing[:3]}")
            else:
                torch.manual_seed(seed)
                for module in self.model.modules():
                    if hasattr(module, "reset_lora_parameters") and "default" in getattr(
                        module, "lora_A", {}
                    ):
                        module.reset_lora_parameters("default", True)
            dtype = torch.bfloat16 if self.spec.bf16 else torch.float32
            for name, p in self.model.named_parameters():
                if "lora_" in name:
                    p.data = p.data.to(dtype)
                    p.requires_grad_(True)

        def save(self, folder: str | Path, state: dict | None = None) -> None:
            """Write the adapter (LoRA) or the whole model in Hugging Face format, float32 for LoRA."""
            if state is None:
                state = {
                    n: p.detach().float().cpu() for n, p in self.model.named_parameters() if "lora_" in n
                }
            if self.spec.lora:
                self.model.save_pretrained(folder, safe_serialization=True, state_dict=state)
            else:
                full = {k: v.float() for k, v in self.model.state_dict().items()}
                self.model.save_pretrained(folder, safe_serialization=True, state_dict={**full, **state})

    return ActionLM


def _read_adapter(folder: str, spec: ModelSpec) -> dict[str, Any]:
    import json

    from safetensors.torch import load_file

    cfg_path = Path(folder) / "adapter_config.json"
    weights = Path(folder) / "adapter_model.safetensors"
    if not weights.exists() or not cfg_path.exists():
        raise FileNotFoundError(
            f"adapter folder {folder} lacks adapter_config.json/adapter_model.safetensors"
        )
    cfg = json.loads(cfg_path.read_text())
    shape = (cfg.get("r"), cfg.get("lora_alpha"), set(cfg.get("target_modules") or []))
    if shape != (spec.lora_r, spec.lora_alpha, set(spec.target_modules)):
        raise ValueError(
            f"adapter {folder}: r={shape[0]} lora_alpha={shape[1]} targets={sorted(shape[2])} differ from "
            f"train.lora_r={spec.lora_r} train.lora_alpha={spec.lora_alpha} "
            f"train.target_modules={list(spec.target_modules)}"
        )
    return load_file(str(weights))


def load_model(spec: ModelSpec, device: Any = "cpu") -> Any:
    """Load the base model of ``spec`` on ``device`` and wrap it (with a fresh LoRA) in an ``ActionLM``.

    bf16 loads the weights in bf16 and keeps the LoRA weights in bf16 too; packed specs use the
    ``hamo_packed`` attention (``packing.py``), padded ones SDPA; ``spec.fused`` swaps in the fused
    LoRA linear, RMSNorm and loss of ``fused.py``.

    Raises:
        OSError: ``spec.base_path`` is not a model folder or hub id that loads.
    """
    import torch
    from transformers import AutoModelForCausalLM

    from hamo_ray.training.packing import prepare_varlen, register_attention

    dtype = torch.bfloat16 if spec.bf16 else torch.float32
    attn = register_attention() if spec.packed else "sdpa"
    if spec.packed and torch.device(device).type == "cuda":
        prepare_varlen()  # probed here, never inside a (checkpointed) forward
    model = AutoModelForCausalLM.from_pretrained(spec.base_path, dtype=dtype, attn_implementation=attn)
    model.config.use_cache = False
    if spec.liger:
        _apply_liger(model)
    if spec.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if spec.lora:  # the frozen embeddings give no grad-requiring input to checkpointed blocks otherwise
            model.enable_input_require_grads()
    if spec.lora:
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(
            r=spec.lora_r,
            lora_alpha=spec.lora_alpha,
            lora_dropout=spec.lora_dropout,
            target_modules=list(spec.target_modules),
            task_type="CAUSAL_LM",
        )
        # autocast_adapter_dtype=False: the adapter stays in the model's dtype (no float32 casts per layer).
        model = get_peft_model(model, lora, autocast_adapter_dtype=False)
    if spec.fused:  # fused LoRA linears and RMSNorm (fused.py); the loss's head in ActionLM.forward
        from hamo_ray.training.fused import fuse_lora, fuse_rms_norm

        n_lora = fuse_lora(model) if spec.lora else 0
        n_norm = 0 if spec.liger else fuse_rms_norm(model)
        logger.info("fused kernels: %d LoRA linears, %d RMSNorms", n_lora, n_norm)
    if spec.compile:
        _compile_layers(model)
    lm = _action_lm_class()(model, spec)
    return lm.to(device)


def _compile_layers(model: Any) -> None:
    """``torch.compile`` every decoder layer in place (dynamic shapes: one graph for every pack size).

    The layers share their code, so they share the compiled graphs; the packed batch's host-side
    ``seq_lens`` do not reach them where the varlen kernel runs (``ActionLM.forward``).
    """
    import torch

    layers = [
        m
        for m in model.modules()
        if isinstance(m, torch.nn.ModuleList) and len(m) and "Layer" in type(m[0]).__name__
    ]
    if not layers:
        raise ValueError(f"train.compile: no decoder layers found in {type(model).__name__}")
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    for layer in layers[0]:
        layer.compile(dynamic=True)
    logger.info("torch.compile: %d decoder layers", len(layers[0]))


def _apply_liger(model: Any) -> None:
    """Swap in Liger's fused RMSNorm, SwiGLU and RoPE kernels (the LM head stays ours: labelled rows only).

    Raises:
        ImportError: liger-kernel is not installed.
    """
    try:
        from liger_kernel.transformers import _apply_liger_kernel_to_instance
    except ImportError as e:
        raise ImportError("train.liger needs the liger-kernel package (pip install liger-kernel)") from e
    _apply_liger_kernel_to_instance(
        model=model,
        rope=True,
        rms_norm=True,
        swiglu=True,
        cross_entropy=False,
        fused_linear_cross_entropy=False,
    )
    logger.info("liger kernels applied to %s", type(model).__name__)


def _master_weights():
    import torch

    class MasterAdamW:
        """AdamW on float32 copies of low-precision trainable weights (copied back after each step)."""

        def __init__(self, params: list, lr: float, weight_decay: float, fused: bool):
            self.params = params
            self.master = [p.detach().float().clone().requires_grad_(True) for p in params]
            kw = {"fused": True} if fused else {}
            self.inner = torch.optim.AdamW(self.master, lr=lr, weight_decay=weight_decay, **kw)
            self.param_groups = self.inner.param_groups

        def step(self) -> None:
            for p, m in zip(self.params, self.master):
                m.grad = None if p.grad is None else p.grad.float()
            self.inner.step()
            with torch.no_grad():
                torch._foreach_copy_(self.params, self.master)

        def zero_grad(self, set_to_none: bool = True) -> None:
            for p in self.params:
                p.grad = None
            self.inner.zero_grad(set_to_none=set_to_none)

    return MasterAdamW


class Stepper:
    """Wraps an ``ActionLM`` for one stage: DDP or a DeepSpeed engine, AdamW, linear warm-up/decay.

    ``stepper.model(**inputs)`` forwards (through DDP/DeepSpeed, so gradients synchronise);
    ``stepper.step(loss)`` does backward, clipping (1.0), the optimizer and the schedule.
    """

    def __init__(self, lm: Any, cfg: StepConfig, total_steps: int, device: Any):
        import torch
        import torch.distributed as dist

        self.lm = lm
        self.deepspeed = cfg.strategy == "deepspeed"
        self.params = [p for p in lm.parameters() if p.requires_grad]
        accum = cfg.grad_accum_steps if self.deepspeed else 1
        total = max(1, math.ceil(total_steps / accum))
        warmup = max(1, int(0.05 * total))
        low_precision = any(p.dtype != torch.float32 for p in self.params)
        cuda = torch.device(device).type == "cuda"
        if self.deepspeed or not low_precision:
            kw = {"fused": True} if cuda and not self.deepspeed else {}
            self.optimizer = torch.optim.AdamW(self.params, lr=cfg.lr, weight_decay=cfg.weight_decay, **kw)
            inner = self.optimizer
        else:  # bf16 LoRA weights, float32 optimizer state and master weights
            self.optimizer = _master_weights()(self.params, cfg.lr, cfg.weight_decay, fused=cuda)
            inner = self.optimizer.inner
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            inner, lambda s: min((s + 1) / warmup, max(0.0, (total - s) / max(1, total - warmup)))
        )
        if self.deepspeed:
            from hamo_ray.training.deepspeed import initialize_engine

            self.model = initialize_engine(lm, self.optimizer, cfg.ds_config, self.scheduler)
        elif dist.is_initialized() and dist.get_world_size() > 1:
            ids = [torch.device(device).index or 0] if cuda else None
            self.model = torch.nn.parallel.DistributedDataParallel(lm, device_ids=ids)
        else:
            self.model = lm

    def step(self, loss: Any) -> None:
        import torch

        if self.deepspeed:  # clipping, accumulation and the LR schedule are the engine's
            self.model.backward(loss)
            self.model.step()
            return
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0, foreach=True)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()

    @property
    def lr(self) -> float:
        """The learning rate the next step uses."""
        return float(self.scheduler.get_last_lr()[0])

    def trainable_state(self) -> dict[str, Any]:
        """The trainable weights as float32 CPU tensors (collective under ZeRO-3: call on every rank)."""
        if self.deepspeed:
            from hamo_ray.training.deepspeed import trainable_state_dict

            state = trainable_state_dict(self.model)
            return {k.removeprefix("model."): v for k, v in state.items()}
        return {
            n.removeprefix("model."): p.detach().float().cpu()
            for n, p in self.lm.named_parameters()
            if p.requires_grad
        }

    def close(self) -> None:
        """Drop the engine/optimizer so the next stage starts clean (the loaded model stays).

        A DeepSpeed engine is destroyed first: that removes the gradient hooks ZeRO put on the
        parameters, which would otherwise outlive it on the kept model.
        """
        self.hooks_left = False
        if self.deepspeed and self.model is not None:
            try:
                self.model.destroy()
            except Exception as e:  # hooks may remain on the parameters: the caller reloads the model
                logger.warning("DeepSpeed engine destroy failed (%s); the model will be reloaded", e)
                self.hooks_left = True
        self.model = self.optimizer = self.scheduler = None


def rank_share(batches: list[list[int]], rank: int, world: int) -> list[list[int]]:
    """This rank's batches; every rank gets the same count (collectives must match), repeating if short."""
    per_rank = math.ceil(len(batches) / world)
    mine = batches[rank::world][:per_rank]
    while len(mine) < per_rank:
        mine.append(batches[len(mine) % len(batches)])
    return mine
