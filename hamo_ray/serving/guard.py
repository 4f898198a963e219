"""Request guard of the HTTP routes: optional bearer API key and a request body size limit.

An ASGI middleware (``GuardMiddleware``) added to each FastAPI ingress of the endpoint
(``hamo_ray.serving.app``, ``hamo_ray.serving.harness``). Its settings are per process: a Serve
replica calls ``configure_guard`` in its ``__init__`` (one replica per actor process), because Serve
hands each replica its own copy of the FastAPI app, so state cannot be set on the app object.

- ``Authorization: Bearer <key>`` is required when an API key is configured; a missing or wrong
  key gets 401 (constant-time comparison). The probe routes ``/health`` and ``/metrics`` stay open
  (as vLLM's server leaves them, for load balancers and Prometheus) unless ``open_probes`` is off
  (``serve.auth_probes``).
- A body above ``max_body_bytes`` gets 413, from its ``Content-Length`` before anything is read,
  or while it streams in (chunked uploads).

Errors are OpenAI-style JSON: ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import hmac
import json
from dataclasses import dataclass
from typing import Any

from starlette.exceptions import HTTPException

Scope = dict[str, Any]


@dataclass
class GuardSettings:
    api_key: str | None = None
    max_body_bytes: int = 1_000_000
    open_probes: bool = True  # /health and /metrics answer without the key


PROBE_PATHS = frozenset({"/health", "/metrics"})


_settings = GuardSettings()


def configure_guard(api_key: str | None, max_body_bytes: int, open_probes: bool = True) -> None:
    """Set this process's guard (called by a replica before it serves requests).

    Args:
        api_key: the bearer key every route wants; None or "": no key.
        max_body_bytes: larger request bodies get 413.
        open_probes: ``/health`` and ``/metrics`` (under the app's route prefix) need no key.
    """
    _settings.api_key = api_key or None
    _settings.max_body_bytes = int(max_body_bytes)
    _settings.open_probes = bool(open_probes)


def is_probe(scope: Scope) -> bool:
    """Whether the request is for ``/health`` or ``/metrics`` of this app (its route prefix removed)."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    if root and path.startswith(root):
        path = path[len(root) :]
    return path in PROBE_PATHS


def error_body(status: int, message: str, kind: str, code: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}}).encode()


class BodyTooLarge(HTTPException):
    """Raised while a body streams in past the limit; FastAPI passes HTTPExceptions through as-is."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body larger than {limit} bytes")


async def _send_json(send, status: int, body: bytes, headers: list[tuple[bytes, bytes]] = ()) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


def authorized(headers: dict[bytes, bytes]) -> bool:
    """Whether the request's ``Authorization`` header carries the configured key (True when none is)."""
    if not _settings.api_key:
        return True
    value = headers.get(b"authorization", b"").decode("latin-1")
    scheme, _, token = value.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip(), _settings.api_key)


class GuardMiddleware:
    """ASGI middleware enforcing ``GuardSettings`` on every HTTP request."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        if not (_settings.open_probes and is_probe(scope)) and not authorized(headers):
            body = error_body(401, "invalid or missing API key", "authentication_error", "invalid_api_key")
            await _send_json(send, 401, body, [(b"www-authenticate", b"Bearer")])
            return
        limit = _settings.max_body_bytes
        too_large = error_body(
            413, f"request body larger than {limit} bytes", "invalid_request_error", "request_too_large"
        )
        try:
            declared = int(headers.get(b"content-length", b"0") or 0)
        except ValueError:
            declared = 0
        if declared > limit:
            await _send_json(send, 413, too_large)
            return
        seen = 0
        started = False

        async def counting_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise BodyTooLarge(limit)
            return message

        async def tracking_send(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except BodyTooLarge:
            if not started:
                await _send_json(send, 413, too_large)
