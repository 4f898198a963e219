"""The worlds behind the loopback AgentGym servers (``standin.AgentGymStandin``): ``SciWorldBackend``
(the real ScienceWorld simulator), ``TextCraftBackend`` and ``BabyAIBackend`` (generated worlds with the
real servers' texts and grammar; ``standin``'s docstring says what each is and is not).
"""

from __future__ import annotations

import random
import re
from typing import Any


class Refused(Exception):
    """Answered as AgentGym does: HTTP 200 ``{"error": message}``."""


class Backend:
    """One environment type behind the server; subclasses keep per-id state."""

    banner = "Stand-in"
    create_needs_body = False  # textcraft's /create takes a pydantic body: 422 without one
    second_close = "false"  # "false" (textcraft, babyai) or "500" (sciworld)

    def create(self, idx: int) -> dict[str, Any]:
        raise NotImplementedError

    def reset(self, idx: int, data_idx: int) -> dict[str, Any]:
        raise NotImplementedError

    def step(self, idx: int, action: str) -> dict[str, Any]:
        raise NotImplementedError

    def close(self, idx: int) -> None:
        pass

    def expert_plan(self, data_idx: int) -> list[str]:
        raise NotImplementedError


# --- ScienceWorld: the real simulator, as agentenv-sciworld runs it -------------------------------------


class SciWorldBackend(Backend):
    """AgentGym's ScienceWorld server over the real simulator (see the module docstring)."""

    banner = "ScienceWorld"
    second_close = "500"

    def __init__(self, jvm_heap: str = "512m") -> None:
        from hamo_ray.envs.expert_ids import agentgym_sciworld_items

        self.games = agentgym_sciworld_items()
        self.jvm_heap = jvm_heap
        self.envs: dict[int, Any] = {}
        self.done: dict[int, bool] = {}

    def create(self, idx: int) -> dict[str, Any]:
        from hamo_ray.envs.scienceworld_jvm import capped_env_class

        self.envs[idx] = capped_env_class()(self.jvm_heap)  # envStepLimit 100, the package's default
        self.done[idx] = False
        return {"id": idx}

    def reset(self, idx: int, data_idx: int) -> dict[str, Any]:
        env = self.envs[idx]
        if not 0 <= data_idx < len(self.games):
            raise Refused("list index out of range")
        task, variation = self.games[data_idx]
        env.load(task, variation)
        description = env.getTaskDescription()
        ob, reward, done, info = env.step("look around")
        self.done[idx] = bool(done)
        return {
            "task_name": task,
            "var_num": variation,
            "task_description": description,
            "observation": ob,
            "reward": reward,
            "score": info["score"],
            "deleted": False,
            "done": done,
        }

    def step(self, idx: int, action: str) -> dict[str, Any]:
        if self.done.get(idx):
            raise Refused(f"The task with environment {idx} has finished.")
        ob, reward, done, info = self.envs[idx].step(action)
        self.done[idx] = bool(done)
        return {"observation": ob, "reward": reward, "score": info["score"], "done": done}

    def close(self, idx: int) -> None:
        self.envs.pop(idx).close()

    def expert_plan(self, data_idx: int) -> list[str]:
        from hamo_ray.envs.scienceworld_jvm import capped_env_class

        env = capped_env_class()(self.jvm_heap)
        try:
            task, variation = self.games[data_idx]
            env.load(task, variation, "", generateGoldPath=True)
            return list(env.get_gold_action_sequence())
        finally:
            env.close()


# --- TextCraft: a generated crafting world with the real server's texts and quirks ----------------------

_MATERIALS = (
    "oak", "birch", "spruce", "acacia", "jungle", "crimson", "warped", "granite", "diorite", "andesite",
    "copper", "iron", "gold", "quartz", "amethyst", "prismarine", "basalt", "blackstone", "sandstone", "tuff",
)  # fmt: skip
_KINDS = ("log", "ingot", "dust", "shard", "fiber", "nugget", "crystal", "resin")
_PRODUCTS = (
    "planks", "slab", "stairs", "block", "wall", "lantern", "gear", "rod", "frame", "panel", "sign",
    "hinge", "plate", "brick", "tile", "beam",
)  # fmt: skip


def _textcraft_world(data_idx: int) -> tuple[str, list[str], list[tuple[str, int, list[tuple[int, str]]]]]:
    """Goal ``data_idx`` of the stand-in: (goal item, base items, recipes (output, count, inputs)) with
    the crafting depth of the real server's item ``data_idx`` (``domains.textcraft_depth``)."""
    from hamo_ray.envs.agentgym.items import TEXTCRAFT_NUM_GOALS, textcraft_depth

    n = data_idx % TEXTCRAFT_NUM_GOALS
    rng = random.Random(f"textcraft/{n}")
    depth = textcraft_depth(n)
    material = _MATERIALS[n % len(_MATERIALS)]
    bases = [f"{material} {k}" for k in rng.sample(_KINDS, 2)]
    recipes: list[tuple[str, int, list[tuple[int, str]]]] = []
    inputs = [(rng.randint(1, 3), bases[0]), (1, bases[1])]
    products = rng.sample(_PRODUCTS, depth)
    for level in range(depth):
        out = f"{material} {products[level]}"
        count = 1 if level == depth - 1 else rng.randint(1, 2)
        recipes.append((out, count, inputs))
        inputs = [(count, out)] + ([(1, bases[level % 2])] if level % 2 == 0 else [])
    return recipes[-1][0], bases, recipes


def _recipe_text(out: str, count: int, inputs: list[tuple[int, str]]) -> str:
    return f"craft {count} {out} using " + ", ".join(f"{c} {i}" for c, i in inputs)


class _Craft:
    def __init__(self, data_idx: int) -> None:
        self.goal, self.bases, self.recipes = _textcraft_world(data_idx)
        distractor = _textcraft_world(data_idx + 7)[2][0]
        lines = [_recipe_text(*r) for r in self.recipes] + [_recipe_text(*distractor)]
        random.Random(data_idx).shuffle(lines)
        self.commands = "\n".join(lines)
        self.inventory: dict[str, int] = {}

    def observation(self) -> str:
        return f"Crafting commands:\n{self.commands}\n\nGoal: craft {self.goal}."

    def act(self, action: str) -> tuple[str, int]:
        if m := re.fullmatch(r"get ([0-9]+) (.*)", action):
            item = m.group(2)
            if item not in self.bases:
                return f"Could not find {item}", 0
            self.inventory[item] = self.inventory.get(item, 0) + int(m.group(1))
            return f"Got {m.group(1)} {item}", 0
        if m := re.fullmatch(r"craft (.*) using (.*)", action):
            out = re.sub(r"^[0-9]+ ", "", m.group(1))
            wanted = []
            for part in m.group(2).split(","):
                pm = re.fullmatch(r"([0-9]+) (.*)", part.strip())
                if pm is None:
                    return f"Wrong item format: {part.strip()}", 0
                wanted.append((int(pm.group(1)), pm.group(2)))
            recipe = next((r for r in self.recipes if r[0] == out and sorted(r[2]) == sorted(wanted)), None)
            if recipe is None:
                return f"Could not find a valid recipe for {out}", 0
            if any(self.inventory.get(i, 0) < c for c, i in wanted):
                return f"Could not find enough items to craft minecraft:{out.replace(' ', '_')}", 0
            for c, i in wanted:
                self.inventory[i] -= c
            self.inventory[out] = self.inventory.get(out, 0) + recipe[1]
            return f"Crafted {recipe[1]} minecraft:{out.replace(' ', '_')}", int(out == self.goal)
        if action == "inventory":
            held = " ".join(f"[{i}] ({n})" for i, n in self.inventory.items() if n)
            return "Inventory: " + (held or "You are not carrying anything."), 0
        return f"Could not execute {action}", 0

    def plan(self) -> list[str]:
        actions = []
        need: dict[str, int] = {}
        for _out, _count, inputs in self.recipes:
            for c, i in inputs:
                if i in self.bases:
                    need[i] = need.get(i, 0) + c
        actions += [f"get {n} {i}" for i, n in need.items()]
        actions += [_recipe_text(*r) for r in self.recipes]
        return actions


class TextCraftBackend(Backend):
    """AgentGym's TextCraft server over a generated crafting world (see the module docstring)."""

    banner = "TextCraft"
    create_needs_body = True

    def __init__(self) -> None:
        self.envs: dict[int, _Craft] = {}

    def create(self, idx: int) -> dict[str, Any]:
        self.envs[idx] = _Craft(idx)  # the real server resets a new environment to item <id>
        obs = self.envs[idx].observation()
        return {"id": idx, "observation": obs, "done": False, "reward": 0}

    def reset(self, idx: int, data_idx: int) -> dict[str, Any]:
        self.envs[idx] = _Craft(data_idx)
        return {"id": idx, "observation": self.envs[idx].observation(), "done": False, "reward": 0}

    def step(self, idx: int, action: str) -> dict[str, Any]:
        obs, reward = self.envs[idx].act(action)
        return {"observation": obs, "reward": reward, "done": bool(reward)}  # done is not kept

    def close(self, idx: int) -> None:
        del self.envs[idx]

    def expert_plan(self, data_idx: int) -> list[str]:
        return _Craft(data_idx).plan()


# --- BabyAI: an abstract room with the real server's texts, level list and reward -------------------


class _Room:
    COLORS = ("red", "green", "blue", "purple", "yellow", "grey")
    OBJECTS = ("ball", "box", "key")
    MAX_STEPS = 64

    def __init__(self, data_idx: int) -> None:
        from hamo_ray.envs.agentgym.domains import BABYAI_LEVELS

        self.level = BABYAI_LEVELS[data_idx % 40]
        rng = random.Random(f"babyai/{data_idx}")
        self.objects = [(rng.choice(self.COLORS), rng.choice(self.OBJECTS)) for _ in range(3)]
        self.target = self.objects[rng.randrange(3)]
        self.pick = "Pickup" in self.level or "Unlock" in self.level
        name = f"{self.target[0]} {self.target[1]}"
        self.mission = f"pick up the {name}" if self.pick else f"go to the {name}"
        self.near: tuple[str, str] | None = None
        self.steps, self.reward, self.done = 0, 0.0, False

    def _names(self) -> list[str]:
        names, seen = [], {}
        for color, obj in self.objects:
            seen[(color, obj)] = seen.get((color, obj), 0) + 1
            names.append(f"{color} {obj} {seen[(color, obj)]}")
        return names

    def actions(self) -> list[str]:
        acts = ["turn left", "turn right", "move forward"]
        acts += [f"go to {n}" for n in self._names()]
        if self.near is not None:
            acts.append(f"pick up {self.near[0]} {self.near[1]}")
        return acts + ["check available actions"]

    def describe(self) -> str:
        parts = [
            f"a {c} {o} {i + 2} steps in front of you and {i} steps to your right"
            for i, (c, o) in enumerate(self.objects)
        ]
        return "In front of you in this room, you can see several objects: " + ". ".join(parts) + "."

    def with_actions(self, text: str) -> str:
        return text + "\nAvailable actions: [" + ", ".join(f'"{a}"' for a in self.actions()) + "]"

    def act(self, action: str) -> str:
        action = action.lower().strip()
        self.steps += 1
        if "check" in action:
            return "You can take the following actions: " + ", ".join(self.actions())
        if action not in self.actions():
            return "The action is not recognized. Please check valid actions."
        if action.startswith("go to "):
            name = action[len("go to ") :].rsplit(" ", 1)[0]
            self.near = tuple(name.split(" ", 1))  # type: ignore[assignment]
            text = f"You are now in front of the {name}. " + self.describe()
            if not self.pick and self.near == self.target:
                self._win()
        elif action.startswith("pick up "):
            text = f"You pick up the {self.near[0]} {self.near[1]}."
            if self.near == self.target:
                self._win()
        else:
            text = self.describe()
        if self.done:
            text += "\n The task is completed."
        return text

    def _win(self) -> None:
        self.reward, self.done = round(1 - 0.9 * self.steps / self.MAX_STEPS, 4), True

    def plan(self) -> list[str]:
        name = self._names()[self.objects.index(self.target)]
        return [f"go to {name}"] + ([f"pick up {self.target[0]} {self.target[1]}"] if self.pick else [])


class BabyAIBackend(Backend):
    """AgentGym's BabyAI server over an abstract room (see the module docstring)."""

    banner = "BabyAI"

    def __init__(self) -> None:
        self.envs: dict[int, _Room | None] = {}
        self.score: dict[int, float] = {}

    def create(self, idx: int) -> dict[str, Any]:
        self.envs[idx] = None  # the real server makes the game on /reset
        return {"id": idx}

    def reset(self, idx: int, data_idx: int) -> dict[str, Any]:
        if data_idx < 0:
            raise Refused(f"invalid data_idx {data_idx}")
        room = self.envs[idx] = _Room(data_idx)
        self.score[idx] = 0.0
        obs = room.with_actions(f"Your goal: {room.mission}\n" + room.describe())
        return {"observation": obs, "reward": 0, "score": 0, "deleted": False, "done": False}

    def step(self, idx: int, action: str) -> dict[str, Any]:
        room = self.envs[idx]
        if room is None:
            raise Refused(f"{idx}")  # the real server's KeyError text
        if room.done:
            raise Refused(f"The task with environment {idx} has finished.")
        obs = room.with_actions(room.act(action))
        self.score[idx] += room.reward  # the real server's score sums the reward over steps
        return {"observation": obs, "reward": room.reward, "score": self.score[idx], "done": room.done}

    def close(self, idx: int) -> None:
        if self.envs.pop(idx) is None:
            raise KeyError(idx)  # the real server returns false for an environment never reset

    def expert_plan(self, data_idx: int) -> list[str]:
        return _Room(data_idx).plan()
