"""The steps of a stage in which a served adapter plays: ETO's exploration, the release replays, and
the evaluation (step 7) on every domain's test set.

Each plays through ``context.acting`` (merged weights or LoRA, ``serve.eval_weights``) and through
``context.play_checked`` / ``evaluation.faults.run_checked``: episodes lost to a fault are played again
once the endpoint answers healthy, and a stage with more lost than ``eval.max_failed_fraction`` fails
(``StageFailed``) instead of committing a score over the survivors.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from hamo_ray.config import EvalConfig
from hamo_ray.evaluation.faults import run_checked
from hamo_ray.memory.pipeline import internalised, release_internalised
from hamo_ray.rollout.client import PolicySpec
from hamo_ray.run.context import Release, StageContext, acting, healthy, play_checked, stop_acting
from hamo_ray.run.folder import RunFolder
from hamo_ray.run.resources import stage_seed
from hamo_ray.types import StageResult, Trajectory

logger = logging.getLogger(__name__)


def explore(
    ctx: StageContext, stage: int, domain: str, trajs: list[Trajectory], adapter_name: str
) -> list[Trajectory]:
    """ETO, first half: the stage's tasks played by the behavioural-cloning adapter ``adapter_name``."""
    cfg = ctx.cfg
    endpoint = acting(ctx, adapter_name)  # serve.eval_weights: merged weights or LoRA
    spec = endpoint.spec(adapter_name, cfg, seed=stage_seed(cfg.run.seed, stage, "explore"))
    try:
        return play_checked(
            ctx, domain, [t.task for t in trajs], spec, f"stage {stage} ETO exploration", endpoint
        )
    finally:
        stop_acting(ctx)  # DPO trains next: the merged engine's memory back


def release(
    ctx: StageContext,
    stage: int,
    domain: str,
    anchors: list[Trajectory],
    store: Any,
    adapter_name: str,
    done: list[StageResult],
) -> Release:
    """docs/method.md step 6: release the cards of the anchors the new adapter solves without any card.

    The anchors' tasks are replayed by ``adapter_name`` (the stage's final adapter: for ETO the DPO
    one) with retrieval off, so no card at all is injected, not only the anchor's own (the simplest
    faithful reading of "internalised"); a card goes when its replay reached
    ``memory.release_min_score`` without error (``release_internalised``). In the same rollout the
    tasks of the cards the previous stage released are replayed again, the same way: how many are
    still solved says whether a released card's task stays solved one stage later (measured only,
    nothing is un-released). One seed, ``stage_seed(run.seed, stage, "release")``, for both.

    Returns:
        The card ids released, and the figures for ``StageResult.release``: ``replayed``,
        ``released``, ``replay_failed`` (replays with an error), ``replay_mean_score`` (over the
        replays without error), ``followup_checked``, ``followup_solved``.
    """
    cfg = ctx.cfg
    prev = next((r for r in done if r.stage == stage - 1), None)
    followup: list[Trajectory] = []
    if prev is not None and prev.released:
        wanted = set(prev.released)
        followup = [t for t in ctx.folder.load_trajectories(prev.stage) or [] if t.card_id in wanted]
        if len(followup) < len(wanted):
            logger.warning(
                "release: %d of stage %d's %d released cards have no stored trajectory; not followed up",
                len(wanted) - len(followup), prev.stage, len(wanted),
            )  # fmt: skip
    endpoint = acting(ctx, adapter_name)  # kept for the evaluation that follows
    spec = endpoint.spec(adapter_name, cfg, seed=stage_seed(cfg.run.seed, stage, "release"), retrieval=False)
    tasks = [t.task for t in anchors] + [t.task for t in followup]
    by_domain: dict[str, list[int]] = {}  # one rollout per domain (cross-domain follow-ups differ)
    for i, task in enumerate(tasks):
        by_domain.setdefault(task.domain, []).append(i)
    episodes: list[Trajectory | None] = [None] * len(tasks)
    for d, idx in by_domain.items():
        got = play_checked(
            ctx, d, [tasks[i] for i in idx], spec, f"stage {stage} release replay ({d})", endpoint
        )
        for i, t in zip(idx, got, strict=True):
            episodes[i] = t
    replays, again = episodes[: len(anchors)], episodes[len(anchors) :]
    ids = release_internalised(store, anchors, replays, cfg.memory)
    ran = [t.score for t in replays if t.error is None]
    figures = {
        "replayed": float(len(replays)),
        "released": float(len(ids)),
        "replay_failed": float(len(replays) - len(ran)),
        "replay_mean_score": sum(ran) / len(ran) if ran else 0.0,
        "followup_checked": float(len(again)),
        "followup_solved": float(sum(internalised(t, cfg.memory) for t in again)),
    }
    logger.info(
        "release: stage %d (%s): %d of %d anchors solved without cards (mean %.1f, %d failed; solved: "
        "score >= %g) -> their cards released; follow-up: %d of the %d released at stage %d still solved",
        stage, domain, len(ids), len(replays), figures["replay_mean_score"], len(replays) - len(ran),
        cfg.memory.release_min_score, int(figures["followup_solved"]), len(again), stage - 1,
    )  # fmt: skip
    return Release(ids, figures)


def evaluate_policy(
    ctx: StageContext, stage: int, model: str | None
) -> tuple[dict[str, float], dict[str, float]]:
    """Step 7 for the served ``model`` (None: the base model), cards injected with ``method.retrieval``.

    An adapter acts on merged weights when ``serve.eval_weights`` says so (``run.services.Services.acting``:
    an engine checked to state ``model`` before any episode), deleted after the evaluation."""
    cfg = ctx.cfg
    endpoint = acting(ctx, model)
    spec = endpoint.spec(
        model or cfg.model.name,
        cfg,
        seed=stage_seed(cfg.run.seed, stage, "evaluate"),
        retrieval=cfg.method.retrieval,
    )
    try:
        return evaluate(ctx.pools, ctx.folder, stage, ctx.tasks.test, spec, cfg.eval, healthy(ctx, endpoint))
    finally:
        stop_acting(ctx)


def evaluate(
    pools: Callable[[str], Any],
    folder: RunFolder,
    stage: int,
    test_tasks: Mapping,
    spec: PolicySpec,
    ecfg: EvalConfig | None = None,
    wait: Callable[[], None] | None = None,
) -> tuple[dict[str, float], dict[str, float]]:
    """Step 7: every domain's test tasks against the endpoint; the episodes are saved.

    Episodes lost to a fault (the engine died, a connection, a timeout, an actor, an environment) are
    played again with the same seeds once ``wait`` returns (the endpoint healthy), up to
    ``eval.retries`` times (``hamo_ray.evaluation.faults.run_checked``); more than
    ``eval.max_failed_fraction`` of a domain's episodes still lost fails the stage (``StageFailed``):
    a score over the survivors is never committed.

    Returns:
        Domain -> mean score (0-100) over the episodes that ran (an episode whose prompt did not fit the
        context, or a fault within the allowance, is left out of the mean and counted apart, never
        scored 0), and the evaluation's figures: ``episodes`` and ``failed_episodes`` (also per domain,
        ``episodes/<domain>``, ``failed/<domain>``), ``seconds_per_episode`` (wall time over all domains
        / episodes) and, where the endpoint reports vLLM's counters, ``prefix_cache_hit_rate`` (prompt
        tokens served from the prefix cache).

    Raises:
        StageFailed: too many episodes of a domain lost to faults (the message names the causes).
    """
    import time

    from hamo_ray.serving.client import hit_rate, prefix_cache_counters

    ecfg = ecfg or EvalConfig()
    scores, stats, episodes, n_failed, start = {}, {}, 0, 0, time.perf_counter()
    before = prefix_cache_counters(spec.base_url, spec.api_key)
    for domain, tasks in test_tasks.items():
        desc = f"stage {stage} evaluation ({domain})"
        trajs = run_checked(
            pools(domain), list(tasks), spec, desc, ecfg.max_failed_fraction, ecfg.retries, wait
        )
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
        for key, n in _card_counts(played).items():  # injected, withheld by the gate, dropped to fit
            stats[key] = stats.get(key, 0) + n
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


def _card_counts(trajs: list[Trajectory]) -> dict[str, int]:
    """The cards of played episodes: ``cards_injected``, ``cards_withheld`` (by the gate) and
    ``cards_dropped`` (by ``fit_cards``), summed over episodes."""
    return {
        "cards_injected": sum(len(t.cards_used) for t in trajs),
        "cards_withheld": sum(t.cards_withheld for t in trajs),
        "cards_dropped": sum(t.cards_dropped for t in trajs),
    }
