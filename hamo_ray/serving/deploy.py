"""Deploying the policy endpoint on the connected Ray cluster: ``start_policy_server`` (the Serve app of
``hamo_ray.serving.app``), ``running_http`` (where Serve's proxy really listens),
``shutdown_policy_server``. Talking to a running endpoint over HTTP is ``hamo_ray.serving.client``.
"""

from __future__ import annotations

import logging
import time
import uuid
from pathlib import Path

from hamo_ray.config import ModelConfig, ServeConfig
from hamo_ray.serving.client import base_url, wait_healthy
from hamo_ray.serving.engine import DEFAULT_MAX_LORA_RANK
from hamo_ray.serving.objstore import is_uri

logger = logging.getLogger(__name__)


def start_policy_server(
    model_path: str | Path,
    model_cfg: ModelConfig,
    serve_cfg: ServeConfig,
    adapter_root: str | Path,
    *,
    max_lora_rank: int = DEFAULT_MAX_LORA_RANK,
    timeout_s: float = 600.0,
) -> str:
    """Deploy the policy endpoint on the connected Ray cluster and wait until it answers.

    Serve's proxy starts on ``serve_cfg.host:port`` (a Serve instance already running keeps its own).
    ``adapter_root``: the folder adapters are published from (created if missing) or an object-store
    URI (publish paths are then relative to it). Returns the base URL, e.g. ``http://127.0.0.1:8000``
    (OpenAI clients use ``url + "/v1"``); raises PolicyServerError if not healthy within ``timeout_s``.
    """
    from ray import serve

    from hamo_ray.serving.app import build_app

    t0 = time.monotonic()
    if not is_uri(adapter_root):
        Path(adapter_root).expanduser().mkdir(parents=True, exist_ok=True)
    logging_config = {"enable_access_log": serve_cfg.access_log}
    serve.start(http_options={"host": serve_cfg.host, "port": serve_cfg.port}, logging_config=logging_config)
    instance = uuid.uuid4().hex
    app = build_app(model_path, model_cfg, serve_cfg, adapter_root, max_lora_rank, instance)
    serve.run(
        app,
        # A run names its app and route after its run id (run.services.Services); a bare config: hamo at /.
        name=serve_cfg.app_name or "hamo",
        route_prefix=serve_cfg.route_prefix or "/",
        blocking=False,
        logging_config=logging_config,
    )
    url = base_url(running_http(serve_cfg))
    wait_healthy(url, max(1.0, timeout_s - (time.monotonic() - t0)), instance, api_key=serve_cfg.api_key)
    logger.info("policy server %r healthy at %s after %.1fs", model_cfg.name, url, time.monotonic() - t0)
    return url


def running_http(serve_cfg: ServeConfig) -> ServeConfig:
    """``serve_cfg`` with the host and port of the running Serve proxy (an earlier start wins)."""
    try:
        from ray.serve.context import _get_global_client  # private; Serve has no public getter

        http = _get_global_client().http_config
        host, port = http.host, http.port
    except Exception:  # another Serve version: trust the config
        return serve_cfg
    if (host, port) != (serve_cfg.host, serve_cfg.port):
        logger.warning("Serve was already running on %s:%s; serving there, not on %s:%s", host, port,
                       serve_cfg.host, serve_cfg.port)  # fmt: skip
    return serve_cfg.model_copy(update={"host": host, "port": port})


def shutdown_policy_server(serve_cfg: ServeConfig | None = None) -> None:
    """Delete the endpoint's Serve application; stop Serve too when no other application is left."""
    from ray import serve

    try:
        serve.delete((serve_cfg or ServeConfig()).app_name or "hamo")
        if not serve.status().applications:
            serve.shutdown()
    except Exception as exc:  # Serve already gone: nothing to stop
        logger.info("policy server shutdown: %s", exc)
