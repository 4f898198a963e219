"""Fault injection: a killed environment process and a killed rollout actor lose no episode."""

from __future__ import annotations

import os
import signal
import threading
import time

from hamo_ray.config import EnvConfig, PromptConfig, RolloutConfig
from hamo_ray.envs import get_domain


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
