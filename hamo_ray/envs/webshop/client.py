"""Clients for the real WebShop: its text environment in-process, or an environment server over HTTP.

Neither can run here (WebShop needs its repository, a product file from a file host, a spaCy model and
a pyserini/Java index), so the HTTP client is tested against a loopback server speaking the same API.

**In-process** (``env.webshop.backend=text_env``): needs ``web_agent_site`` importable, i.e. a checkout of
https://github.com/princeton-nlp/WebShop set up with its ``setup.sh -d small`` (or ``-d all``) in the
same Python environment. ``WebShopTextEnv`` wraps ``web_agent_site.envs.WebAgentTextEnv(observation_mode=
"text", num_products=...)``: ``reset(session=i)`` loads goal ``i`` of the server's goal list,
``step(action)`` returns ``(observation, reward 0-1, done, info)``.

**Environment server** (``env.webshop.backend=http env.webshop.url=http://host:36001``): the AgentGym
WebShop server (``agentenv-webshop``; start it with ``webshop --host 0.0.0.0 --port 36001`` after its
``setup.sh``). Its API, which ``WebShopHttpEnv`` speaks:

=====================================  ===========================================================
``POST /create``                       -> ``env_idx`` (int)
``POST /reset`` ``{env_idx, session_id}``  -> ``[observation, null]``; loads goal ``session_id``
``GET /instruction_text?env_idx=``     -> ``"Instruction: ..."``
``GET /observation?env_idx=``          -> the current page, text mode
``POST /step`` ``{env_idx, action}``   -> ``{state, reward, done, info}``
``GET /available_actions?env_idx=``    -> ``{has_search_bar, clickables}``
``POST /close`` ``{env_idx}``          -> ``{closed}``
=====================================  ===========================================================

Tasks: WebShop's 12,087 human instructions in the server's fixed shuffled order, one task type
(``all``), split as WebShop's baselines and ReAct/AgentGym do: test = goals 0-499, dev = 500-1499,
train = 1500 on. The score is 100 x the reward of the purchase. The real WebShop has no per-instruction
expert behind these APIs (its human demonstrations are files of its repository), so
``expert_actions`` raises ``NotImplementedError``: a run with a real backend takes its WebShop experts
from a file (``env.expert_source=file``, ``hamo_ray/envs/expert_data.py``: AgentGym's / ETO's data).
``server.py`` serves the stand-in behind this same API (tests, smoke runs).
"""

from __future__ import annotations

import logging
from typing import Any

from hamo_ray.envs.base import EnvLifecycle, StepResult
from hamo_ray.types import TaskSpec

logger = logging.getLogger(__name__)

REAL_TASK_TYPE = "all"
REAL_NUM_GOALS = 12087
REAL_SPLITS = {"test": range(0, 500), "dev": range(500, 1500), "train": range(1500, REAL_NUM_GOALS)}
_NO_EXPERT = (
    "the real WebShop offers no expert actions through its text environment or env server; "
    "import expert trajectories (env.expert_source=file, env.expert_files.webshop=<AgentGym/ETO file>) "
    "or use the stand-in (env.webshop.backend=standin)"
)


def _strip_instruction(text: str) -> str:
    text = text.strip()
    if text.lower().startswith("instruction:"):
        text = text[len("instruction:") :]
    return text.strip()


class _RealWebShop(EnvLifecycle):
    """Shared episode bookkeeping; subclasses implement the four ``_`` transport methods."""

    def __init__(self) -> None:
        self._task: TaskSpec | None = None
        self._done = False
        self._score = 0.0

    def reset(self, task: TaskSpec) -> tuple[str, str]:
        """Load goal ``task.variation`` of the real goal list; returns (instruction, first page).

        Raises:
            ValueError: the variation is outside the task's split.
        """
        if task.variation not in REAL_SPLITS.get(task.split, range(0)):
            raise ValueError(
                f"{task.id}: variation {task.variation} is not in the WebShop {task.split} split"
            )
        observation = self._reset(task.variation)
        self._task, self._done, self._score = task, False, 0.0
        return _strip_instruction(self._instruction()), observation

    def step(self, action: str) -> StepResult:
        if self._task is None:
            raise RuntimeError("step() before reset()")
        if self._done:
            return StepResult(self._observation(), 0.0, True, self._score)
        observation, reward, done = self._step(action)
        if done:
            self._done, self._score = True, round(100.0 * float(reward), 4)
            return StepResult(observation, self._score, True, self._score)
        return StepResult(observation, 0.0, False, 0.0)

    def expert_actions(self) -> list[str]:
        raise NotImplementedError(_NO_EXPERT)

    def valid_actions(self) -> list[str]:
        available = self._available()
        search = ["search[<keywords>]"] if available.get("has_search_bar") else []
        return search + [f"click[{c}]" for c in available.get("clickables", []) if c != "search"]

    def _reset(self, goal_index: int) -> str:
        raise NotImplementedError

    def _instruction(self) -> str:
        raise NotImplementedError

    def _observation(self) -> str:
        raise NotImplementedError

    def _step(self, action: str) -> tuple[str, float, bool]:
        raise NotImplementedError

    def _available(self) -> dict[str, Any]:
        raise NotImplementedError


class WebShopTextEnv(_RealWebShop):
    """WebShop's own ``WebAgentTextEnv`` in this process (text observations).

    Args:
        num_products: passed to ``WebAgentTextEnv`` (its indexes exist for 100, 1000, 100000 and None = all).

    Raises:
        ImportError: ``web_agent_site`` is not importable (WebShop is not installed here).
    """

    def __init__(self, num_products: int | None = 1000) -> None:
        super().__init__()
        from web_agent_site.envs import WebAgentTextEnv

        self._env = WebAgentTextEnv(observation_mode="text", num_products=num_products)

    def _reset(self, goal_index: int) -> str:
        observation, _ = self._env.reset(session=goal_index)
        return observation

    def _instruction(self) -> str:
        return self._env.get_instruction_text()

    def _observation(self) -> str:
        return self._env.observation

    def _step(self, action: str) -> tuple[str, float, bool]:
        observation, reward, done, _ = self._env.step(action)
        return observation, reward, done

    def _available(self) -> dict[str, Any]:
        return self._env.get_available_actions()

    def _close(self) -> None:
        self._env.close()


class WebShopHttpEnv(_RealWebShop):
    """One environment of a WebShop env server (AgentGym API, see the module docstring).

    The transport is the shared AgentGym client's (``hamo_ray.envs.agentgym.client.ServerClient``):
    ``{"error": ...}`` answers, 4xx and 5xx raise ``AgentGymError`` (an episode error), a refused
    connection is retried; this class maps WebShop's own dialect (``env_idx``, ``session_id``).

    Args:
        url: the server's base URL, e.g. ``http://127.0.0.1:36001``.
        timeout: seconds per request (a search on the full catalogue can take a few seconds).

    Raises:
        AgentGymError: the server answers with an error; httpx.ConnectError: it cannot be reached.
    """

    def __init__(self, url: str, timeout: float = 60.0) -> None:
        super().__init__()
        from hamo_ray.envs.agentgym.client import ServerClient

        self._server = ServerClient(url, timeout=timeout)
        try:
            self.env_idx = int(self._call("POST", "/create"))
        except Exception:
            self._server.close()
            raise
        logger.debug("webshop server %s: env %d created", url, self.env_idx)

    def _call(self, method: str, path: str, **body: Any) -> Any:
        if method == "GET":
            return self._server.call("GET", path, params=body)
        return self._server.call("POST", path, body or None)

    def _reset(self, goal_index: int) -> str:
        return self._call("POST", "/reset", env_idx=self.env_idx, session_id=goal_index)[0]

    def _instruction(self) -> str:
        return self._call("GET", "/instruction_text", env_idx=self.env_idx)

    def _observation(self) -> str:
        return self._call("GET", "/observation", env_idx=self.env_idx)

    def _step(self, action: str) -> tuple[str, float, bool]:
        out = self._call("POST", "/step", env_idx=self.env_idx, action=action)
        return out["state"], float(out["reward"]), bool(out["done"])

    def _available(self) -> dict[str, Any]:
        return self._call("GET", "/available_actions", env_idx=self.env_idx)

    def _close(self) -> None:
        """Release the server-side environment (best effort) and the connection (idempotent)."""
        if self._server.closed:
            return
        try:
            self._call("POST", "/close", env_idx=self.env_idx)
        except Exception:  # noqa: BLE001 - the server may already be gone
            logger.debug("webshop server: closing env %d failed", self.env_idx, exc_info=True)
        finally:
            self._server.close()
