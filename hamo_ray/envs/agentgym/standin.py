"""Loopback servers that speak AgentGym's environment-server protocol, quirks included (tests, smoke runs).

``AgentGymStandin(backend)`` is a ``ThreadingHTTPServer`` on a background thread with AgentGym's
routes and behaviour (``protocol.py``): errors as HTTP 200 ``{"error": ...}`` (unknown id, index out of
range, step after done where the server refuses it), 422 with FastAPI's ``detail`` for a missing field
(and for textcraft's ``/create`` without a body), 500 for a second ``/close`` on sciworld, ``false`` for
one on textcraft and babyai. It counts what was created and closed (``created``, ``open_ids``).

Backends:

- ``SciWorldBackend``: the **real** ScienceWorld simulator, as AgentGym's ``agentenv-sciworld`` runs it:
  one JVM per environment (heap capped), the package's ``load(task, variation)`` (no simplifications)
  and ``step`` (its 100-step cap and its -100 on a failed task), the item list of 4,639 (task,
  variation) pairs without 5-x, 9-x, 10-x. Scores are the simulator's.
- ``TextCraftBackend``: a generated crafting world, **not** Minecraft's recipes: 544 goals whose
  crafting depth follows the real server's blocks (``domains.TEXTCRAFT_DEPTHS``), the real server's
  observation text and action grammar (``get N item``, ``craft N X using N A, N B``, ``inventory``),
  reward 1 on success and ``done`` not kept after it.
- ``BabyAIBackend``: a small abstract room, **not** MiniGrid: the real server's level list (item
  ``n``: level ``n % 40 + 1``, seed ``n // 40``), its ``Your goal:`` and ``Available actions: [...]``
  texts, a time-discounted reward (``1 - 0.9 * steps / 64``) and its ``score`` that sums rewards.

Usage::

    with AgentGymStandin(TextCraftBackend()) as url:   # http://127.0.0.1:<free port>
        run with env.textcraft.url=<url>

    python -m hamo_ray.envs.agentgym.standin sciworld --port 36001   # serve until interrupted
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

from hamo_ray.envs.agentgym.standin_backends import (  # noqa: F401  (importable from here)
    BabyAIBackend,
    Backend,
    Refused,
    SciWorldBackend,
    TextCraftBackend,
)

logger = logging.getLogger(__name__)


BACKENDS = {"sciworld": SciWorldBackend, "textcraft": TextCraftBackend, "babyai": BabyAIBackend}


class AgentGymStandin:
    """An AgentGym-protocol server on a background thread; a context manager yielding its base URL."""

    def __init__(self, backend: Backend, host: str = "127.0.0.1", port: int = 0) -> None:
        self.backend = backend
        self.created = 0
        self.open_ids: set[int] = set()
        self.closed_ids: set[int] = set()
        self.requests: list[str] = []  # "<route>" per request, in order
        self._lock = threading.Lock()
        self.httpd = ThreadingHTTPServer((host, port), self._handler())
        self.httpd.daemon_threads = True
        self.url = f"http://{host}:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def start(self) -> str:
        self._thread.start()
        logger.info("AgentGym %s stand-in at %s", self.backend.banner, self.url)
        return self.url

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        for idx in list(self.open_ids):
            try:
                self.backend.close(idx)
            except Exception:  # noqa: BLE001
                pass

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def expert_plan(self, data_idx: int) -> list[str]:
        return self.backend.expert_plan(data_idx)

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server, backend = self, self.backend

        def missing(*fields: str) -> tuple[int, Any]:
            detail = [
                {"type": "missing", "loc": ["body", *([f] if f else [])], "msg": "Field required"}
                for f in fields
            ]
            return 422, {"detail": detail}

        def dispatch(method: str, route: str, body: Any, query: dict) -> tuple[int, Any]:
            if method == "GET":
                if route == "/":
                    return 200, f"This is environment {backend.banner}."
                return 404, {"detail": "Not Found"}
            if route == "/create":
                if backend.create_needs_body and body is None:
                    return missing("")
                with server._lock:
                    idx = server.created
                    server.created += 1
                try:
                    out = backend.create(idx)
                except Exception as err:  # noqa: BLE001
                    return 200, {"error": str(err)}
                server.open_ids.add(idx)
                return 200, out
            if not isinstance(body, dict):
                return missing("id")
            need = {"/reset": ["id"], "/step": ["id", "action"], "/close": ["id"]}.get(route)
            if need is None:
                return 404, {"detail": "Not Found"}
            if route == "/reset" and not isinstance(backend, TextCraftBackend):
                need = need + ["data_idx"]  # textcraft's data_idx defaults to 0
            absent = [f for f in need if f not in body]
            if absent:
                return missing(*absent)
            idx = body["id"]
            if route == "/close":
                if idx not in server.open_ids:
                    if backend.second_close == "500":
                        return 500, "Internal Server Error"
                    return 200, False
                server.open_ids.discard(idx)
                server.closed_ids.add(idx)
                try:
                    backend.close(idx)
                except Exception:  # noqa: BLE001 - the real textcraft/babyai answer false
                    return 200, False
                return 200, True
            if idx not in server.open_ids:
                return 200, {"error": f"The id {idx} is not valid."}
            try:
                if route == "/reset":
                    return 200, backend.reset(idx, int(body.get("data_idx", 0)))
                return 200, backend.step(idx, str(body["action"]))
            except Refused as err:
                return 200, {"error": str(err)}
            except Exception as err:  # noqa: BLE001 - AgentGym wraps every call in try/except
                return 200, {"error": f"{err}"}

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _reply(self, status: int, out: Any) -> None:
                if isinstance(out, str) and status == 500:
                    data, kind = out.encode(), "text/plain"
                else:
                    data, kind = json.dumps(out).encode(), "application/json"
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _serve(self, method: str) -> None:
                url = urlparse(self.path)
                body = None
                if method == "POST":
                    length = int(self.headers.get("Content-Length") or 0)
                    raw = self.rfile.read(length) if length else b""
                    try:
                        body = json.loads(raw) if raw.strip() else None
                    except json.JSONDecodeError:
                        return self._reply(422, {"detail": [{"type": "json_invalid", "loc": ["body"]}]})
                server.requests.append(url.path)
                status, out = dispatch(method, url.path, body, parse_qs(url.query))
                self._reply(status, out)

            def do_GET(self) -> None:  # noqa: N802
                self._serve("GET")

            def do_POST(self) -> None:  # noqa: N802
                self._serve("POST")

        return Handler


def agenttraj_items(server: AgentGymStandin, name: str, indices: list[int]) -> list[dict[str, Any]]:
    """AgentTraj-format items (``item_id`` ``<name>_<N>``, ``conversations``) of the stand-in's expert
    plans, played through the server over HTTP: the first human turn is the reset's observation (for
    sciworld: task description + newline + observation, as AgentTraj has it), each later one the step's.
    Items whose plan does not succeed are left out.
    """
    from hamo_ray.envs.agentgym.client import ServerClient
    from hamo_ray.envs.agentgym.protocol import server_spec

    spec = server_spec(name)
    client = ServerClient(server.url)
    items = []
    try:
        idx = client.call("POST", "/create", spec.create_body)["id"]
        for n in indices:
            first = client.call("POST", "/reset", {"id": idx, **spec.reset_body(n)})
            text = first["observation"]
            if name == "sciworld":
                text = f"{first['task_description']}\n{text}"
            conv = [
                {"from": "human", "loss": None, "value": f"You are an agent in {spec.banner} ..."},
                {"from": "gpt", "loss": False, "value": "Ok."},
                {"from": "human", "loss": None, "value": text},
            ]
            score, done = 0.0, False
            for k, action in enumerate(server.expert_plan(n)):
                out = client.call("POST", "/step", {"id": idx, "action": action})
                conv.append(
                    {"from": "gpt", "loss": True, "value": f"Thought:\nstep {k}.\n\nAction:\n{action}"}
                )
                conv.append({"from": "human", "loss": None, "value": spec.observation(out)})
                score, done = spec.score(out, score), spec.done(out)
                if done:
                    break
            if done and score > 0:
                items.append({"item_id": f"{name}_{n}", "conversations": conv})
        client.call("POST", "/close", {"id": idx})
    finally:
        client.close()
    return items


def main(argv: list[str] | None = None) -> None:
    """``python -m hamo_ray.envs.agentgym.standin {sciworld,textcraft,babyai} [--host H] [--port P]``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("env", choices=sorted(BACKENDS))
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=36001)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    server = AgentGymStandin(BACKENDS[args.env](), args.host, args.port)

    def interrupt(*_: object) -> None:  # SIGTERM (and SIGINT, which a background job ignores) end it cleanly
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
    print(f"AgentGym {args.env} stand-in at {server.url}", flush=True)
    try:
        server.httpd.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        open_ids = sorted(server.open_ids)
        print(f"AgentGym {args.env} stand-in: {server.created} environments created, "
              f"{len(server.closed_ids)} closed, {len(open_ids)} left open {open_ids[:20]}", flush=True)  # fmt: skip
        server.stop()


if __name__ == "__main__":
    main()
