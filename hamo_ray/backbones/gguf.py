"""Converting a GGUF file into a plain Hugging Face folder (``hamo_ray.backbones.sources`` decides when and where).

The GGUF model is loaded dequantised in float32, saved as safetensors with its tokenizer and a
generation config whose eos is the tokenizer's, and the saved folder is verified: reloaded, it must
give the GGUF model's logits, the same chat template and the same token ids.
"""

from __future__ import annotations

import gc
import hashlib
import logging
import shutil
from pathlib import Path
from typing import Any

from hamo_ray.config import ConfigError

logger = logging.getLogger(__name__)

# Part of every converted folder's name: bump it when the conversion's output changes.
CONVERTER_VERSION = 1
_SAMPLE = "Hello world! The quick brown fox jumps over 13 lazy dogs.\n<|im_start|>user"
_DISK_MARGIN = 1.1  # free space asked for: the float32 weights x this, plus the tokenizer's few MB
_hashes: dict[tuple[str, int, int], str] = {}  # (file, size, mtime_ns) -> sha256, within a process


def _content_hash(file: Path) -> str:
    """sha256 of the file's bytes (remembered per size and mtime within this process)."""
    st = file.stat()
    key = (str(file.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _hashes:
        digest = hashlib.sha256()
        with open(file, "rb") as f:
            while chunk := f.read(1 << 22):
                digest.update(chunk)
        _hashes[key] = digest.hexdigest()
    return _hashes[key]


def _gguf_kwargs(file: Path) -> tuple[str, dict[str, Any]]:
    return str(file.parent), {"gguf_file": file.name}


def _cannot_load(path: str, file: Path, e: BaseException) -> ConfigError:
    return ConfigError(
        f"model.path: transformers cannot load {path!r} ({file}) from GGUF: {type(e).__name__}: {e}"
    )


def _inspect(path: str, file: Path):
    """The source's HF config and parameter count, from the GGUF metadata (no weights read)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    root, kwargs = _gguf_kwargs(file)
    try:
        config = AutoConfig.from_pretrained(root, **kwargs)
        with torch.device("meta"):
            shell = AutoModelForCausalLM.from_config(config)
    except Exception as e:
        raise _cannot_load(path, file, e) from e
    params = sum(p.numel() for p in shell.parameters())  # tied weights counted (and saved) once
    return config, params


def _check_disk(path: str, cache: Path, params: int) -> None:
    need = int(params * 4 * _DISK_MARGIN) + (64 << 20)
    free = shutil.disk_usage(cache).free
    if free < need:
        raise ConfigError(
            f"model.path: converting {path!r} needs about {need / 1e9:.2f} GB in model.cache_dir "
            f"({cache}), which has {free / 1e9:.2f} GB free"
        )


def _convert(path: str, file: Path, config, params: int, tmp: Path) -> dict[str, Any]:
    """Load the GGUF dequantised in float32, save it as an HF folder in ``tmp``, verify the reload."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    root, kwargs = _gguf_kwargs(file)
    load: dict[str, Any] = {"config": config, "dtype": torch.float32}
    if hasattr(transformers, "GgufConfig"):  # never the packed-weights path: a plain dense model
        load["quantization_config"] = transformers.GgufConfig(dequantize=True)
    try:
        tokenizer = AutoTokenizer.from_pretrained(root, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(root, **kwargs, **load)
    except Exception as e:
        raise _cannot_load(path, file, e) from e
    # What GGUF loading attaches makes save_pretrained refuse (and would mark the folder quantized).
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None
    for obj in (model.config, getattr(model, "generation_config", None)):
        if obj is not None and hasattr(obj, "quantization_config"):
            delattr(obj, "quantization_config")
    packed = sorted({str(p.dtype) for p in model.parameters() if p.dtype != torch.float32})
    if packed:
        raise ConfigError(f"model.path: {path!r} loaded with {packed} weights, not a float32 model")
    _set_eos(model, tokenizer)
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit and (tokenizer.model_max_length or 0) > 10**12:  # "no limit" from GGUF: the context length
        tokenizer.model_max_length = limit
    model.eval()
    ids = tokenizer(_SAMPLE).input_ids[:24]
    with torch.no_grad():
        reference = model(torch.tensor([ids])).logits
    tmp.mkdir(parents=True)
    model.save_pretrained(str(tmp))
    tokenizer.save_pretrained(str(tmp))
    for saved in tmp.iterdir():  # safetensors writes 0600; the cache is shared like any HF folder
        saved.chmod(saved.stat().st_mode | 0o044)
    class_name = type(model).__name__
    del model
    gc.collect()

    reloaded = AutoModelForCausalLM.from_pretrained(str(tmp), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = reloaded(torch.tensor([ids])).logits
    diff = float((logits - reference).abs().max())
    del reloaded
    gc.collect()
    tok2 = AutoTokenizer.from_pretrained(str(tmp))
    generation = GenerationConfig.from_pretrained(str(tmp))
    problems = []
    if diff > 1e-4 * max(1.0, float(reference.abs().max())):
        problems.append(f"the reloaded folder's logits differ from the GGUF model's by {diff:.3g}")
    if tok2.chat_template != tokenizer.chat_template:
        problems.append("the reloaded tokenizer's chat template differs from the GGUF's")
    if tok2(_SAMPLE).input_ids[: len(ids)] != ids:
        problems.append("the reloaded tokenizer encodes differently from the GGUF's")
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in _ids(generation.eos_token_id):
        problems.append(f"generation_config.json's eos {generation.eos_token_id} lacks the tokenizer's")
    if problems:
        raise ConfigError(f"model.path: converting {path!r} failed its check: {'; '.join(problems)}")
    if not tokenizer.chat_template:
        logger.warning("model.path %s: the GGUF has no chat template (tokenizer.chat_template)", path)
    return {
        "source": path,
        "gguf": str(file),
        "sha256": _content_hash(file),
        "converter_version": CONVERTER_VERSION,
        "transformers": transformers.__version__,
        "architecture": class_name,
        "parameters": params,
        "dtype": "float32",
        "max_logit_diff": diff,
    }


def _ids(value) -> list[int]:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _set_eos(model, tokenizer) -> None:
    """The generation config stops on the tokenizer's eos (as well as the GGUF's own eos ids)."""
    generation = model.generation_config
    eos = _ids(generation.eos_token_id) or _ids(model.config.eos_token_id)
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos:
        eos.append(tokenizer.eos_token_id)
    if eos:
        generation.eos_token_id = eos[0] if len(eos) == 1 else eos
    if generation.pad_token_id is None and tokenizer.pad_token_id is not None:
        generation.pad_token_id = tokenizer.pad_token_id
