"""Episodes lost to faults: which failures are faults, replaying them, and failing a stage that lost too many.

An episode that failed carries its ``error`` (``Trajectory.error``). Most failures are faults of the
machinery, not outcomes of the policy: the engine died or was replaced, a connection was cut, a request
or an environment step timed out, a rollout actor died, an environment broke. Leaving them out of a
mean silently changes what the number measures (the early finishers of a dying engine), so
:func:`run_checked` plays them again with the same seeds once the endpoint is healthy, and raises
:class:`StageFailed` when more than ``eval.max_failed_fraction`` of the episodes are still lost. The one
failure that is an outcome, not a fault, is a prompt over the model's context (``fault_kind`` None):
it is counted apart and never replayed (a replay would fail the same way)::

    trajs = run_checked(pool, tasks, spec, "stage 1 evaluation (scienceworld)", cfg.eval, wait)
"""

from __future__ import annotations

import logging
import os
import re
import signal
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, Protocol

logger = logging.getLogger(__name__)

# The policy's own outcome: its prompt outgrew the context (vLLM's 400 answers for it).
_CONTEXT = re.compile(
    r"maximum context length|longer than the maximum model length|exceeds the model's max|"
    r"prompt \(length \d+\) is longer|max_model_len",
    re.IGNORECASE,
)
# First match wins: the order puts the most specific causes first.
_KINDS = (
    ("harness", re.compile(r"harness answered", re.IGNORECASE)),
    ("engine died", re.compile(r"EngineDead|engine unhealthy|EngineCore|answered 5\d\d", re.IGNORECASE)),
    ("rollout actor died", re.compile(r"ActorDied|RayActorError|WorkerCrashed|OutOfMemory|\bactor\b", re.I)),
    ("timeout", re.compile(r"timeout|timed out", re.IGNORECASE)),
    (
        "connection",
        re.compile(
            r"ConnectError|ConnectionRefused|RemoteProtocolError|ReadError|NetworkError|Connection", re.I
        ),
    ),
)


KILL_AT = "HAMO_KILL_AT"  # fault injection: the phase at which this process SIGKILLs itself


def fault_point(name: str) -> None:
    """SIGKILL this process when ``$HAMO_KILL_AT`` is ``name`` (e.g. ``stage-1:train``: after stage 1's
    training). The fault-matrix test (``tests/ray/test_fault_matrix.py``) kills the driver this way at
    every phase of a stage; unset, it does nothing."""
    if os.environ.get(KILL_AT) == name:
        logger.warning("%s=%s: killing this process (fault injection)", KILL_AT, name)
        for handler in logging.getLogger().handlers:
            handler.flush()
        os.kill(os.getpid(), signal.SIGKILL)


class StageFailed(RuntimeError):
    """A stage that must not be committed (episodes lost to faults, no preference pairs); resubmitting
    the same command retries it."""


class Pool(Protocol):
    def run(self, tasks: list, policy: Any = None, desc: str = "episodes") -> list: ...


def fault_kind(error: str | None) -> str | None:
    """The kind of fault ``error`` names ("engine died", "timeout", "connection", "rollout actor died",
    "harness", "environment or client error"), or None when it is no fault (no error, or a prompt over
    the context)."""
    if not error or _CONTEXT.search(error):
        return None
    return next((kind for kind, pattern in _KINDS if pattern.search(error)), "environment or client error")


def describe_faults(trajs: Sequence[Any]) -> str:
    """``engine died: 8 (e.g. '...'), timeout: 1 (e.g. '...')`` for the faulted episodes of ``trajs``."""
    kinds: Counter[str] = Counter()
    example: dict[str, str] = {}
    for t in trajs:
        kind = fault_kind(t.error)
        if kind:
            kinds[kind] += 1
            example.setdefault(kind, t.error.splitlines()[0][:200])
    return ", ".join(f"{k}: {n} (e.g. {example[k]!r})" for k, n in kinds.most_common())


def run_checked(
    pool: Pool,
    tasks: list,
    spec: Any,
    desc: str,
    max_failed_fraction: float = 0.0,
    retries: int = 2,
    wait: Callable[[], None] | None = None,
) -> list:
    """``pool.run(tasks, spec)``, faulted episodes played again, and a stage failure if too many stay lost.

    Args:
        pool: the domain's rollout pool (``EnvPool.run``: one trajectory per task, in order).
        tasks, spec, desc: as ``pool.run``; a replay plays the same tasks with the same spec, so the
            same per-turn seeds (``turn_seed`` is a function of the task and turn, not of the order).
        max_failed_fraction: the share of ``tasks`` that may stay faulted (``eval.max_failed_fraction``).
        retries: how many times faulted episodes are played again (``eval.retries``).
        wait: called before each replay; blocks until the endpoint answers healthy (a replaced replica).

    Returns:
        One trajectory per task; failed ones (within the allowance, or prompts over the context) carry
        their ``error``.

    Raises:
        StageFailed: more than ``max_failed_fraction`` of the episodes faulted after the replays; the
            message names the causes.
    """
    trajs = list(pool.run(tasks, spec, desc=desc))
    for attempt in range(1, retries + 1):
        redo = [i for i, t in enumerate(trajs) if fault_kind(t.error)]
        if not redo:
            break
        logger.warning(
            "%s: %d of %d episodes failed (%s); playing them again with the same seeds once the endpoint "
            "is healthy (replay %d of %d)",
            desc, len(redo), len(trajs), describe_faults([trajs[i] for i in redo]), attempt, retries,
        )  # fmt: skip
        if wait is not None:
            wait()
        again = pool.run([tasks[i] for i in redo], spec, desc=f"{desc}, replay {attempt}")
        for i, traj in zip(redo, again, strict=True):
            trajs[i] = traj
    faulted = [t for t in trajs if fault_kind(t.error)]
    if len(faulted) > max_failed_fraction * len(trajs):
        raise StageFailed(
            f"{desc}: {len(faulted)} of {len(trajs)} episodes lost to faults after {retries} replay(s) "
            f"({describe_faults(faulted)}); eval.max_failed_fraction={max_failed_fraction:g}. The stage is "
            "not committed: fix the cause and submit the same command again to retry it"
        )
    return trajs
