"""The model a training worker holds: the base model, its LoRA adapter, and the action-token forward.

::

    spec = ModelSpec.from_config(tcfg, base_path)          # what to load (LoRA, dtype, attention)
    lm = load_model(spec, device)                           # an ActionLM: peft model + action head
    lm.reset_adapter(init_adapter=prev, seed=0)             # a new stage: LoRA weights only
    logp = lm(**batch.model_inputs(device))                 # log-probs of the labelled tokens
    lm.save(folder)                                         # peft files (float32 LoRA weights)

:class:`ActionLM` runs the decoder and applies the LM head only at the positions whose next token
is labelled (gathered with indices computed on the host), so the ``tokens x vocabulary`` logits
never exist (with ``ModelSpec.fused``, the default on GPU, those rows' logits are computed chunk by
chunk and recomputed in the backward pass, and the LoRA linears and RMSNorms run fused: ``fused.py``);
with bf16 the LoRA weights are bf16 too (no per-layer casts). ``ModelSpec`` travels to the workers
inside the stage's job (``contracts.py``); the optimizer around the model is ``stepper.py``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from hamo_ray.training.contracts import ModelSpec

__all__ = ["ModelSpec", "load_model"]

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
