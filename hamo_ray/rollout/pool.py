"""``EnvPool``: many ``EnvWorker`` actors, each running several episodes at once.

Driver-side usage (the stream is the only caller)::

    pool = EnvPool("scienceworld", cfg.env, cfg.prompt, cfg.rollout)
    expert = pool.run(tasks)                       # gold actions
    evals = pool.run(tasks, PolicySpec(url, "stage-1", harness_url=...))
    pool.shutdown()

Every task asked for gets exactly one trajectory, in the order asked (a failed episode carries its
``error``).
"""

from __future__ import annotations

import logging
import time

from hamo_ray.config import EnvConfig, PromptConfig, RolloutConfig
from hamo_ray.rollout.client import PolicySpec
from hamo_ray.types import TaskSpec, Trajectory

logger = logging.getLogger(__name__)


class EnvPool:
    def __init__(
        self, domain: str, env_cfg: EnvConfig, prompt_cfg: PromptConfig, rollout_cfg: RolloutConfig
    ) -> None:
        import ray

        from hamo_ray.rollout.worker import EnvWorker

        self.domain = domain
        self.cfg = rollout_cfg
        actor_cls = ray.remote(EnvWorker).options(
            num_cpus=rollout_cfg.cpus_per_worker,
            resources=dict(rollout_cfg.resources),
            scheduling_strategy=rollout_cfg.scheduling,
            max_restarts=1,
        )
        self.workers = [
            actor_cls.remote(domain, env_cfg, prompt_cfg, rollout_cfg.envs_per_worker)
            for _ in range(rollout_cfg.num_workers)
        ]

    def submit(self, tasks: list[TaskSpec], policy: PolicySpec | None = None, chunk: int | None = None):
        """Start the episodes; returns ``(object refs, task index lists)`` (one ref per chunk of tasks)."""
        chunk = chunk or self.cfg.envs_per_worker
        refs, index_lists = [], []
        for n, start in enumerate(range(0, len(tasks), chunk)):
            idx = list(range(start, min(start + chunk, len(tasks))))
            refs.append(self._submit_chunk(n, [tasks[i] for i in idx], policy))
            index_lists.append(idx)
        return refs, index_lists

    def _submit_chunk(self, n: int, tasks: list[TaskSpec], policy: PolicySpec | None):
        worker = self.workers[n % len(self.workers)]
        return worker.run.remote(tasks, policy, self.cfg.max_attempts)

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
        score_sum = 0.0
        refs, index_lists = self.submit(tasks, policy)
        where = {ref: (idx, n, 0) for n, (ref, idx) in enumerate(zip(refs, index_lists, strict=True))}
        results: list[Trajectory | None] = [None] * len(tasks)
        pending, done_n = list(refs), 0
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            for ref in ready:
                idx, n, tries = where.pop(ref)
                try:
                    trajs = ray.get(ref)
                except Exception as exc:  # the actor died (killed, out of memory, node lost)
                    error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                    if tries < self.cfg.max_actor_restarts:
                        logger.warning(
                            "%s: actor lost %d episodes (%s); replaying them", desc, len(idx), error
                        )
                        retry = self._submit_chunk(n + tries + 1, [tasks[i] for i in idx], policy)
                        where[retry] = (idx, n, tries + 1)
                        pending.append(retry)
                        continue
                    logger.error("%s: %d episodes lost with their actor: %s", desc, len(idx), error)
                    kind = "policy" if policy else "expert"
                    trajs = [
                        Trajectory(task=tasks[i], goal="", init_obs="", source=kind, error=error) for i in idx
                    ]
                for i, traj in zip(idx, trajs, strict=True):
                    results[i] = traj
                    done_n += 1
                    score_sum += traj.score
                bar.update(len(idx))
                bar.set_postfix(score=f"{score_sum / max(1, done_n):.1f}", refresh=False)
            if bar.disable:
                logger.info("%s: %d/%d done (%.0fs)", desc, done_n, len(tasks), time.time() - start)
        bar.close()
        failed = sum(1 for r in results if r is not None and r.error)
        logger.info(
            "%s: %d episodes in %.0fs, mean score %.2f%s",
            desc,
            done_n,
            time.time() - start,
            score_sum / max(1, done_n),
            f", {failed} failed" if failed else "",
        )
        missing = [tasks[i].id for i, r in enumerate(results) if r is None]
        if missing:
            raise RuntimeError(f"{desc}: no trajectory for {missing}")
        return [r for r in results if r is not None]

    def shutdown(self) -> None:
        import ray

        for w in self.workers:
            try:
                ray.get(w.close.remote(), timeout=30)
            except Exception:
                logger.debug("worker close failed", exc_info=True)
            ray.kill(w)
        self.workers = []
