"""Item ids of AgentGym's and ETO's expert data -> this project's tasks (``TaskSpec``); see ``expert_data``.

- ScienceWorld: AgentGym ``sciworld_<N>`` is the N-th (task, variation) of its env server's list (the
  package's tasks in id order without 5-x, 9-x and 10-x, each with all its variations); ETO ``<T>_<V>``
  is task T of ETO's ``taskname2id.json`` (the 30 task names sorted alphabetically), variation V.
- ALFWorld: AgentGym ``alfworld_<N>`` is line N of ``data/agentgym_alfworld_games.txt`` (AgentGym's
  mapping files); ETO's ``game_file`` names the game folder. The variation is the game's place among
  the domain's games (``GameStore.variation_of``).
- WebShop: AgentGym ``webshop_<N>`` and ETO ``<N>`` are WebShop goal (session) N.

The split of a task is the split its variation belongs to.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from typing import Any

from hamo_ray.config import ConfigError
from hamo_ray.types import TaskSpec

# ETO's eval_agent/data/sciworld/taskname2id.json: the task names sorted alphabetically, numbered from 0.
_ETO_SCIWORLD = (
    "boil", "change-the-state-of-matter-of", "freeze", "melt", "measure-melting-point-known-substance",
    "measure-melting-point-unknown-substance", "use-thermometer", "power-component",
    "power-component-renewable-vs-nonrenewable-energy", "test-conductivity",
    "test-conductivity-of-unknown-substances", "find-animal", "find-living-thing", "find-non-living-thing",
    "find-plant", "grow-fruit", "grow-plant", "chemistry-mix", "chemistry-mix-paint-secondary-color",
    "chemistry-mix-paint-tertiary-color", "lifespan-longest-lived", "lifespan-longest-lived-then-shortest-lived",
    "lifespan-shortest-lived", "identify-life-stages-1", "identify-life-stages-2",
    "inclined-plane-determine-angle", "inclined-plane-friction-named-surfaces",
    "inclined-plane-friction-unnamed-surfaces", "mendelian-genetics-known-plant",
    "mendelian-genetics-unknown-plant",
)  # fmt: skip
# Task ids the AgentGym ScienceWorld server leaves out of its item list.
_AGENTGYM_SCIWORLD_SKIP = {"5-1", "5-2", "9-1", "9-2", "9-3", "10-1", "10-2"}
AGENTGYM_PREFIX = {
    "scienceworld": "sciworld", "alfworld": "alfworld", "webshop": "webshop",
    "textcraft": "textcraft", "babyai": "babyai",
}  # fmt: skip
_ALFWORLD_SPLIT_DIRS = {"train": "train", "valid_seen": "dev", "valid_unseen": "test"}


class ExpertDataError(ConfigError):
    """A malformed expert file; the message names the file, the item index and the field."""


@functools.cache
def agentgym_sciworld_items() -> tuple[tuple[str, int], ...]:
    from scienceworld.constants import ID2TASK
    from scienceworld.utils import infer_task

    from hamo_ray.envs.scienceworld_tasks import variation_splits

    items: list[tuple[str, int]] = []
    for key, name in ID2TASK.items():
        if key not in _AGENTGYM_SCIWORLD_SKIP:
            task = infer_task(name)
            items += [(task, v) for v in range(sum(len(r) for r in variation_splits(task).values()))]
    return tuple(items)


@functools.cache
def agentgym_sciworld_index() -> dict[tuple[str, int], int]:
    """(task, variation) -> its ``data_idx`` on AgentGym's sciworld server."""
    return {item: n for n, item in enumerate(agentgym_sciworld_items())}


@functools.cache
def agentgym_alfworld_items() -> tuple[str, ...]:
    text = (Path(__file__).parent / "data" / "agentgym_alfworld_games.txt").read_text()
    return tuple(line for line in text.splitlines() if line and not line.startswith("#"))


class Item:
    """Error helper for one item of one file."""

    def __init__(self, path: Path, index: int, raw: Any) -> None:
        self.path, self.index, self.raw = path, index, raw

    def error(self, field: str, msg: str) -> ExpertDataError:
        return ExpertDataError(f"expert file {self.path}: item {self.index}: field {field!r}: {msg}")

    def ident(self, keys: tuple[str, ...] = ("item_id", "id")) -> tuple[str, str]:
        """(the first of ``keys`` the item has, its value as text)."""
        for key in keys:
            if self.raw.get(key) is not None:
                return key, str(self.raw[key])
        raise self.error(keys[0], f"no item id ({' or '.join(keys)})")


def scienceworld_task(item: Item) -> TaskSpec:
    from hamo_ray.envs.scienceworld_tasks import variation_splits

    field, ident = item.ident()
    if m := re.fullmatch(r"sciworld_(\d+)", ident):
        table = agentgym_sciworld_items()
        n = int(m.group(1))
        if n >= len(table):
            raise item.error(field, f"{ident!r}: AgentGym's ScienceWorld list has {len(table)} items")
        task, variation = table[n]
    elif m := re.fullmatch(r"(\d+)_(\d+)", ident):
        if int(m.group(1)) >= len(_ETO_SCIWORLD):
            raise item.error(field, f"{ident!r}: ETO's ScienceWorld task ids are 0-{len(_ETO_SCIWORLD) - 1}")
        task, variation = _ETO_SCIWORLD[int(m.group(1))], int(m.group(2))
    else:
        raise item.error(
            field, f"{ident!r} is neither AgentGym's 'sciworld_<N>' nor ETO's '<task>_<variation>'"
        )
    for split, variations in variation_splits(task).items():
        if variation in variations:
            return TaskSpec(domain="scienceworld", task=task, variation=variation, split=split)
    raise item.error(field, f"{ident!r}: {task} has no variation {variation}")


def alfworld_task(item: Item, store) -> TaskSpec | None:
    from hamo_ray.envs.alfworld.generate import TASK_TYPES

    field, ident = item.ident(("game_file", "item_id"))
    if m := re.fullmatch(r"alfworld_(\d+)", ident):
        table = agentgym_alfworld_items()
        if int(m.group(1)) >= len(table):
            raise item.error(field, f"{ident!r}: AgentGym's ALFWorld list has {len(table)} items")
        ident = table[int(m.group(1))]
    parts = [p for p in ident.replace("\\", "/").split("/") if p]
    if parts and parts[-1].startswith("game."):
        parts = parts[:-1]
    if len(parts) < 3:
        raise item.error(field, f"{ident!r} is not '<split dir>/<task folder>/<trial>' (or alfworld_<N>)")
    split_dir, folder, trial = parts[-3:]
    if split_dir not in _ALFWORLD_SPLIT_DIRS:
        if split_dir == "valid_train":
            return None  # AgentGym's held-out items: no split of this project
        raise item.error(field, f"{ident!r}: unknown split folder {split_dir!r}")
    task_type = folder.split("-")[0]
    if task_type not in TASK_TYPES:
        raise item.error(field, f"{ident!r}: unknown task type {task_type!r}")
    split = _ALFWORLD_SPLIT_DIRS[split_dir]
    variation = store.variation_of(split, task_type, folder, trial)
    if variation is None:
        raise item.error(field, f"{ident!r}: no such game among the {split} games under {store.describe()}")
    return TaskSpec(domain="alfworld", task=task_type, variation=variation, split=split)


_PUT = re.compile(r"put (.+?) in/on (.+)")
_MOVE = re.compile(r"move (.+?) to (.+)")


@functools.lru_cache(maxsize=4096)
def _grammar_moves(game_file: Path) -> bool:
    """Whether the game's grammar writes ALFWorld's put command as ``move O to R`` (alfworld >= 0.4)."""
    return 'template :: "move {o} to {r}"' in json.loads(game_file.read_text()).get("grammar", "")


def alfworld_commands(actions: list[str], store, task: TaskSpec) -> list[str]:
    """Put commands in the form the task's game understands.

    AgentGym's and ETO's data were recorded with the older grammar (``put O in/on R``); the alfworld
    package here (0.4) names that command ``move O to R``. The game file's own grammar decides; a game
    not generated yet has the package's grammar.
    """
    game = store.existing_game(task.split, task.task, task.variation)
    moves = _grammar_moves(game) if game is not None else True
    pattern, form = (_PUT, "move {} to {}") if moves else (_MOVE, "put {} in/on {}")
    return [form.format(*m.groups()) if (m := pattern.fullmatch(a)) else a for a in actions]


def webshop_task(item: Item) -> TaskSpec:
    from hamo_ray.envs.webshop.client import REAL_SPLITS, REAL_TASK_TYPE

    field, ident = item.ident()
    m = re.fullmatch(r"(?:webshop_)?(\d+)", ident)
    if m is None:
        raise item.error(field, f"{ident!r} is neither AgentGym's 'webshop_<N>' nor a WebShop goal index")
    n = int(m.group(1))
    for split, goals in REAL_SPLITS.items():
        if n in goals:
            return TaskSpec(domain="webshop", task=REAL_TASK_TYPE, variation=n, split=split)
    raise item.error(field, f"{ident!r}: WebShop has goals 0-{max(REAL_SPLITS['train'])}")


def agentgym_server_task(item: Item, domain: str) -> TaskSpec:
    """``textcraft_<N>`` / ``babyai_<N>``: the task of item N of that AgentGym server (``agentgym.domains``)."""
    from hamo_ray.envs.agentgym.items import babyai_task, textcraft_task

    field, ident = item.ident()
    prefix = AGENTGYM_PREFIX[domain]
    m = re.fullmatch(rf"{prefix}_(\d+)", ident)
    if m is None:
        raise item.error(field, f"{ident!r} is not AgentGym's '{prefix}_<N>'")
    try:
        return (textcraft_task if domain == "textcraft" else babyai_task)(int(m.group(1)))
    except ValueError as err:
        raise item.error(field, str(err)) from None
