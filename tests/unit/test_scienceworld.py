"""ScienceWorld domain: task list and splits (no JVM), and one real heap-capped simulator per module."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from hamo_ray.config import ConfigError, EnvConfig
from hamo_ray.envs import get_domain
from hamo_ray.envs.base import SPLITS, Env
from hamo_ray.envs.scienceworld import (
    INVALID_ACTION_OBSERVATION,
    ScienceWorldDomain,
    ScienceWorldEnv,
    query_splits,
    variation_splits,
)
from hamo_ray.types import TaskSpec

needs_java = pytest.mark.skipif(shutil.which("java") is None, reason="ScienceWorld needs a Java runtime")


@pytest.fixture(scope="module")
def domain() -> ScienceWorldDomain:
    return ScienceWorldDomain(EnvConfig())


@pytest.fixture(scope="module")
def env(domain: ScienceWorldDomain) -> Iterator[ScienceWorldEnv]:
    if shutil.which("java") is None:
        pytest.skip("ScienceWorld needs a Java runtime")
    env = domain.make_env()
    yield env
    env.close()


def _cmdline(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")


# -- task list and splits: no JVM ------------------------------------------------------------------


def test_registered_and_import_is_light() -> None:
    assert isinstance(get_domain("scienceworld", EnvConfig()), ScienceWorldDomain)
    code = "import sys, hamo_ray.envs.scienceworld; assert not {'scienceworld', 'py4j'} & set(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_task_types(domain: ScienceWorldDomain) -> None:
    names = domain.task_types()
    assert len(names) == len(set(names)) == 30
    assert {"find-living-thing", "lifespan-longest-lived", "mendelian-genetics-unknown-plant"} <= set(names)


def test_splits_are_disjoint_and_cover_every_variation(domain: ScienceWorldDomain) -> None:
    totals = dict.fromkeys(SPLITS, 0)
    for task_type in domain.task_types():
        splits = {s: [t.variation for t in domain.tasks(s, task_type)] for s in SPLITS}
        assert all(splits.values()), task_type
        assert sorted(sum(splits.values(), [])) == list(range(sum(map(len, splits.values()))))
        for s in SPLITS:
            totals[s] += len(splits[s])
    assert totals == {"train": 3592, "dev": 1796, "test": 1819}


def test_tasks_limit_and_fields(domain: ScienceWorldDomain) -> None:
    tasks = domain.tasks("test", "lifespan-longest-lived", limit=2)
    assert tasks == [
        TaskSpec(domain="scienceworld", task="lifespan-longest-lived", variation=v, split="test")
        for v in (93, 94)
    ]


def test_unknown_split_or_task_type(domain: ScienceWorldDomain) -> None:
    with pytest.raises(ConfigError, match="'validation'"):
        domain.tasks("validation", "find-plant")
    with pytest.raises(ConfigError, match="'find-unicorn'.*find-plant"):
        domain.tasks("train", "find-unicorn")
    with pytest.raises(ConfigError, match="find-unicorn"):
        domain.check_task_types(["find-plant", "find-unicorn"])


def test_bad_heap_is_rejected_before_starting_java() -> None:
    with pytest.raises(ConfigError, match="jvm_heap"):
        ScienceWorldEnv(EnvConfig(scienceworld={"jvm_heap": "lots"}))


# -- one real simulator ----------------------------------------------------------------------------


def test_jvm_heap_is_capped(env: ScienceWorldEnv) -> None:
    assert isinstance(env, Env)
    assert "-Xmx512m" in _cmdline(env.pid)


def test_split_table_matches_the_jvm(env: ScienceWorldEnv) -> None:
    for task_type, splits in query_splits(env._sw).items():
        assert {s: list(v) for s, v in variation_splits(task_type).items()} == {
            s: list(v) for s, v in splits.items()
        }


@pytest.mark.parametrize(
    ("task_type", "index"), [("lifespan-longest-lived", 0), ("find-non-living-thing", 1)]
)
def test_expert_reaches_100(
    env: ScienceWorldEnv, domain: ScienceWorldDomain, task_type: str, index: int
) -> None:
    task = domain.tasks("train", task_type)[index]
    goal, obs = env.reset(task)
    start = env.score  # the look-around at reset may already earn partial credit
    assert goal.startswith("Your task is to") and obs.startswith("This room is called the")
    gold = env.expert_actions()
    assert 0 < len(gold) <= 10
    results = [env.step(action) for action in gold]  # gold paths may run on after done (e.g. "wait1")
    assert results[-1].done and results[-1].score == 100.0
    assert sum(r.reward for r in results) == 100.0 - start


@pytest.mark.parametrize("action", ["", "   ", "asdkjh qwe zzz", "x" * 100_000, "\x00\n\t", "focus on ☃"])
def test_malformed_action_gets_invalid_observation(
    env: ScienceWorldEnv, domain: ScienceWorldDomain, action: str
) -> None:
    env.reset(domain.tasks("dev", "find-animal", limit=1)[0])
    before = env.score
    result = env.step(action)
    assert result.observation == INVALID_ACTION_OBSERVATION
    assert (result.reward, result.done, result.score) == (0.0, False, before)


def test_failure_is_done_with_score_zero(env: ScienceWorldEnv, domain: ScienceWorldDomain) -> None:
    env.reset(domain.tasks("train", "find-living-thing", limit=1)[0])
    assert env.step("go to kitchen").score > 0
    failed = env.step("focus on fridge")  # the simulator scores a wrong focus -100
    assert failed.done and failed.score == 0.0 and failed.reward < 0
    after = env.step("look around")
    assert (after.done, after.score, after.reward) == (True, 0.0, 0.0)
    assert "kitchen" in after.observation


def test_java_exception_in_step_is_an_invalid_action(
    env: ScienceWorldEnv, domain: ScienceWorldDomain, monkeypatch: pytest.MonkeyPatch
) -> None:
    from py4j.protocol import Py4JJavaError

    env.reset(domain.tasks("train", "find-plant", limit=1)[0])
    jvm = env._sw._gateway.jvm

    class Throwing:
        def __init__(self, step):
            self.step = step

    monkeypatch.setattr(env, "_server", Throwing(lambda action: jvm.java.lang.Integer.parseInt(action)))
    assert env._raw_step("not a number") == INVALID_ACTION_OBSERVATION
    monkeypatch.setattr(env, "_server", Throwing(lambda action: getattr(jvm.scala.Predef, "assert")(False)))
    with pytest.raises(Py4JJavaError):  # a java.lang.Error is the JVM's problem, not the action's
        env._raw_step("look around")


def test_valid_actions_and_reuse(env: ScienceWorldEnv, domain: ScienceWorldDomain) -> None:
    first = domain.tasks("test", "lifespan-shortest-lived", limit=1)[0]
    goal, _ = env.reset(first)
    assert "shortest life span" in goal
    assert "look around" in env.valid_actions()
    goal, _ = env.reset(domain.tasks("test", "find-plant", limit=1)[0])
    assert "find a(n) plant" in goal and env.task is not None and env.task.task == "find-plant"
    with pytest.raises(ValueError, match="variation 300"):
        env.reset(TaskSpec(domain="scienceworld", task="find-plant", variation=300))


@needs_java
def test_close_ends_the_jvm_and_unknown_simplification() -> None:
    env = ScienceWorldEnv(EnvConfig(scienceworld={"jvm_heap": "256m"}))
    proc = env._sw.java_process
    assert "-Xmx256m" in _cmdline(env.pid)
    with pytest.raises(RuntimeError, match="reset"):
        env.step("look around")
    env.close()
    assert proc.poll() is not None
    env.close()  # idempotent
    with pytest.raises(ConfigError, match="'noGravity'"):
        ScienceWorldEnv(EnvConfig(scienceworld={"simplifications": "easy,noGravity"}))
