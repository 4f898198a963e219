"""AgentGym's environment servers, one row each: routes, payload fields and how they map onto ``Env``.

Read from AgentGym's source (github ``WooooDyy/AgentGym``, folders ``agentenv-<name>``, ``server.py``,
``model.py``, ``environment.py`` / ``env_wrapper.py``). Every server is one FastAPI app:

=====================  ==========================================================================
``POST /create``       -> ``{"id": n}`` (sciworld, babyai: no body; textcraft: a body, ``{}``, is
                       required (422 without); it also resets environment ``n`` to item ``n``)
``POST /reset``        ``{id, data_idx}`` (alfworld: ``{id, game, world_type}``) -> the first payload
``POST /step``         ``{id, action}`` -> ``{observation, reward, done, ...}``
``POST /close``        ``{id}`` (alfworld has none; sciworld answers 500 to a second close)
``GET /``              a banner, ``"This is environment <Name>."``
=====================  ==========================================================================

Quirks every client must live with: an error comes back as HTTP **200** with ``{"error": "..."}``
(unknown id, index out of range, step after done on sciworld and babyai); a missing field is 422
(FastAPI's validation); a second ``close`` on sciworld is 500 (its ``close`` raises outside its try).

Per server (the mapping ``AgentGymEnv`` applies; scores always on 0-100):

=========  ==================================  ==============================  ===================================
server     goal / first observation            score                           done / valid actions
=========  ==================================  ==============================  ===================================
sciworld   ``task_description`` / the reset's  ``score`` (0-100; -100 when    ``done``; the package caps an
           ``observation`` (``look around``)   the task failed: done, 0)       episode at 100 steps (done); none
textcraft  the ``Goal: craft X.`` line / the   100 once ``reward`` is 1        ``done`` is not kept after success:
           crafting commands before it                                         kept here; none
babyai     the ``Your goal:`` line / the rest  ``reward`` x 100 (0-1, time-    ``done``; the ``Available actions:
                                               discounted; its ``score`` sums  [...]`` list of every observation
                                               rewards over steps: not used)
alfworld   ``Your task is to:`` / the room     ``reward`` (won) x 100          ``done``; ``available_actions``
=========  ==================================  ==============================  ===================================

WebShop's server (``agentenv-webshop``) speaks another dialect (``env_idx``, ``session_id``, goal from
``/instruction_text``); ``hamo_ray.envs.webshop.client`` maps it and shares the transport
(``client.ServerClient``). Adding an environment: one ``ServerSpec`` here, and a domain (its task
list, item index per task) in ``domains.py``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

Payload = dict[str, Any]


@dataclass(frozen=True)
class ServerSpec:
    """One AgentGym environment server's dialect (see the module docstring's tables)."""

    name: str  # AgentGym's name: the item-id prefix (``sciworld_12``) and the ``agentenv-<name>`` folder
    banner: str  # what ``GET /`` names: "This is environment <banner>."
    first: Callable[[Payload], tuple[str, str]]  # the reset payload -> (goal, first observation)
    observation: Callable[[Payload], str]  # a step payload -> the observation the agent sees
    score: Callable[[Payload, float], float]  # (step payload, score so far) -> score on 0-100
    done: Callable[[Payload], bool]  # a step payload -> episode over
    valid_actions: Callable[[Payload], list[str] | None] = lambda p: None
    create_body: dict[str, Any] | None = None  # the body /create needs (textcraft: {})
    reset_body: Callable[[int], dict[str, Any]] = lambda n: {"data_idx": n}
    has_close: bool = True  # alfworld's server has no /close
    extra: dict[str, Any] = field(default_factory=dict)


def _sciworld_score(p: Payload, _: float) -> float:
    raw = float(p.get("score", 0))
    return 0.0 if raw < 0 else raw


def _sciworld_done(p: Payload) -> bool:
    return bool(p.get("done")) or float(p.get("score", 0)) < 0


_GOAL_LINE = re.compile(r"^\s*Goal:\s*(.+?)\s*$", re.MULTILINE)


def textcraft_first(text: str) -> tuple[str, str]:
    """``"Crafting commands:\\n...\\n\\nGoal: craft X."`` -> (``"craft X."``, the commands).

    Raises:
        ValueError: no ``Goal:`` line.
    """
    found = list(_GOAL_LINE.finditer(text))
    if not found:
        raise ValueError("textcraft observation without a 'Goal: ...' line")
    m = found[-1]
    return m.group(1), (text[: m.start()] + text[m.end() :]).strip()


_YOUR_GOAL = re.compile(r"^\s*Your goal:\s*(.*)$", re.MULTILINE)
_AVAILABLE = re.compile(r"Available actions:\s*(\[.*\])\s*\Z", re.DOTALL)


def babyai_first(text: str) -> tuple[str, str]:
    """``"Your goal: G\\n<observation>"`` -> (``"G"``, the observation).

    Raises:
        ValueError: no ``Your goal:`` line.
    """
    m = _YOUR_GOAL.search(text)
    if m is None:
        raise ValueError("babyai observation without a 'Your goal: ...' line")
    return m.group(1).strip(), (text[: m.start()] + text[m.end() :]).strip()


def babyai_actions(text: str) -> list[str] | None:
    """The ``Available actions: ["a", "b"]`` list at the end of a BabyAI observation, or None."""
    m = _AVAILABLE.search(text)
    if m is None:
        return None
    try:
        actions = json.loads(m.group(1))
    except json.JSONDecodeError:
        return None
    return [a for a in actions if isinstance(a, str)]


def alfworld_first(text: str) -> tuple[str, str]:
    """The room description and ``Your task is to: G`` -> (``"G"``, the room).

    Raises:
        ValueError: no ``Your task is to:`` sentence.
    """
    room, sep, goal = text.partition("Your task is to:")
    if not sep:
        raise ValueError("alfworld observation without 'Your task is to:'")
    return goal.strip(), room.strip()


SERVERS: dict[str, ServerSpec] = {
    "sciworld": ServerSpec(
        name="sciworld",
        banner="ScienceWorld",
        first=lambda p: (p["task_description"], p["observation"]),
        observation=lambda p: p["observation"],
        score=_sciworld_score,
        done=_sciworld_done,
        extra={"step_cap": 100},
    ),
    "textcraft": ServerSpec(
        name="textcraft",
        banner="TextCraft",
        first=lambda p: textcraft_first(p["observation"]),
        observation=lambda p: p["observation"],
        score=lambda p, so_far: 100.0 if float(p.get("reward", 0)) >= 1 else so_far,
        done=lambda p: bool(p.get("done")) or float(p.get("reward", 0)) >= 1,
        create_body={},
    ),
    "babyai": ServerSpec(
        name="babyai",
        banner="BabyAI",
        first=lambda p: babyai_first(p["observation"]),
        observation=lambda p: p["observation"],
        score=lambda p, _: round(100.0 * float(p.get("reward", 0)), 4),
        done=lambda p: bool(p.get("done")),
        valid_actions=lambda p: babyai_actions(p.get("observation", "")),
    ),
    "alfworld": ServerSpec(
        name="alfworld",
        banner="AlfWorld",
        first=lambda p: alfworld_first(p["observation"]),
        observation=lambda p: p["observation"],
        score=lambda p, _: 100.0 * float(p.get("reward", 0)),
        done=lambda p: bool(p.get("done")),
        valid_actions=lambda p: list(p.get("available_actions") or []) or None,
        reset_body=lambda n: {"game": n, "world_type": "Text"},
        has_close=False,
    ),
}


def server_spec(name: str) -> ServerSpec:
    """The row of AgentGym environment ``name``.

    Raises:
        KeyError: no row for ``name`` (the message lists the known ones).
    """
    if name not in SERVERS:
        raise KeyError(f"no AgentGym server spec {name!r}; known: {', '.join(sorted(SERVERS))}")
    return SERVERS[name]
