"""Playing ALFWorld's official handcoded expert on a game, and the guards its engine needs.

``play_expert`` runs the official wrapper stack (``PddlEnv`` + ``AlfredDemangler`` + ``AlfredInfos`` +
``AlfredExpert``); ``generate`` uses it to validate games, ``AlfWorldEnv`` to plan official games
without a stored walkthrough. Two pitfalls of the engine are guarded here: fast-downward's ``pddl2sas``
overwrites ``sys.argv`` on every load/reset (``keep_argv``), and the handcoded expert draws from the
global ``random`` (``seeded_global_random``).
"""

from __future__ import annotations

import contextlib
import logging
import random
import sys
import threading
from collections.abc import Iterator
from typing import Any

logger = logging.getLogger(__name__)

EXPERT_MAX_STEPS = 200  # AlfredExpert's own budget for the handcoded expert
_EXPERT_LOCK = threading.Lock()  # the handcoded expert draws from the global ``random``
_ARGV_LOCK = threading.Lock()
_argv_users = 0
_argv_saved: list[str] = []


@contextlib.contextmanager
def keep_argv() -> Iterator[None]:
    """Restore ``sys.argv`` after engine calls: fast-downward's ``pddl2sas`` (run by every game load and
    reset) sets it to ``["translate.py", "domain", "task"]``. Nesting- and thread-safe."""
    global _argv_users, _argv_saved
    with _ARGV_LOCK:
        if _argv_users == 0:
            _argv_saved = list(sys.argv)
        _argv_users += 1
    try:
        yield
    finally:
        with _ARGV_LOCK:
            _argv_users -= 1
            if _argv_users == 0:
                sys.argv = _argv_saved


@contextlib.contextmanager
def seeded_global_random(seed: int) -> Iterator[None]:
    """Seed the global ``random`` (the handcoded expert's source) for a block, then restore it."""
    with _EXPERT_LOCK:
        state = random.getstate()
        random.seed(seed)
        try:
            yield
        finally:
            random.setstate(state)


def play_expert(game_file: str, expert_type: str = "handcoded", seed: int = 0) -> list[str] | None:
    """Play the official expert on ``game_file`` through the official wrapper stack.

    Returns:
        The commands up to the win, or None when the expert fails, times out or does not win.
    """
    from alfworld.agents.environment.alfred_tw_env import AlfredDemangler, AlfredExpert, AlfredInfos
    from textworld import EnvInfos
    from textworld.envs import PddlEnv

    env = AlfredExpert(
        AlfredInfos(
            AlfredDemangler(PddlEnv(EnvInfos(admissible_commands=True, won=True, extras=["gamefile"])))
        ),
        expert_type=expert_type,
    )
    commands: list[str] = []
    with seeded_global_random(seed), keep_argv():
        try:
            env.load(game_file)
            state = env.reset()
            if expert_type == "planner":
                return _replay(env, list(state["extra.expert_plan"]))
            while not state["won"] and len(commands) < EXPERT_MAX_STEPS:
                command = state["extra.expert_plan"][0]
                state, _, _ = env.step(command)
                commands.append(command)
        except Exception as exc:  # noqa: BLE001 - the expert raises plain Exceptions (timeouts, failures)
            logger.debug("expert failed on %s: %s", game_file, exc)
            return None
        finally:
            env.close()
    return commands if state["won"] else None


def _replay(env: Any, plan: list[str]) -> list[str] | None:
    state = None
    for i, command in enumerate(plan):
        state, _, done = env.step(command)
        if done or state["won"]:
            return plan[: i + 1]
    return None
