"""A generator of ALFRED-style ALFWorld games on the ``alfworld`` package's own domain, grammar and rooms.

ALFWorld's games (``json_2.1.1/<split>/<task>/<trial>/game.tw-pddl``) are made from ALFRED trials recorded
in the AI2-THOR simulator and downloaded by ``alfworld-download``; the package itself ships only the PDDL
domain (``alfred.pddl``), the text grammar (``alfred.twl2``), the task goals and templates
(``alfworld.gen.goal_library``), the object/receptacle affordances (``alfworld.gen.constants``) and, per
AI2-THOR floor plan (30 kitchens, living rooms, bedrooms and bathrooms), the receptacles with their
navigation points and the object types in the room (``alfworld/gen/layouts/FloorPlan<n>-*.json``).

``generate_game`` builds one game from those pieces, the way ALFRED's sampler does, and writes it in the
official layout, so that ``AlfredTWEnv`` (which walks a folder for ``traj_data.json``) and the handcoded
expert (which reads the task parameters from ``traj_data.json`` next to the game) treat it like a
downloaded one:

1. a room: a floor plan of a room type where the task is valid (``constants.GOALS_VALID``) and that holds
   what the task needs (microwave, fridge, sink basin, a lamp); **the split decides the rooms**: train and
   dev draw from ALFRED's train floor plans (``constants.TRAIN_SCENE_NUMBERS``, as ``valid_seen`` does),
   test from its held-out ones (``TEST_SCENE_NUMBERS``, as ``valid_unseen``), so train and test games are
   disjoint by room; train and dev differ by placement (their seeds differ);
2. the receptacles of the layout at their navigation points, plus one instance of each receptacle type
   the room has but the layout lacks (stove burners, coffee machine, toaster, garbage can ...) at a free
   navigation point of the room;
3. a task: target object type, goal receptacle type (or lamp) and the templated task text (the same
   templates ``alfworld.agents.utils.misc.get_templated_task_desc`` draws from);
4. objects: 1-3 targets (2-3 for pick-two) and a random subset of the room's other object types, each put
   into a receptacle that can contain it (``constants.VAL_RECEPTACLE_OBJECTS``); targets never start in a
   receptacle of the goal type (nor in the microwave/fridge/sink for heat/cool/clean), so no game starts won;
5. the PDDL problem (objects, types, ``canContain``, affordances, placements, start location, the task's
   goal from ``goal_library``), the grammar with the task text, ``traj_data.json`` with ``pddl_params``;
6. validation: the official handcoded expert plays the game through the official wrapper stack
   (``PddlEnv`` + ``AlfredDemangler`` + ``AlfredInfos`` + ``AlfredExpert``); a game it does not win is
   dropped and the next attempt (same variation, next sub-seed) is tried. The winning command list is
   stored as the game's ``walkthrough`` and ``solvable: true``, exactly as ``alfworld-generate`` does.

Everything is derived from ``(seed, split, task type, variation, attempt)``: the same call writes the same
game. Games are written into a temporary folder and renamed, so concurrent writers never expose half a game.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import random
import shutil
import sys
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

GENERATOR_VERSION = "g1"
TASK_TYPES = (
    "pick_and_place_simple",
    "look_at_obj_in_light",
    "pick_clean_then_place_in_recep",
    "pick_heat_then_place_in_recep",
    "pick_cool_then_place_in_recep",
    "pick_two_obj_and_place",
)
# Our split -> the official ALFWorld folder it mirrors.
SPLIT_DIRS = {"train": "train", "dev": "valid_seen", "test": "valid_unseen"}
MAX_ATTEMPTS = 20
EXPERT_MAX_STEPS = 200  # AlfredExpert's own budget for the handcoded expert
MAX_WALKTHROUGH = 50  # keep games whose expert wins within ALFWorld's usual 50-step episode budget
_LAMP_HOSTS = ("Desk", "SideTable", "Dresser", "DiningTable", "CoffeeTable", "Shelf", "TVStand")
_EXTRA_COUNTS = {"StoveBurner": 4}  # receptacles missing from a layout: instances to add
_NEEDS = {  # receptacle type a task needs in the room, and types its goal receptacle must not be
    "pick_clean_then_place_in_recep": ("SinkBasin", {"SinkBasin", "BathtubBasin"}),
    "pick_heat_then_place_in_recep": ("Microwave", {"Microwave"}),
    "pick_cool_then_place_in_recep": ("Fridge", {"Fridge"}),
}
_ACTION_SET = {
    "pick_clean_then_place_in_recep": "Cleanable",
    "pick_heat_then_place_in_recep": "Heatable",
    "pick_cool_then_place_in_recep": "Coolable",
}
_EXPERT_LOCK = threading.Lock()  # the handcoded expert draws from the global ``random``
_ARGV_LOCK = threading.Lock()
_argv_users = 0
_argv_saved: list[str] = []


class GenerationError(RuntimeError):
    """No valid game could be generated for a variation (after ``MAX_ATTEMPTS`` attempts)."""


@dataclass(frozen=True)
class Receptacle:
    id: str  # ALFRED object id, e.g. "Cabinet|+00.68|+00.50|-02.20"
    type: str  # e.g. "Cabinet", "SinkBasin"
    loc: str  # location id, e.g. "loc|0|-5|2|30"


def pddl_name(alfred_id: str) -> str:
    """ALFRED id -> PDDL name, as ``PlannedGameState.fix_pddl_str_chars`` does ("|" -> "_bar_" ...)."""
    for old, new in (("-", "_minus_"), ("|", "_bar_"), ("+", "_plus_"), (".", "_dot_"), (",", "_comma_")):
        alfred_id = alfred_id.replace(old, new)
    return alfred_id


def sub_seed(*parts: object) -> int:
    """A stable 64-bit seed derived from ``parts`` (the same on every machine and Python run)."""
    return int.from_bytes(hashlib.sha256("/".join(map(str, parts)).encode()).digest()[:8], "big")


@cache
def _constants() -> Any:
    import alfworld.gen.constants as constants

    return constants


@cache
def _layouts_dir() -> Path:
    return Path(_constants().__file__).parent / "layouts"


@cache
def _scene(scene: int) -> tuple[tuple[Receptacle, ...], tuple[str, ...], tuple[tuple[float, float], ...]]:
    """(receptacles of the layout, object types in the room, navigation points) of floor plan ``scene``."""
    import numpy as np

    c = _constants()
    base = _layouts_dir() / f"FloorPlan{scene}"
    points = json.loads((base.parent / f"{base.name}-openable.json").read_text())
    receptacles = []
    for rid, (x, z, rot, hor) in sorted(points.items()):
        parts = rid.split("|")
        rtype = parts[-1] if len(parts) > 4 else parts[0]  # "Sink|x|y|z|SinkBasin" is a SinkBasin
        if rtype in c.RECEPTACLES and rtype not in c.MOVABLE_RECEPTACLES_SET:
            receptacles.append(Receptacle(rid, rtype, _loc(x, z, rot, hor)))
    objects = tuple(json.loads((base.parent / f"{base.name}-objects.json").read_text()))
    nav = tuple((float(x), float(z)) for x, z in np.load(base.parent / f"{base.name}-layout.npy"))
    return tuple(receptacles), objects, nav


def _loc(x: float, z: float, rot: float, hor: float) -> str:
    return f"loc|{round(x / 0.25)}|{round(z / 0.25)}|{round(rot / 90) % 4}|{round(hor)}"


def scenes_for(split: str, task_type: str) -> list[int]:
    """Floor plans a game of ``task_type`` in ``split`` may use (room type valid and needs met)."""
    c = _constants()
    pool = c.TEST_SCENE_NUMBERS if split == "test" else c.TRAIN_SCENE_NUMBERS
    rooms = c.GOALS_VALID[task_type]
    out = []
    for scene in sorted(pool):
        if not any(scene in c.SCENE_TYPE[room] for room in rooms):
            continue
        receptacles, objects, _ = _scene(scene)
        rtypes = {r.type for r in receptacles} | set(objects)
        need = _NEEDS.get(task_type, (None, set()))[0]
        if need and need not in rtypes:
            continue
        if task_type == "look_at_obj_in_light" and not {"DeskLamp", "FloorLamp"} & set(objects):
            continue
        out.append(scene)
    return out


def _pickupable_types() -> set[str]:
    c = _constants()
    placeable = set().union(*c.VAL_RECEPTACLE_OBJECTS.values())
    return {o for o in placeable if o in c.OBJECTS and not o.endswith("Sliced")}


def _room(scene: int, rng: random.Random) -> list[Receptacle]:
    """The layout's receptacles plus the room's receptacle types the layout lacks, at free nav points."""
    c = _constants()
    receptacles, objects, nav = _scene(scene)
    have = {r.type for r in receptacles}
    out = list(receptacles)
    taken = {r.loc.rsplit("|", 2)[0] for r in receptacles}
    free = [p for p in nav if _loc(p[0], p[1], 0, 0).rsplit("|", 2)[0] not in taken]
    for rtype in sorted(set(objects) & c.RECEPTACLES - c.MOVABLE_RECEPTACLES_SET - have):
        for _ in range(_EXTRA_COUNTS.get(rtype, 1)):
            x, z = free.pop(rng.randrange(len(free))) if free else rng.choice(nav)
            rid = f"{rtype}|{x:+06.2f}|{rng.uniform(0.0, 1.5):+06.2f}|{z:+06.2f}"
            out.append(Receptacle(rid, rtype, _loc(x, z, rng.randrange(4) * 90, 30)))
    return out


def _can_contain(rtype: str, otype: str) -> bool:
    return otype in _constants().VAL_RECEPTACLE_OBJECTS.get(rtype, ())


def _choose_task(task_type: str, scene: int, receptacles: list[Receptacle], rng: random.Random) -> dict:
    """pddl_params (object/parent/toggle targets) for ``task_type`` in this room, or {} if none fits."""
    c = _constants()
    _, objects, _ = _scene(scene)
    rtypes = sorted({r.type for r in receptacles})
    candidates = sorted(_pickupable_types() & set(objects))
    if task_type in _ACTION_SET:
        candidates = [o for o in candidates if o in c.VAL_ACTION_OBJECTS[_ACTION_SET[task_type]]]
    if task_type == "look_at_obj_in_light":
        lamps = sorted({"DeskLamp", "FloorLamp"} & set(objects))
        hosts = [r for r in rtypes if r in _LAMP_HOSTS]
        usable = [o for o in candidates if any(_can_contain(r, o) for r in rtypes)]
        if not (lamps and hosts and usable):
            return {}
        return _params(rng.choice(usable), "", rng.choice(lamps))
    banned = _NEEDS.get(task_type, (None, set()))[1]
    pairs = []
    for obj in candidates:
        sources = [r for r in rtypes if _can_contain(r, obj) and r not in banned]
        for parent in rtypes:
            if parent not in banned and _can_contain(parent, obj) and [s for s in sources if s != parent]:
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


def _place_objects(
    task_type: str, params: dict, scene: int, receptacles: list[Receptacle], rng: random.Random
) -> list[tuple[str, str, Receptacle]]:
    """(alfred id, type, receptacle) of every object; targets avoid receptacles that would pre-win the goal."""
    _, objects, _ = _scene(scene)
    target = params["object_target"]
    avoid = {params["parent_target"]} | _NEEDS.get(task_type, (None, set()))[1]
    counts = {target: rng.randint(2, 3) if task_type == "pick_two_obj_and_place" else rng.randint(1, 3)}
    others = sorted(_pickupable_types() & set(objects) - {target})
    for obj in rng.sample(others, k=rng.randint(len(others) // 4, len(others) // 2)):
        counts[obj] = rng.randint(1, 2)
    if params["toggle_target"]:
        counts[params["toggle_target"]] = 1
    placed = []
    for otype, n in counts.items():
        if otype in ("DeskLamp", "FloorLamp"):
            hosts = [r for r in receptacles if r.type in _LAMP_HOSTS]
        elif otype == target:
            hosts = [r for r in receptacles if _can_contain(r.type, otype) and r.type not in avoid]
        else:
            hosts = [r for r in receptacles if _can_contain(r.type, otype)]
        for _ in range(n if hosts else 0):
            host = rng.choice(hosts)
            oid = (
                f"{otype}|{rng.uniform(-3, 3):+06.2f}|{rng.uniform(0, 2):+06.2f}|{rng.uniform(-3, 3):+06.2f}"
            )
            placed.append((oid, otype, host))
    return placed


def build_problem(task_type: str, scene: int, rng: random.Random) -> tuple[str, dict] | None:
    """The PDDL problem text and ``pddl_params`` of one game in floor plan ``scene`` (None: no task fits)."""
    c = _constants()
    from alfworld.gen import goal_library

    receptacles = _room(scene, rng)
    params = _choose_task(task_type, scene, receptacles, rng)
    if not params:
        return None
    placed = _place_objects(task_type, params, scene, receptacles, rng)
    if not any(otype == params["object_target"] for _, otype, _ in placed):
        return None
    _, _, nav = _scene(scene)
    x, z = rng.choice(nav)
    start = _loc(x, z, rng.randrange(4) * 90, 30)

    rtype_names = sorted(c.RECEPTACLES - c.MOVABLE_RECEPTACLES_SET)
    otype_names = sorted(c.OBJECTS_SET - set(rtype_names))
    locations = sorted({r.loc for r in receptacles} | {start})
    lines = [f"(define (problem plan_hamo_{GENERATOR_VERSION}_{scene})", "(:domain alfred)", "(:objects"]
    lines += ["agent1 - agent"]
    lines += [f"{t}Type - otype" for t in otype_names] + [f"{t}Type - rtype" for t in rtype_names]
    lines += [f"{pddl_name(oid)} - object" for oid, _, _ in placed]
    lines += [f"{pddl_name(r.id)} - receptacle" for r in receptacles]
    lines += [f"{pddl_name(loc)} - location" for loc in locations]
    lines += [")", "(:init", f"(atLocation agent1 {pddl_name(start)})"]
    otypes_present = sorted({otype for _, otype, _ in placed})
    for r in receptacles:
        lines.append(f"(receptacleType {pddl_name(r.id)} {r.type}Type)")
        lines.append(f"(receptacleAtLocation {pddl_name(r.id)} {pddl_name(r.loc)})")
        if r.type in c.OPENABLE_CLASS_SET:
            lines.append(f"(openable {pddl_name(r.id)})")
    for rtype in sorted({r.type for r in receptacles}):
        lines += [f"(canContain {rtype}Type {o}Type)" for o in otypes_present if _can_contain(rtype, o)]
    affordances = {"cleanable": "Cleanable", "heatable": "Heatable", "coolable": "Coolable"}
    for oid, otype, host in placed:
        name = pddl_name(oid)
        lines += [f"(objectType {name} {otype}Type)", f"(inReceptacle {name} {pddl_name(host.id)})"]
        lines.append(f"(objectAtLocation {name} {pddl_name(host.loc)})")
        if otype in ("DeskLamp", "FloorLamp"):
            lines.append(f"(toggleable {name})")
            continue
        lines.append(f"(pickupable {name})")
        if otype in c.MOVABLE_RECEPTACLES_SET:
            lines.append(f"(isReceptacleObject {name})")
        lines += [f"({p} {name})" for p, s in affordances.items() if otype in c.VAL_ACTION_OBJECTS[s]]
    lines.append(")")
    goal = goal_library.gdict[task_type]["pddl"].format(
        obj=params["object_target"], recep=params["parent_target"], toggle=params["toggle_target"], mrecep=""
    )
    return "\n".join(lines) + "\n" + goal.replace("#", "-"), params


def task_description(task_type: str, params: dict, rng: random.Random) -> str:
    """The templated task text, as ``get_templated_task_desc`` builds it (seeded here)."""
    from alfworld.gen import goal_library

    template = rng.choice(goal_library.gdict[task_type]["templates"])
    return template.format(
        obj=params["object_target"].lower(),
        recep=params["parent_target"].lower(),
        toggle=params["toggle_target"].lower(),
        mrecep="",
    )


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


def game_dir_prefix(task_type: str, variation: int) -> str:
    return f"{task_type}-{variation:05d}"


def generate_game(
    root: Path, pddl_domain: str, grammar: str, split: str, task_type: str, variation: int, seed: int
) -> Path:
    """Generate, validate and write one game under ``root/json_2.1.1/<split dir>/``; returns its game file.

    Raises:
        GenerationError: no attempt produced a game the handcoded expert wins.
    """
    scenes = scenes_for(split, task_type)
    split_dir = root / "json_2.1.1" / SPLIT_DIRS[split]
    split_dir.mkdir(parents=True, exist_ok=True)
    for attempt in range(MAX_ATTEMPTS):
        base = sub_seed(GENERATOR_VERSION, seed, split, task_type, variation, attempt)
        rng = random.Random(base)
        scene = rng.choice(scenes)
        built = build_problem(task_type, scene, rng)
        if built is None:
            continue
        problem, params = built
        desc = task_description(task_type, params, rng)
        name = "-".join(
            [game_dir_prefix(task_type, variation), params["object_target"], "None"]
            + [params["parent_target"] or "None", str(scene)]
        )
        traj_data = {
            "task_type": task_type,
            "task_id": f"hamo_{GENERATOR_VERSION}_s{seed}_{split}_{variation:05d}",
            "pddl_params": params,
            "scene": {"floor_plan": f"FloorPlan{scene}", "scene_num": scene, "random_seed": base % 2**31},
            "turk_annotations": {"anns": [{"task_desc": desc, "high_descs": [], "assignment_id": ""}]},
            "hamo": {"generator": GENERATOR_VERSION, "seed": seed, "split": split, "attempt": attempt},
        }
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=split_dir))
        try:
            trial = tmp / "trial_hamo"
            trial.mkdir()
            (trial / "traj_data.json").write_text(json.dumps(traj_data, indent=1))
            (trial / "initial_state.pddl").write_text(problem)
            game = {
                "pddl_domain": pddl_domain,
                "grammar": grammar.replace("UNKNOWN GOAL", desc),
                "pddl_problem": problem,
                "solvable": None,
                "walkthrough": None,
            }
            game_file = trial / "game.tw-pddl"
            game_file.write_text(json.dumps(game))
            walkthrough = play_expert(str(game_file), "handcoded", seed=base)
            if walkthrough is None or len(walkthrough) > MAX_WALKTHROUGH:
                logger.debug(
                    "%s %s v%d attempt %d: expert did not win in time", split, task_type, variation, attempt
                )
                continue
            game.update(solvable=True, walkthrough=walkthrough)
            game_file.write_text(json.dumps(game))
            final = split_dir / name
            try:
                os.rename(tmp, final)
            except OSError:  # another process wrote the same game first
                pass
            return final / "trial_hamo" / "game.tw-pddl"
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    raise GenerationError(
        f"alfworld: no {task_type} game for {split} variation {variation} after {MAX_ATTEMPTS} attempts"
    )
