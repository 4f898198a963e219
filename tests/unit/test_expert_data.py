"""Expert-data import: AgentGym / ETO files of all three domains, written from real episodes, map back
to the tasks they were played on, replay to the same score, split into stages; bad files are named.

Needs a JVM (ScienceWorld), the alfworld package (one generated game, ~5-30 s) and a loopback WebShop
env server (the stand-in behind the AgentGym API).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from expert_formats import agentgym_item, eto_item, play, write

from hamo_ray.config import ConfigError, EnvConfig, load_config
from hamo_ray.envs import get_domain
from hamo_ray.envs.expert_data import ExpertDataError, load_expert_file, split_react, stage_experts
from hamo_ray.envs.expert_ids import agentgym_alfworld_items, agentgym_sciworld_items
from hamo_ray.envs.webshop.catalog import build_catalog
from hamo_ray.envs.webshop.server import StandinServer
from hamo_ray.types import TaskSpec


def test_split_react_forms() -> None:
    assert split_react("Thought: go there.\nAction: teleport to kitchen") == (
        "go there.",
        "teleport to kitchen",
    )
    assert split_react("Thought:\nI think so.\n\nAction:\nclick[buy now]\n") == (
        "I think so.",
        "click[buy now]",
    )
    assert split_react("look around") == ("", "look around")
    assert split_react("  open   door to   kitchen \n more") == ("", "open door to kitchen")
    assert split_react("Thought: nothing to do") == ("", "Thought: nothing to do")  # no Action: plain text


def test_agentgym_sciworld_ids_follow_its_server_list() -> None:
    table = agentgym_sciworld_items()
    # boil, melt, freeze, change-state (30 each), use-thermometer 540, measure-melting-point 436 + 300,
    # power-component 20 + 20, test-conductivity 900 + 600: find-living-thing (4-1) starts at 2936
    assert table[0] == ("boil", 0) and table[30] == ("melt", 0)
    assert table[2936] == ("find-living-thing", 0) and table[2936 + 7] == ("find-living-thing", 7)
    assert table[4136] == ("chemistry-mix", 0)  # 5-1/5-2 (grow-*) are not on AgentGym's list
    assert {t for t, _ in table}.isdisjoint({"grow-plant", "grow-fruit", "mendelian-genetics-known-plant"})


@pytest.fixture(scope="module")
def sw_episodes():
    domain = get_domain("scienceworld", EnvConfig())
    env = domain.make_env()
    try:
        tasks = [TaskSpec(domain="scienceworld", task="find-living-thing", variation=v) for v in (0, 1)]
        yield {t.variation: play(env, t) for t in tasks}, env
    finally:
        env.close()


def test_scienceworld_agentgym_and_eto_round_trip(sw_episodes, tmp_path: Path) -> None:
    episodes, env = sw_episodes
    goal, obs, actions, observations, score = episodes[0]
    assert score == 100.0
    others = [
        agentgym_item(i, "x", ["a"], ["b"]) for i in ("webshop_3", "babyai_5")
    ]  # a mixed AgentTraj file
    agentgym = write(
        tmp_path / "agentgym.json",
        [others[0], agentgym_item("sciworld_2936", f"{goal}\n{obs}", actions, observations), others[1]],
    )
    goal1, obs1, actions1, observations1, _ = episodes[1]
    # ETO: the first turn is the task only; the episode opens with the look around reset() does here
    eto_one = eto_item("12_1", goal1, ["look around", *actions1], [obs1, *observations1])
    eto_one["conversations"].pop()  # ETO's data may end with the last action
    eto = write(tmp_path / "eto.json", [eto_one])
    (a,) = load_expert_file(agentgym, "scienceworld", EnvConfig())
    (e,) = load_expert_file(eto, "scienceworld", EnvConfig())
    assert a.task == TaskSpec(domain="scienceworld", task="find-living-thing", variation=0, split="train")
    assert (a.goal, a.init_obs, a.actions, a.observations) == (goal, obs, actions, observations)
    assert a.thoughts == [f"step {k} of the plan." for k in range(len(actions))]
    assert (
        a.source == "expert" and a.score == 100.0 and a.id == "scienceworld/find-living-thing/train/0/expert"
    )
    assert e.task.variation == 1 and (e.goal, e.init_obs, e.actions) == (goal1, obs1, actions1)
    assert e.observations == [*observations1[:-1], ""]  # the missing last answer
    # the imported task is the one the episode was played on: its actions replay to the same score
    assert play(env, e.task, e.actions)[4] == 100.0


@pytest.fixture(scope="module")
def alfworld_game(tmp_path_factory):
    """One generated pick_and_place_simple train game: (generated cfg, its game file)."""
    root = tmp_path_factory.mktemp("alf")
    cfg = EnvConfig(domain="alfworld", alfworld={"games": "generated", "games_dir": str(root / "gen")})
    game = get_domain("alfworld", cfg).store.game_file("train", "pick_and_place_simple", 0)
    return cfg, game


def test_alfworld_eto_and_agentgym_round_trip(alfworld_game, tmp_path: Path) -> None:
    cfg, game = alfworld_game
    env = get_domain("alfworld", cfg).make_env()
    task = TaskSpec(domain="alfworld", task="pick_and_place_simple", variation=0)
    try:
        goal, room, actions, observations, score = play(env, task)
    finally:
        env.close()
    assert score == 100.0
    first = f"{room}\n\nYour task is to: {goal}"
    eto = write(
        tmp_path / "eto.json",
        [
            eto_item(
                0,
                first,
                actions,
                observations,
                game_file=f"/x/json_2.1.1/train/{game.parent.parent.name}/trial_hamo",
            )
        ],
    )
    (e,) = load_expert_file(eto, "alfworld", cfg)
    assert e.task == task and (e.goal, e.init_obs, e.actions, e.observations) == (
        goal,
        room,
        actions,
        observations,
    )

    # AgentGym ids name official folders: lay the game out under two official folders, the item's second
    n = next(i for i, line in enumerate(agentgym_alfworld_items()) if line.startswith("train/pick_and_place"))
    _, folder, trial = agentgym_alfworld_items()[n].split("/")
    official = tmp_path / "official"
    for f, t in (("pick_and_place_simple-AAA-None-Box-1", "trial_T0"), (folder, trial)):
        shutil.copytree(game.parent, official / "json_2.1.1" / "train" / f / t)
    ocfg = EnvConfig(domain="alfworld", alfworld={"data": str(official)})
    avail = "\nAVAILABLE ACTIONS: look,inventory,go to shelf 1"
    # the data's alfworld release wrote the put command as `put O in/on R`; this game's grammar: `move O to R`
    old_form = [re.sub(r"^move (.+?) to (.+)$", r"put \1 in/on \2", a) for a in actions]
    assert old_form != actions
    item = agentgym_item(f"alfworld_{n}", first + avail, old_form, [o + avail for o in observations])
    skipped = agentgym_item(
        "alfworld_2500", first, actions, observations
    )  # AgentGym's valid_train: no split here
    (g,) = load_expert_file(write(tmp_path / "agentgym.json", [item, skipped]), "alfworld", ocfg)
    assert g.task == TaskSpec(domain="alfworld", task="pick_and_place_simple", variation=1)
    assert (g.goal, g.init_obs, g.actions, g.observations) == (goal, room, actions, observations)
    env = get_domain("alfworld", ocfg).make_env()
    try:
        assert play(env, g.task, g.actions)[4] == 100.0
        assert env.game_file == official / "json_2.1.1" / "train" / folder / trial / "game.tw-pddl"
    finally:
        env.close()


@pytest.fixture()
def webshop_server():
    server = StandinServer(build_catalog(0, 1000))
    server.start()
    yield server
    server.stop()


def test_webshop_agentgym_and_eto_round_trip(webshop_server, tmp_path: Path) -> None:
    cfg = EnvConfig(domain="webshop", webshop={"backend": "http", "url": webshop_server.url})
    env = get_domain("webshop", cfg).make_env()
    try:
        episodes = {
            n: play(
                env,
                TaskSpec(domain="webshop", task="all", variation=n, split=split),
                webshop_server.expert_plan(n),
            )
            for n, split in ((1500, "train"), (1501, "train"), (3, "test"))
        }
        goal, page, actions, observations, score = episodes[1500]
        assert score == 100.0 and actions[-1] == "click[buy now]"
        items = [agentgym_item("webshop_1500", page, actions, observations)]
        g1, p1, a1, o1, _ = episodes[1501]
        items.append(eto_item("1501", f"Observation:\n{p1}", a1, o1, reward=0.75))
        g3, p3, a3, o3, _ = episodes[3]
        items.append(eto_item(3, p3, a3, o3))
        a, e, t = load_expert_file(write(tmp_path / "ws.json", items), "webshop", cfg)
        assert a.task == TaskSpec(domain="webshop", task="all", variation=1500, split="train")
        assert (a.goal, a.init_obs, a.actions, a.observations, a.score) == (
            goal,
            page,
            actions,
            observations,
            100.0,
        )
        assert (e.task.variation, e.goal, e.init_obs, e.score) == (1501, g1, p1, 75.0)
        assert t.task.split == "test" and t.goal == g3
        assert play(env, a.task, a.actions)[4] == 100.0  # the mapped goal is the one played
    finally:
        env.close()


def _sw_item(ident: str, **extra) -> dict:
    return eto_item(
        ident,
        "Your task is to find a living thing.",
        ["look around", "focus on egg"],
        ["room", "ok"],
        **extra,
    )


def test_bad_files_name_file_item_and_field(tmp_path: Path) -> None:
    env = EnvConfig()
    cases = [
        ([_sw_item("12_0"), {"id": "12_1"}], "item 1: field 'conversations'"),
        ([{"id": "12_0", "conversations": [{"from": "system", "value": "x"}]}], "item 0: field 'conversations[0].from'"),
        ([_sw_item("abc")], "item 0: field 'id'"),
        ([_sw_item("40_1")], "item 0: field 'id'"),
        ([_sw_item("12_9999")], "item 0: field 'id'"),
        ([_sw_item("12_0", reward=3)], "item 0: field 'reward'"),
        ([_sw_item("12_0", score="high")], "item 0: field 'score'"),
        ([eto_item("12_0", "Your task is to x.", [""], ["o"])], "item 0: field 'conversations[3].value'"),
        ([{"id": "12_0", "conversations": [{"from": "human", "value": "t"}, {"from": "human", "value": "u"}]}],
         "item 0: field 'conversations[1].from'"),
    ]  # fmt: skip
    for n, (items, expected) in enumerate(cases):
        path = write(tmp_path / f"bad{n}.json", items)
        with pytest.raises(ExpertDataError, match=str(path)) as err:
            load_expert_file(path, "scienceworld", env)
        assert expected in str(err.value), (expected, str(err.value))
    (tmp_path / "broken.json").write_text("[{")
    with pytest.raises(ExpertDataError, match="broken.json: not a JSON list"):
        load_expert_file(tmp_path / "broken.json", "scienceworld", env)
    with pytest.raises(ExpertDataError, match="missing.json: does not exist"):
        load_expert_file(tmp_path / "missing.json", "scienceworld", env)
    ws = write(
        tmp_path / "ws.json",
        [eto_item(1500, "WebShop [SEP] Instruction: [SEP] x [SEP] Search", ["a"], ["b"])],
    )
    with pytest.raises(ExpertDataError, match="env.webshop.backend"):
        load_expert_file(ws, "webshop", EnvConfig(domain="webshop"))
    with pytest.raises(ExpertDataError, match="item 0: field 'item_id'.*webshop_99999"):
        load_expert_file(write(tmp_path / "w2.json", [agentgym_item("webshop_99999", "p", ["a"], ["b"])]),
                         "webshop", EnvConfig(domain="webshop", webshop={"backend": "http", "url": "http://x"}))  # fmt: skip


def test_alfworld_unknown_game_and_missing_official_data_are_named(alfworld_game, tmp_path: Path) -> None:
    cfg, _ = alfworld_game
    first = "You are in the middle of a room.\n\nYour task is to: put a cd in box."
    path = write(
        tmp_path / "a.json",
        [
            eto_item(
                0,
                first,
                ["look"],
                ["x"],
                game_file="json_2.1.1/train/pick_and_place_simple-00199-Cd-None-Box-1/trial_T1",
            )
        ],
    )
    with pytest.raises(ExpertDataError, match="item 0: field 'game_file'.*no such game"):
        load_expert_file(path, "alfworld", cfg)
    with pytest.raises(ConfigError, match=f"env.alfworld.games=official.*{tmp_path / 'none'}"):
        load_expert_file(
            path, "alfworld", EnvConfig(domain="alfworld", alfworld={"data": str(tmp_path / "none")})
        )


def test_stage_experts_split_like_the_simulator_tasks(tmp_path: Path) -> None:
    items = [_sw_item(f"12_{v}") for v in range(6)]  # find-living-thing train 0-5
    items += [_sw_item(f"20_{v}") for v in range(3)]  # lifespan-longest-lived train 0-2
    items += [
        _sw_item("12_250"),
        _sw_item("12_6", score=0),
        _sw_item("14_0"),
        _sw_item("12_0"),
    ]  # test, failed, other type, dup
    path = write(tmp_path / "sw.json", items)
    base = [
        "env.expert_source=file",
        f"env.expert_files={{scienceworld: {path}}}",
        "env.task_types=[find-living-thing, lifespan-longest-lived]",
        "protocol.num_stages=2",
        "protocol.train_per_task=4",
    ]
    cfg = load_config(None, base)
    s1, s2 = stage_experts(cfg, 1), stage_experts(cfg, 2)
    assert [(t.task.task[:4], t.task.variation) for t in s1] == [
        ("find", 0),
        ("find", 2),
        ("life", 0),
        ("life", 2),
    ]
    assert [(t.task.task[:4], t.task.variation) for t in s2] == [("find", 1), ("find", 3), ("life", 1)]
    assert all(
        t.source == "expert" and t.init_obs == "room" and t.actions == ["focus on egg"] for t in s1 + s2
    )
    cross = load_config(
        None,
        [
            *base[:3],
            "protocol.kind=cross_domain",
            "protocol.order=[scienceworld]",
            "protocol.train_per_task=100",
        ],
    )
    assert (
        len(stage_experts(cross, 1)) == 9
    )  # 6 + 3: not the test item, the failed one, the dup or find-plant
    empty = load_config(None, [*base[:2], "env.task_types=[boil]"])
    with pytest.raises(ExpertDataError, match="stage 1: the expert file of scienceworld.*boil"):
        stage_experts(empty, 1)
    assert json.loads(path.read_text())[0]["id"] == "12_0"
