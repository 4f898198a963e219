"""The policy endpoint: a Ray Serve deployment serving vLLM's own OpenAI application over its engine.

Each replica starts vLLM's ``AsyncLLM`` and builds vLLM's app state and FastAPI app with vLLM's own
``init_app_state`` and ``build_app`` (``vllm.entrypoints.launchers``), as ``vllm serve`` does and as
``ray.serve.llm``'s direct streaming does; Serve gets the app from ``__serve_build_asgi_app__``. So
``/v1/chat/completions`` and ``/v1/completions`` (streaming, ``n``, logprobs, ``response_format``,
structured outputs, tools, ``echo``, ``return_token_ids``, ...), ``/v1/models``, ``/tokenize``,
``/detokenize`` and ``/version`` are vLLM's code. vLLM's other routes are removed.

HaMo's own parts:

- Adapters: ``POST /v1/load_lora_adapter`` ``{"lora_name", "lora_path"}`` (and ``load_adapter``
  through a Serve handle) loads a folder inside the adapter root (``AdapterRegistry``: local or an
  object store, names never reused) through vLLM's ``OpenAIServingModels.load_lora_adapter``. A name
  another replica published is found by a vLLM LoRA resolver reading the registry, so every replica
  serves every published name; ``/v1/models`` adopts them first, so it lists them all.
- The training format: chat is rendered with the tokenizer's template, string content, and the run's
  template variables under the request's ``chat_template_kwargs`` (``engine.start_engine``), the
  call training makes. A request's own ``chat_template``, ``truncate_prompt_tokens``,
  ``add_special_tokens`` on chat, template-call arguments in ``chat_template_kwargs``, fields vLLM
  does not know, and ``max_tokens`` above ``serve.max_tokens_limit`` get 400 naming the field.
- ``GET /health`` (with this deployment's ``instance`` and the replica's ``direct_url``), ``GET
  /metrics`` of every replica (``hamo_ray.serving.metrics``), the guard (``hamo_ray.serving.guard``).
- Each replica also serves the same app on a port of its own (``direct_url``), as ``vllm serve`` does,
  without Serve's proxy hop; the Serve route (``serve.port``) balances over the replicas.

Why this and not ``ray.serve.llm`` (measured: the same throughput; adapters only from cloud URIs; only
private classes to extend): docs/serving.md. Merged weights (``merged=``, ``swap``):
``hamo_ray.serving.merged`` and ``hamo_ray.serving.weight_swap``.
"""

import asyncio
import logging
import os
import types
from http import HTTPStatus
from pathlib import Path

from pydantic import BaseModel, ConfigDict
from ray import serve
from starlette.responses import JSONResponse, PlainTextResponse

from hamo_ray.config import ModelConfig, ServeConfig
from hamo_ray.serving.adapters import AdapterError, AdapterRegistry
from hamo_ray.serving.engine import DEFAULT_MAX_LORA_RANK, start_engine
from hamo_ray.serving.guard import GUARDED, GuardMiddleware, GuardSettings, guard_handler
from hamo_ray.serving.metrics import InflightMiddleware, ReplicaMetrics, RunningPeak
from hamo_ray.serving.objstore import is_uri
from hamo_ray.serving.weight_swap import EXTENSION as WEIGHT_SWAP_EXTENSION
from hamo_ray.serving.weight_swap import load_into_engine, set_served

logger = logging.getLogger(__name__)

# vLLM's routes served as they are (ours: /health, /metrics, /v1/models, /v1/load_lora_adapter).
VLLM_ROUTES = frozenset(
    {"/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize", "/version", "/openapi.json",
     "/docs", "/docs/oauth2-redirect", "/redoc"}
)  # fmt: skip
SWAPPING = "(weights loading)"  # the served name while a merged replica's weights change: matches no request


def _error(message: str, status: int = 400, param: str | None = None) -> JSONResponse:
    from vllm.entrypoints.serve import create_error_response

    kind = {400: "BadRequestError", 404: "NotFoundError", 409: "ConflictError"}.get(status, "ServerError")
    body = create_error_response(message, kind, HTTPStatus(status), param).model_dump()
    return JSONResponse(body, status_code=status)


def _registry_resolver(registry: AdapterRegistry):
    """A vLLM LoRA resolver serving the names the registry file holds (published by any replica)."""
    from vllm.lora.request import LoRARequest
    from vllm.lora.resolver import LoRAResolver

    def current(lora_name: str) -> Path | None:  # the folder, while it holds the weights the name names
        registry.sync()
        path = registry.get(lora_name)
        try:
            return None if path is None else registry.check(lora_name, str(path))[0]
        except AdapterError as exc:
            logger.warning("not serving %r: %s", lora_name, exc.message)
            return None

    class RegistryResolver(LoRAResolver):
        async def resolve_lora(self, base_model_name: str, lora_name: str):
            path = await asyncio.to_thread(current, lora_name)  # may download from the store: off the loop
            return None if path is None else LoRARequest(lora_name, 1, str(path))  # vLLM sets the id

    return RegistryResolver()


class LoadLoRARequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str


@serve.deployment
@serve.ingress()
class PolicyServer:
    """One replica: vLLM's engine and OpenAI app, the adapter registry, the guard and the metrics board.

    ``adapter_root``: the folder (or object-store URI) every adapter must lie in; ``instance``: an id
    ``/health`` reports, so a client knows it reached this deployment.
    """

    async def __init__(
        self,
        model_path: str,
        model_cfg: ModelConfig,
        serve_cfg: ServeConfig,
        adapter_root: str,
        max_lora_rank: int = DEFAULT_MAX_LORA_RANK,
        instance: str = "",
        merged: dict | None = None,
    ):
        from vllm.entrypoints.launchers.api_server.app_state import init_app_state
        from vllm.entrypoints.launchers.app import build_app as build_vllm_app

        os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"  # requests for unknown names ask the resolver
        self._base, self._instance, self._lock = model_cfg.name, instance, asyncio.Lock()
        self._guard = GuardSettings(
            serve_cfg.api_key or None, serve_cfg.max_request_bytes, not serve_cfg.auth_probes
        )
        self._merged = merged  # {"name", "path"}: this engine runs that adapter merged, without LoRA
        self._registry = AdapterRegistry(adapter_root, set() if merged else {model_cfg.name}, max_lora_rank)
        swap = bool(merged and merged.get("swap"))  # the engine takes each adapter's weights in place
        self._base_path, self._weights = model_path, None
        if merged and not swap:  # model_cfg.name is the adapter's name (hamo_ray.serving.merged)
            from hamo_ray.serving.merged import prepare_merged

            model_path = await asyncio.to_thread(
                prepare_merged, self._registry, model_path, name=merged["name"], path=merged["path"],
                slot=merged.get("slot"),
            )  # fmt: skip
        self._engine, self._args = start_engine(
            model_path, model_cfg, serve_cfg, max_lora_rank=max_lora_rank, lora=not merged,
            extension=WEIGHT_SWAP_EXTENSION if swap else None,
        )  # fmt: skip
        tasks = await self._engine.get_supported_tasks()
        self._app = build_vllm_app(self._args, tasks, self._engine.model_config)  # as `vllm serve` does
        await init_app_state(self._engine, self._app.state, self._args, tasks)
        state = self._app.state
        self._models = state.openai_serving_models
        if not merged:
            self._models.lora_resolvers.append(_registry_resolver(self._registry))
        for attr, method in GUARDED:
            if getattr(state, attr, None) is not None:
                limits = serve_cfg.max_tokens_limit, self._engine.model_config.max_model_len
                guard_handler(getattr(state, attr), method, *limits)
        self._running = RunningPeak()
        self._metrics = ReplicaMetrics(self._own_metrics)
        self._host, self._direct_url = serve_cfg.host, None
        await self._adopt()
        if swap and merged["name"] is not None:  # started from the base folder: the merge goes in first
            await self._swap(merged["name"], merged["path"])
        elif swap:  # the base weights, as the engine loaded them
            self._weights = {"state": "loaded", "name": merged["base_name"], "folder": str(model_path)}
            self._set_served(merged["base_name"])

    async def __serve_build_asgi_app__(self):
        from starlette.exceptions import HTTPException
        from vllm.entrypoints.serve.exception_handling.handlers.http import http_exception_handler

        app = self._app
        app.state.server = types.SimpleNamespace()  # vLLM's engine-error handler reads it (no uvicorn here)
        app.router.routes[:] = [r for r in app.router.routes if getattr(r, "path", None) in VLLM_ROUTES]
        app.add_api_route("/health", self.health, methods=["GET"])
        app.add_api_route("/metrics", self.metrics, methods=["GET"])
        app.add_api_route("/v1/models", self.models, methods=["GET"])
        app.add_api_route("/v1/load_lora_adapter", self.load_lora_adapter, methods=["POST"])
        app.add_exception_handler(HTTPException, http_exception_handler)  # 404/405 as OpenAI JSON too
        app.middleware_stack = None  # vLLM's build_app built it; ours go outermost
        app.add_middleware(InflightMiddleware, peak=self._running)
        app.add_middleware(GuardMiddleware, settings=self._guard)
        await self._serve_directly(app)
        return app

    async def _serve_directly(self, app) -> None:
        """Serve ``app`` on a port of this replica's own too, as ``vllm serve`` does: no proxy hop."""
        import socket

        import ray
        import uvicorn

        sock = socket.create_server((self._host, 0), backlog=4096)
        from vllm import envs

        keep_alive = envs.VLLM_HTTP_TIMEOUT_KEEP_ALIVE
        config = uvicorn.Config(
            app, lifespan="off", log_level="warning", access_log=False, timeout_keep_alive=keep_alive
        )
        config.load()
        self._direct = uvicorn.Server(config)
        self._direct.lifespan = config.lifespan_class(config)
        await self._direct.startup(sockets=[sock])  # not serve(): Ray, not uvicorn, owns the signals
        self._direct_task = asyncio.get_running_loop().create_task(self._direct.main_loop())
        host = self._host if self._host not in ("0.0.0.0", "::", "") else ray.util.get_node_ip_address()
        self._direct_url = f"http://{host}:{sock.getsockname()[1]}"
        logger.info("replica serving directly at %s", self._direct_url)

    def __del__(self) -> None:
        if getattr(self, "_direct", None) is not None:
            self._direct.should_exit = True
        if getattr(self, "_engine", None) is not None:
            self._engine.shutdown()

    async def check_health(self) -> None:
        """Serve's periodic check: raises (Serve replaces the replica) if the engine died, or if an
        in-place weight load failed half-way (its weights are a mix)."""
        await self._check_engine()
        self._metrics.start()  # runs in the replica's loop: start publishing to the board

    async def _check_engine(self) -> None:
        await self._engine.check_health()
        if self._weights is not None and self._weights.get("state") == "broken":
            raise RuntimeError(
                f"in-place weight load failed, the engine's weights are mixed: {self._weights}"
            )

    def _own_metrics(self) -> str:
        from prometheus_client import generate_latest
        from vllm.v1.metrics.prometheus import get_prometheus_registry

        return generate_latest(get_prometheus_registry()).decode() + self._running.text(self._base)

    async def _adopt(self) -> None:
        """Load the adapters other replicas (or this one's predecessor) registered."""
        if self._merged:
            return
        await asyncio.to_thread(self._registry.sync)
        for name in self._registry.names():
            if name not in self._models.lora_requests:
                await self._models.resolve_lora(name)

    async def load_adapter(self, name: str, path: str) -> dict:
        """Serve the peft adapter in ``path`` (inside the adapter root) under the new name ``name``.

        The weights go into the engine now, so a broken adapter fails here. The same name and folder
        again is a no-op. Returns ``{"lora_name", "lora_path", "lora_int_id", "status": "loaded" |
        "already_loaded"}``; raises AdapterError 400 (bad name, path, rank or weights) or 409 (name taken).
        """
        from vllm.entrypoints.serve.lora.protocol import LoadLoRAAdapterRequest

        if self._merged:
            raise AdapterError(400, f"this engine serves {self._base!r} merged into its weights, no adapter")
        async with self._lock:
            await asyncio.to_thread(self._registry.sync)
            resolved, known = await asyncio.to_thread(self._registry.check, name, path)  # may download
            if name not in self._models.lora_requests:
                request = LoadLoRAAdapterRequest(lora_name=name, lora_path=str(resolved))
                result = await self._models.load_lora_adapter(request)
                if not isinstance(result, str):
                    raise AdapterError(
                        400, f"the engine could not load {str(resolved)!r}: {result.error.message}"
                    )
                self._registry.add(name, resolved)
        lora = self._models.lora_requests[name]
        status = "already_loaded" if known else "loaded"
        logger.info("adapter %r (lora id %d) from %s: %s", name, lora.lora_int_id, resolved, status)
        return dict(lora_name=name, lora_path=str(resolved), lora_int_id=lora.lora_int_id, status=status)

    async def swap(self, name: str | None, path: str | None = None) -> dict:
        """Serve adapter ``name`` (at ``path``, inside the adapter root) merged into the base weights, or
        the base weights (``name`` None, as the base's name), loaded into this merged replica's running
        engine in place (``weight_swap.load_into_engine``: no name is served meanwhile). A failed load
        leaves the replica unhealthy (``check_health`` raises: Serve replaces it).

        Raises:
            AdapterError: the registry refuses ``name``/``path``.
            MergedWeightsError: not a swapping replica, or the load failed.
        """
        from hamo_ray.serving.merged import MergedWeightsError

        if not (self._merged and self._merged.get("swap")):
            raise MergedWeightsError("this replica does not take weights in place")
        async with self._lock:
            return await self._swap(name, path)

    async def _swap(self, name: str | None, path: str | None) -> dict:
        import time

        from hamo_ray.serving.merged import MergedWeightsError, prepare_merged

        t0, served, folder = time.monotonic(), self._merged["base_name"], self._base_path
        if name is not None:
            served, folder = name, await asyncio.to_thread(
                prepare_merged, self._registry, self._base_path, name=name, path=str(path),
                slot=self._merged.get("slot"),
            )  # fmt: skip
        merge_s = time.monotonic() - t0
        self._set_served(SWAPPING)  # nothing is served while the weights change
        self._weights = {"state": "loading", "folder": str(folder)}
        try:
            infos, held = await load_into_engine(self._engine, str(folder), name)
        except Exception as exc:
            self._weights = {"state": "broken", "folder": str(folder), "error": repr(exc)}
            raise MergedWeightsError(f"loading {folder} into the running engine failed: {exc!r}") from exc
        self._weights = {
            "state": "loaded",
            "name": served,
            "folder": str(folder),
            "marker": held.get("marker"),
        }
        self._set_served(served)
        info = {
            "name": served, "folder": str(folder), "merge_s": round(merge_s, 2),
            "load_s": round(max(i["seconds"] for i in infos), 2), "kernels": infos[0]["kernels"],
            "seconds": round(time.monotonic() - t0, 2),
        }  # fmt: skip
        logger.info("weights in place: %s", info)
        return info

    def _set_served(self, name: str) -> None:
        """Serve the engine's weights under ``name`` (and no other)."""
        self._base = name
        set_served(self._models, name, str(self._base_path))

    async def load_lora_adapter(self, body: LoadLoRARequest):
        try:
            return await self.load_adapter(body.lora_name, body.lora_path)
        except AdapterError as exc:
            return _error(exc.message, exc.status, "lora_path")

    async def models(self):
        await self._adopt()
        return JSONResponse((await self._models.show_available_models()).model_dump())

    async def health(self):
        try:
            await self._check_engine()
        except Exception as exc:
            return _error(f"engine unhealthy: {exc}", 503)
        out = dict(status="ok", model=self._base, instance=self._instance, direct_url=self._direct_url)
        if self._weights is not None:  # a swapping merged replica: which folder's weights it holds
            out["weights"] = {k: v for k, v in self._weights.items() if k != "marker"}
        return out

    async def metrics(self):
        """Every replica's Prometheus page, each sample labelled ``replica`` (``ReplicaMetrics``)."""
        from prometheus_client import CONTENT_TYPE_LATEST

        return PlainTextResponse(await self._metrics.text(), media_type=CONTENT_TYPE_LATEST)


def build_app(
    model_path: str | Path,
    model_cfg: ModelConfig,
    serve_cfg: ServeConfig,
    adapter_root: str | Path,
    max_lora_rank: int = DEFAULT_MAX_LORA_RANK,
    instance: str = "",
    merged: dict | None = None,
):
    """The Serve application of the policy endpoint, sized by ``serve_cfg``; pass it to ``serve.run``.

    ``merged={"name", "path"}``: the replicas serve that adapter (a path inside ``adapter_root``) merged
    into the base weights, without LoRA, as ``model_cfg.name`` (``hamo_ray.serving.merged``); with
    ``"swap": True`` (and ``"base_name"``) each replica's engine starts from the base folder, loads the
    merge in place, and takes other adapters (or the base weights) through ``PolicyServer.swap``.

    GPUs per replica: ``serve_cfg.num_gpus`` when set, else ``tensor_parallel_size`` when the Ray
    cluster has GPUs, else none (CPU).
    """
    import ray

    num_gpus = serve_cfg.num_gpus
    if not num_gpus and ray.is_initialized() and ray.cluster_resources().get("GPU", 0) > 0:
        num_gpus = float(serve_cfg.tensor_parallel_size)
    deployment = PolicyServer.options(
        name="PolicyServer",
        num_replicas=serve_cfg.num_replicas,
        ray_actor_options={
            "num_cpus": serve_cfg.num_cpus,
            "num_gpus": num_gpus,
            "resources": dict(serve_cfg.resources),
            # Serve runs the app on the replica's own event loop, not a second thread's: no thread
            # hop per ASGI message (Ray's RAY_SERVE_THROUGHPUT_OPTIMIZED default for replicas).
            "runtime_env": {"env_vars": {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0"}},
        },
        max_ongoing_requests=max(8, 2 * serve_cfg.max_num_seqs),  # vLLM queues and batches itself
        health_check_period_s=30,
        health_check_timeout_s=60,
    )
    root = str(adapter_root) if is_uri(adapter_root) else str(Path(adapter_root).expanduser())
    return deployment.bind(str(model_path), model_cfg, serve_cfg, root, max_lora_rank, instance, merged)
