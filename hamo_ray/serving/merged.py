"""Acting on merged weights: a stage's adapter folded into the base weights, served by an engine without LoRA.

On CPU, vLLM 0.32 runs a LoRA-enabled engine eagerly (``CpuPlatform`` sets ``CompilationMode.NONE``
whenever ``enable_lora``) and applies each adapter with per-token weight gathers (``PunicaWrapperCPU``,
``bgmv``/``sgmv`` in plain torch): a stage evaluated through its adapter decodes ~2-3x slower than the
base weights on an engine without LoRA (docs/performance.md#evaluation-on-merged-weights). A stage is
evaluated (and its release replays and ETO exploration played) with ONE adapter at a time, so it need
not pay for LoRA: ``serve.eval_weights`` (``auto`` | ``merged`` | ``adapter``) chooses.

With merged weights the stage's policy is a second Serve application of the same ``PolicyServer``
(``<policy app>-merged`` at ``<route>/merged``), started for the adapter and deleted after the stage's
evaluation:

- the replica resolves the adapter exactly as the LoRA registry does (``AdapterRegistry.check``: inside
  the adapter root, downloaded from an object store, and, for a content-named stage adapter
  ``stage-<t>:<12 hex>``, refused unless the folder still holds those weights), then merges it into the
  base weights in a Ray task on its own node (:func:`merge_on_node`; peft ``merge_and_unload``), into
  the app's node-local folder ``slot-<app>`` (one path for every stage: vLLM keys its compile cache by
  the model's path), whose marker, written last, names the adapter's full content digest and the
  base's fingerprint (reused only while it names the weights asked for);
- its engine runs without LoRA and serves the model under the ADAPTER's served name, so the episodes'
  ``model`` is the adapter's name as with LoRA, and ``/health`` (``model``) and ``/v1/models`` state
  which weights the engine holds; the driver checks both before any episode (:func:`check_serves`),
  so a resumed or redone stage (new weights, new name) never acts on stale merged weights.

``/v1/load_lora_adapter`` on a merged app answers 400: it serves one fixed set of weights.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

EVAL_WEIGHTS = ("auto", "merged", "adapter")
MARKER = "hamo_merged.json"  # written last into a merged folder: which adapter and base it holds
# Agreement of merged and LoRA weights on the publish probe: greedy tokens equal, or the largest logprob
# difference of the common prefix within this (float32: ~1e-5 measured on SmolLM2; bf16 rounds more).
AGREEMENT_TOLERANCE = 0.05


class MergedWeightsError(RuntimeError):
    """A merged engine is not serving the weights asked for (or could not be started)."""


def resolve_eval_weights(setting: str, *, gpus: bool) -> str:
    """``merged`` or ``adapter`` for ``serve.eval_weights``.

    ``auto``: merged where the policy replicas have no GPU (vLLM-CPU: LoRA costs ~2-3x decode time,
    a second engine of a CPU-sized model a few GiB of RAM), the adapter on GPUs (a second engine would
    double the model's and KV cache's GPU memory, and vLLM's GPU LoRA kernels cost far less).
    """
    if setting not in EVAL_WEIGHTS:
        raise ValueError(f"serve.eval_weights must be one of {EVAL_WEIGHTS}, got {setting!r}")
    if setting == "auto":
        return "adapter" if gpus else "merged"
    return setting


def base_fingerprint(base: str | Path) -> str:
    """A cheap fingerprint of a base model folder: its resolved path, and each file's name, size and
    mtime (hashing the weights themselves would read GBs per stage)."""
    folder = Path(base).expanduser().resolve()
    h = hashlib.sha256(str(folder).encode())
    for file in sorted(p for p in folder.rglob("*") if p.is_file()):
        st = file.stat()
        h.update(f"{file.relative_to(folder).as_posix()}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    return h.hexdigest()


def merged_key(adapter_digest: str, base_fp: str) -> str:
    """The merged folder's name: 16 hex of the adapter's digest, 8 of the base's fingerprint."""
    return f"{adapter_digest[:16]}-{base_fp[:8]}"


def read_marker(folder: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((Path(folder) / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def is_current(folder: Path, adapter_digest: str, base_fp: str) -> bool:
    """Whether ``folder`` holds the merge of exactly that adapter into exactly that base."""
    marker = read_marker(folder)
    return bool(marker) and marker.get("adapter_digest") == adapter_digest and marker.get("base") == base_fp


def default_merged_cache() -> Path:
    """Where a node keeps merged folders: ``$HAMO_MERGED_CACHE``, default ``~/.cache/hamo_ray/merged``."""
    return Path(os.environ.get("HAMO_MERGED_CACHE", "~/.cache/hamo_ray/merged")).expanduser()


def merge_adapter(
    base: str | Path,
    adapter: str | Path,
    cache: str | Path | None = None,
    *,
    keep: int = 2,
    slot: str | None = None,
) -> Path:
    """Fold the peft adapter in ``adapter`` into the base weights in ``base``; the merged HF folder.

    The folder is ``<cache>/<merged_key>``, or with ``slot`` ``<cache>/slot-<slot>`` (one folder per
    merged app, rewritten per adapter: vLLM keys its compile cache by the model's PATH, so an engine
    started from the same path for the next stage's weights reuses the compiled graph); either way
    its marker (:func:`is_current`) says which weights it holds. A current folder is reused, else the
    merge is written into a temporary folder (weights in the base's dtype, merged in float32; the
    base's tokenizer and template files copied) with the marker last and renamed into place. ``keep``:
    at most this many content-named merged folders stay in ``cache`` (the oldest go first).
    """
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from hamo_ray.serving.objstore import folder_digest

    base, adapter = Path(base).expanduser().resolve(), Path(adapter).expanduser().resolve()
    cache = Path(cache) if cache else default_merged_cache()
    digest, base_fp = folder_digest(adapter), base_fingerprint(base)
    out = cache / (f"slot-{slot}" if slot else merged_key(digest, base_fp))
    if is_current(out, digest, base_fp):
        logger.info("merged weights of %s already in %s", adapter, out)
        os.utime(out)  # the newest: pruned last
        _prune(cache, keep, out)
        return out
    t0 = time.monotonic()
    cache.mkdir(parents=True, exist_ok=True)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    dtype = getattr(model.config, "dtype", None) or torch.float32
    saved_dtype = _base_dtype(base) or dtype
    merged = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=cache))
    try:
        merged.to(saved_dtype).save_pretrained(tmp, safe_serialization=True)
        for file in base.iterdir():  # tokenizer, chat template, generation config
            if file.is_file() and not _is_weight_file(file) and not (tmp / file.name).exists():
                shutil.copy2(file, tmp / file.name)
        marker = {"adapter": str(adapter), "adapter_digest": digest, "base": base_fp, "base_path": str(base)}
        (tmp / MARKER).write_text(json.dumps(marker, indent=1))
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _prune(cache, keep, out)
    logger.info("merged %s into %s in %.1fs", adapter, out, time.monotonic() - t0)
    return out


def _base_dtype(base: Path):
    import torch

    try:
        cfg = json.loads((base / "config.json").read_text())
    except (OSError, ValueError):
        return None
    name = cfg.get("dtype") or cfg.get("torch_dtype")
    return getattr(torch, name, None) if isinstance(name, str) else None


def _is_weight_file(file: Path) -> bool:
    return file.suffix in (".safetensors", ".bin", ".pt", ".gguf") or file.name.endswith(".index.json")


SLOT_MAX_AGE_S = 24 * 3600  # an app's slot folder untouched this long is removed (see _prune)


def _prune(cache: Path, keep: int, current: Path) -> None:
    """Remove all but the ``keep`` newest merged folders of ``cache`` (never ``current``), and the slot
    folders (``slot-<app>``) of other apps not written for ``SLOT_MAX_AGE_S``: an engine reads its
    folder only when it starts or loads weights in place, and a slot found missing is merged again."""
    now = time.time()
    for slot in cache.glob("slot-*"):
        try:
            if slot != current and now - slot.stat().st_mtime > SLOT_MAX_AGE_S:
                shutil.rmtree(slot, ignore_errors=True)
        except OSError:  # removed by another run's prune
            continue
    folders = sorted(
        (p for p in cache.iterdir() if p.is_dir() and not p.name.startswith((".", "slot-")) and p != current),
        key=lambda p: p.stat().st_mtime,
        reverse=True,
    )
    for old in folders[max(0, keep - 1) :]:
        shutil.rmtree(old, ignore_errors=True)


def merge_on_node(base: str | Path, adapter: str | Path, cache: str | Path | None = None, **kw) -> Path:
    """:func:`merge_adapter` in a Ray task on THIS node (the merged folder is node-local, as is the engine
    that reads it); in-process where Ray is not initialised."""
    import ray

    if not ray.is_initialized():
        return merge_adapter(base, adapter, cache, **kw)
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    # No CPU of its own: the caller (a replica starting) holds its CPUs idle while it waits for it.
    task = ray.remote(num_cpus=0)(merge_adapter).options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(
            ray.get_runtime_context().get_node_id(), soft=False
        ),
        name="hamo-merge-adapter",
    )
    return Path(ray.get(task.remote(str(base), str(adapter), None if cache is None else str(cache), **kw)))


def prepare_merged(registry, base: str | Path, *, name: str, path: str, slot: str | None = None) -> str:
    """In a merged replica: the adapter ``name`` at ``path`` resolved by the LoRA ``registry`` (inside
    its root, downloaded from a store, the folder's digest checked against a content name), merged
    into ``base`` on this node; the merged folder.

    Raises:
        AdapterError: the registry refuses ``name``/``path``.
        MergedWeightsError: the merged folder holds other weights than ``name`` names.
    """
    from hamo_ray.serving.adapters import DIGEST_RE

    folder, _ = registry.check(name, path)
    out = merge_on_node(base, folder, slot=slot)
    digest = (read_marker(out) or {}).get("adapter_digest", "")
    if (named := DIGEST_RE.search(name)) and not digest.startswith(named.group(1)):
        raise MergedWeightsError(f"{out} holds the merge of adapter digest {digest[:12]!r}, not {name!r}")
    return str(out)
