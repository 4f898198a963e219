"""The rollout client: chats go to a replica's own port, and to Serve's route once that port is gone.

A real HTTP server (the standard library's, in a thread) stands in for the route; the direct port is
a closed one. No Ray.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from hamo_ray.rollout.client import PolicyClient, PolicySpec


class _Chat(BaseHTTPRequestHandler):
    seen: list[dict] = []

    def do_POST(self):  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        _Chat.seen.append({"path": self.path, **body})
        out = json.dumps(
            {"choices": [{"message": {"content": "look around"}}], "usage": {"completion_tokens": 2}}
        )
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out.encode())

    def log_message(self, *args):
        pass


@pytest.fixture()
def route():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Chat)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _Chat.seen.clear()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def _closed_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def test_a_gone_replica_falls_back_to_the_route(route):
    async def go():
        client = PolicyClient(PolicySpec(base_url=_closed_port(), fallback_url=route, model="stage-1"))
        try:
            first = await client.act([{"role": "user", "content": "hi"}])
            second = await client.act([{"role": "user", "content": "hi again"}])
        finally:
            await client.aclose()
        return first, second, client.url

    first, second, url = asyncio.run(go())
    assert first == ("look around", 2) and second == ("look around", 2)
    assert url == route  # once fallen back, it stays there
    assert [s["path"] for s in _Chat.seen] == ["/v1/chat/completions"] * 2
    assert _Chat.seen[0]["model"] == "stage-1"


def test_without_a_fallback_the_connect_error_is_raised():
    import httpx

    async def go():
        client = PolicyClient(PolicySpec(base_url=_closed_port(), model="m"))
        try:
            await client.act([{"role": "user", "content": "hi"}])
        finally:
            await client.aclose()

    with pytest.raises(httpx.ConnectError):
        asyncio.run(go())


def test_a_regex_goes_as_structured_outputs(route):
    async def go():
        client = PolicyClient(PolicySpec(base_url=route, model="m"))
        try:
            await client.act([{"role": "user", "content": "hi"}])
            await client.act([{"role": "user", "content": "hi"}], regex="(look|go north)")
        finally:
            await client.aclose()

    asyncio.run(go())
    assert "structured_outputs" not in _Chat.seen[0]
    assert _Chat.seen[1]["structured_outputs"] == {"regex": "(look|go north)"}
