"""The ALFWorld domain and environment: official games, or generated ones when the config asks for them.

See the package docstring (``hamo_ray.envs.alfworld``) for usage, splits, timings and memory.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import time
from pathlib import Path
from typing import Any, Literal

from hamo_ray.config import ConfigError, ConfigSection, EnvConfig
from hamo_ray.envs.alfworld.generate import SPLIT_DIRS, TASK_TYPES, game_dir_prefix
from hamo_ray.envs.base import Domain, EnvLifecycle, StepResult, register_domain
from hamo_ray.types import TaskSpec

logger = logging.getLogger(__name__)

SPLITS = tuple(SPLIT_DIRS)
_TASK_PREFIX = "Your task is to: "
_BANNER = "-= Welcome to TextWorld, ALFRED! =-"


class AlfWorldConfig(ConfigSection):
    """ALFWorld's settings, ``env.alfworld.*``."""

    # "official" (the downloaded games; missing data stops the run before any work) or "generated"
    # (hamo_ray/envs/alfworld/generate.py; not comparable with published ALFWorld numbers).
    games: Literal["official", "generated"] = "official"
    # the official games (ALFWORLD_DATA layout, json_2.1.1/...); default $ALFWORLD_DATA, else ~/.cache/alfworld
    data: str | None = None
    games_dir: str | None = None  # the generated games; default ~/.cache/hamo_ray/alfworld
    seed: int = 0  # generator seed of the generated games
    games_per_task: int = 200  # generated games per task type and split


def official_root(cfg: EnvConfig) -> Path:
    """Where official games are looked for: ``env.alfworld.data``, else $ALFWORLD_DATA, else ~/.cache/alfworld."""
    root = cfg.alfworld.data or os.environ.get("ALFWORLD_DATA") or "~/.cache/alfworld"
    return Path(root).expanduser()


def generated_root(cfg: EnvConfig) -> Path:
    """Cache folder of the generated games (one subfolder per generator version and seed)."""
    from hamo_ray.envs.alfworld.generate import GENERATOR_VERSION

    base = Path(cfg.alfworld.games_dir or "~/.cache/hamo_ray/alfworld").expanduser()
    return base / f"{GENERATOR_VERSION}-seed{cfg.alfworld.seed}"


@functools.cache
def official_games(root: Path, split: str, task_type: str) -> tuple[Path, ...]:
    """Solvable official game files of one split and task type, sorted by path (the variation order).

    Skips what ``AlfredTWEnv`` skips: movable-receptacle and sliced trials, trials without a
    ``traj_data.json`` or ``game.tw-pddl``, and games not marked ``solvable``.
    """
    games = []
    for game in sorted((root / "json_2.1.1" / SPLIT_DIRS[split]).glob(f"{task_type}-*/*/game.tw-pddl")):
        if "movable" in str(game) or "Sliced" in str(game) or not (game.parent / "traj_data.json").exists():
            continue
        if json.loads(game.read_text()).get("solvable"):
            games.append(game)
    return tuple(games)


def has_official_data(root: Path) -> bool:
    train = root / "json_2.1.1" / "train"
    return train.is_dir() and next(train.glob("*/*/game.tw-pddl"), None) is not None


@functools.cache
def _game_logic() -> tuple[str, str]:
    """The package's PDDL domain and grammar (``alfworld/data/alfred.pddl`` and ``alfred.twl2``)."""
    import alfworld

    data = Path(alfworld.__file__).parent / "data"
    return (data / "alfred.pddl").read_text(), (data / "alfred.twl2").read_text()


class GameStore:
    """Maps a ``TaskSpec`` to its game file: an official one, or a generated one (made on first use).

    ``env.alfworld.games`` decides which: ``official`` games must be there (``check`` raises otherwise,
    naming the setting and the folder); ``generated`` ones are made when an episode first needs them.
    Construction is cheap: no folder is listed and nothing is generated.
    """

    def __init__(self, cfg: EnvConfig) -> None:
        self.cfg = cfg
        self.root = official_root(cfg)
        self.official = cfg.alfworld.games == "official"
        self.generated = generated_root(cfg)

    def describe(self) -> str:
        """Where the games come from, for messages."""
        if self.official:
            return f"{self.root} (official games)"
        return f"{self.generated} (generated games, env.alfworld.games=generated)"

    def check(self) -> None:
        """Raise unless the configured games can be had.

        Raises:
            ConfigError: ``env.alfworld.games=official`` and no official games under the data folder.
        """
        if self.official and not has_official_data(self.root):
            raise ConfigError(
                f"env.alfworld.games=official: no official ALFWorld games under {self.root} "
                "(expected json_2.1.1/train/<task>/<trial>/game.tw-pddl, as `alfworld-download` fills; "
                "set env.alfworld.data or $ALFWORLD_DATA to that folder, or env.alfworld.games=generated "
                "for generated games, which are not comparable with published ALFWorld numbers)"
            )

    def variation_of(self, split: str, task_type: str, folder: str, trial: str) -> int | None:
        """The variation of the game ``<split dir>/<folder>/<trial>``, or None when there is no such game."""
        if self.official:
            self.check()
            for i, game in enumerate(official_games(self.root, split, task_type)):
                if game.parent.name == trial and game.parent.parent.name == folder:
                    return i
            return None
        m = re.fullmatch(rf"{re.escape(task_type)}-(\d{{5}})-.*", folder)
        if m is None or trial != "trial_hamo" or int(m.group(1)) >= self.cfg.alfworld.games_per_task:
            return None
        return int(m.group(1))

    def count(self, split: str, task_type: str) -> int:
        if self.official:
            self.check()
            return len(official_games(self.root, split, task_type))
        return self.cfg.alfworld.games_per_task

    def game_file(self, split: str, task_type: str, variation: int) -> Path:
        """The game file of a variation, generating (and caching) it if needed.

        Raises:
            ValueError: unknown split/task type, or a variation out of range.
        """
        if split not in SPLITS or task_type not in TASK_TYPES:
            raise ValueError(f"alfworld: unknown split {split!r} or task type {task_type!r}")
        total = self.count(split, task_type)
        if not 0 <= variation < total:
            raise ValueError(f"alfworld/{task_type}/{split}: variation {variation} outside 0..{total - 1}")
        if self.official:
            return official_games(self.root, split, task_type)[variation]
        split_dir = self.generated / "json_2.1.1" / SPLIT_DIRS[split]
        found = sorted(split_dir.glob(f"{game_dir_prefix(task_type, variation)}-*/trial_hamo/game.tw-pddl"))
        if found:
            return found[0]
        from hamo_ray.envs.alfworld.generate import generate_game

        domain, grammar = _game_logic()
        seed = self.cfg.alfworld.seed
        return generate_game(self.generated, domain, grammar, split, task_type, variation, seed)

    def existing_game(self, split: str, task_type: str, variation: int) -> Path | None:
        """The game file of a variation if it is already there (nothing is generated)."""
        if self.official:
            games = official_games(self.root, split, task_type)
            return games[variation] if 0 <= variation < len(games) else None
        split_dir = self.generated / "json_2.1.1" / SPLIT_DIRS[split]
        return next(
            split_dir.glob(f"{game_dir_prefix(task_type, variation)}-*/trial_hamo/game.tw-pddl"), None
        )

    def ensure(self, split: str, task_type: str, variations: range) -> None:
        """Generate the missing games among ``variations`` (a no-op for official data), logging progress."""
        if self.official:
            return
        start = time.monotonic()
        for i, variation in enumerate(variations, 1):
            split_dir = self.generated / "json_2.1.1" / SPLIT_DIRS[split]
            if next(split_dir.glob(f"{game_dir_prefix(task_type, variation)}-*/trial_hamo"), None):
                continue
            self.game_file(split, task_type, variation)
            logger.info(
                "alfworld: generated %s game %d/%d of %s (%.0f s so far)",
                split,
                i,
                len(variations),
                task_type,
                time.monotonic() - start,
            )


def _make_tw_env() -> Any:
    """The official text-env stack of ``AlfredTWEnv`` / ``alfworld-generate``, without the expert wrapper."""
    from alfworld.agents.environment.alfred_tw_env import AlfredDemangler, AlfredInfos
    from textworld import EnvInfos
    from textworld.envs import PddlEnv

    infos = EnvInfos(admissible_commands=True, won=True, extras=["gamefile"])
    return AlfredInfos(AlfredDemangler(PddlEnv(infos), shuffle=False))


class AlfWorldEnv(EnvLifecycle):
    """One ALFWorld text game at a time, through the official ``PddlEnv`` + ALFWorld wrappers.

    Args:
        cfg: ``max_turns`` (an episode is done, unwon, after this many steps) and the game sources
            (``env.alfworld``: ``data``, ``games_dir``, ``seed``, ``games_per_task``).
    """

    def __init__(self, cfg: EnvConfig | None = None, store: GameStore | None = None) -> None:
        self.cfg = cfg or EnvConfig(domain="alfworld")
        self.store = store or GameStore(self.cfg)
        self._env = _make_tw_env()
        self._task: TaskSpec | None = None
        self._game_file: Path | None = None
        self._state: Any = None
        self._walkthrough: list[str] | None = None
        self._steps = 0
        self._done = False
        self._score = 0.0

    @property
    def task(self) -> TaskSpec | None:
        return self._task

    @property
    def game_file(self) -> Path | None:
        """The loaded game's ``game.tw-pddl``."""
        return self._game_file

    def reset(self, task: TaskSpec) -> tuple[str, str]:
        """Load ``task``'s game (generating it on first use) and return (task text, room description).

        Raises:
            ValueError: unknown split or task type, or a variation out of range.
        """
        from hamo_ray.envs.alfworld.expert import keep_argv

        game_file = self.store.game_file(task.split, task.task, task.variation)
        with keep_argv():
            if game_file != self._game_file:  # loading parses the game again (two PDDL->SAS translations)
                self._env.load(str(game_file))
            self._state = self._env.reset()
        self._task, self._game_file = task, game_file
        self._walkthrough = json.loads(game_file.read_text()).get("walkthrough")
        self._steps, self._done, self._score = 0, False, 0.0
        intro = self._state["feedback"].replace(_BANNER, "").strip()
        room, _, goal = intro.partition(_TASK_PREFIX)
        return goal.strip(), room.strip()

    def step(self, action: str) -> StepResult:
        """Apply ``action``; a command that is not admissible gets the game's own "Nothing happens."."""
        if self._task is None:
            raise RuntimeError("AlfWorldEnv.step() before reset()")
        self._state, _, _ = self._env.step(str(action))
        observation = self._state["feedback"]
        if self._done:
            return StepResult(observation, 0.0, True, self._score)
        self._steps += 1
        score = 100.0 if self._state["won"] else 0.0
        reward, self._score = score - self._score, score
        self._done = bool(self._state["won"]) or self._steps >= self.cfg.max_turns
        return StepResult(observation, reward, self._done, score)

    def expert_actions(self) -> list[str]:
        """The game's expert walkthrough (the handcoded expert's winning commands).

        Generated games and ``alfworld-generate``d ones store it; otherwise the handcoded expert is
        played on the loaded game once (seeded by the task id) and its commands are kept.
        """
        if self._task is None or self._game_file is None:
            raise RuntimeError("AlfWorldEnv.expert_actions() before reset()")
        if self._walkthrough is None:
            from hamo_ray.envs.alfworld.expert import play_expert
            from hamo_ray.envs.alfworld.generate import sub_seed

            plan = play_expert(str(self._game_file), "handcoded", seed=sub_seed(self._task.id))
            if plan is None:
                plan = play_expert(str(self._game_file), "planner") or []
            self._walkthrough = plan
        return list(self._walkthrough)

    def valid_actions(self) -> list[str]:
        """The admissible commands now (the engine computes them on every step anyway)."""
        if self._state is None:
            raise RuntimeError("AlfWorldEnv.valid_actions() before reset()")
        return list(self._state["admissible_commands"])

    def _close(self) -> None:
        self._env.close()


@register_domain("alfworld", config=AlfWorldConfig)
class AlfWorldDomain(Domain):
    """ALFWorld's six task types; official games (``ALFWORLD_DATA``) or generated ones (``env.alfworld.games``).

    Splits: ``train`` = ``json_2.1.1/train``, ``dev`` = ``valid_seen``, ``test`` = ``valid_unseen``.
    """

    env_memory_mb = 60  # resource hint: ~50 MB for the first env of a process, a few MB per further one
    # TextWorld's game-logic parser (tatsu) underneath is process-global: concurrent resets/steps in
    # threads of one process corrupt each other ("pop from empty list"), so an actor steps one at a time.
    thread_safe = False
    lists_actions = True  # the admissible commands, computed on every step anyway (20-60 of them)
    worlds_from_spec = False  # a world is a room, known from the first observation (hamo_ray.memory.worlds)

    def __init__(self, cfg: EnvConfig) -> None:
        super().__init__(cfg)
        self._store: GameStore | None = None

    @property
    def store(self) -> GameStore:
        if self._store is None:
            self._store = GameStore(self.cfg)
        return self._store

    def task_types(self) -> list[str]:
        return list(TASK_TYPES)

    def tasks(self, split: str, task_type: str, limit: int | None = None) -> list[TaskSpec]:
        """Games of ``task_type`` in ``split`` in variation order.

        Nothing is generated here (config checks and ``Stream`` construction call this): a generated
        game is made when an episode first loads it (``AlfWorldEnv.reset``), or by ``store.ensure``.

        Raises:
            ConfigError: unknown split or task type; official games asked for and missing.
        """
        if split not in SPLITS:
            raise ConfigError(f"unknown alfworld split {split!r}; known: {', '.join(SPLITS)}")
        self.check_task_types([task_type])
        variations = range(self.store.count(split, task_type))
        if limit is not None:
            variations = variations[:limit]
        return [TaskSpec(domain=self.name, task=task_type, variation=v, split=split) for v in variations]

    def make_env(self) -> AlfWorldEnv:
        return AlfWorldEnv(self.cfg, self.store)
