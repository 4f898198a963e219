"""Which environment instance ("world") a card or a trajectory belongs to, per domain.

Training-time retrieval (``hamo_ray.memory.recall.training_experience``) excludes every card of the
example's own world, under any task type: at inference no card of the test task's world exists (test
variations are never trained on), so a training example that sees one (the "twin") learns to copy what
inference never offers::

    world_of_trajectory(traj) == world_of_card(card)   # card and trajectory share their world

The rule per domain (docs/method.md step 4):

- ``scienceworld``: the topic of the task (the number before the dash of its id: 7 for ``7-1
  lifespan-longest-lived``, ``7-2 lifespan-shortest-lived``, ``7-3 ...then-shortest-lived``), the split
  and the variation. The tasks of one topic build a variation's world from the same draw (the lifespan
  tasks of variation 0 share their animals: the longest-lived card names an animal of the shortest-lived
  task's world); tasks of different topics may share the start room, not what the task is about.
- ``alfworld``: the room, i.e. the initial observation (``You are in the middle of a room ...``, the
  receptacles of the floor plan), whatever the task type and split: the test games are held-out
  rooms, so no card of a test game's room exists at test.
- any other domain (``webshop``, ``textworld``): the task itself (domain, task type, split, variation):
  a WebShop instruction or a TextWorld seed is its own world (the catalogue is every task's, at test too).
"""

from __future__ import annotations

import functools

from hamo_ray.types import Card, TaskSpec, Trajectory


@functools.cache
def _scienceworld_topics() -> dict[str, str]:
    """Task name -> topic (``boil`` -> ``1``), from the package's task list (no JVM); {} without it."""
    try:
        from scienceworld.constants import ID2TASK
        from scienceworld.utils import infer_task
    except ImportError:  # pragma: no cover - scienceworld is a dependency
        return {}
    return {infer_task(name): task_id.split("-")[0] for task_id, name in ID2TASK.items()}


def world_of(domain: str, task: str, split: str, variation: int, init_obs: str = "") -> tuple:
    """The world a task instance belongs to (a hashable key; equal keys: the same world).

    Args:
        domain, task, split, variation: the task instance (``TaskSpec``'s fields).
        init_obs: its initial observation (ALFWorld's rooms are told apart by it).
    """
    if domain == "scienceworld":
        return (domain, split, "topic", _scienceworld_topics().get(task, task), int(variation))
    if domain == "alfworld":
        return (domain, "room", init_obs.strip())
    return (domain, task, split, int(variation))


def world_of_task(task: TaskSpec, init_obs: str = "") -> tuple:
    """:func:`world_of` of a task spec."""
    return world_of(task.domain, task.task, task.split, task.variation, init_obs)


def world_of_trajectory(traj: Trajectory) -> tuple:
    """:func:`world_of` of a trajectory's task (and initial observation)."""
    return world_of_task(traj.task, traj.init_obs)


def card_split(card: Card) -> str:
    """The split of a card's task, read from its trajectory id (``domain/task/split/variation/source``)."""
    parts = card.trajectory_id.rsplit("/", 3)
    return parts[1] if len(parts) == 4 else ""


def world_of_card(card: Card) -> tuple:
    """:func:`world_of` of the task a card was distilled from."""
    return world_of(card.domain, card.task, card_split(card), card.variation, card.init_obs)
