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

import hashlib
import json
import logging
import os
import random
import shutil
import tempfile
from pathlib import Path

from hamo_ray.envs.alfworld.expert import play_expert
from hamo_ray.envs.alfworld.layout import (
    alfworld_constants,
    can_contain,
    choose_task,
    furnished_room,
    loc_id,
    place_objects,
    scene_data,
    scenes_for,
)

# ``scenes_for`` is re-exported: which rooms a split may use is part of this module's contract.
__all__ = [
    "GENERATOR_VERSION",
    "SPLIT_DIRS",
    "TASK_TYPES",
    "GenerationError",
    "build_problem",
    "game_dir_prefix",
    "generate_game",
    "scenes_for",
    "sub_seed",
]

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
MAX_WALKTHROUGH = 50  # keep games whose expert wins within ALFWorld's usual 50-step episode budget


class GenerationError(RuntimeError):
    """No valid game could be generated for a variation (after ``MAX_ATTEMPTS`` attempts)."""


def pddl_name(alfred_id: str) -> str:
    """ALFRED id -> PDDL name, as ``PlannedGameState.fix_pddl_str_chars`` does ("|" -> "_bar_" ...)."""
    for old, new in (("-", "_minus_"), ("|", "_bar_"), ("+", "_plus_"), (".", "_dot_"), (",", "_comma_")):
        alfred_id = alfred_id.replace(old, new)
    return alfred_id


def sub_seed(*parts: object) -> int:
    """A stable 64-bit seed derived from ``parts`` (the same on every machine and Python run)."""
    return int.from_bytes(hashlib.sha256("/".join(map(str, parts)).encode()).digest()[:8], "big")


def build_problem(task_type: str, scene: int, rng: random.Random) -> tuple[str, dict] | None:
    """The PDDL problem text and ``pddl_params`` of one game in floor plan ``scene`` (None: no task fits)."""
    c = alfworld_constants()
    from alfworld.gen import goal_library

    receptacles = furnished_room(scene, rng)
    params = choose_task(task_type, scene, receptacles, rng)
    if not params:
        return None
    placed = place_objects(task_type, params, scene, receptacles, rng)
    if not any(otype == params["object_target"] for _, otype, _ in placed):
        return None
    _, _, nav = scene_data(scene)
    x, z = rng.choice(nav)
    start = loc_id(x, z, rng.randrange(4) * 90, 30)

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
        lines += [f"(canContain {rtype}Type {o}Type)" for o in otypes_present if can_contain(rtype, o)]
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


def game_dir_prefix(task_type: str, variation: int) -> str:
    """The start of a generated game's folder name, e.g. ``pick_and_place_simple-00003``."""
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
