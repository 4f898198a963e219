"""ALFWorld domain: task types, splits, the game generator, the official wrapper, the expert, bad input.

The module fixture generates one train game per task type (plus one test game) into a temporary folder;
that is most of this module's time (~15 s on 2 cores with the variations in QUICK).
"""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import alfworld  # noqa: F401 - a required dependency (pyproject.toml): missing, this module fails, never skips
import pytest

from hamo_ray.config import ConfigError, EnvConfig
from hamo_ray.envs import get_domain
from hamo_ray.envs.alfworld import AlfWorldEnv, generate
from hamo_ray.envs.alfworld.domain import GameStore
from hamo_ray.types import TaskSpec

SIX = [
    "pick_and_place_simple",
    "look_at_obj_in_light",
    "pick_clean_then_place_in_recep",
    "pick_heat_then_place_in_recep",
    "pick_cool_then_place_in_recep",
    "pick_two_obj_and_place",
]


def _cfg(games_dir: Path, **kw) -> EnvConfig:
    return EnvConfig(
        domain="alfworld",
        task_types=SIX,
        alfworld={
            "games": "generated",
            "data": str(games_dir / "no-official-data"),
            "games_dir": str(games_dir),
        },
        **kw,
    )


# The generator's time differs by variation (it retries until the expert wins the game): measured on
# 2 cores, pick_two_obj variations 0-4 took 35, 10, 68, 2 and 103 s, pick_heat 12, 6, 2, 9 and 2 s. The
# fixture takes a quick one of those two types (the others are 0-7 s at variation 0).
QUICK = {"pick_two_obj_and_place": 3, "pick_heat_then_place_in_recep": 2}


@pytest.fixture(scope="module")
def games(tmp_path_factory: pytest.TempPathFactory) -> tuple[EnvConfig, dict]:
    """One generated train game per task type and one test game; returns (cfg, {(split, type): task})."""
    cfg = _cfg(tmp_path_factory.mktemp("alfworld"))
    domain = get_domain("alfworld", cfg)
    tasks = {("train", tt): domain.tasks("train", tt, limit=4)[QUICK.get(tt, 0)] for tt in SIX}
    tasks["test", "look_at_obj_in_light"] = domain.tasks("test", "look_at_obj_in_light", limit=1)[0]
    for task in tasks.values():  # tasks() generates nothing: the games are made on first use
        domain.store.game_file(task.split, task.task, task.variation)
    return cfg, tasks


def _traj_data(cfg: EnvConfig, task) -> dict:
    game = GameStore(cfg).game_file(task.split, task.task, task.variation)
    return json.loads((game.parent / "traj_data.json").read_text())


def test_task_types_are_the_six_and_unknown_is_a_config_error(tmp_path: Path) -> None:
    domain = get_domain("alfworld", _cfg(tmp_path))
    assert domain.task_types() == SIX
    with pytest.raises(ConfigError, match="boil"):
        domain.tasks("train", "boil")
    with pytest.raises(ConfigError, match="validation"):
        domain.tasks("validation", "pick_and_place_simple")


def test_splits_use_disjoint_rooms() -> None:
    for tt in SIX:
        train, dev, test = (set(generate.scenes_for(s, tt)) for s in ("train", "dev", "test"))
        assert train and test, tt
        assert train == dev  # dev mirrors valid_seen: seen rooms, other placements
        assert not train & test, tt


def test_generator_is_deterministic_and_splits_differ() -> None:
    for tt in SIX:
        scene = generate.scenes_for("train", tt)[0]
        a = generate.build_problem(tt, scene, random.Random(7))
        b = generate.build_problem(tt, scene, random.Random(7))
        assert a is not None and a == b, tt
        assert generate.build_problem(tt, scene, random.Random(8)) != a, tt


def test_generated_games_are_official_format_and_splits_disjoint(games) -> None:
    cfg, tasks = games
    train_scenes = set()
    for (split, tt), task in tasks.items():
        data = _traj_data(cfg, task)
        assert data["task_type"] == tt
        game = json.loads(GameStore(cfg).game_file(split, tt, task.variation).read_text())
        assert game["solvable"] is True and game["walkthrough"]
        assert set(game) >= {"pddl_domain", "grammar", "pddl_problem"}
        if split == "train":
            train_scenes.add(data["scene"]["scene_num"])
    test_scene = _traj_data(cfg, tasks["test", "look_at_obj_in_light"])["scene"]["scene_num"]
    assert test_scene not in train_scenes
    assert test_scene in generate.scenes_for("test", "look_at_obj_in_light")


def test_same_seed_regenerates_the_same_game(games, tmp_path: Path) -> None:
    cfg, tasks = games
    task = tasks["train", "look_at_obj_in_light"]
    original = GameStore(cfg).game_file(task.split, task.task, task.variation)
    again = GameStore(_cfg(tmp_path)).game_file(task.split, task.task, task.variation)
    assert again.parent.parent.name == original.parent.parent.name
    assert again.read_text() == original.read_text()


def test_expert_reaches_100_on_every_task_type(games) -> None:
    cfg, tasks = games
    env = AlfWorldEnv(cfg)
    try:
        for (split, tt), task in tasks.items():
            goal, obs = env.reset(task)
            assert goal and obs.startswith("You are in the middle of a room"), (tt, goal, obs)
            plan = env.expert_actions()
            assert len(plan) <= cfg.max_turns
            result = None
            for action in plan:
                result = env.step(action)
                if result.done:
                    break
            assert result is not None and result.done and result.score == 100.0, (split, tt, plan)
    finally:
        env.close()


def test_generated_games_load_in_alfred_tw_env(games) -> None:
    """The official ``AlfredTWEnv`` collects the generated folder and its gym env (with the
    handcoded ``AlfredExpert`` wrapper) plays the walkthrough to a win."""
    from alfworld.agents.environment.alfred_tw_env import AlfredTWEnv

    cfg, tasks = games
    task = tasks["train", "look_at_obj_in_light"]
    game_file = GameStore(cfg).game_file(task.split, task.task, task.variation)
    config = {
        "env": {
            "goal_desc_human_anns_prob": 0,
            "task_types": [2],
            "domain_randomization": False,
            "expert_type": "handcoded",
        },
        "dataset": {"data_path": str(game_file.parents[2]), "num_train_games": -1},
        "general": {"training_method": "dagger"},
        "dagger": {"training": {"max_nb_steps_per_episode": 50}},
    }
    tw = AlfredTWEnv(config, train_eval="train")
    assert tw.game_files == [str(game_file)]
    env = tw.init_env(batch_size=1)
    try:
        obs, infos = env.reset()
        assert "Your task is to" in obs[0]
        for action in json.loads(game_file.read_text())["walkthrough"]:
            assert infos["extra.expert_plan"][0]  # the wrapper's handcoded expert proposes a command
            obs, scores, dones, infos = env.step([action])
        assert infos["won"][0] and dones[0]
    finally:
        env.close()


def test_malformed_actions_get_the_engine_answer(games) -> None:
    cfg, tasks = games
    env = AlfWorldEnv(cfg)
    try:
        env.reset(tasks["train", "pick_and_place_simple"])
        for action in ["", "   ", "fly to the moon", "go to", "take", "\x00\n\t", "ünïcödé ☃", "x" * 100_000]:
            result = env.step(action)
            assert result.observation == "Nothing happens." and not result.done and result.score == 0.0
        assert "look" in env.valid_actions()
    finally:
        env.close()


def test_episode_is_done_after_max_turns(games) -> None:
    cfg, tasks = games
    env = AlfWorldEnv(cfg.model_copy(update={"max_turns": 3}))
    try:
        env.reset(tasks["train", "pick_and_place_simple"])
        assert [env.step("look").done for _ in range(3)] == [False, False, True]
        assert env.step("look").score == 0.0
    finally:
        env.close()


def test_missing_official_data_stops_with_the_setting_and_folder_named(tmp_path: Path) -> None:
    """Official games asked for (the default) and missing: a ConfigError, never generated games."""
    cfg = EnvConfig(
        domain="alfworld", alfworld={"data": str(tmp_path / "none"), "games_dir": str(tmp_path / "gen")}
    )
    assert cfg.alfworld.games == "official"
    domain = get_domain("alfworld", cfg)  # cheap: nothing listed, nothing generated
    for call in (
        lambda: domain.tasks("train", "pick_and_place_simple"),
        domain.store.check,
        lambda: domain.make_env().reset(
            TaskSpec(domain="alfworld", task="pick_and_place_simple", variation=0)
        ),
    ):
        with pytest.raises(
            ConfigError,
            match=f"env.alfworld.games=official: no official ALFWorld games under {tmp_path / 'none'}",
        ):
            call()
    assert not (tmp_path / "gen").exists()


def test_listing_tasks_generates_nothing(tmp_path: Path) -> None:
    domain = get_domain("alfworld", _cfg(tmp_path / "games"))
    tasks = domain.tasks("train", "pick_heat_then_place_in_recep", limit=3)
    assert [t.variation for t in tasks] == [0, 1, 2]
    assert len(domain.tasks("test", "pick_and_place_simple")) == domain.cfg.alfworld.games_per_task
    assert not (tmp_path / "games").exists()


def test_official_data_is_used_when_present(games, tmp_path: Path) -> None:
    """A folder in the ``alfworld-download`` layout is listed as is, nothing is generated."""
    cfg, tasks = games
    task = tasks["train", "pick_and_place_simple"]
    trial = GameStore(cfg).game_file(task.split, task.task, task.variation).parent
    dest = tmp_path / "json_2.1.1" / "train" / "pick_and_place_simple-Cd-None-GarbageCan-312" / "trial_T1"
    shutil.copytree(trial, dest)
    official = EnvConfig(
        domain="alfworld", alfworld={"data": str(tmp_path), "games_dir": str(tmp_path / "gen")}
    )
    domain = get_domain("alfworld", official)
    assert len(domain.tasks("train", "pick_and_place_simple")) == 1
    assert domain.tasks("test", "pick_and_place_simple") == []
    env = domain.make_env()
    try:
        env.reset(domain.tasks("train", "pick_and_place_simple")[0])
        assert env.game_file == dest / "game.tw-pddl"
    finally:
        env.close()
    assert not (tmp_path / "gen").exists()


def test_import_is_light() -> None:
    code = (
        "import sys, hamo_ray.envs.alfworld; "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('alfworld', 'textworld', 'fast_downward')]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
