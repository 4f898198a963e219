"""Distillers: trajectory -> solution outline -> experience card.

A distiller turns a trajectory's action sequence into a short, strategy-level *solution outline*
(docs/method.md: ``z_i``). The offline default is :class:`OutlineDistiller` ("outline"), a deterministic
rule set: navigation chains become ``navigate to X``, non-progress actions (``look around``,
``inventory``) are dropped, repeats and repeated blocks are collapsed, and the steps are numbered,
keeping the concrete object names so that a tiny model can copy them. The LLM distiller ("llm",
``hamo_ray.memory.distill_llm``) asks any OpenAI-compatible endpoint and falls back to this one.

Run it on one trajectory::

    from hamo_ray.memory import get_distiller
    outline = get_distiller("outline").distill([trajectory])[0]
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

from hamo_ray.types import Card, Trajectory

if TYPE_CHECKING:
    from hamo_ray.config import MemoryConfig

MAX_STEPS = 12  # outline steps kept; a final "..." marks a longer solution
MAX_BLOCK = 6  # longest repeated block (in steps) that is collapsed into one "repeat" step
MAX_STEP_CHARS = 160  # one step's text is cut to this many characters

# Actions that gather information but do not move the task forward (ScienceWorld, ALFWorld, TextWorld).
_NON_PROGRESS = {"look around", "look", "l", "inventory", "i", "task", "score", "help", "check valid actions"}
_DOOR = re.compile(r"^open door to (?P<place>.+)$")
_MOVE = re.compile(r"^(?:go to|teleport to) (?P<place>.+)$")


class Distiller(Protocol):
    """Turns trajectories into solution outlines, one per trajectory, in order.

    Batched on purpose: an LLM distiller sends many requests at once.
    """

    def distill(self, trajectories: Sequence[Trajectory]) -> list[str]: ...


_DISTILLERS: dict[str, Callable[..., Distiller]] = {}


def register_distiller(name: str) -> Callable[[Callable[..., Distiller]], Callable[..., Distiller]]:
    """Register a distiller factory (a class or a function) under ``name``.

    A factory with a ``from_config(mcfg)`` class method is built from the memory config by
    :func:`get_distiller`; otherwise it is called without arguments.

    Args:
        name: the name that ``MemoryConfig.distiller`` uses.

    Returns:
        A decorator that registers its argument and returns it unchanged.

    Raises:
        ValueError: ``name`` is already registered.
    """

    def deco(factory: Callable[..., Distiller]) -> Callable[..., Distiller]:
        if name in _DISTILLERS:
            raise ValueError(f"distiller {name!r} is already registered")
        _DISTILLERS[name] = factory
        return factory

    return deco


def get_distiller(name: str, mcfg: MemoryConfig | None = None) -> Distiller:
    """Build the distiller registered under ``name``.

    Args:
        name: a registered distiller name, e.g. "outline" or "llm".
        mcfg: memory settings, passed to the factory's ``from_config`` when it has one.

    Returns:
        A new distiller instance.

    Raises:
        KeyError: no distiller has that name; the message lists the known ones.
    """
    if name not in _DISTILLERS:
        raise KeyError(f"unknown distiller {name!r}; known: {sorted(_DISTILLERS)}")
    factory = _DISTILLERS[name]
    from_config = getattr(factory, "from_config", None)
    if from_config is not None and mcfg is not None:
        return from_config(mcfg)
    return factory()


def _clean(action: str) -> str:
    return " ".join(action.split())


def _is_non_progress(action: str) -> bool:
    # A bare number answers ScienceWorld's "which one did you mean?" question: not a strategy step.
    return not action or action.lower() in _NON_PROGRESS or action.isdigit()


def _group_navigation(actions: list[str]) -> list[str]:
    """Replace each maximal chain of door/go/teleport actions by one ``navigate to X`` step."""
    steps: list[str] = []
    chain: list[str] = []  # raw actions of the current navigation chain
    places: list[str] = []  # places entered in the current chain, in order

    def flush() -> None:
        if places:
            via = [p for p in dict.fromkeys(places[:-1]) if p != places[-1]]
            steps.append(f"navigate to {places[-1]}" + (f" (via {', '.join(via)})" if via else ""))
        else:  # doors opened without going through them
            steps.extend(chain)
        chain.clear()
        places.clear()

    for action in actions:
        door, move = _DOOR.match(action), _MOVE.match(action)
        if door or move:
            chain.append(action)
            if move:
                places.append(move["place"])
            continue
        flush()
        steps.append(action)
    flush()
    return steps


def _repeats(steps: list[str], i: int, period: int) -> int:
    """How many times the block ``steps[i:i+period]`` occurs back to back from ``i``."""
    block, count = steps[i : i + period], 1
    while steps[i + count * period : i + (count + 1) * period] == block:
        count += 1
    return count


def _collapse_repeats(steps: list[str]) -> list[str]:
    """Collapse a repeated step into ``X (x3)``, then a repeated block into ``repeat 3 times: A, B``."""
    single: list[str] = []
    i = 0
    while i < len(steps):
        count = _repeats(steps, i, 1)
        single.append(steps[i] + (f" (x{count})" if count > 1 else ""))
        i += count
    out: list[str] = []
    i = 0
    while i < len(single):
        best_period, best_count = 1, 1
        for period in range(2, MAX_BLOCK + 1):
            count = _repeats(single, i, period)
            if count > 1 and period * count > best_period * best_count:
                best_period, best_count = period, count
        if best_count > 1:
            out.append(f"repeat {best_count} times: " + ", ".join(single[i : i + best_period]))
            i += best_period * best_count
        else:
            out.append(single[i])
            i += 1
    return out


def _numbered(steps: list[str], max_steps: int) -> str:
    """``1. a; 2. b; ...``: at most ``max_steps`` steps (a final "..." marks more), each cut to MAX_STEP_CHARS."""
    cut = [s if len(s) <= MAX_STEP_CHARS else s[: MAX_STEP_CHARS - 3] + "..." for s in steps[:max_steps]]
    parts = [f"{i}. {s}" for i, s in enumerate(cut, start=1)]
    if len(steps) > max_steps:
        parts.append("...")
    return "; ".join(parts)


def outline_from_trajectory(traj: Trajectory, max_steps: int = MAX_STEPS) -> str:
    """Distil a trajectory's actions into a numbered, strategy-level solution outline.

    Deterministic: the same actions always give the same outline. Example::

        1. navigate to kitchen; 2. pick up thermometer; 3. focus on thermometer in inventory; ...

    Args:
        traj: the trajectory; only its actions are used.
        max_steps: steps kept; a longer outline ends with a "..." marker.

    Returns:
        The outline, one line, steps separated by "; ". Empty when no action makes progress.
    """
    actions = [a for a in (_clean(a) for a in traj.actions) if not _is_non_progress(a)]
    steps = _collapse_repeats(_group_navigation(actions))
    return _numbered(steps, max_steps)


@register_distiller("outline")
class OutlineDistiller:
    """The deterministic, offline distiller: :func:`outline_from_trajectory` on each trajectory."""

    def __init__(self, max_steps: int = MAX_STEPS) -> None:
        self.max_steps = max_steps

    def distill(self, trajectories: Sequence[Trajectory]) -> list[str]:
        """Outline each trajectory, in order (see :func:`outline_from_trajectory`)."""
        return [outline_from_trajectory(t, self.max_steps) for t in trajectories]


# Words of actions that say what to do, not which thing: kept by the general digest.
_FUNCTION_WORDS = set(
    "a an the to on in into from at of with and or up down out off it its inventory via navigate focus pick "
    "move put take open close activate deactivate use pour mix wait wait1 look go teleport connect "
    "disconnect eat drink read heat cool clean slice toggle examine search click buy now next prev back "
    "repeat times x2 x3 x4 x5".split()
)
_WORD = re.compile(r"[a-z0-9']+")
_TARGET = re.compile(
    r"\b(?:find|focus on|identify)\s+(?:the|a\(n\)|an|a)\s+(?P<what>[a-z][a-z0-9' -]*?)\s*(?:[.,;:]|\band\b|\bthen\b|$)"
)
DEFAULT_TARGET = "the thing the task asks for"


def goal_target(goal: str) -> str:
    """The thing a goal asks for, as the goal words it ("the animal with the longest life span")."""
    match = _TARGET.search(goal.lower())
    return f"the {match['what'].strip()}" if match else DEFAULT_TARGET


def _generalise(step: str, known: set[str], target: str) -> str:
    """Each run of words neither in the goal, nor in the initial observation, nor a function word becomes ``target``."""
    out: list[str] = []
    run = False
    for token in step.split(" "):
        words = _WORD.findall(token.lower())
        specific = bool(words) and all(
            w not in known and w not in _FUNCTION_WORDS and not w.isdigit() for w in words
        )
        if specific:
            if not run:
                out.append(target + ("," if token.endswith(",") else ""))
            run = True
        else:
            out.append(token)
            run = False
    return " ".join(out)


def general_outline_from_trajectory(traj: Trajectory, max_steps: int = MAX_STEPS) -> str:
    """The digest, less bound to the variation: names the task did not give become the rule that found them.

    The steps of :func:`outline_from_trajectory`, where every run of words that neither the goal nor
    the initial observation contains (the animal this variation happened to hold, a product id) is
    replaced by the thing the goal asks for (``goal_target``): ``focus on egg giant tortoise`` becomes
    ``focus on the animal with the longest life span``. Names the task gives (the red box, an ALFWorld
    receptacle the initial observation lists) and navigation steps (a domain's rooms are the same in
    every variation) are kept. Deterministic, offline.
    """
    known = set(_WORD.findall(f"{traj.goal} {traj.init_obs}".lower()))
    target = goal_target(traj.goal)
    actions = [a for a in (_clean(a) for a in traj.actions) if not _is_non_progress(a)]
    steps = [  # places are the same in every variation of a domain: navigation is kept as it is
        s if s.startswith("navigate to ") else _generalise(s, known, target)
        for s in _group_navigation(actions)
    ]
    steps = _collapse_repeats(steps)
    return _numbered(steps, max_steps)


@register_distiller("outline_general")
class GeneralOutlineDistiller(OutlineDistiller):
    """The deterministic digest with variation-specific names generalised (:func:`general_outline_from_trajectory`)."""

    def distill(self, trajectories: Sequence[Trajectory]) -> list[str]:
        return [general_outline_from_trajectory(t, self.max_steps) for t in trajectories]


def card_from_trajectory(traj: Trajectory, stage: int, outline: str) -> Card:
    """Build the experience card of a trajectory.

    Args:
        traj: the trajectory the card describes.
        stage: the stream stage that added it to memory.
        outline: its solution outline (from a distiller).

    Returns:
        The card; its id is ``traj.card_id``, so a re-run gives the same id.
    """
    return Card(
        id=traj.card_id,
        trajectory_id=traj.id,
        domain=traj.task.domain,
        task=traj.task.task,
        variation=traj.task.variation,
        stage=stage,
        goal=traj.goal,
        init_obs=traj.init_obs,
        outline=outline,
        score=traj.score,
    )
