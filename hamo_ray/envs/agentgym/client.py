"""A client for AgentGym's environment servers behind the ``Env`` protocol.

``ServerClient`` is the transport to one server (JSON over HTTP, shared with the WebShop client):

- **errors are episode errors**: a ``{"error": ...}`` answer (AgentGym answers errors with HTTP 200),
  any 4xx (422: a missing field) or 5xx raises ``AgentGymError``. The rollout actor then closes the
  environment, retries the episode on a fresh one and, its attempts spent, records the episode as failed
  with the error (``hamo_ray.rollout.worker``): counted as an environment error, never a score of 0.
- **retries** only where the request cannot have reached the server (the connection was refused or
  could not be opened: ``httpx.ConnectError`` / ``ConnectTimeout``), ``retries`` times with a doubling
  pause; a request cut after it was sent is not replayed (a ``/step`` would be applied twice).
- **a bound per server**: at most ``max_envs`` environments of one URL are open at once in a process
  (``EnvSlots``); one more waits up to ``slot_timeout`` s for a slot, then fails naming the setting.

``AgentGymEnv`` is one server-side environment: created once (``/create``) and reused across
``reset`` calls, closed once (``/close``) by ``close()`` whatever happened (idempotent: a second
``close()`` sends nothing, so sciworld's 500 on a second close never happens). The payload mapping is the
server's row in ``protocol.SERVERS``. ``done`` is kept here once reached (textcraft's server forgets
it; sciworld's and babyai's refuse a step after it): a step after ``done`` returns the last observation
and the final score without calling the server.

Usage::

    env = AgentGymEnv(server_spec("textcraft"), "http://127.0.0.1:36001", item_of=lambda t: t.variation)
    goal, obs = env.reset(task)            # POST /reset {id, data_idx}
    result = env.step("get 1 oak log")     # StepResult(observation, reward, done, score 0-100)
    env.close()                             # POST /close {id}
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from hamo_ray.envs.agentgym.protocol import Payload, ServerSpec
from hamo_ray.envs.base import EnvLifecycle, StepResult
from hamo_ray.types import TaskSpec

logger = logging.getLogger(__name__)


class AgentGymError(RuntimeError):
    """The server answered with an error (``{"error": ...}``, a 4xx or a 5xx): the episode fails."""


class EnvSlots:
    """Process-wide bound on the environments open on one server URL."""

    _lock = threading.Lock()
    _sems: dict[str, tuple[int, threading.BoundedSemaphore]] = {}

    @classmethod
    def acquire(cls, url: str, max_envs: int, timeout: float, setting: str) -> None:
        """Take a slot of ``url`` (at most ``max_envs``).

        Raises:
            AgentGymError: no slot freed within ``timeout`` s (names ``setting``).
        """
        with cls._lock:
            bound, sem = cls._sems.get(url, (None, None))
            if sem is None or bound != max_envs:
                sem = threading.BoundedSemaphore(max_envs)
                cls._sems[url] = (max_envs, sem)
        if not sem.acquire(timeout=timeout):
            raise AgentGymError(
                f"{setting}={max_envs}: that many environments of {url} are open in this process; "
                f"none was closed within {timeout:g}s"
            )

    @classmethod
    def release(cls, url: str) -> None:
        with cls._lock:
            entry = cls._sems.get(url)
        if entry is not None:
            try:
                entry[1].release()
            except ValueError:  # released more often than taken (the bound was changed meanwhile)
                pass

    @classmethod
    def in_use(cls, url: str) -> int:
        """Slots of ``url`` taken now (tests)."""
        with cls._lock:
            entry = cls._sems.get(url)
        return 0 if entry is None else entry[0] - entry[1]._value  # noqa: SLF001


class ServerClient:
    """JSON over HTTP to one environment server (see the module docstring for errors and retries).

    Args:
        url: the server's base URL, e.g. ``http://127.0.0.1:36001``.
        timeout: seconds per request.
        retries: tries after the first when the connection cannot be opened.
        backoff: the first pause between tries (doubled each time), seconds.
    """

    def __init__(self, url: str, timeout: float = 60.0, retries: int = 3, backoff: float = 0.5) -> None:
        import httpx

        self.url = url.rstrip("/")
        self.retries, self.backoff = retries, backoff
        self._http = httpx.Client(base_url=self.url, timeout=timeout)

    @property
    def closed(self) -> bool:
        return self._http.is_closed

    def call(self, method: str, route: str, body: Any = None, params: dict | None = None) -> Any:
        """``method route`` with a JSON ``body`` (POST) or query ``params`` (GET); the decoded answer.

        Raises:
            AgentGymError: an ``{"error": ...}`` answer, a 4xx or 5xx status, or a body that is not JSON.
            httpx.ConnectError / httpx.ConnectTimeout: the server could not be reached after the retries.
        """
        import httpx

        pause = self.backoff
        for attempt in range(self.retries + 1):
            try:
                if method == "GET":
                    response = self._http.get(route, params=params)
                else:
                    response = self._http.post(route, json=body)
                break
            except (httpx.ConnectError, httpx.ConnectTimeout) as err:
                if attempt == self.retries:
                    raise
                logger.warning("%s%s: %s; retrying in %.1fs", self.url, route, err, pause)
                time.sleep(pause)
                pause *= 2
        where = f"{method} {self.url}{route}"
        if response.status_code >= 400:
            raise AgentGymError(f"{where}: HTTP {response.status_code}: {response.text[:500]}")
        try:
            out = response.json()
        except ValueError:
            raise AgentGymError(f"{where}: not JSON: {response.text[:200]!r}") from None
        if isinstance(out, dict) and "error" in out:
            raise AgentGymError(f"{where}: {out['error']}")
        return out

    def close(self) -> None:
        self._http.close()


class AgentGymEnv(EnvLifecycle):
    """One environment of an AgentGym server (see the module docstring).

    Args:
        spec: the server's row (``protocol.SERVERS``).
        url: the server's base URL.
        item_of: the server's item index (``data_idx``) of a task; raises ``ValueError`` naming a task the
            server does not list.
        expert: the gold actions of a task (the local simulator's, or an expert file's); None: no expert.
        max_envs: the bound on open environments of ``url`` in this process.
        setting: the config key of the URL (``env.textcraft.url``), named in errors.
        timeout: seconds per request.

    Raises:
        AgentGymError: ``/create`` failed; httpx.ConnectError: the server is unreachable.
    """

    def __init__(
        self,
        spec: ServerSpec,
        url: str,
        item_of: Callable[[TaskSpec], int],
        expert: Callable[[TaskSpec], list[str]] | None = None,
        max_envs: int = 16,
        setting: str = "url",
        timeout: float = 60.0,
        slot_timeout: float = 300.0,
    ) -> None:
        self.spec, self.url, self._item_of, self._expert = spec, url.rstrip("/"), item_of, expert
        self._setting = setting
        EnvSlots.acquire(self.url, max_envs, slot_timeout, setting.rsplit(".", 1)[0] + ".max_envs")
        self._server = ServerClient(url, timeout=timeout)
        self.id: int | None = None
        try:
            created = self._server.call("POST", "/create", spec.create_body)
            self.id = int(created["id"]) if isinstance(created, dict) else int(created)
        except Exception:
            self._server.close()
            EnvSlots.release(self.url)
            raise
        self._task: TaskSpec | None = None
        self._last: Payload = {}
        self._obs = ""
        self._score = 0.0
        self._done = False
        self.steps = 0

    @property
    def task(self) -> TaskSpec | None:
        return self._task

    def reset(self, task: TaskSpec) -> tuple[str, str]:
        """Load ``task`` (its item index on the server); returns (goal, first observation).

        Raises:
            ValueError: the server does not list the task (named).
            AgentGymError: the server answered with an error.
        """
        if self._server.closed:
            raise RuntimeError(f"{self.spec.name} environment {self.id} is closed")
        index = self._item_of(task)
        payload = self._server.call("POST", "/reset", {"id": self.id, **self.spec.reset_body(index)})
        if not isinstance(payload, dict):
            raise AgentGymError(f"{self.url}/reset: expected an object, got {type(payload).__name__}")
        try:
            goal, obs = self.spec.first(payload)
        except (KeyError, ValueError) as err:
            raise AgentGymError(f"{self.url}/reset of {task.id} (item {index}): {err}") from None
        self._task, self._last, self._obs, self.steps = task, payload, obs, 0
        self._score = self.spec.score(payload, 0.0) if "score" in payload or "reward" in payload else 0.0
        self._done = False
        return goal, obs

    def step(self, action: str) -> StepResult:
        """Apply ``action`` on the server (not after ``done``: then the final result, no call).

        Raises:
            AgentGymError: the server answered with an error.
        """
        if self._task is None:
            raise RuntimeError(f"{self.spec.name} step() before reset()")
        if self._done:
            return StepResult(self._obs, 0.0, True, self._score)
        payload = self._server.call("POST", "/step", {"id": self.id, "action": action})
        if not isinstance(payload, dict):
            raise AgentGymError(f"{self.url}/step: expected an object, got {type(payload).__name__}")
        try:
            obs = self.spec.observation(payload)
            score = float(self.spec.score(payload, self._score))
            done = self.spec.done(payload)
        except (KeyError, TypeError, ValueError) as err:
            raise AgentGymError(f"{self.url}/step: malformed answer {payload!r:.300}: {err}") from None
        reward = score - self._score
        self._last, self._obs, self._score, self._done = payload, obs, score, done
        self.steps += 1
        return StepResult(obs, reward, done, score)

    def expert_actions(self) -> list[str]:
        if self._task is None:
            raise RuntimeError(f"{self.spec.name} expert_actions() before reset()")
        if self._expert is None:
            raise NotImplementedError(
                f"the AgentGym {self.spec.name} server offers no expert actions; import expert "
                f"trajectories (env.expert_source=file, env.expert_files.<domain>=<AgentTraj file>)"
            )
        return list(self._expert(self._task))

    def valid_actions(self) -> list[str] | None:
        return self.spec.valid_actions(self._last)

    def _close(self) -> None:
        """Close the server-side environment once (best effort) and release its slot (idempotent)."""
        if self._server.closed:
            return
        try:
            if self.spec.has_close and self.id is not None:
                self._server.call("POST", "/close", {"id": self.id})
        except Exception:  # noqa: BLE001 - the server may be gone; the slot is freed all the same
            logger.warning("%s: closing environment %s failed", self.url, self.id, exc_info=True)
        finally:
            self._server.close()
            EnvSlots.release(self.url)
            closer = getattr(self._expert, "close", None)
            if closer is not None:
                closer()
