"""A loopback WebShop environment server speaking the AgentGym API, backed by the offline stand-in.

It lets the HTTP backend (``env.webshop.backend=http``) run end to end where the real WebShop cannot
(tests, a laptop): same routes and payloads as AgentGym's ``agentenv-webshop`` server (see
``client.py``), pages and rewards from ``standin.WebShopStandinEnv``. It is not the WebShop benchmark.

Usage::

    with StandinServer(build_catalog(0, 1000)) as url:      # http://127.0.0.1:<free port>
        run with env.webshop.backend=http env.webshop.url=<url>

Goal (session) ``i`` is a stand-in instruction in the same split as WebShop's goal ``i`` (test 0-499,
dev 500-1499, train 1500 on: ``client.REAL_SPLITS``): category ``CATEGORIES[i % 5]``, the
``(i // 5)``-th instruction of that category's split (cycling), so train and test goals stay disjoint.
``expert_plan(i)`` is the stand-in expert's plan for goal ``i`` (tests write expert files with it).
"""

from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

from hamo_ray.envs.webshop.catalog import CATEGORIES, Catalog
from hamo_ray.envs.webshop.client import REAL_SPLITS
from hamo_ray.envs.webshop.standin import WebShopStandinEnv
from hamo_ray.types import TaskSpec

logger = logging.getLogger(__name__)


def standin_task(catalog: Catalog, goal_index: int) -> TaskSpec:
    """The stand-in task that plays WebShop goal ``goal_index``.

    Raises:
        ValueError: the index is outside WebShop's goal list.
    """
    split = next((s for s, goals in REAL_SPLITS.items() if goal_index in goals), None)
    if split is None:
        raise ValueError(f"webshop goal {goal_index} is outside 0..{max(REAL_SPLITS['train'])}")
    category = CATEGORIES[goal_index % len(CATEGORIES)]
    variations = catalog.split_range(category, split)
    return TaskSpec(
        domain="webshop",
        task=category,
        variation=variations[(goal_index // len(CATEGORIES)) % len(variations)],
        split=split,
    )


class StandinServer:
    """A ``ThreadingHTTPServer`` on a background thread; a context manager yielding its base URL."""

    def __init__(self, catalog: Catalog, host: str = "127.0.0.1", port: int = 0) -> None:
        self.catalog = catalog
        self.envs: dict[int, WebShopStandinEnv] = {}
        self._lock = threading.Lock()
        self._next = 0
        self.httpd = ThreadingHTTPServer((host, port), self._handler())
        self.url = f"http://{host}:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def expert_plan(self, goal_index: int) -> list[str]:
        """The stand-in expert's actions for goal ``goal_index`` (from a fresh session)."""
        env = WebShopStandinEnv(self.catalog)
        env.reset(standin_task(self.catalog, goal_index))
        return env.expert_actions()

    def start(self) -> str:
        self._thread.start()
        logger.info("webshop stand-in server at %s", self.url)
        return self.url

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _reply(self, body: object, status: int = 200) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:  # noqa: N802
                url = urlparse(self.path)
                if url.path == "/":
                    return self._reply("This is environment WebShop (hamo-ray stand-in).")
                env = server.envs.get(int(parse_qs(url.query).get("env_idx", ["-1"])[0]))
                if env is None:
                    return self._reply({"detail": "no such env"}, 404)
                if url.path == "/instruction_text":
                    return self._reply("Instruction: " + env._require_goal().instruction_text)
                if url.path == "/observation":
                    return self._reply(env.observation)
                if url.path == "/available_actions":
                    return self._reply(
                        {"has_search_bar": env._page == "search", "clickables": list(env.clickables())}
                    )
                self._reply({"detail": "not found"}, 404)

            def do_POST(self) -> None:  # noqa: N802
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length) or b"{}")
                if self.path == "/create":
                    with server._lock:
                        idx, server._next = server._next, server._next + 1
                        server.envs[idx] = WebShopStandinEnv(server.catalog)
                    return self._reply(idx)
                env = server.envs.get(body.get("env_idx", -1))
                if env is None:
                    return self._reply({"detail": "no such env"}, 404)
                if self.path == "/reset":
                    try:
                        task = standin_task(server.catalog, int(body["session_id"]))
                    except (KeyError, TypeError, ValueError) as err:
                        return self._reply({"detail": str(err)}, 422)
                    _, obs = env.reset(task)
                    return self._reply([obs, None])
                if self.path == "/step":
                    r = env.step(body["action"])
                    return self._reply(
                        {"state": r.observation, "reward": r.score / 100, "done": r.done, "info": None}
                    )
                if self.path == "/close":
                    return self._reply({"closed": server.envs.pop(body["env_idx"], None) is not None})
                self._reply({"detail": "not found"}, 404)

        return Handler
