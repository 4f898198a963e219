"""What every stage of a run stands on: the seeds, the protocol's task lists, the rollout pools, the backbone.

The steps of a stage themselves are ``hamo_ray.run.stage``; ``Stream`` sets these up once per run::

    seed = stage_seed(cfg.run.seed, stage, "evaluate")   # one seed per (run seed, stage, purpose)
    tasks = TaskLists(cfg, domains)                       # tasks.stages[t - 1], tasks.test[domain]
    pools = EnvPools(cfg)                                 # pools(domain).run(tasks, spec, desc)
    model_path = resolve_backbone(cfg, folder, pools)     # the HF folder training and serving load
"""

from __future__ import annotations

import logging
from functools import cached_property

from hamo_ray.config import HamoConfig
from hamo_ray.run.folder import PhaseClock, RunFolder
from hamo_ray.types import TaskSpec, Trajectory

logger = logging.getLogger(__name__)


SEED_PURPOSES = ("evaluate", "train", "explore", "dpo", "release", "select", "replay")


def stage_seed(run_seed: int, stage: int, purpose: str) -> int:
    """The seed of one random process of one stage of a run: distinct for every (seed, stage, purpose).

    It depends on the run seed and the stage only, never on the method, so the methods of one seed share
    each stage's evaluation draws (paired differences stay meaningful) while every stage draws anew
    (``run.seed + stage`` made seed 0 stage 2 equal seed 1 stage 1). Rollouts derive each turn's
    sampling seed from it and the episode (``rollout.worker``).

    Raises:
        ValueError: an unknown ``purpose`` (one of ``SEED_PURPOSES``).
    """
    import zlib

    if purpose not in SEED_PURPOSES:
        raise ValueError(f"unknown seed purpose {purpose!r} (one of {', '.join(SEED_PURPOSES)})")
    return zlib.crc32(f"hamo/{run_seed}/{stage}/{purpose}".encode()) & 0x7FFFFFFF


def process_seed(cfg: HamoConfig, stage: int, purpose: str) -> int:
    """The seed of the run's ``purpose`` process at ``stage``: :func:`stage_seed`, except selection's and
    replay's under ``protocol.seeds: legacy`` (``run.seed * 1000 + stage``, what runs before that key
    drew, so an old run resumes with its own draws)."""
    if cfg.protocol.seeds == "legacy" and purpose in ("select", "replay"):
        return cfg.run.seed * 1000 + stage
    return stage_seed(cfg.run.seed, stage, purpose)


def split_stages(tasks_by_type: dict[str, list[TaskSpec]], num_stages: int) -> list[list[TaskSpec]]:
    """Sample-disjoint stage subsets, each covering every task type (round-robin within a type)."""
    stages: list[list[TaskSpec]] = [[] for _ in range(num_stages)]
    for tasks in tasks_by_type.values():
        for i, task in enumerate(tasks):
            stages[i % num_stages].append(task)
    return stages


def domain_tasks(cfg: HamoConfig, domains: dict, name: str, split: str) -> list[TaskSpec]:
    """``split``'s tasks of domain ``name``, task type by task type (``protocol.*_per_task`` each)."""
    key = "protocol.train_per_task" if split == "train" else "protocol.test_per_task"
    limit = cfg.per_domain(key, name)
    if split == "train" or cfg.protocol.eval_worlds == "all" or not domains[name].worlds_from_spec:
        return [t for tt in cfg.task_types(name) for t in domains[name].tasks(split, tt, limit=limit)]
    return distinct_worlds([domains[name].tasks(split, tt) for tt in cfg.task_types(name)], limit)


def distinct_worlds(by_type: list[list[TaskSpec]], limit: int) -> list[TaskSpec]:
    """``protocol.eval_worlds: distinct``: up to ``limit`` tasks of each list (a task type's, in order)
    whose world (``hamo_ray.memory.worlds.world_of_task``) no task taken before shares."""
    from hamo_ray.memory.worlds import world_of_task

    taken, out = set(), []
    for tasks in by_type:
        kept = 0
        for t in tasks:
            if kept == limit:
                break
            if (w := world_of_task(t)) not in taken:
                taken.add(w)
                out.append(t)
                kept += 1
        if tasks and kept < limit:
            logger.warning(
                "protocol.eval_worlds=distinct: %s has %d %s tasks in worlds no earlier task type took, "
                "not %d", tasks[0].task, kept, tasks[0].split, limit,
            )  # fmt: skip
    return out


def stage_tasks(cfg: HamoConfig, domains: dict) -> list[list[TaskSpec]]:
    """The stages' training tasks: one domain split into stages, or one stage per domain (cross-domain)."""
    p = cfg.protocol
    if p.kind == "cross_domain":
        return [domain_tasks(cfg, domains, d, "train") for d in p.order]
    by_type: dict[str, list[TaskSpec]] = {}
    for t in domain_tasks(cfg, domains, cfg.env.domain, "train"):
        by_type.setdefault(t.task, []).append(t)
    return split_stages(by_type, p.num_stages)


class TaskLists:
    """A run's task lists, each made on first use (ALFWorld generates games then).

    Args:
        cfg: the run's config (``protocol``, ``env.task_types``).
        domains: domain name -> ``Env`` (``hamo_ray.envs.get_domain``).
    """

    def __init__(self, cfg: HamoConfig, domains: dict) -> None:
        self.cfg, self.domains = cfg, domains

    @cached_property
    def stages(self) -> list[list[TaskSpec]]:
        """Each stage's training tasks (``stages[t - 1]`` for stage t)."""
        return stage_tasks(self.cfg, self.domains)

    @cached_property
    def test(self) -> dict[str, list[TaskSpec]]:
        """Every domain's test tasks, evaluated after every stage; ``<domain>@seen``: the dev split's
        tasks of the domains of ``protocol.eval_seen``, evaluated beside them."""
        from hamo_ray.evaluation.metrics import SEEN

        test = {name: domain_tasks(self.cfg, self.domains, name, "test") for name in self.domains}
        for name in self.cfg.protocol.eval_seen:
            test[name + SEEN] = domain_tasks(self.cfg, self.domains, name, "dev")
        return test


class EnvPools:
    """One ``EnvPool`` (rollout actors) per domain, made on first use: ``pools(domain)``."""

    def __init__(self, cfg: HamoConfig) -> None:
        self.cfg, self._pools = cfg, {}

    def __call__(self, domain: str):
        from hamo_ray.evaluation.metrics import base_domain

        domain = base_domain(domain)  # alfworld@seen plays on alfworld's pool
        if domain not in self._pools:
            from hamo_ray.rollout.pool import EnvPool

            self._pools[domain] = EnvPool(domain, self.cfg.env, self.cfg.prompt, self.cfg.rollout)
        return self._pools[domain]

    def close(self) -> None:
        for pool in self._pools.values():
            pool.shutdown()
        self._pools.clear()


def resolve_backbone(cfg: HamoConfig, folder: RunFolder, pools: EnvPools) -> str:
    """``model.path`` as the HF folder (or hub id) that training and serving load.

    A GGUF file or a packaged model is converted once into ``model.cache_dir`` (``hamo_ray.backbones.sources``);
    the embedded backbone is built once per settings from expert episodes (cached).
    """
    if cfg.model.path != "embedded":
        from hamo_ray.backbones.sources import resolve_model_path

        folder.backbone = resolve_model_path(cfg.model.path, cfg.model.cache_dir)
    else:
        from hamo_ray.backbones.toy import ensure_backbone

        def experts(domain: str, tasks: list[TaskSpec]) -> list[Trajectory]:
            return pools(domain).run(tasks, None, desc=f"backbone experts ({domain})")

        with PhaseClock(folder.timings)("backbone"):
            folder.backbone = str(ensure_backbone(cfg, experts))
    return folder.backbone
