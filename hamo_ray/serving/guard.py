"""Request guard of the endpoint's HTTP apps: an optional bearer API key and a body size limit.

An ASGI middleware, outermost on the policy app (``hamo_ray.serving.app``) and the harness app:

- ``Authorization: Bearer <key>`` is required when a key is configured; a missing or wrong key gets
  401 (constant-time comparison). ``/health`` and ``/metrics`` stay open for probes and scrapers, as
  vLLM leaves them, unless ``open_probes`` is off (``serve.auth_probes``).
- A body above ``max_body_bytes`` gets 413: from its ``Content-Length``, or, for a chunked body, while
  it is read (it is buffered up to the limit, then handed on).

The settings are the middleware's own (``GuardMiddleware(app, settings=...)``) or, without them, this
process's (``configure_guard``; a Serve replica is one process). Errors are OpenAI-style JSON.
"""

from __future__ import annotations

import hmac
import json
from dataclasses import dataclass


@dataclass
class GuardSettings:
    api_key: str | None = None
    max_body_bytes: int = 1_000_000
    open_probes: bool = True  # /health and /metrics answer without the key


PROBE_PATHS = frozenset({"/health", "/metrics"})
_settings = GuardSettings()


def configure_guard(api_key: str | None, max_body_bytes: int, open_probes: bool = True) -> GuardSettings:
    """Set (and return) this process's guard: the key (None or "": none), the body limit, open probes."""
    _settings.api_key = api_key or None
    _settings.max_body_bytes = int(max_body_bytes)
    _settings.open_probes = bool(open_probes)
    return _settings


def is_probe(scope) -> bool:
    """Whether the request is for ``/health`` or ``/metrics`` of this app (its route prefix removed)."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    return (path[len(root) :] if root and path.startswith(root) else path) in PROBE_PATHS


def error_body(status: int, message: str, kind: str, code: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}}).encode()


async def _send_json(send, status: int, body: bytes, headers=()) -> None:
    head = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *headers]
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": body})


class GuardMiddleware:
    """ASGI middleware enforcing ``GuardSettings`` on every HTTP request."""

    def __init__(self, app, settings: GuardSettings | None = None) -> None:
        self.app = app
        self.settings = settings

    def authorized(self, headers: dict[bytes, bytes]) -> bool:
        key = (self.settings or _settings).api_key
        if not key:
            return True
        scheme, _, token = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip(), key)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        settings = self.settings or _settings
        headers = dict(scope.get("headers") or [])
        if not (settings.open_probes and is_probe(scope)) and not self.authorized(headers):
            body = error_body(401, "invalid or missing API key", "authentication_error", "invalid_api_key")
            return await _send_json(send, 401, body, [(b"www-authenticate", b"Bearer")])
        limit = settings.max_body_bytes
        too_large = error_body(
            413, f"request body larger than {limit} bytes", "invalid_request_error", "request_too_large"
        )
        declared = headers.get(b"content-length", b"")
        if declared:
            if (int(declared) if declared.isdigit() else 0) > limit:
                return await _send_json(send, 413, too_large)
            return await self.app(scope, receive, send)  # the HTTP server holds it to that length
        if scope.get("method") in ("GET", "HEAD"):
            return await self.app(scope, receive, send)
        messages, seen = [], 0  # a chunked body: read it up to the limit, then hand it on
        while True:
            message = await receive()
            messages.append(message)
            seen += len(message.get("body", b""))
            if seen > limit:
                return await _send_json(send, 413, too_large)
            if message["type"] != "http.request" or not message.get("more_body"):
                break

        async def replay():
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)
