"""The policy endpoint: a Ray Serve deployment over vLLM's v1 ``AsyncLLM``, OpenAI-compatible, multi-LoRA.

Routes: ``GET /health``, ``GET /v1/models``, ``POST /v1/chat/completions``, ``POST /v1/completions``
(both with ``stream=true`` SSE), ``POST /v1/load_lora_adapter`` ``{"lora_name", "lora_path"}``,
``GET /metrics`` (the engine's Prometheus metrics, e.g. ``vllm:num_requests_running``, of EVERY replica:
each sample carries a ``replica`` label, whichever replica the proxy picks). Every route
is guarded (``hamo_ray.serving.guard``: optional bearer key, body size limit); ``/health`` and
``/metrics`` stay open for probes and scrapers unless ``serve.auth_probes``. ``max_tokens`` above
``serve.max_tokens_limit`` is refused.

A drop-in for vLLM's OpenAI server: the sampling fields vLLM honours go to ``vllm.SamplingParams``
(``protocol`` validates the requests and maps them, ``responses`` builds the answers and SSE
chunks), fields it cannot serve get 400 naming them, ``n`` > 1 returns ``n`` choices. Chat messages are rendered with the tokenizer's chat template and the template variables
``model.enable_thinking`` / ``model.chat_template_kwargs`` of the run, overridden per request by
``chat_template_kwargs`` (vLLM's field) - the call and variables training uses
(``hamo_ray.prompting.encode_chat``), so a trained prompt and a served one are the same tokens.
The server builds no prompts itself: rollout workers build them (``hamo_ray.rollout.worker``).
Adapter loading is also a deployment method (``handle.load_adapter.remote(name, path)``). Deploy it
with ``hamo_ray.serving.start_policy_server``, or by hand::

    serve.run(build_app(model_path, model_cfg, serve_cfg, adapter_root), name="hamo", blocking=False)

Why our own deployment and not ``ray.serve.llm`` (Ray 2.60, read in its installed sources):

- ``LoraConfig.dynamic_lora_loading_path`` is validated by ``is_remote_path`` and must start with
  s3://, gs://, abfss:// or azure:// (``ray/llm/_internal/serve/core/configs/llm_config.py``); local
  adapter folders are not accepted, and adapters are only found as subfolders of that URI, served as
  ``<base_model_id>:<subfolder>`` (``common/utils/lora_utils.py: get_lora_model_ids``), through Serve
  model multiplexing and a cloud download step (``serve/utils/lora_serve_utils.py``).
- Its OpenAI ingress (``serve/core/ingress/ingress.py``) has no ``/v1/load_lora_adapter`` route; the
  engine's ``resolve_lora`` is reachable only through the multiplexing path above.
- Extending it means subclassing private ``ray.llm._internal`` classes that change between Ray
  releases. vLLM's ``AsyncLLM`` (``vllm/v1/engine/async_llm.py``) offers what we need as public
  methods: ``generate(prompt, SamplingParams, request_id, lora_request=...)``, ``add_lora``,
  ``check_health``, ``shutdown``; ``LoRARequest(lora_name, lora_int_id, lora_path)``
  (``vllm/lora/request.py``) loads a local peft folder under any name.

So this deployment owns adapter naming (any new name, a folder inside the adapter root, a distinct
integer id each), applies the tokenizer's chat template itself (transformers
``apply_chat_template(..., tokenize=True, return_dict=False)``, the call training uses) and hands
the engine token ids, so training and inference see the same tokens.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from hamo_ray.config import ModelConfig, ServeConfig
from hamo_ray.serving import protocol as oa
from hamo_ray.serving import responses
from hamo_ray.serving.adapters import AdapterError, AdapterRegistry
from hamo_ray.serving.engine import DEFAULT_MAX_LORA_RANK, build_engine
from hamo_ray.serving.guard import GuardMiddleware, configure_guard
from hamo_ray.serving.metrics import ReplicaMetrics, RunningPeak
from hamo_ray.serving.objstore import is_uri

logger = logging.getLogger(__name__)

api = FastAPI(title="HaMo policy server")
api.add_middleware(GuardMiddleware)


@api.exception_handler(oa.APIError)
async def _api_error(_: Request, exc: oa.APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


@api.exception_handler(StarletteHTTPException)
async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    """Unknown routes (404), wrong methods (405), oversize bodies (413), as OpenAI-style JSON."""
    code = "request_too_large" if exc.status_code == 413 else None
    return JSONResponse(
        oa.APIError(exc.status_code, str(exc.detail), code=code).body(), status_code=exc.status_code
    )


@api.exception_handler(RequestValidationError)
async def _invalid_body(_: Request, exc: RequestValidationError) -> JSONResponse:
    """400 naming the field: unknown fields, refused fields (``protocol.UNSUPPORTED``), bad values."""
    errors = exc.errors()
    param = ".".join(str(p) for p in errors[0]["loc"][1:]) if errors else None
    parts = []
    for e in errors:
        name = ".".join(str(p) for p in e["loc"][1:]) or "body"
        if e["type"] == "extra_forbidden":
            parts.append(f"unsupported field `{name}`: this server does not serve it")
        else:
            parts.append(f"{name}: {str(e['msg']).removeprefix('Value error, ')}")
    return JSONResponse(oa.APIError(400, "; ".join(parts), param=param).body(), status_code=400)


@api.exception_handler(Exception)
async def _internal_error(_: Request, exc: Exception) -> JSONResponse:
    logger.error("unhandled error", exc_info=exc)
    return JSONResponse(oa.APIError(500, f"{type(exc).__name__}: {exc}").body(), status_code=500)


@serve.deployment
@serve.ingress(api)
class PolicyServer:
    """One replica: a vLLM engine, the base model's tokenizer and the adapters it serves by name.

    Args:
        model_path: local HF folder (or hub id) of the base model (weights + tokenizer).
        model_cfg: served name, dtype, context length.
        serve_cfg: engine sizing (see ``hamo_ray.serving.engine``).
        adapter_root: the folder every adapter must lie in (a run folder's ``adapters/``), or an
            object-store URI whose adapters each replica downloads (``hamo_ray.serving.objstore``).
        max_lora_rank: the largest adapter rank accepted.
        instance: an id ``GET /health`` reports, so a client knows it reached this deployment and
            not another server on the same port.
    """

    def __init__(
        self,
        model_path: str,
        model_cfg: ModelConfig,
        serve_cfg: ServeConfig,
        adapter_root: str,
        max_lora_rank: int = DEFAULT_MAX_LORA_RANK,
        instance: str = "",
    ):
        from transformers import AutoTokenizer

        configure_guard(serve_cfg.api_key, serve_cfg.max_request_bytes, open_probes=not serve_cfg.auth_probes)
        self._instance = instance
        self._max_tokens_limit = serve_cfg.max_tokens_limit
        self._template_kwargs = model_cfg.template_kwargs()  # the run's defaults; requests override
        self._model_path = str(model_path)
        self._base = model_cfg.name
        self._max_model_len = model_cfg.max_model_len
        self._tokenizer = AutoTokenizer.from_pretrained(self._model_path)
        self._registry = AdapterRegistry(adapter_root, {self._base}, max_lora_rank)
        self._loras: dict[str, Any] = {}  # name -> vllm LoRARequest
        self._next_lora_id = 1
        self._load_lock = asyncio.Lock()
        self._running = RunningPeak()
        self._metrics = ReplicaMetrics(self._own_metrics)  # /metrics of every replica
        self._engine = build_engine(self._model_path, model_cfg, serve_cfg, max_lora_rank=max_lora_rank)
        self._adopt_registered()

    def __del__(self) -> None:
        engine = getattr(self, "_engine", None)
        if engine is not None:
            engine.shutdown()

    async def check_health(self) -> None:
        """Serve's periodic health check: raises (and Serve replaces the replica) if the engine died."""
        await self._engine.check_health()
        self._metrics.start()  # the first check runs in the replica's loop: start publishing

    def _own_metrics(self) -> str:
        from prometheus_client import REGISTRY, generate_latest

        return generate_latest(REGISTRY).decode() + self._running.text(self._base)

    def _lora_request(self, name: str, path: Path):
        from vllm.lora.request import LoRARequest

        request = LoRARequest(lora_name=name, lora_int_id=self._next_lora_id, lora_path=str(path))
        self._next_lora_id += 1
        return request

    def _adopt_registered(self) -> None:
        """Serve the adapters other replicas (or this replica's predecessor) registered."""
        for name, path in self._registry.sync():
            self._loras[name] = self._lora_request(name, path)
            self._registry.add(name, path, persist=False)
            logger.info("adopted adapter %r from %s", name, path)

    async def load_adapter(self, name: str, path: str) -> dict[str, Any]:
        """Serve the peft adapter in ``path`` (inside the adapter root) under the new name ``name``.

        Loading the same name and folder again is a no-op. The weights are loaded into the engine
        now, so a broken adapter fails here and not at its first request.

        Returns:
            ``{"lora_name", "lora_path", "lora_int_id", "status": "loaded" | "already_loaded"}``.

        Raises:
            AdapterError: status 400 (bad name/path/rank, weights the engine rejects) or 409 (name taken).
        """
        async with self._load_lock:
            self._adopt_registered()
            resolved, known = self._registry.check(name, path)
            if known:
                lora = self._loras[name]
                return {
                    "lora_name": name,
                    "lora_path": str(resolved),
                    "lora_int_id": lora.lora_int_id,
                    "status": "already_loaded",
                }
            lora = self._lora_request(name, resolved)
            try:
                await self._engine.add_lora(lora)
            except Exception as exc:
                raise AdapterError(400, f"the engine could not load {str(resolved)!r}: {exc}") from exc
            self._loras[name] = lora
            self._registry.add(name, resolved)
        logger.info("serving adapter %r (lora id %d) from %s", name, lora.lora_int_id, resolved)
        return {
            "lora_name": name,
            "lora_path": str(resolved),
            "lora_int_id": lora.lora_int_id,
            "status": "loaded",
        }

    def _lookup(self, model: str):
        """The LoRARequest for a served model name (None for the base), else a 404."""
        if model == self._base:
            return None
        if model not in self._loras:
            self._adopt_registered()
        if model not in self._loras:
            raise oa.APIError(
                404, f"The model `{model}` does not exist.", param="model", code="model_not_found"
            )
        return self._loras[model]

    @api.get("/health")
    async def health(self) -> dict[str, str]:
        try:
            await self._engine.check_health()
        except Exception as exc:
            raise oa.APIError(503, f"engine unhealthy: {exc}") from exc
        return {"status": "ok", "model": self._base, "instance": self._instance}

    @api.get("/v1/models")
    async def models(self) -> dict[str, Any]:
        self._adopt_registered()
        created = responses.now()
        card = {
            "object": "model",
            "created": created,
            "owned_by": "hamo",
            "max_model_len": self._max_model_len,
        }
        data = [{"id": self._base, "root": self._model_path, "parent": None, **card}]
        data += [
            {"id": n, "root": lr.lora_path, "parent": self._base, **card} for n, lr in self._loras.items()
        ]
        return {"object": "list", "data": data}

    @api.post("/v1/load_lora_adapter")
    async def load_lora_adapter(self, body: oa.LoadLoRARequest) -> dict[str, Any]:
        try:
            return await self.load_adapter(body.lora_name, body.lora_path)
        except AdapterError as exc:
            raise oa.APIError(exc.status, exc.message, param="lora_path") from exc

    @api.get("/metrics")
    async def metrics(self) -> PlainTextResponse:
        """Every replica's Prometheus metrics (vLLM's and Python's), each sample labelled ``replica``.

        This replica's are read now; the others' are the latest they published (at most
        ``PUBLISH_EVERY_S`` old). Before the board exists (the first seconds) only this replica's.
        """
        from prometheus_client import CONTENT_TYPE_LATEST

        return PlainTextResponse(await self._metrics.text(), media_type=CONTENT_TYPE_LATEST)

    def _render(self, body: oa.ChatCompletionRequest) -> tuple[list[int], str | None]:
        """Token ids (and, when asked, the text) of a chat request under the chat template.

        The template variables are the run's (``model.template_kwargs()``) with the request's
        ``chat_template_kwargs`` on top; the call is the one training makes
        (``hamo_ray.prompting.encode_chat``), so the ids are the ones a training example holds.
        """
        messages = [m.to_template() for m in body.messages]
        kwargs = {**self._template_kwargs, **(body.chat_template_kwargs or {})}
        call = dict(
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
            **kwargs,
        )
        try:
            ids = self._tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False, **call)
            text = (
                self._tokenizer.apply_chat_template(messages, tokenize=False, **call)
                if body.return_prompt_text
                else None
            )
        except Exception as exc:
            raise oa.APIError(400, f"cannot apply the chat template: {exc}", param="messages") from exc
        return list(ids), text

    @api.post("/v1/chat/completions")
    async def chat_completions(self, body: oa.ChatCompletionRequest):
        lora = self._lookup(body.model)
        ids, text = self._render(body)
        return await self._respond(body, ids, lora, chat=True, prompt_text=text)

    @api.post("/v1/completions")
    async def completions(self, body: oa.CompletionRequest):
        lora = self._lookup(body.model)
        ids = self._tokenizer(body.prompt_text())["input_ids"]
        return await self._respond(body, list(ids), lora, chat=False)

    async def _respond(
        self,
        body: oa.ChatCompletionRequest | oa.CompletionRequest,
        ids: list[int],
        lora: Any,
        chat: bool,
        prompt_text: str | None = None,
    ):
        params = body.sampling_params(len(ids), self._max_model_len, self._max_tokens_limit)
        rid = responses.new_id("chatcmpl" if chat else "cmpl")
        gen = self._engine.generate({"prompt_token_ids": ids}, params, rid, lora_request=lora)
        if body.stream:
            events = responses.sse_events(gen, body, rid, ids, chat, prompt_text)
            return StreamingResponse(self._running.track(events), media_type="text/event-stream")
        final = None
        self._running.enter()
        try:
            async for out in gen:
                final = out
        except Exception as exc:
            raise oa.engine_error(exc) from exc
        finally:
            self._running.exit()
        outputs = sorted(final.outputs, key=lambda o: o.index)
        logprobs = [responses.request_logprobs(body, chat, o) for o in outputs]
        return responses.response(
            chat, rid, body.model, responses.now(), outputs, ids, logprobs, body.return_token_ids, prompt_text
        )


def build_app(
    model_path: str | Path,
    model_cfg: ModelConfig,
    serve_cfg: ServeConfig,
    adapter_root: str | Path,
    max_lora_rank: int = DEFAULT_MAX_LORA_RANK,
    instance: str = "",
):
    """The Serve application of the policy endpoint, sized by ``serve_cfg``; pass it to ``serve.run``.

    GPUs per replica: ``serve_cfg.num_gpus`` when set, else ``tensor_parallel_size`` when the Ray
    cluster has GPUs, else none (CPU). The replica builds the engine for what it was granted.
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
        },
        # vLLM batches and queues requests itself; let rollouts keep it full.
        max_ongoing_requests=max(8, 2 * serve_cfg.max_num_seqs),
        health_check_period_s=30,
        health_check_timeout_s=60,
    )
    return deployment.bind(
        str(model_path),
        model_cfg,
        serve_cfg,
        str(adapter_root) if is_uri(adapter_root) else str(Path(adapter_root).expanduser()),
        max_lora_rank,
        instance,
    )
