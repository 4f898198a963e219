"""The rooms of generated ALFWorld games: AI2-THOR floor plans, the task drawn in one, the objects placed.

Steps 1-4 of ``hamo_ray.envs.alfworld.generate`` (see there): everything comes from the ``alfworld``
package's own data (``alfworld.gen.constants`` and ``alfworld/gen/layouts/FloorPlan<n>-*.json``), and
every draw from the ``random.Random`` passed in, so a seed gives the same room, task and placements.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

_LAMP_HOSTS = ("Desk", "SideTable", "Dresser", "DiningTable", "CoffeeTable", "Shelf", "TVStand")
_EXTRA_COUNTS = {"StoveBurner": 4}  # receptacles missing from a layout: instances to add
NEEDS = {  # receptacle type a task needs in the room, and types its goal receptacle must not be
    "pick_clean_then_place_in_recep": ("SinkBasin", {"SinkBasin", "BathtubBasin"}),
    "pick_heat_then_place_in_recep": ("Microwave", {"Microwave"}),
    "pick_cool_then_place_in_recep": ("Fridge", {"Fridge"}),
}
_ACTION_SET = {
    "pick_clean_then_place_in_recep": "Cleanable",
    "pick_heat_then_place_in_recep": "Heatable",
    "pick_cool_then_place_in_recep": "Coolable",
}


@dataclass(frozen=True)
class Receptacle:
    """A fixed receptacle of a room (cabinet, sink basin, fridge ...) where the agent can go."""

    id: str  # ALFRED object id, e.g. "Cabinet|+00.68|+00.50|-02.20"
    type: str  # e.g. "Cabinet", "SinkBasin"
    loc: str  # location id, e.g. "loc|0|-5|2|30"


@cache
def alfworld_constants() -> Any:
    """``alfworld.gen.constants`` (imported on first use: ``import alfworld`` touches ``~/.cache``)."""
    import alfworld.gen.constants as constants

    return constants


@cache
def layouts_dir() -> Path:
    """The package's AI2-THOR floor plan files (``FloorPlan<n>-{openable,objects,layout}``)."""
    return Path(alfworld_constants().__file__).parent / "layouts"


@cache
def scene_data(scene: int) -> tuple[tuple[Receptacle, ...], tuple[str, ...], tuple[tuple[float, float], ...]]:
    """(receptacles of the layout, object types in the room, navigation points) of floor plan ``scene``."""
    import numpy as np

    c = alfworld_constants()
    base = layouts_dir() / f"FloorPlan{scene}"
    points = json.loads((base.parent / f"{base.name}-openable.json").read_text())
    receptacles = []
    for rid, (x, z, rot, hor) in sorted(points.items()):
        parts = rid.split("|")
        rtype = parts[-1] if len(parts) > 4 else parts[0]  # "Sink|x|y|z|SinkBasin" is a SinkBasin
        if rtype in c.RECEPTACLES and rtype not in c.MOVABLE_RECEPTACLES_SET:
            receptacles.append(Receptacle(rid, rtype, loc_id(x, z, rot, hor)))
    objects = tuple(json.loads((base.parent / f"{base.name}-objects.json").read_text()))
    nav = tuple((float(x), float(z)) for x, z in np.load(base.parent / f"{base.name}-layout.npy"))
    return tuple(receptacles), objects, nav


def loc_id(x: float, z: float, rot: float, hor: float) -> str:
    """ALFRED's location id of a pose: grid cell (0.25 m), rotation quarter and camera horizon."""
    return f"loc|{round(x / 0.25)}|{round(z / 0.25)}|{round(rot / 90) % 4}|{round(hor)}"


def scenes_for(split: str, task_type: str) -> list[int]:
    """Floor plans a game of ``task_type`` in ``split`` may use (room type valid and needs met)."""
    c = alfworld_constants()
    pool = c.TEST_SCENE_NUMBERS if split == "test" else c.TRAIN_SCENE_NUMBERS
    rooms = c.GOALS_VALID[task_type]
    out = []
    for scene in sorted(pool):
        if not any(scene in c.SCENE_TYPE[room] for room in rooms):
            continue
        receptacles, objects, _ = scene_data(scene)
        rtypes = {r.type for r in receptacles} | set(objects)
        need = NEEDS.get(task_type, (None, set()))[0]
        if need and need not in rtypes:
            continue
        if task_type == "look_at_obj_in_light" and not {"DeskLamp", "FloorLamp"} & set(objects):
            continue
        out.append(scene)
    return out


def pickupable_types() -> set[str]:
    """Object types that can be picked up and placed (sliced variants excluded)."""
    c = alfworld_constants()
    placeable = set().union(*c.VAL_RECEPTACLE_OBJECTS.values())
    return {o for o in placeable if o in c.OBJECTS and not o.endswith("Sliced")}


def furnished_room(scene: int, rng: random.Random) -> list[Receptacle]:
    """The layout's receptacles plus the room's receptacle types the layout lacks, at free nav points."""
    c = alfworld_constants()
    receptacles, objects, nav = scene_data(scene)
    have = {r.type for r in receptacles}
    out = list(receptacles)
    taken = {r.loc.rsplit("|", 2)[0] for r in receptacles}
    free = [p for p in nav if loc_id(p[0], p[1], 0, 0).rsplit("|", 2)[0] not in taken]
    for rtype in sorted(set(objects) & c.RECEPTACLES - c.MOVABLE_RECEPTACLES_SET - have):
        for _ in range(_EXTRA_COUNTS.get(rtype, 1)):
            x, z = free.pop(rng.randrange(len(free))) if free else rng.choice(nav)
            rid = f"{rtype}|{x:+06.2f}|{rng.uniform(0.0, 1.5):+06.2f}|{z:+06.2f}"
            out.append(Receptacle(rid, rtype, loc_id(x, z, rng.randrange(4) * 90, 30)))
    return out


def can_contain(rtype: str, otype: str) -> bool:
    """Whether a receptacle of type ``rtype`` may hold an object of type ``otype``."""
    return otype in alfworld_constants().VAL_RECEPTACLE_OBJECTS.get(rtype, ())


def choose_task(task_type: str, scene: int, receptacles: list[Receptacle], rng: random.Random) -> dict:
    """pddl_params (object/parent/toggle targets) for ``task_type`` in this room, or {} if none fits."""
    c = alfworld_constants()
    _, objects, _ = scene_data(scene)
    rtypes = sorted({r.type for r in receptacles})
    candidates = sorted(pickupable_types() & set(objects))
    if task_type in _ACTION_SET:
        candidates = [o for o in candidates if o in c.VAL_ACTION_OBJECTS[_ACTION_SET[task_type]]]
    if task_type == "look_at_obj_in_light":
        lamps = sorted({"DeskLamp", "FloorLamp"} & set(objects))
        hosts = [r for r in rtypes if r in _LAMP_HOSTS]
        usable = [o for o in candidates if any(can_contain(r, o) for r in rtypes)]
        if not (lamps and hosts and usable):
            return {}
        return _params(rng.choice(usable), "", rng.choice(lamps))
    banned = NEEDS.get(task_type, (None, set()))[1]
    pairs = []
    for obj in candidates:
        sources = [r for r in rtypes if can_contain(r, obj) and r not in banned]
        for parent in rtypes:
            if parent not in banned and can_contain(parent, obj) and [s for s in sources if s != parent]:
                pairs.append((obj, parent))
    if not pairs:
        return {}
    obj, parent = rng.choice(pairs)
    return _params(obj, parent, "")


def _params(obj: str, parent: str, toggle: str) -> dict:
    return {
        "object_target": obj,
        "parent_target": parent,
        "toggle_target": toggle,
        "mrecep_target": "",
        "object_sliced": False,
    }


def place_objects(
    task_type: str, params: dict, scene: int, receptacles: list[Receptacle], rng: random.Random
) -> list[tuple[str, str, Receptacle]]:
    """(alfred id, type, receptacle) of every object; targets avoid receptacles that would pre-win the goal."""
    _, objects, _ = scene_data(scene)
    target = params["object_target"]
    avoid = {params["parent_target"]} | NEEDS.get(task_type, (None, set()))[1]
    counts = {target: rng.randint(2, 3) if task_type == "pick_two_obj_and_place" else rng.randint(1, 3)}
    others = sorted(pickupable_types() & set(objects) - {target})
    for obj in rng.sample(others, k=rng.randint(len(others) // 4, len(others) // 2)):
        counts[obj] = rng.randint(1, 2)
    if params["toggle_target"]:
        counts[params["toggle_target"]] = 1
    placed = []
    for otype, n in counts.items():
        if otype in ("DeskLamp", "FloorLamp"):
            hosts = [r for r in receptacles if r.type in _LAMP_HOSTS]
        elif otype == target:
            hosts = [r for r in receptacles if can_contain(r.type, otype) and r.type not in avoid]
        else:
            hosts = [r for r in receptacles if can_contain(r.type, otype)]
        for _ in range(n if hosts else 0):
            host = rng.choice(hosts)
            oid = (
                f"{otype}|{rng.uniform(-3, 3):+06.2f}|{rng.uniform(0, 2):+06.2f}|{rng.uniform(-3, 3):+06.2f}"
            )
            placed.append((oid, otype, host))
    return placed
