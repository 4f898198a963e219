"""Request guard of the endpoint's HTTP apps: an optional bearer API key and a body size limit.

An ASGI middleware, outermost on the policy app (``hamo_ray.serving.app``) and the harness app:

- ``Authorization: Bearer <key>`` is required when a key is configured; a missing or wrong key gets
  401 (constant-time comparison). ``/health`` and ``/metrics`` stay open for probes and scrapers, as
  vLLM leaves them, unless ``open_probes`` is off (``serve.auth_probes``).
- A body above ``max_body_bytes`` gets 413: from its ``Content-Length``, or, for a chunked body, while
  it is read (it is buffered up to the limit, then handed on).

The settings are the middleware's own (``GuardMiddleware(app, settings=...)``) or, without them, this
process's (``configure_guard``; a Serve replica is one process). Errors are OpenAI-style JSON.

Also the policy app's refusals of request fields that would break the training format or the limits
(:func:`refusal`, wrapped around vLLM's handlers by :func:`guard_handler`).
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


# -- fields of a parsed vLLM request the endpoint refuses (the training format, the limits) -----------
REFUSED = {
    "chat_template": "a request's own chat template would break the training format",
    "truncate_prompt_tokens": "a truncated prompt is not the trained one",
}
TEMPLATE_CALL_ARGS = frozenset(
    {"conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
     "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
     "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"}
)  # fmt: skip
GUARDED = [("openai_serving_chat", "create_chat_completion"), ("openai_serving_completion", "create_completion"),
           ("serving_tokenization", "create_tokenize")]  # fmt: skip


def refusal(request, max_tokens_limit: int, max_model_len: int) -> tuple[str, str] | None:
    """``(field, message)`` when a parsed vLLM request would break the training format or the limits."""
    for name in request.model_extra or {}:
        return name, f"unsupported field `{name}`: this server does not serve it"
    for name, why in REFUSED.items():
        if getattr(request, name, None) is not None:
            return name, f"`{name}` is not served: {why}"
    if hasattr(request, "messages") and getattr(request, "add_special_tokens", False):
        return "add_special_tokens", "`add_special_tokens` is not served on chat: the template places them"
    reserved = sorted(set(getattr(request, "chat_template_kwargs", None) or {}) & TEMPLATE_CALL_ARGS)
    if reserved:
        return "chat_template_kwargs", f"`chat_template_kwargs` {reserved} are arguments of the template call"
    tokens = getattr(request, "max_completion_tokens", None) or getattr(request, "max_tokens", None)
    if tokens is not None and tokens > max_tokens_limit:
        return "max_tokens", f"max_tokens {tokens} exceeds this server's limit {max_tokens_limit}"
    if tokens is None and max_tokens_limit < max_model_len and hasattr(request, "max_completion_tokens"):
        request.max_completion_tokens = max_tokens_limit  # the default length (vLLM cuts it to the context)
    return None


def guard_handler(handler, method: str, *limits: int) -> None:
    """Wrap a vLLM serving object's ``method`` so a request :func:`refusal` refuses gets 400 naming the field."""
    from vllm.entrypoints.serve import create_error_response

    inner = getattr(handler, method)

    async def guarded(request, *args, **kwargs):
        if refused := refusal(request, *limits):
            return create_error_response(refused[1], param=refused[0])
        return await inner(request, *args, **kwargs)

    setattr(handler, method, guarded)
