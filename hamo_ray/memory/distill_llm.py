"""The LLM distiller: trajectory -> strategy-level solution outline through an OpenAI-compatible endpoint.

Any server speaking ``POST {base_url}/chat/completions`` works: the project's own Serve app, a vLLM
server of a larger teacher model, a hosted API. Selected with ``memory.distiller=llm`` and
``memory.llm_base_url=http://host:port/v1``, or ``memory.llm_base_url=policy``: the run's own policy
endpoint and its base model (no adapter), bound when the stream starts (``bind_policy``). It runs
inside the Ray Data card pipeline, one distiller per task, each with at most ``memory.llm_concurrency``
requests in flight.

Per trajectory: one request with :data:`PROMPT_TEMPLATE`. The model sees the goal, the initial
observation and every action *with the observation it produced* (clipped: :data:`MAX_STEP_OBS_CHARS`
each), and is asked for subgoals with their purpose, in the task's own terms: what is specific to the
variation (which animal, which room) is to be stated as the rule that found it ("the animal with the
longest lifespan among those outside"), unless the goal itself names it. The paper's cards are
strategy-level (the steps and their purpose), not action logs; the prompt is the project's choice
(the paper does not publish its own). The reply is normalised to one line of numbered steps
(``1. ...; 2. ...``) and validated. An *empty* outline (no step left) or a *runaway* one (longer than
``llm_max_outline_chars``, or cut by the token limit) is retried, as are HTTP errors and timeouts, up
to ``llm_max_retries`` times with a short exponential back-off; after that the deterministic distiller
(``llm_fallback``, "outline" by default) writes the outline, and the row is counted as a fallback
(``outline_source == "fallback"``; the stage's ``distil`` figures and log line count them)::

    from hamo_ray.config import MemoryConfig
    distiller = LLMDistiller.from_config(MemoryConfig(distiller="llm", llm_base_url="http://127.0.0.1:8000/v1"))
    outlines, sources = distiller.distill_with_sources(trajectories)   # sources: "llm" or "fallback"

httpx is imported when a distiller is built.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from hamo_ray.memory.distill import get_distiller, register_distiller
from hamo_ray.types import Trajectory

if TYPE_CHECKING:
    from hamo_ray.config import MemoryConfig

logger = logging.getLogger(__name__)

POLICY = "policy"  # memory.llm_base_url value: the run's own policy endpoint (bound by the stream)

SYSTEM_PROMPT = (
    "You turn an agent's successful episode into a short strategy that solves other variations of the "
    "same task."
)
# {goal}, {init_obs}, {steps} (one numbered action a line, its observation indented below) and
# {max_steps} are filled in.
PROMPT_TEMPLATE = """Task: {goal}
Initial observation: {init_obs}

The agent solved it. Its actions, each followed by what the environment answered:
{steps}

Write the strategy for this kind of task: at most {max_steps} numbered steps, one per line. Each step
is a subgoal and its purpose, e.g. "Go outside, where the animals are, to compare them." Group
navigation into one step and drop looking around. Where this episode picked something particular
(an animal, an object, a room), say how it was chosen ("the animal with the longest lifespan"), not
its name, unless the task names it. Answer with the numbered steps only."""

MAX_PROMPT_ACTIONS = 40  # longer episodes keep their first and last 20 steps
MAX_OBS_CHARS = 600  # the initial observation
MAX_STEP_OBS_CHARS = 160  # each step's observation
_STEP = re.compile(r"^\s*(?:\d+\s*[.):-]|[-*•])\s*")
_FENCE = re.compile(r"^```.*$", re.MULTILINE)
_THINK = re.compile(r"<think>.*?(?:</think>|$)", re.DOTALL)


class InvalidOutline(ValueError):
    """The endpoint answered, but the outline is empty or runaway."""


def _clip(text: str, max_chars: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= max_chars else text[: max_chars - 3].rstrip() + "..."


def build_prompt(traj: Trajectory, max_steps: int = 12) -> str:
    """The user message for one trajectory (see :data:`PROMPT_TEMPLATE`): actions with their observations."""
    steps = [
        f"{i}. > {action}\n   {_clip(obs, MAX_STEP_OBS_CHARS)}"
        for i, (action, obs) in enumerate(zip(traj.actions, traj.observations, strict=True), start=1)
    ]
    if len(steps) > MAX_PROMPT_ACTIONS:
        half = MAX_PROMPT_ACTIONS // 2
        steps = [*steps[:half], f"... ({len(steps) - 2 * half} steps left out) ...", *steps[-half:]]
    return PROMPT_TEMPLATE.format(
        goal=traj.goal.strip(),
        init_obs=_clip(traj.init_obs, MAX_OBS_CHARS),
        steps="\n".join(steps),
        max_steps=max_steps,
    )


def normalise_outline(text: str, max_chars: int, truncated: bool = False) -> str:
    """Turn a reply into one line ``1. step; 2. step; ...``, or raise :class:`InvalidOutline`.

    Args:
        text: the model's reply.
        max_chars: longest accepted outline (characters, after normalising).
        truncated: the reply was cut by the token limit (``finish_reason == "length"``).

    Returns:
        The normalised outline.

    Raises:
        InvalidOutline: no step left (empty), or the outline is runaway (too long or cut).
    """
    if truncated:
        raise InvalidOutline("runaway: the reply hit the token limit")
    from hamo_ray.prompting import strip_reasoning

    text = strip_reasoning(text or "")
    lines = [_STEP.sub("", line).strip() for line in _FENCE.sub("", text).splitlines()]
    steps = [" ".join(line.split()) for line in lines if line.strip()]
    if len(steps) == 1 and "; " in steps[0]:  # already one line of "1. a; 2. b"
        steps = [_STEP.sub("", s).strip() for s in steps[0].split("; ") if s.strip()]
    if not steps:
        raise InvalidOutline("empty outline")
    outline = "; ".join(f"{i}. {s}" for i, s in enumerate(steps, start=1))
    if len(outline) > max_chars:
        raise InvalidOutline(f"runaway outline: {len(outline)} > {max_chars} characters")
    return outline


@register_distiller("llm")
class LLMDistiller:
    """Outlines from an OpenAI-compatible chat endpoint, validated, with a deterministic fallback.

    Args:
        mcfg: the memory section, passed whole; the distiller reads its ``llm_*`` settings:
            ``llm_base_url`` (the API root, e.g. ``http://127.0.0.1:8000/v1``), ``llm_model``,
            ``llm_api_key`` (a bearer token; "EMPTY" for local servers), ``llm_concurrency`` (requests in
            flight), ``llm_max_retries`` (before the fallback), ``llm_timeout_s`` (per request),
            ``llm_max_tokens``, ``llm_temperature``, ``llm_max_outline_chars`` (longer outlines are
            runaway), ``llm_fallback`` (the registered distiller used when every try failed) and
            ``llm_chat_template_kwargs`` (e.g. Qwen3's ``enable_thinking: false``).
        backoff_s: the first retry waits this long, doubling each time.

    Raises:
        ValueError: no ``memory.llm_base_url``, or ``policy`` not yet bound to the run's endpoint.
    """

    def __init__(self, mcfg: MemoryConfig, *, backoff_s: float = 0.2) -> None:
        import httpx

        if not mcfg.llm_base_url:
            raise ValueError("memory.llm_base_url is required for the llm distiller")
        if mcfg.llm_base_url == POLICY:
            raise ValueError(
                "memory.llm_base_url='policy' is bound to the run's endpoint when the stream starts "
                "(hamo_ray.memory.distill_llm.bind_policy); outside a stream give a URL"
            )
        self.settings = mcfg
        self.url = mcfg.llm_base_url.rstrip("/") + "/chat/completions"
        self.model = mcfg.llm_model
        self.concurrency = max(1, mcfg.llm_concurrency)
        self.max_retries = max(0, mcfg.llm_max_retries)
        self.max_tokens = mcfg.llm_max_tokens
        self.temperature = mcfg.llm_temperature
        self.max_outline_chars = mcfg.llm_max_outline_chars
        self.backoff_s = backoff_s
        self.chat_template_kwargs = mcfg.llm_chat_template_kwargs or None
        self.fallback = get_distiller(mcfg.llm_fallback)
        self._client = httpx.Client(
            timeout=mcfg.llm_timeout_s,
            headers={"Authorization": f"Bearer {mcfg.llm_api_key}"},
            limits=httpx.Limits(max_connections=self.concurrency),
        )

    @classmethod
    def from_config(cls, mcfg: MemoryConfig) -> LLMDistiller:
        """The distiller described by the ``memory.llm_*`` settings (the same as ``LLMDistiller(mcfg)``)."""
        return cls(mcfg)

    def _request(self, traj: Trajectory) -> str:
        body: dict[str, Any] = {
            "model": self.model,
            "messages": [
                {"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": build_prompt(traj)},
            ],
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
        }
        if self.chat_template_kwargs:
            body["chat_template_kwargs"] = self.chat_template_kwargs
        response = self._client.post(self.url, json=body)
        response.raise_for_status()
        choice = response.json()["choices"][0]
        return normalise_outline(
            choice["message"].get("content") or "",
            self.max_outline_chars,
            truncated=choice.get("finish_reason") == "length",
        )

    def _one(self, traj: Trajectory) -> tuple[str | None, str]:
        """(outline or None, last error) after at most ``1 + max_retries`` tries."""
        error = ""
        for attempt in range(self.max_retries + 1):
            if attempt:
                time.sleep(min(5.0, self.backoff_s * 2 ** (attempt - 1)))
            try:
                return self._request(traj), ""
            except InvalidOutline as exc:
                error = str(exc)
            except Exception as exc:  # HTTP status, connection, timeout, malformed JSON
                error = f"{type(exc).__name__}: {exc}"
            logger.debug("llm distiller: %s try %d failed: %s", traj.id, attempt + 1, error)
        return None, error

    def distill_with_sources(self, trajectories: Sequence[Trajectory]) -> tuple[list[str], list[str]]:
        """Outline each trajectory, in order, and say who wrote it.

        Returns:
            (outlines, sources): ``sources[i]`` is "llm" or "fallback".
        """
        if not trajectories:
            return [], []
        with ThreadPoolExecutor(max_workers=min(self.concurrency, len(trajectories))) as pool:
            results = list(pool.map(self._one, trajectories))
        failed = [i for i, (outline, _) in enumerate(results) if outline is None]
        backup = self.fallback.distill([trajectories[i] for i in failed]) if failed else []
        outlines = [outline or "" for outline, _ in results]
        sources = ["llm"] * len(trajectories)
        for i, outline in zip(failed, backup, strict=True):
            outlines[i], sources[i] = outline, "fallback"
        if failed:
            logger.warning(
                "llm distiller: %d of %d outlines fell back to the deterministic distiller (last: %s)",
                len(failed),
                len(trajectories),
                results[failed[-1]][1],
            )
        return outlines, sources

    def distill(self, trajectories: Sequence[Trajectory]) -> list[str]:
        """Outline each trajectory, in order (see :meth:`distill_with_sources`)."""
        return self.distill_with_sources(trajectories)[0]

    def close(self) -> None:
        self._client.close()


def bind_policy(
    mcfg: MemoryConfig, base_url: str, model: str, api_key: str | None, template_kwargs: dict[str, Any]
) -> MemoryConfig:
    """``mcfg`` with ``llm_base_url='policy'`` bound to the run's policy endpoint; other configs unchanged.

    Args:
        mcfg: the run's memory settings.
        base_url: the policy endpoint's root (``http://host:port``, without ``/v1``).
        model: the served base model's name (``model.name``): cards are written without any adapter.
        api_key: the endpoint's key, None when it has none.
        template_kwargs: the model's chat-template variables (``ModelConfig.template_kwargs()``).
    """
    if mcfg.distiller != "llm" or mcfg.llm_base_url != POLICY:
        return mcfg
    return mcfg.model_copy(
        update={
            "llm_base_url": base_url.rstrip("/") + "/v1",
            "llm_model": model,
            "llm_api_key": api_key or "EMPTY",
            "llm_chat_template_kwargs": mcfg.llm_chat_template_kwargs or template_kwargs,
        }
    )
