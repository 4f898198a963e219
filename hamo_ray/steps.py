"""The steps of a stage, as functions of the config, the run folder and the data; ``Stream`` runs them.

The numbers are those of the eight steps in docs/architecture.md. Step 1 (collect) and step 5
(train) are ``Stream`` methods; the rest are here, with the task lists of a protocol and the
rollout pools::

    pools = EnvPools(cfg)
    store, figures = distil(cfg, folder, stage, trajectories) # 2. cards into the memory
    anchors, budget = select(cfg, trajectories, store)        # 3. coverage selection
    replayed = replay(cfg, folder, stage, done, len(anchors)) # 4. earlier stages' anchors
    scores = evaluate(pools, folder, stage, test_tasks, spec) # 7. every domain's test set
"""

from __future__ import annotations

import logging
import math

from hamo_ray.config import HamoConfig
from hamo_ray.memory.pipeline import add_stage_cards
from hamo_ray.rollout.client import PolicySpec
from hamo_ray.run_folder import PhaseClock, RunFolder
from hamo_ray.selection import sample_replay, select_anchors
from hamo_ray.types import StageResult, TaskSpec, Trajectory

logger = logging.getLogger(__name__)


SEED_PURPOSES = ("evaluate", "train", "explore", "dpo", "release")


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


def split_stages(tasks_by_type: dict[str, list[TaskSpec]], num_stages: int) -> list[list[TaskSpec]]:
    """Sample-disjoint stage subsets, each covering every task type (round-robin within a type)."""
    stages: list[list[TaskSpec]] = [[] for _ in range(num_stages)]
    for tasks in tasks_by_type.values():
        for i, task in enumerate(tasks):
            stages[i % num_stages].append(task)
    return stages


def domain_tasks(cfg: HamoConfig, domains: dict, name: str, split: str) -> list[TaskSpec]:
    """``split``'s tasks of domain ``name``, task type by task type (``protocol.*_per_task`` each)."""
    key = "protocol.test_per_task" if split == "test" else "protocol.train_per_task"
    limit = cfg.per_domain(key, name)
    return [t for tt in cfg.task_types(name) for t in domains[name].tasks(split, tt, limit=limit)]


def stage_tasks(cfg: HamoConfig, domains: dict) -> list[list[TaskSpec]]:
    """The stages' training tasks: one domain split into stages, or one stage per domain (cross-domain)."""
    p = cfg.protocol
    if p.kind == "cross_domain":
        return [domain_tasks(cfg, domains, d, "train") for d in p.order]
    by_type: dict[str, list[TaskSpec]] = {}
    for t in domain_tasks(cfg, domains, cfg.env.domain, "train"):
        by_type.setdefault(t.task, []).append(t)
    return split_stages(by_type, p.num_stages)


class EnvPools:
    """One ``EnvPool`` (rollout actors) per domain, made on first use: ``pools(domain)``."""

    def __init__(self, cfg: HamoConfig) -> None:
        self.cfg, self._pools = cfg, {}

    def __call__(self, domain: str):
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

    A GGUF file or a packaged model is converted once into ``model.cache_dir`` (``hamo_ray.models``);
    the embedded backbone is built once per settings from expert episodes (cached).
    """
    if cfg.model.path != "embedded":
        from hamo_ray.models import resolve_model_path

        folder.backbone = resolve_model_path(cfg.model.path, cfg.model.cache_dir)
    else:
        from hamo_ray.training.backbone import ensure_backbone

        def experts(domain: str, tasks: list[TaskSpec]) -> list[Trajectory]:
            return pools(domain).run(tasks, None, desc=f"backbone experts ({domain})")

        with PhaseClock(folder.timings)("backbone"):
            folder.backbone = str(ensure_backbone(cfg, experts, folder.path / "train"))
    return folder.backbone


def distil(cfg: HamoConfig, folder: RunFolder, stage: int, trajs: list[Trajectory], endpoint=None):
    """Stage step 2: the run's memory with the stage's cards added, and what distilling did.

    ``memory.llm_base_url: policy`` is bound to ``endpoint`` (the run's policy endpoint, base model).

    Returns:
        ``(store, figures)``: the store (None when the method has no memory) and ``cards_added``,
        ``rejected``, ``llm_outlines``, ``fallback_outlines`` (outlines the LLM distiller failed to
        write, written by the deterministic one instead); empty without memory.
    """
    if not cfg.method.uses_memory:
        return None, {}
    mcfg = cfg.memory
    if endpoint is not None:
        from hamo_ray.memory.distill_llm import bind_policy

        mcfg = bind_policy(
            mcfg, endpoint.base_url, cfg.model.name, endpoint.api_key, cfg.model.template_kwargs()
        )
    elif mcfg.distiller == "llm" and mcfg.llm_base_url == "policy":
        raise ValueError("memory.llm_base_url='policy' needs the run's policy endpoint")
    store = folder.store(cfg)
    report = add_stage_cards(store, trajs, stage, mcfg)
    figures = {
        "cards_added": report.added,
        "rejected": len(report.rejected),
        "llm_outlines": report.sources.get("llm", 0),
        "fallback_outlines": report.fallbacks,
    }
    return store, figures


def select(cfg: HamoConfig, trajs: list[Trajectory], store, stage: int = 0) -> tuple[list[Trajectory], int]:
    """Stage step 3: anchors by retrieval coverage over the stage's cards (all, without selection).

    A floor above the greedy saturation point is filled round-robin over the trajectories' task
    types, ties drawn with the stage's seed (``run.seed * 1000 + stage``).
    """
    sc, use = cfg.selection, cfg.method.selection and store is not None
    vectors = store.vectors([t.card_id for t in trajs]) if use else None
    floor = max(sc.min_budget, math.ceil(sc.min_fraction * len(trajs)))
    types = [(t.task.domain, t.task.task) for t in trajs]
    seed = cfg.run.seed * 1000 + stage
    return select_anchors(trajs, vectors, sc.k, floor, sc.batch_size, groups=types, seed=seed)


def replay(
    cfg: HamoConfig, folder: RunFolder, stage: int, done: list[StageResult], n: int
) -> list[Trajectory]:
    """Stage step 4: ``replay.ratio`` x ``n`` anchors of earlier stages (none without training)."""
    if not (cfg.method.replay and cfg.method.train):
        return []
    return sample_replay(folder.anchors(done), n, cfg.replay.ratio, seed=cfg.run.seed * 1000 + stage)


def evaluate(
    pools: EnvPools, folder: RunFolder, stage: int, test_tasks: dict, spec: PolicySpec
) -> tuple[dict[str, float], dict[str, float]]:
    """Stage step 7: every domain's test tasks against the endpoint; the episodes are saved.

    Returns:
        Domain -> mean score (0-100) over the episodes that ran (an episode that failed, e.g. its
        prompt refused as too long, is left out of the mean and counted apart, never scored 0), and the
        evaluation's figures: ``episodes`` and ``failed_episodes`` (also per domain,
        ``episodes/<domain>``, ``failed/<domain>``), ``seconds_per_episode`` (wall time over all domains
        / episodes) and, where the endpoint reports vLLM's counters, ``prefix_cache_hit_rate`` (prompt
        tokens served from the prefix cache).
    """
    import time

    from hamo_ray.serving.client import hit_rate, prefix_cache_counters

    scores, stats, episodes, n_failed, start = {}, {}, 0, 0, time.perf_counter()
    before = prefix_cache_counters(spec.base_url, spec.api_key)
    for domain, tasks in test_tasks.items():
        trajs = pools(domain).run(tasks, spec, desc=f"stage {stage} evaluation ({domain})")
        folder.save_episodes(stage, domain, trajs)
        failed = [t for t in trajs if t.error]
        played = [t for t in trajs if not t.error]
        if failed:
            logger.warning(
                "evaluate: %d %s episodes failed (left out of the score, counted apart): %s",
                len(failed), domain, failed[0].error,
            )  # fmt: skip
        scores[domain] = sum(t.score for t in played) / len(played) if played else 0.0
        stats[f"episodes/{domain}"], stats[f"failed/{domain}"] = len(trajs), len(failed)
        episodes += len(trajs)
        n_failed += len(failed)
    stats |= {
        "episodes": episodes,
        "failed_episodes": n_failed,
        "seconds_per_episode": (time.perf_counter() - start) / max(1, episodes),
    }
    rate = hit_rate(before, prefix_cache_counters(spec.base_url, spec.api_key))
    if rate is not None:
        stats["prefix_cache_hit_rate"] = rate
    logger.info("evaluate: %s", {k: round(v, 3) for k, v in stats.items()})
    return scores, stats
