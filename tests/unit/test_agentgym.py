"""The AgentGym env-server client against loopback servers speaking AgentGym's protocol (real HTTP).

The servers (``hamo_ray.envs.agentgym.standin``) keep AgentGym's quirks: errors as HTTP 200
``{"error": ...}``, 422 for a missing field, 500 for a second sciworld close, textcraft's ``done`` not
kept after success; the sciworld one runs the real simulator.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

from hamo_ray.config import ConfigError, EnvConfig, load_config
from hamo_ray.envs import get_domain
from hamo_ray.envs.agentgym.client import AgentGymEnv, AgentGymError, EnvSlots, ServerClient
from hamo_ray.envs.agentgym.domains import (
    BABYAI_LEVELS,
    TEXTCRAFT_NUM_GOALS,
    babyai_item,
    babyai_task,
    textcraft_item,
    textcraft_task,
)
from hamo_ray.envs.agentgym.protocol import babyai_actions, server_spec, textcraft_first
from hamo_ray.envs.agentgym.standin import (
    AgentGymStandin,
    BabyAIBackend,
    SciWorldBackend,
    TextCraftBackend,
    agenttraj_items,
)
from hamo_ray.envs.expert_data import ExpertDataError, load_expert_file
from hamo_ray.envs.expert_ids import agentgym_sciworld_items
from hamo_ray.envs.sources import DataSourceError, check_data_sources
from hamo_ray.types import TaskSpec


@pytest.fixture(scope="module")
def textcraft():
    server = AgentGymStandin(TextCraftBackend())
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def babyai():
    server = AgentGymStandin(BabyAIBackend())
    server.start()
    yield server
    server.stop()


def _domain(name: str, url: str, **extra):
    return get_domain(name, EnvConfig(domain=name, **{name: {"url": url, **extra}}))


# --- the protocol's quirks, through the transport ------------------------------------------------------


def test_errors_answered_as_200_are_raised(textcraft) -> None:
    client = ServerClient(textcraft.url)
    try:
        with pytest.raises(AgentGymError, match="The id 999 is not valid"):
            client.call("POST", "/step", {"id": 999, "action": "inventory"})
        raw = httpx.post(textcraft.url + "/step", json={"id": 999, "action": "x"})
        assert raw.status_code == 200 and "error" in raw.json()  # the quirk the client must catch
    finally:
        client.close()


def test_missing_field_is_422_and_textcraft_create_needs_a_body(textcraft) -> None:
    client = ServerClient(textcraft.url)
    try:
        with pytest.raises(AgentGymError, match="HTTP 422"):
            client.call("POST", "/step", {"id": 0})
        with pytest.raises(AgentGymError, match="HTTP 422"):
            client.call("POST", "/create")  # no body: FastAPI's 422
        assert client.call("POST", "/create", {})["id"] >= 0
    finally:
        client.close()


def test_second_close_is_500_on_sciworld_and_the_env_closes_once(monkeypatch) -> None:
    backend = SciWorldBackend()
    server = AgentGymStandin(backend)
    server.start()
    try:
        env = _domain("scienceworld", server.url, backend="agentgym").make_env()
        env.close()
        env.close()  # idempotent: nothing sent the second time
        assert server.requests.count("/close") == 1 and server.open_ids == set()
        client = ServerClient(server.url)
        with pytest.raises(AgentGymError, match="HTTP 500"):
            client.call("POST", "/close", {"id": env.id})  # what a second close would have met
        client.close()
        assert EnvSlots.in_use(server.url) == 0
    finally:
        server.stop()


def test_textcraft_done_is_kept_after_success(textcraft) -> None:
    domain = _domain("textcraft", textcraft.url)
    task = domain.tasks("test", "depth-2", limit=1)[0]
    with domain.make_env() as env:
        goal, obs = env.reset(task)
        assert goal.startswith("craft ") and "Crafting commands:" in obs and "Goal:" not in obs
        for action in textcraft.expert_plan(domain.item_of(task)):
            result = env.step(action)
        assert result.done and result.score == 100.0 and result.reward == 100.0
        steps = textcraft.requests.count("/step")
        after = env.step("inventory")  # the server would answer done=false: kept here, not sent
        assert after.done and after.score == 100.0 and after.reward == 0.0
        assert textcraft.requests.count("/step") == steps
        # the raw server forgets done after success, which is why the client keeps it
        client = ServerClient(textcraft.url)
        assert client.call("POST", "/step", {"id": env.id, "action": "inventory"})["done"] is False
        client.close()
        # the same environment is reused for the next task (one /create)
        creates = textcraft.requests.count("/create")
        env.reset(domain.tasks("dev", "depth-1", limit=1)[0])
        assert textcraft.requests.count("/create") == creates


def test_babyai_scores_from_reward_and_lists_actions(babyai) -> None:
    domain = _domain("babyai", babyai.url)
    assert domain.lists_actions
    task = domain.tasks("test", "Pickup", limit=1)[0]
    with domain.make_env() as env:
        goal, obs = env.reset(task)
        assert goal.startswith("pick up the ") and "Your goal" not in obs
        valid = env.valid_actions()
        assert "check available actions" in valid and any(a.startswith("go to ") for a in valid)
        bad = env.step("fly away")
        assert not bad.done and bad.score == 0.0
        for action in babyai.expert_plan(domain.item_of(task)):
            result = env.step(action)
        # 3 steps of 64: 1 - 0.9 * 3 / 64, on 0-100
        assert result.done and result.score == pytest.approx(100 * (1 - 0.9 * 3 / 64), abs=0.01)
        with pytest.raises(AgentGymError, match="has finished"):
            ServerClient(babyai.url).call("POST", "/step", {"id": env.id, "action": "turn left"})


def test_reset_out_of_range_is_an_episode_error(babyai) -> None:
    env = AgentGymEnv(server_spec("babyai"), babyai.url, item_of=lambda t: -1, max_envs=4)
    try:
        with pytest.raises(AgentGymError, match="invalid data_idx"):
            env.reset(TaskSpec(domain="babyai", task="Pickup", variation=0, split="test"))
    finally:
        env.close()


def test_retries_only_connection_errors_then_raises() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    client = ServerClient(url, retries=2, backoff=0.05)
    start = time.monotonic()
    with pytest.raises(httpx.ConnectError):
        client.call("GET", "/")
    assert time.monotonic() - start >= 0.05 + 0.1  # two pauses, doubling
    # a server that comes up while the client retries is reached
    server = AgentGymStandin(TextCraftBackend(), port=port)
    timer = threading.Timer(0.4, server.start)
    timer.start()
    try:
        slow = ServerClient(url, retries=6, backoff=0.1)
        assert slow.call("GET", "/") == "This is environment TextCraft."
        slow.close()
    finally:
        timer.join()
        server.stop()
    client.close()


def test_bound_on_environments_per_server(textcraft) -> None:
    spec = server_spec("textcraft")
    kw = dict(item_of=textcraft_item, max_envs=2, setting="env.textcraft.url", slot_timeout=0.2)
    url = textcraft.url + "/"  # the same server under another spelling shares the bound
    first, second = AgentGymEnv(spec, textcraft.url, **kw), AgentGymEnv(spec, url, **kw)
    try:
        with pytest.raises(AgentGymError, match=r"env\.textcraft\.max_envs=2"):
            AgentGymEnv(spec, textcraft.url, **kw)
        first.close()
        third = AgentGymEnv(spec, textcraft.url, **kw)
        third.close()
    finally:
        first.close()
        second.close()
    assert EnvSlots.in_use(textcraft.url) == 0


# --- item tables and splits ----------------------------------------------------------------------------


def test_item_tables_round_trip_and_splits_are_disjoint() -> None:
    for n in range(TEXTCRAFT_NUM_GOALS):
        assert textcraft_item(textcraft_task(n)) == n
    assert textcraft_task(TEXTCRAFT_NUM_GOALS + 3) == textcraft_task(3)  # the server wraps
    for n in (0, 39, 40, 3999):
        assert babyai_item(babyai_task(n)) == n
    assert babyai_task(41) == TaskSpec(domain="babyai", task=BABYAI_LEVELS[1], variation=1, split="test")
    with pytest.raises(ValueError, match="seed 100"):
        babyai_task(4000)
    for name, url in (("textcraft", "http://x"), ("babyai", "http://x")):
        domain = _domain(name, url)
        for tt in domain.task_types():
            ids = [
                set(t.id.rsplit("/", 2)[0] + f"/{t.variation}" for t in domain.tasks(s, tt))
                for s in ("train", "dev", "test")
            ]
            assert all(ids) and not (ids[0] & ids[1] or ids[0] & ids[2] or ids[1] & ids[2])
    with pytest.raises(ValueError, match="lists no such item"):
        textcraft_item(TaskSpec(domain="textcraft", task="depth-4", variation=11))


def test_url_required_and_unknown_task_types_refused() -> None:
    with pytest.raises(ConfigError, match=r"env\.textcraft\.url"):
        get_domain("textcraft", EnvConfig(domain="textcraft"))
    with pytest.raises(ConfigError, match=r"env\.scienceworld\.url"):
        get_domain("scienceworld", EnvConfig(scienceworld={"backend": "agentgym"}))
    with pytest.raises(ConfigError, match="depth-9"):
        _domain("textcraft", "http://x").tasks("test", "depth-9")


def test_sciworld_tasks_the_server_does_not_list_are_refused_by_name() -> None:
    domain = _domain("scienceworld", "http://x", backend="agentgym")
    with pytest.raises(ConfigError, match="grow-plant"):
        domain.check_task_types(["boil", "grow-plant"])
    with pytest.raises(ConfigError, match="mendelian-genetics-known-plant"):
        domain.tasks("test", "mendelian-genetics-known-plant")
    get_domain("scienceworld", EnvConfig()).check_task_types(["grow-plant"])  # in-process: listed


def test_parsers() -> None:
    assert textcraft_first("Crafting commands:\ncraft 1 a using 1 b\n\nGoal: craft a.") == (
        "craft a.",
        "Crafting commands:\ncraft 1 a using 1 b",
    )
    assert babyai_actions('x\nAvailable actions: ["turn left", "go to red ball 1"]') == [
        "turn left",
        "go to red ball 1",
    ]
    assert babyai_actions("no list") is None


# --- ScienceWorld through the server (the real simulator behind it) ------------------------------------


def test_sciworld_through_the_server_matches_in_process() -> None:
    server = AgentGymStandin(SciWorldBackend())
    server.start()
    try:
        domain = _domain("scienceworld", server.url, backend="agentgym")
        task = domain.tasks("test", "find-living-thing", limit=1)[0]
        with domain.make_env() as env:
            goal, obs = env.reset(task)
            plan = env.expert_actions()  # the local simulator's gold path, no simplifications
            for action in plan:
                result = env.step(action)
                if result.done:
                    break
            assert result.done and result.score == 100.0
            loaded = json.loads(
                httpx.post(server.url + "/reset", json={"id": env.id, "data_idx": domain.item_of(task)}).text
            )
            assert (loaded["task_name"], loaded["var_num"]) == (task.task, task.variation)
            assert agentgym_sciworld_items()[domain.item_of(task)] == (task.task, task.variation)
        local = get_domain("scienceworld", EnvConfig(scienceworld={"simplifications": ""})).make_env()
        try:
            local_goal, local_obs = local.reset(task)
        finally:
            local.close()
        assert (goal, obs) == (local_goal, local_obs)  # the same texts; scores on the same 0-100
        assert server.open_ids == set()
    finally:
        server.stop()


# --- expert files and data-source checks ---------------------------------------------------------------


def test_agenttraj_files_of_textcraft_and_babyai_import(tmp_path, textcraft, babyai) -> None:
    for name, server in (("textcraft", textcraft), ("babyai", babyai)):
        items = agenttraj_items(server, name, [0, 5, 200, 440])
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(items))
        cfg = EnvConfig(domain=name, **{name: {"url": server.url}})
        trajs = load_expert_file(path, name, cfg)
        assert len(trajs) == 4 and all(t.score == 100.0 and t.actions and t.goal for t in trajs)
        domain = _domain(name, server.url)
        with domain.make_env() as env:  # the imported goal and observation are the env's own
            for t in trajs:
                assert env.reset(t.task) == (t.goal, t.init_obs)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"item_id": "textcraft_x", "conversations": []}]))
    with pytest.raises(ExpertDataError, match="item 0"):
        load_expert_file(bad, "textcraft", EnvConfig(domain="textcraft", textcraft={"url": "http://x"}))


def _cfg(name: str, url: str, *extra: str):
    return load_config(
        "jobs/configs/tiny.yaml",
        [f"env.domain={name}", f"env.task_types=[{'depth-1' if name == 'textcraft' else 'Pickup'}]",
         f"env.{name}.url={url}", *extra],
    )  # fmt: skip


def test_data_sources_name_the_server_the_bound_and_the_experts(tmp_path, textcraft, babyai) -> None:
    with pytest.raises(DataSourceError, match=r"env\.expert_source=simulator.*textcraft"):
        check_data_sources(_cfg("textcraft", textcraft.url))
    path = tmp_path / "tc.json"
    path.write_text(json.dumps(agenttraj_items(textcraft, "textcraft", [1, 2, 3])))
    files = ["env.expert_source=file", f"env.expert_files={{textcraft: {path}}}"]
    found = check_data_sources(_cfg("textcraft", textcraft.url, *files))
    assert found[0].setting == "env.textcraft.url" and "TextCraft" in found[0].detail
    with pytest.raises(DataSourceError, match="is not an AgentGym textcraft server"):
        check_data_sources(_cfg("textcraft", babyai.url, *files))
    with pytest.raises(DataSourceError, match=r"env\.textcraft\.max_envs=4: rollout\.num_workers"):
        check_data_sources(_cfg("textcraft", textcraft.url, *files, "env.textcraft.max_envs=4"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    with pytest.raises(DataSourceError, match="unreachable"):
        check_data_sources(_cfg("textcraft", dead, *files))
