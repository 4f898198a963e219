"""TextWorld (generated text games with walkthroughs, the ``textworld`` package) as a HaMo domain.

Usage::

    domain = get_domain("textworld", EnvConfig(domain="textworld"))
    task = domain.tasks("test", "tw-cooking", limit=1)[0]     # variation = the game's seed
    env = domain.make_env()
    goal, obs = env.reset(task)           # generates the game on first use (4-10 s), then cached
    for action in env.expert_actions():   # the game's walkthrough
        result = env.step(action)         # StepResult(observation, reward, done, score 0-100)

- **Task types** are four of the package's challenges (``tw-make <challenge>``), each at one fixed, small
  difficulty (``CHALLENGES``): ``tw-simple`` (dense rewards, detailed goal), ``tw-coin_collector``
  (level 5), ``tw-treasure_hunter`` (level 5), ``tw-cooking`` (one-ingredient recipe, one location,
  containers to open).
- **Variations are seeds**; the splits are disjoint seed ranges (``SPLIT_SEEDS``). For ``tw-cooking`` the
  challenge's own split (train/valid/test food items and preparations) follows ours, and ``tw-simple``
  test games come from its test distribution (``test=True``).
- **Games** are generated on first use (``textworld.challenges.CHALLENGES[name]`` + ``compile_game``, the
  same path as ``tw-make``) into ``env.textworld.games_dir`` (default ``~/.cache/hamo_ray/textworld``),
  one folder per (challenge, settings, seed); generation writes a temporary folder and renames it, so
  concurrent processes never see half a game (at worst two generate the same one). ``pregenerate``
  makes the missing games of a task list in parallel processes, with progress logging.
- **Goal** is the game's objective; the first observation is the game's opening text (the objective
  again, then the first room) without the "TEXT WORLD" ASCII-art banner (~1,600 characters). **Score** is the game score over its maximum, 0-100; the episode
  is done when the game is won or lost. **Expert** is the game's walkthrough.
- **Actions** go to the game's Inform 7 parser, which answers malformed ones itself ("That's not a verb I
  recognise."). Commands are sent one line each, so line breaks and control characters are replaced
  by spaces and a command is cut to 200 characters (a newline would otherwise smuggle in a second command,
  e.g. ``quit``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from hamo_ray.config import ConfigSection
from hamo_ray.envs.base import Domain, EnvLifecycle, StepResult, register_domain
from hamo_ray.types import TaskSpec

logger = logging.getLogger(__name__)


class TextWorldConfig(ConfigSection):
    """TextWorld's settings, ``env.textworld.*``."""

    games_dir: str | None = None  # the generated games; default ~/.cache/hamo_ray/textworld


SPLIT_SEEDS = {"train": range(0, 10_000), "dev": range(10_000, 11_000), "test": range(20_000, 21_000)}
CHALLENGES: dict[str, dict[str, Any]] = {
    "tw-simple": {"rewards": "dense", "goal": "detailed", "test": False},
    "tw-coin_collector": {"level": 5},
    "tw-treasure_hunter": {"level": 5},
    "tw-cooking": {
        "recipe": 1,
        "take": 1,
        "go": 1,
        "open": True,
        "cook": False,
        "cut": False,
        "drop": False,
        "recipe_seed": None,
    },
}
_COOKING_SPLIT = {"train": "train", "dev": "valid", "test": "test"}
_MAX_COMMAND_CHARS = 200
_CONTROL = re.compile(r"[\x00-\x1f\x7f]+")
_GAME_FILE = "game.z8"
_BANNER_LINES = 25


def default_games_dir() -> Path:
    return Path.home() / ".cache" / "hamo_ray" / "textworld"


def _split_of(seed: int) -> str:
    for split, seeds in SPLIT_SEEDS.items():
        if seed in seeds:
            return split
    raise ValueError(f"textworld seed {seed} is in no split ({SPLIT_SEEDS})")


def _settings(challenge: str, seed: int) -> dict[str, Any]:
    settings = dict(CHALLENGES[challenge])
    split = _split_of(seed)
    if challenge == "tw-cooking":
        settings["split"] = _COOKING_SPLIT[split]
        settings["recipe_seed"] = seed
    elif challenge == "tw-simple":
        settings["test"] = split == "test"
    return settings


def game_dir(games_dir: Path, challenge: str, seed: int) -> Path:
    """Where the game of ``challenge`` and ``seed`` lives: settings and package version in the name."""
    import textworld

    key = json.dumps([textworld.__version__, _settings(challenge, seed)], sort_keys=True)
    digest = hashlib.sha1(key.encode()).hexdigest()[:10]
    return games_dir / f"{challenge}-{digest}" / f"seed-{seed}"


def ensure_game(games_dir: Path, challenge: str, seed: int) -> Path:
    """The compiled game file, generated now if missing (4-10 s).

    Raises:
        ValueError: unknown challenge or a seed outside every split.
    """
    if challenge not in CHALLENGES:
        raise ValueError(f"unknown textworld challenge {challenge!r}; known: {', '.join(CHALLENGES)}")
    final = game_dir(games_dir, challenge, seed)
    if (final / _GAME_FILE).exists():
        return final / _GAME_FILE
    import textworld
    import textworld.challenges
    from textworld.generator import compile_game

    final.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix=f".seed-{seed}-", dir=final.parent))
    try:
        options = textworld.GameOptions()
        options.seeds = seed
        options.path = str(tmp / _GAME_FILE)
        options.file_ext = ".z8"
        options.force_recompile = True
        _, make_game, _ = textworld.challenges.CHALLENGES[challenge]
        game = make_game(settings=_settings(challenge, seed), options=options)
        compile_game(game, options)
        try:
            os.rename(tmp, final)
        except OSError:  # another process finished the same game first
            if not (final / _GAME_FILE).exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info(
        "textworld: generated %s seed %d in %.1f s (%s)", challenge, seed, time.perf_counter() - start, final
    )
    return final / _GAME_FILE


def pregenerate(games_dir: Path, tasks: list[TaskSpec], workers: int | None = None) -> list[Path]:
    """Generate the games of ``tasks`` that are missing, ``workers`` at a time, logging progress.

    Each game is made in a fresh process (spawned, one per worker): the package's generators share a
    module-level random state, so games made side by side in threads would not be reproducible.
    """
    import concurrent.futures
    import multiprocessing

    jobs = sorted({(t.task, t.variation) for t in tasks})
    missing = [j for j in jobs if not (game_dir(games_dir, *j) / _GAME_FILE).exists()]
    if missing:
        logger.info("textworld: generating %d of %d games into %s", len(missing), len(jobs), games_dir)
        workers = max(1, min(workers or os.cpu_count() or 1, len(missing)))
        ctx = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(workers, mp_context=ctx) as pool:
            futures = [pool.submit(ensure_game, games_dir, *j) for j in missing]
            for done, future in enumerate(concurrent.futures.as_completed(futures), 1):
                future.result()
                logger.info("textworld: %d/%d games generated", done, len(missing))
    return [game_dir(games_dir, *j) / _GAME_FILE for j in jobs]


def _strip_banner(text: str) -> str:
    """The opening text without the "TEXT WORLD" ASCII-art banner (its lines are drawn with ``$$``)."""
    lines = text.strip("\n").split("\n")
    art = [i for i, line in enumerate(lines[:_BANNER_LINES]) if "$$" in line]
    return "\n".join(lines[art[-1] + 1 :] if art else lines).strip()


def clean_command(action: str) -> str:
    """One parser line: control characters (newlines included) to spaces, at most 200 characters."""
    return _CONTROL.sub(" ", action).strip()[:_MAX_COMMAND_CHARS]


class TextWorldEnv(EnvLifecycle):
    """One TextWorld game at a time; ``reset`` loads the task's game (generating it if needed).

    Args:
        games_dir: the cache of generated games.
    """

    def __init__(self, games_dir: Path) -> None:
        self.games_dir = games_dir
        self._env: Any = None
        self._task: TaskSpec | None = None
        self._state: Any = None
        self._score = 0.0
        self._done = False

    def reset(self, task: TaskSpec) -> tuple[str, str]:
        """Load the game of ``task`` (``task.variation`` is its seed); returns (objective, opening text).

        Raises:
            ValueError: unknown challenge, or a seed outside the task's split.
        """
        if task.variation not in SPLIT_SEEDS.get(task.split, range(0)):
            raise ValueError(f"{task.id}: seed {task.variation} is not in the {task.split} seeds")
        path = ensure_game(self.games_dir, task.task, task.variation)
        import textworld

        if self._env is not None:
            self._env.close()
        infos = textworld.EnvInfos(
            objective=True, score=True, max_score=True, won=True, lost=True, admissible_commands=True,
            extras=["walkthrough"],
        )  # fmt: skip
        self._env = textworld.start(str(path), request_infos=infos)
        self._state = self._env.reset()
        self._task, self._score, self._done = task, 0.0, False
        return self._state["objective"].strip(), _strip_banner(self._state.feedback)

    def step(self, action: str) -> StepResult:
        """Send ``action`` to the game's parser (cleaned to one line, see the module docstring)."""
        if self._task is None:
            raise RuntimeError("TextWorldEnv.step() before reset()")
        if self._done:
            return StepResult("The game is over.", 0.0, True, self._score)
        self._state, _, done = self._env.step(clean_command(action))
        score = 100.0 * self._state["score"] / max(1, self._state["max_score"])
        reward, self._score = score - self._score, score
        self._done = bool(done or self._state["won"] or self._state["lost"])
        return StepResult(self._state.feedback.strip(), reward, self._done, score)

    def expert_actions(self) -> list[str]:
        """The game's walkthrough."""
        if self._task is None:
            raise RuntimeError("TextWorldEnv.expert_actions() before reset()")
        return list(self._state["extra.walkthrough"])

    def valid_actions(self) -> list[str]:
        """The game's admissible commands now."""
        if self._task is None:
            raise RuntimeError("TextWorldEnv.valid_actions() before reset()")
        return list(self._state["admissible_commands"])

    def _close(self) -> None:
        """Stop the game's interpreter (idempotent)."""
        if self._env is not None:
            self._env.close()
            self._env = None
        self._task = None


@register_domain("textworld", config=TextWorldConfig)
class TextWorldDomain(Domain):
    """Four TextWorld challenges at fixed small difficulties; variations are seeds."""

    env_memory_mb = 100  # resource hint per environment (measured well below this)
    # The package's game-logic parser (tatsu) and engine state are process-global: concurrent resets and
    # steps in threads of one process corrupt each other ("pop from empty list", parser MemoKey errors).
    thread_safe = False
    lists_actions = True  # the game's admissible commands, computed on every step

    def task_types(self) -> list[str]:
        return list(CHALLENGES)

    def tasks(self, split: str, task_type: str, limit: int | None = None) -> list[TaskSpec]:
        """Seeds of ``split`` for ``task_type`` (games are generated when first reset).

        Raises:
            ConfigError: unknown split or task type.
        """
        self.check_split(split)
        self.check_task_types([task_type])
        seeds = SPLIT_SEEDS[split]
        if limit is not None:
            seeds = seeds[:limit]
        return [TaskSpec(domain=self.name, task=task_type, variation=s, split=split) for s in seeds]

    def make_env(self) -> TextWorldEnv:
        games_dir = self.cfg.textworld.games_dir
        return TextWorldEnv(Path(games_dir) if games_dir else default_games_dir())
