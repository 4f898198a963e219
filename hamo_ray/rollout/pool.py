"""``EnvPool``: many ``EnvWorker`` actors, each running several episodes at once.

Driver-side usage (the stream is the only caller)::

    pool = EnvPool("scienceworld", cfg.env, cfg.prompt, cfg.rollout)
    expert = pool.run(tasks)                       # gold actions
    evals = pool.run(tasks, PolicySpec(url, "stage-1", harness_url=...))
    pool.shutdown()

Every task asked for gets exactly one trajectory, in the order asked (a failed episode carries its
``error``).

Faults: an actor that dies (killed, out of memory, its node lost) is restarted by Ray up to
``rollout.max_actor_restarts`` times (``max_restarts``), and the episodes it held are played again on
a live actor; one whose restarts are spent stays dead and the pool works on without it. No wait is
unbounded: while episodes run, the pool pings the actors that hold them, and an actor that has
answered before but leaves a ping unanswered for ``rollout.step_timeout_s`` (its event loop or its
process is wedged) is killed, so Ray restarts it and its episodes are replayed.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from hamo_ray.config import EnvConfig, PromptConfig, RolloutConfig
from hamo_ray.rollout.client import PolicySpec
from hamo_ray.types import TaskSpec, Trajectory

if TYPE_CHECKING:
    from hamo_ray.envs.base import Domain

logger = logging.getLogger(__name__)


class EnvPool:
    def __init__(
        self, domain: str | Domain, env_cfg: EnvConfig, prompt_cfg: PromptConfig, rollout_cfg: RolloutConfig
    ) -> None:
        """``domain``: a registered domain's name, or a ``Domain`` instance the actors get pickled."""
        import ray

        from hamo_ray.rollout.worker import EnvWorker

        self.domain = domain if isinstance(domain, str) else domain.name
        self.cfg = rollout_cfg
        actor_cls = ray.remote(EnvWorker).options(
            num_cpus=rollout_cfg.cpus_per_worker,
            resources=dict(rollout_cfg.resources),
            scheduling_strategy=rollout_cfg.scheduling,
            max_restarts=rollout_cfg.max_actor_restarts,  # Ray replaces a dead actor this many times
        )
        self.workers = [
            actor_cls.remote(
                domain, env_cfg, prompt_cfg, rollout_cfg.envs_per_worker, rollout_cfg.step_timeout_s
            )
            for _ in range(rollout_cfg.num_workers)
        ]
        self.dead: set[int] = set()  # indices of actors whose restarts are spent (gone for good)
        self._heard: set[int] = set()  # actors that answered a ping since their latest (re)start
        self._pings: dict[int, tuple] = {}  # actor index -> (ping ref, monotonic time sent)

    def _submit_chunk(
        self, n: int, tasks: list[TaskSpec], policy: PolicySpec | None, slot: int | None = None
    ):
        """Send a chunk to actor ``slot``, by default the ``n``-th live one (round robin); returns
        (ref, actor index), or None when every actor is dead."""
        if slot is None:
            live = [i for i in range(len(self.workers)) if i not in self.dead]
            if not live:
                return None
            slot = live[n % len(live)]
        return self.workers[slot].run.remote(tasks, policy, self.cfg.max_attempts), slot

    def _live_actor(self, start: int) -> int | None:
        """The first actor from ``start`` on (round robin) that answers a ping, waiting for restarting
        ones (up to ``max(60 s, rollout.step_timeout_s)``); None when every actor is dead."""
        import ray
        from ray.exceptions import ActorDiedError, ActorUnavailableError, GetTimeoutError

        n = len(self.workers)
        deadline = time.monotonic() + max(60.0, self.cfg.step_timeout_s)
        while True:
            waiting = False
            for slot in ((start + k) % n for k in range(n)):
                if slot in self.dead:
                    continue
                try:
                    ray.get(self.workers[slot].ping.remote(), timeout=5)
                    return slot
                except ActorDiedError as exc:
                    self._mark_dead(slot, exc)
                except (ActorUnavailableError, GetTimeoutError):  # restarting, or not started yet
                    waiting = True
            if not waiting or time.monotonic() > deadline:
                return None
            time.sleep(1.0)

    def _probe(self, slot: int) -> None:
        """Ping actor ``slot`` once; mark it dead if Ray says it is (restarts spent)."""
        import ray
        from ray.exceptions import ActorDiedError

        try:
            ray.get(self.workers[slot].ping.remote(), timeout=5)
        except ActorDiedError as exc:
            self._mark_dead(slot, exc)
        except Exception:  # restarting, or slow to answer: it is not known to be dead
            pass

    def _mark_dead(self, slot: int, exc: BaseException) -> None:
        if slot not in self.dead:
            self.dead.add(slot)
            logger.error(
                "rollout actor %d is dead for good (rollout.max_actor_restarts=%d spent): %s; %d of %d left",
                slot, self.cfg.max_actor_restarts, _first_line(exc),
                len(self.workers) - len(self.dead), len(self.workers),
            )  # fmt: skip

    def _watch(self, busy: set[int]) -> None:
        """Ping the actors holding episodes; kill one that answered before but now leaves a ping
        unanswered for ``rollout.step_timeout_s`` (Ray restarts it; its episodes fail over)."""
        import ray
        from ray.exceptions import ActorDiedError, RayActorError

        now = time.monotonic()
        for slot in busy - self.dead:
            if slot in self._pings:
                ref, sent = self._pings[slot]
                if ray.wait([ref], timeout=0)[0]:
                    del self._pings[slot]
                    try:
                        ray.get(ref)
                        self._heard.add(slot)
                    except ActorDiedError as exc:
                        self._mark_dead(slot, exc)
                    except RayActorError:  # restarting: its episodes fail over when it is lost
                        self._heard.discard(slot)
                elif slot in self._heard and now - sent > self.cfg.step_timeout_s:
                    del self._pings[slot]
                    self._heard.discard(slot)
                    logger.error(
                        "rollout actor %d left a ping unanswered for %.0fs (rollout.step_timeout_s): killing it",
                        slot, now - sent,
                    )  # fmt: skip
                    ray.kill(self.workers[slot], no_restart=False)  # Ray restarts it if restarts are left
                    continue
                else:
                    continue  # not answered yet
            self._pings[slot] = (self.workers[slot].ping.remote(), now)

    def run(
        self, tasks: list[TaskSpec], policy: PolicySpec | None = None, desc: str = "episodes"
    ) -> list[Trajectory]:
        """Run one episode per task and return the trajectories in task order, showing progress.

        On a terminal a bar shows episodes done, rate, ETA and the running mean score; elsewhere one
        line per finished chunk is logged. Either way a closing line gives the count, time and mean.

        A chunk whose actor died is played again from the start on another actor (a restarted one
        included), up to ``rollout.max_actor_restarts`` times; then its episodes are recorded as
        failed with the error. Every task gets exactly one trajectory.
        """
        import ray

        from hamo_ray.logs import progress_bar

        start = time.time()
        bar = progress_bar(len(tasks), desc, unit="ep")
        score_sum, scored = 0.0, 0  # over the episodes that ran to the end (a failed one has no score)
        chunk = self.cfg.envs_per_worker
        kind = "policy" if policy else "expert"
        results: list[Trajectory | None] = [None] * len(tasks)
        where: dict = {}  # ref -> (task indices, actor index, replays so far)
        lost: list[tuple[list[int], str]] = []  # chunks no actor could take: (task indices, error)
        for n, first in enumerate(range(0, len(tasks), chunk)):
            idx = list(range(first, min(first + chunk, len(tasks))))
            sent = self._submit_chunk(n, [tasks[i] for i in idx], policy)
            if sent is None:
                lost.append((idx, "every rollout actor is dead (rollout.max_actor_restarts spent)"))
            else:
                where[sent[0]] = (idx, sent[1], 0)
        pending, done_n = list(where), 0
        poll = min(5.0, self.cfg.step_timeout_s / 4)
        while pending or lost:
            ready = []
            if pending:  # bounded: between waits the actors holding episodes are pinged (_watch)
                ready, pending = ray.wait(pending, num_returns=1, timeout=poll)
                self._watch({where[ref][1] for ref in pending})
            finished = []
            for ref in ready:
                idx, slot, tries = where.pop(ref)
                try:
                    finished.append((idx, ray.get(ref)))
                except Exception as exc:  # the actor died (killed, out of memory, node lost, wedged)
                    error = _first_line(exc)
                    if tries >= self.cfg.max_actor_restarts:
                        lost.append((idx, error))
                        continue
                    self._probe(slot)  # gone for good? then no chunk is sent to it again
                    target = self._live_actor(slot + 1)  # another actor first; a restarted one will do
                    sent = None
                    if target is not None:
                        sent = self._submit_chunk(0, [tasks[i] for i in idx], policy, slot=target)
                    if sent is None:
                        lost.append((idx, f"{error}; no rollout actor left to replay them"))
                        continue
                    logger.warning(
                        "%s: actor %d lost %d episodes (%s); replaying them on actor %d",
                        desc, slot, len(idx), error, sent[1],
                    )  # fmt: skip
                    where[sent[0]] = (idx, sent[1], tries + 1)
                    pending.append(sent[0])
            for idx, error in lost:
                logger.error("%s: %d episodes lost with their actor: %s", desc, len(idx), error)
                trajs = [
                    Trajectory(task=tasks[i], goal="", init_obs="", source=kind, error=error) for i in idx
                ]
                finished.append((idx, trajs))
            lost = []
            for idx, trajs in finished:
                for i, traj in zip(idx, trajs, strict=True):
                    results[i] = traj
                    done_n += 1
                    if traj.error is None:
                        score_sum, scored = score_sum + traj.score, scored + 1
                bar.update(len(idx))
                bar.set_postfix(score=f"{score_sum / max(1, scored):.1f}", refresh=False)
            if bar.disable and finished:
                logger.info("%s: %d/%d done (%.0fs)", desc, done_n, len(tasks), time.time() - start)
        bar.close()
        failed = sum(1 for r in results if r is not None and r.error)
        logger.info(
            "%s: %d episodes in %.0fs, mean score %.2f%s",
            desc,
            done_n,
            time.time() - start,
            score_sum / max(1, scored),
            f" over the {scored} that ran to the end, {failed} failed" if failed else "",
        )
        missing = [tasks[i].id for i, r in enumerate(results) if r is None]
        if missing:
            raise RuntimeError(f"{desc}: no trajectory for {missing}")
        return [r for r in results if r is not None]

    def alive(self) -> list[int]:
        """Indices of the actors that answer a ping now (a restarting one is waited for)."""
        return [s for s in range(len(self.workers)) if s not in self.dead and self._live_actor(s) == s]

    def shutdown(self) -> None:
        import ray

        for w in self.workers:
            try:
                ray.get(w.close.remote(), timeout=30)
            except Exception:
                logger.debug("worker close failed", exc_info=True)
            ray.kill(w)
        self.workers = []


def _first_line(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"
