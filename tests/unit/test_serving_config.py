"""Serving settings without a server: the request guard's open probe routes and engine argument pass-through.

pytest tests/unit/test_serving_config.py -q
"""

from __future__ import annotations

import httpx
import pytest
from fastapi import FastAPI

from hamo_ray.config import ModelConfig, ServeConfig
from hamo_ray.serving.engine import check_engine_kwargs, engine_kwargs
from hamo_ray.serving.guard import GuardMiddleware, configure_guard


def _app() -> FastAPI:
    app = FastAPI()
    app.add_middleware(GuardMiddleware)
    for route in ("/health", "/metrics", "/v1/models"):
        app.add_api_route(route, lambda: {"ok": True})
    return app


def _get(path: str, key: str | None = None, root_path: str = "") -> int:
    transport = httpx.ASGITransport(app=_app(), root_path=root_path)
    headers = {"Authorization": f"Bearer {key}"} if key else {}

    async def go() -> int:
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return (await client.get(root_path + path, headers=headers)).status_code

    import asyncio

    return asyncio.run(go())


@pytest.fixture(autouse=True)
def _reset_guard():
    yield
    configure_guard(None, 1_000_000)


def test_probes_open_unless_configured():
    configure_guard("k3y", 1_000_000)  # the default: probes open, as vLLM's server
    assert _get("/health") == 200 and _get("/metrics") == 200
    assert _get("/v1/models") == 401 and _get("/v1/models", "k3y") == 200
    assert _get("/health", root_path="/harness") == 200  # an app under a route prefix
    configure_guard("k3y", 1_000_000, open_probes=not ServeConfig(auth_probes=True).auth_probes)
    assert _get("/health") == 401 and _get("/metrics") == 401 and _get("/health", "k3y") == 200


def test_engine_kwargs_pass_through():
    serve = ServeConfig(max_num_seqs=8, engine_kwargs={"enforce_eager": True, "max_num_seqs": 3})
    kwargs = engine_kwargs("/m", ModelConfig(), serve, device="cpu")
    assert kwargs["enforce_eager"] is True and kwargs["max_num_seqs"] == 3  # the config's own win
    check_engine_kwargs(serve.engine_kwargs)
    with pytest.raises(ValueError, match=r"serve.engine_kwargs: \['not_an_arg'\]"):
        check_engine_kwargs({"not_an_arg": 1})


def test_publishing_to_a_silent_server_fails_naming_the_timeout_setting():
    """An endpoint that accepts the connection and never answers (vLLM compiling its LoRA kernels,
    or hung) fails the publish with AdapterNotLiveError naming ``serve.publish_timeout_s``."""
    import socket

    from hamo_ray.serving import AdapterNotLiveError, publish_adapter

    with socket.create_server(("127.0.0.1", 0)) as silent:  # listens, never accepts nor answers
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        with pytest.raises(AdapterNotLiveError, match=r"within 0.3 s \(serve.publish_timeout_s"):
            publish_adapter(url, "stage-1", "stage-1", "probe", 4, timeout_s=0.3)
    assert ServeConfig().publish_timeout_s == 600.0
    with pytest.raises(ValueError, match="publish_timeout_s"):
        ServeConfig(publish_timeout_s=0)
