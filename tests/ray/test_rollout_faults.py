"""Fault injection: a killed environment process, a wedged environment, a rollout actor killed again and
again or wedged as a whole lose no episode and stall nothing; the serve job's follow loop outlives a
dropped connection.

The wedge and kill tests run a fake domain (``_FakeDomain``, given to the pool as an instance: this
module is pickled by value into the actors) whose episodes take a known time and whose wedged step
never returns; marker files in ``tmp_path`` say which process ran what and which environments were closed.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from hamo_ray.config import EnvConfig, PromptConfig, RolloutConfig
from hamo_ray.envs import Domain, StepResult, get_domain
from hamo_ray.types import TaskSpec

ROOT = Path(__file__).resolve().parents[2]


def _java_pids() -> list[int]:
    pids = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                cmd = open(f"/proc/{d}/cmdline", "rb").read().split(b"\0")
            except OSError:
                continue
            if cmd and cmd[0].endswith(b"java") and any(b"scienceworld" in c for c in cmd):
                pids.append(int(d))
    return pids


def test_killed_env_and_actor_every_task_has_one_trajectory(ray_session):
    import ray

    from hamo_ray.rollout.pool import EnvPool

    env_cfg = EnvConfig(max_turns=60)
    tasks = get_domain("scienceworld", env_cfg).tasks("train", "boil", limit=6)
    before = set(_java_pids())
    pool = EnvPool(
        "scienceworld",
        env_cfg,
        PromptConfig(),
        RolloutConfig(num_workers=2, envs_per_worker=2, max_attempts=3, max_actor_restarts=2),
    )
    killed: dict[str, object] = {}

    def inject() -> None:
        deadline = time.time() + 120
        while time.time() < deadline:
            fresh = [p for p in _java_pids() if p not in before]
            if len(fresh) >= 2:
                time.sleep(1.0)  # let episodes get going
                os.kill(fresh[0], signal.SIGKILL)  # an environment process dies mid-episode
                killed["jvm"] = fresh[0]
                ray.kill(pool.workers[1], no_restart=False)  # an actor dies mid-rollout; Ray restarts it
                killed["actor"] = True
                return
            time.sleep(0.2)

    thread = threading.Thread(target=inject, daemon=True)
    thread.start()
    try:
        trajs = pool.run(tasks, None, desc="fault injection")
    finally:
        thread.join(timeout=5)
        pool.shutdown()
    assert killed.get("jvm") and killed.get("actor"), "the faults were not injected"
    assert [t.task.id for t in trajs] == [t.id for t in tasks]  # exactly one trajectory per task, in order
    replayed = [t for t in trajs if t.error is None]
    assert all(t.score == 100.0 and t.done for t in replayed), [(t.task.id, t.score, t.error) for t in trajs]
    assert len(replayed) == len(tasks), [t.error for t in trajs if t.error]


# --- a fake domain: known episode lengths, a step that never returns, markers of what ran where ---


class _FakeEnv:
    def __init__(self, marks: str, serial: int, step_s: float) -> None:
        self.marks, self.serial, self.step_s = Path(marks), serial, step_s
        self.task: TaskSpec | None = None
        self.turn = 0

    def reset(self, task: TaskSpec) -> tuple[str, str]:
        self.task, self.turn = task, 0
        (self.marks / f"start-{os.getpid()}-{task.variation}-env{self.serial}").touch()
        return f"goal {task.task} {task.variation}", f"env {self.serial}"

    def expert_actions(self) -> list[str]:
        return ["go"] * 3

    def step(self, action: str) -> StepResult:
        if self.task is not None and self.task.task == "wedge":
            time.sleep(3600)  # a wedged simulator: never returns, and closing the env does not free it
        time.sleep(self.step_s)
        self.turn += 1
        done = self.turn >= 3
        return StepResult(f"env {self.serial} pid {os.getpid()}", 0.0, done, 100.0 if done else 0.0)

    def valid_actions(self) -> list[str] | None:
        return None

    def close(self) -> None:
        (self.marks / f"closed-{os.getpid()}-env{self.serial}").touch()


class _FakeDomain(Domain):
    name = "fake"
    thread_safe = False  # one environment thread per actor: a wedged call would hold up every episode

    def __init__(self, marks: Path, step_s: float) -> None:
        super().__init__(EnvConfig())
        self.marks, self.step_s, self.made = str(marks), step_s, 0

    def task_types(self) -> list[str]:
        return ["ok", "wedge"]

    def tasks(self, split: str, task_type: str, limit: int | None = None) -> list[TaskSpec]:
        return [TaskSpec(domain="fake", task=task_type, variation=v, split=split) for v in range(limit or 4)]

    def make_env(self) -> _FakeEnv:
        self.made += 1
        return _FakeEnv(self.marks, self.made, self.step_s)


def _task(kind: str, variation: int) -> TaskSpec:
    return TaskSpec(domain="fake", task=kind, variation=variation)


def _fake_pool(tmp_path: Path, step_s: float, **rollout):
    import ray

    from hamo_ray.rollout.pool import EnvPool

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the actors cannot import this file
    return EnvPool(
        _FakeDomain(tmp_path, step_s), EnvConfig(max_turns=10), PromptConfig(), RolloutConfig(**rollout)
    )


def _pid(traj) -> int:
    return int(traj.observations[-1].rsplit(" ", 1)[1])


def _when_started(tmp_path: Path, pid: int, action, delay: float = 0.0) -> threading.Thread:
    """Run ``action`` once an episode has started in process ``pid`` (after ``delay`` s), in a thread."""

    def watch() -> None:
        deadline = time.time() + 120
        while time.time() < deadline:
            if any(tmp_path.glob(f"start-{pid}-*")):
                time.sleep(delay)
                action()
                return
            time.sleep(0.05)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


@pytest.mark.timeout(300)
def test_a_wedged_environment_fails_its_episode_and_the_next_runs_on_a_fresh_one(ray_session, tmp_path):
    import ray

    pool = _fake_pool(
        tmp_path,
        0.05,
        num_workers=1,
        envs_per_worker=1,
        max_attempts=2,
        max_actor_restarts=0,
        step_timeout_s=3,
    )
    try:  # one actor, one environment slot; one episode per run, so they run in this order
        started = time.monotonic()
        first, wedged, after = (
            pool.run([_task(kind, v)], None, desc=kind)[0] for v, kind in enumerate(["ok", "wedge", "ok"])
        )
        took = time.monotonic() - started
        stats = ray.get(pool.workers[0].stats.remote(), timeout=30)
        closed = {p.name for p in tmp_path.glob("closed-*")}  # before shutdown closes the idle env 3
    finally:
        pool.shutdown()
    assert first.error is None and first.score == 100.0 and first.observations[0].startswith("env 1 ")
    # Failed with the timeout named, after both attempts (each on a fresh environment), not scored.
    assert wedged.error and wedged.error.startswith("EnvTimeoutError: step('go')"), wedged.error
    assert "rollout.step_timeout_s=3s" in wedged.error and not wedged.done and not wedged.actions
    # The wedged environments (1, then the retry's 2) were closed; the next episode made a fresh one (3)
    # and ran, although the actor's one environment thread is still stuck in the first wedged step.
    pid = _pid(first)
    assert closed == {f"closed-{pid}-env1", f"closed-{pid}-env2"}
    assert after.error is None and after.score == 100.0 and after.observations[0].startswith("env 3 ")
    assert stats["timeouts"] == 2 and stats["made"] == 3, stats
    assert took < 60, took  # two 3 s timeouts and a few short episodes, not forever


@pytest.mark.timeout(600)
def test_a_rollout_actor_killed_again_and_again_is_replaced_up_to_the_limit(ray_session, tmp_path):
    import ray

    pool = _fake_pool(
        tmp_path,
        0.4,
        num_workers=2,
        envs_per_worker=2,
        max_attempts=1,
        max_actor_restarts=2,
        step_timeout_s=60,
    )
    tasks = [_task("ok", v) for v in range(8)]  # 4 chunks of 2 episodes, 2 per actor; ~1.2 s per episode
    try:
        for kill in (1, 2, 3):
            victim = ray.get(pool.workers[0].ping.remote(), timeout=120)
            other = ray.get(pool.workers[1].ping.remote(), timeout=120)
            thread = _when_started(tmp_path, victim, lambda: ray.kill(pool.workers[0], no_restart=False))
            trajs = pool.run(tasks, None, desc=f"kill {kill}")
            thread.join(timeout=5)
            assert any(tmp_path.glob(f"start-{victim}-*")), "actor 0 ran nothing before it was killed"
            # Every episode ran to the end, none on the killed process: its episodes were replayed.
            assert [t.task.id for t in trajs] == [t.id for t in tasks]
            assert all(t.error is None and t.score == 100.0 for t in trajs), [t.error for t in trajs]
            assert victim not in {_pid(t) for t in trajs} and other in {_pid(t) for t in trajs}
            if kill < 3:  # replaced: a new process answers in its place
                assert pool.alive() == [0, 1] and not pool.dead
                assert ray.get(pool.workers[0].ping.remote(), timeout=60) != victim
            else:  # rollout.max_actor_restarts=2 spent: gone for good, the pool goes on without it
                assert pool.alive() == [1] and pool.dead == {0}
        trajs = pool.run(tasks, None, desc="one actor left")
        assert all(t.error is None for t in trajs) and {_pid(t) for t in trajs} == {other}
    finally:
        pool.shutdown()


@pytest.mark.timeout(300)
def test_a_wedged_actor_is_killed_and_its_episodes_replayed(ray_session, tmp_path):
    """A rollout actor whose process stops answering (SIGSTOP) holds nothing up past the step timeout."""
    import ray

    pool = _fake_pool(
        tmp_path,
        0.5,
        num_workers=2,
        envs_per_worker=2,
        max_attempts=1,
        max_actor_restarts=1,
        step_timeout_s=4,
    )
    tasks = [_task("ok", v) for v in range(8)]
    victim = ray.get(pool.workers[0].ping.remote(), timeout=120)
    stopped: list[int] = []

    def stop() -> None:  # after the pool has heard from it once, the actor's process freezes
        os.kill(victim, signal.SIGSTOP)
        stopped.append(victim)

    thread = _when_started(tmp_path, victim, stop, delay=1.5)
    try:
        started = time.monotonic()
        trajs = pool.run(tasks, None, desc="wedged actor")
        took = time.monotonic() - started
        thread.join(timeout=5)
        assert stopped, "the actor was not stopped"
        assert [t.task.id for t in trajs] == [t.id for t in tasks]
        assert all(t.error is None and t.score == 100.0 for t in trajs), [t.error for t in trajs]
        assert victim not in {_pid(t) for t in trajs}
        assert took < 120, took
        assert ray.get(pool.workers[0].ping.remote(), timeout=60) != victim  # killed and restarted
    finally:
        if stopped:
            try:
                os.kill(victim, signal.SIGCONT)  # if it is still there, let it be reaped
            except ProcessLookupError:
                pass
        pool.shutdown()


# --- jobs/serve.py: the follow loop outlives a replica being replaced ---


def _serve_job():
    spec = importlib.util.spec_from_file_location("hamo_serve_job", ROOT / "jobs" / "serve.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_serve_follow_loop_survives_a_dropped_connection(monkeypatch, caplog):
    import httpx

    job = _serve_job()
    stop = threading.Event()
    health = iter([httpx.ConnectError("connection refused")])  # the replica is being replaced ...

    def get(url, **kwargs):
        assert url == "http://127.0.0.1:1/health"
        err = next(health, None)
        if err is not None:
            raise err
        return httpx.Response(200, json={})

    class Services:  # stand-in for hamo_ray.run.services.Services
        class endpoint:
            base_url, api_key = "http://127.0.0.1:1", None

        calls = 0

        def publish_committed(self, strict: bool = True) -> list[str]:
            assert strict is False
            Services.calls += 1
            if Services.calls == 1:  # ... and the first round after it drops the connection
                raise httpx.ConnectError("[Errno 111] Connection refused")
            return ["stage-2"] if Services.calls == 2 else []

    announced: list[str] = []

    def announce(name: str) -> None:
        announced.append(name)
        stop.set()

    monkeypatch.setattr(httpx, "get", get)
    caplog.set_level(logging.WARNING, logger="hamo_ray.serve")
    loop = threading.Thread(target=job.follow, args=(Services(), stop, 0.01, announce, 0.05), daemon=True)
    loop.start()
    loop.join(timeout=30)
    assert not loop.is_alive() and announced == ["stage-2"]
    warnings = [r.getMessage() for r in caplog.records if r.name == "hamo_ray.serve"]
    assert len(warnings) == 2 and all("ConnectError" in w and "trying again" in w for w in warnings), warnings
