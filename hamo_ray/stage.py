"""One stage of a run, every step in one place: ``run_stage`` runs steps 1-7, ``Stream`` commits (8).

Each step is a function of the stage's context (:class:`StageContext`: the config, the run folder,
the rollout pools, the endpoint and its services, the trainer, the tracker, the task lists) and the
data, with typed inputs and outputs. The numbers are those of docs/architecture.md::

    ctx = StageContext(cfg, folder, pools, endpoint, services, trainer, tracker, tasks)
    trajs = collect(ctx, stage, domain)                            # 1. expert trajectories
    store, figures = distil(cfg, folder, stage, trajs, endpoint)   # 2. cards into the memory
    anchors, budget = select(cfg, trajs, store, stage)             # 3. coverage selection
    replayed = replay(cfg, folder, stage, done, len(anchors))      # 4. earlier stages' anchors
    adapter = train(ctx, stage, anchors + replayed, store, prev)   # 5. one LoRA adapter (BC)
    adapter = publish(ctx, stage, adapter)                         # 6. served under a new name
    explored = explore(ctx, stage, domain, trajs, adapter.name)    #    ETO: the BC adapter plays,
    tuned = dpo(ctx, stage, trajs, explored, adapter)              #    DPO on (expert, failure) pairs
    ids, figures = release(ctx, stage, domain, anchors, store, adapter.name, done)  # method.release
    scores, stats = evaluate_policy(ctx, stage, adapter.name)      # 7. every domain's test set

A method (``method.*``) switches steps on and off inside :func:`run_stage`; there is one loop. Every
adapter a stage trains is published by :func:`publish`: behavioural cloning's, and for ETO both its
behavioural-cloning adapter (the one its exploration plays, ``stage-<t>-bc``) and its DPO adapter
(``stage-<t>``). Each random process draws its seed from ``steps.stage_seed``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NamedTuple, Protocol

from hamo_ray.config import EvalConfig, HamoConfig
from hamo_ray.envs.expert_cache import cached_experts, play_experts
from hamo_ray.evaluation.faults import StageFailed, run_checked
from hamo_ray.memory.pipeline import add_stage_cards, internalised, release_internalised, training_experience
from hamo_ray.rollout.client import PolicySpec
from hamo_ray.run_folder import PhaseClock, RunFolder
from hamo_ray.selection import sample_replay, select_anchors
from hamo_ray.steps import stage_seed
from hamo_ray.types import StageResult, TaskSpec, Trajectory

logger = logging.getLogger(__name__)


class Tasks(Protocol):
    """The run's task lists (``steps.TaskLists``): each stage's training tasks, every domain's test tasks."""

    stages: list[list[TaskSpec]]
    test: dict[str, list[TaskSpec]]


@dataclass(frozen=True)
class StageContext:
    """What a stage's steps run against: the stream's parts (in-process fakes in the stage test).

    ``pools(domain)`` is the domain's rollout pool (``steps.EnvPools``: ``run(tasks, spec, desc)``),
    ``services`` names and publishes adapters (``runtime.Services``), ``trainer`` trains them
    (``training.driver.StageTrainer``), ``tracker`` records per-step figures (``tracking.Tracker``).
    """

    cfg: HamoConfig
    folder: RunFolder
    pools: Callable[[str], Any]
    endpoint: Any  # runtime.Endpoint: spec(model, cfg, seed=..., retrieval=...) -> PolicySpec
    services: Any = None  # runtime.Services: adapter_name(stage, tag), publish(name, folder)
    trainer: Any = None  # training.driver.StageTrainer: bc, encode_pairs, dpo
    tracker: Any = None  # tracking.Tracker: log_steps(rows, section)
    tasks: Tasks | None = None


@dataclass(frozen=True)
class Adapter:
    """A trained adapter of a stage: its folder (relative to the run folder), its final training loss,
    and its served name once :func:`publish` has published it."""

    path: str
    loss: float
    name: str | None = None


class Release(NamedTuple):
    """What the release step did: the card ids released and the figures of ``StageResult.release``."""

    ids: list[str]
    figures: dict[str, float]


# -- the stage --------------------------------------------------------------------------------------
def initial_stage(ctx: StageContext) -> StageResult:
    """Stage 0 (``protocol.eval_initial``): every domain's test set before any stage."""
    logger.info("=== stage 0: evaluation before any stage ===")
    clock = PhaseClock(tag="stage-0")
    with clock("evaluate"):
        scores, stats = evaluate_policy(ctx, 0, None)
    return StageResult.initial(ctx.cfg.method.name, scores, clock.seconds, stats)


def run_stage(ctx: StageContext, stage: int, domain: str, done: list[StageResult]) -> StageResult:
    """Steps 1-7 of stage ``stage`` (on ``domain``'s data), after the committed stages ``done``.

    Each step is timed by ``PhaseClock`` into ``StageResult.seconds``; the caller commits the result.
    """
    cfg, m, clock = ctx.cfg, ctx.cfg.method, PhaseClock(tag=f"stage-{stage}")
    logger.info("=== stage %d/%d (%s, %s) ===", stage, cfg.protocol.stages, domain, m.name)
    with clock("collect"):  # 1. expert trajectories of the stage's tasks
        trajs = collect(ctx, stage, domain)
    with clock("distil"):  # 2. cards into the memory
        store, distilled = distil(cfg, ctx.folder, stage, trajs, ctx.endpoint)
    with clock("select"):  # 3. anchors by retrieval coverage
        anchors, budget = select(cfg, trajs, store, stage)
    with clock("replay"):  # 4. earlier stages' anchors
        replayed = replay(cfg, ctx.folder, stage, done, len(anchors))
    adapter: Adapter | None = None
    released = Release([], {})  # method.release's card ids and figures
    if m.train:
        tag = "-bc" if m.dpo else ""  # ETO: behavioural cloning first, DPO on top
        prev = next((ctx.folder.path / r.adapter for r in reversed(done) if r.adapter), None)
        with clock("train"):  # 5. one LoRA adapter, initialised from the previous one
            adapter = train(ctx, stage, anchors + replayed, store, prev, tag)
        with clock("publish"):  # 6. served under a new name, proven live
            adapter = publish(ctx, stage, adapter, tag)
        if m.dpo:
            with clock("dpo"):
                explored = explore(ctx, stage, domain, trajs, adapter.name)
                adapter = publish(ctx, stage, dpo(ctx, stage, trajs, explored, adapter))
        if m.release and store is not None:  # docs/method.md step 6
            with clock("release"):
                released = release(ctx, stage, domain, anchors, store, adapter.name, done)
    with clock("evaluate"):  # 7. every domain's test set
        scores, stats = evaluate_policy(ctx, stage, adapter.name if adapter else None)
    return StageResult(
        stage=stage, method=m.name, domain=domain, num_trajectories=len(trajs),
        num_cards=store.count() if store is not None else 0, budget=budget,
        anchors=[t.id for t in anchors], replay=[t.id for t in replayed],
        adapter=adapter.path if adapter else None, adapter_name=adapter.name if adapter else None,
        train_loss=adapter.loss if adapter else None, scores=scores, seconds=clock.seconds,
        evaluation=stats, release=released.figures, released=released.ids, distil=distilled,
    )  # fmt: skip


# -- the steps --------------------------------------------------------------------------------------
def collect(ctx: StageContext, stage: int, domain: str) -> list[Trajectory]:
    """Step 1: the stage's expert trajectories (stored ones first: a redone stage reuses them).

    Imported data (``env.expert_source: file``) or the domain's expert plans played by the pool
    (``play_experts``; through ``env.expert_cache`` when set: runs on the same tasks share them).

    Raises:
        RuntimeError: no usable expert trajectory.
    """
    cfg, folder = ctx.cfg, ctx.folder
    cached = folder.load_trajectories(stage)
    if cached is not None:
        logger.info("collect: reusing %d trajectories of stage %d", len(cached), stage)
        return cached
    if cfg.env.expert_source == "file":  # imported AgentGym / ETO data (hamo_ray.envs.expert_data)
        from hamo_ray.envs.expert_data import stage_experts

        ok = stage_experts(cfg, stage)
        logger.info("collect: %d imported expert trajectories for stage %d (%s)", len(ok), stage, domain)
        folder.save_trajectories(stage, ok)
        return ok
    tasks = ctx.tasks.stages[stage - 1]
    ok, _ = cached_experts(  # the pool starts only when the cache has no entry
        cfg, domain, tasks, lambda: play_experts(ctx.pools(domain), tasks, cfg.env.max_turns, stage, domain)
    )
    folder.save_trajectories(stage, ok)
    return ok


def distil(
    cfg: HamoConfig, folder: RunFolder, stage: int, trajs: list[Trajectory], endpoint: Any = None
) -> tuple[Any, dict[str, int]]:
    """Step 2: the run's memory with the stage's cards added, and what distilling did.

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


def select(
    cfg: HamoConfig, trajs: list[Trajectory], store: Any, stage: int = 0
) -> tuple[list[Trajectory], int]:
    """Step 3: anchors by retrieval coverage over the stage's cards (all, without selection).

    Cards are compared by the embedding ``selection.embed`` names: ``card``, the whole card (outline
    included; ``card_vector``), or ``key``, its retrieval key (``vector``). A floor above the greedy
    saturation point is filled round-robin over the trajectories' task types, ties drawn with the
    stage's seed (``run.seed * 1000 + stage``).

    Returns:
        The anchors and the budget (how many).
    """
    sc, use = cfg.selection, cfg.method.selection and store is not None
    column = "card_vector" if sc.embed == "card" else "vector"
    vectors = store.vectors([t.card_id for t in trajs], column) if use else None
    floor = max(sc.min_budget, math.ceil(sc.min_fraction * len(trajs)))
    types = [(t.task.domain, t.task.task) for t in trajs]
    seed = cfg.run.seed * 1000 + stage
    return select_anchors(trajs, vectors, sc.k, floor, sc.batch_size, groups=types, seed=seed)


def replay(
    cfg: HamoConfig, folder: RunFolder, stage: int, done: list[StageResult], n: int
) -> list[Trajectory]:
    """Step 4: ``replay.ratio`` x ``n`` anchors of earlier stages (none without training)."""
    if not (cfg.method.replay and cfg.method.train):
        return []
    return sample_replay(folder.anchors(done), n, cfg.replay.ratio, seed=cfg.run.seed * 1000 + stage)


def train(
    ctx: StageContext, stage: int, batch: list[Trajectory], store: Any, prev: Path | None, tag: str = ""
) -> Adapter:
    """Step 5: behavioural cloning of ``batch`` into ``adapters/stage-<t><tag>``, from ``prev``.

    With ``method.conditioning`` each trajectory's examples carry the cards retrieved for it from
    the memory up to this stage, never a card of its own world, gated as the harness gates
    (``training_experience``); else none.
    """
    cfg = ctx.cfg
    conditioned = cfg.method.conditioning and store is not None
    counts: dict[str, int] = {}  # injected, withheld by the gate, same-world cards skipped
    cards = (
        training_experience(store, batch, cfg.memory.top_k, max_stage=stage, mcfg=cfg.memory, counts=counts)
        if conditioned
        else {}
    )
    if counts:
        logger.info("train: training cards %s", counts)
    rel = f"adapters/stage-{stage}{tag}"
    result = ctx.trainer.bc(
        batch, cards, ctx.folder.path / rel, init_adapter=prev, seed=stage_seed(cfg.run.seed, stage, "train"),
        name=f"stage-{stage}",
    )  # fmt: skip
    ctx.tracker.log_steps(result.step_metrics, "train")  # numbered on from earlier stages
    logger.info(
        "train: losses %s, %d tokens in %.0fs (+%.1fs start-up)",
        [round(x, 3) for x in result.losses], result.tokens, result.seconds, result.startup_s,
    )  # fmt: skip
    return Adapter(path=rel, loss=result.loss)


def publish(ctx: StageContext, stage: int, adapter: Adapter, tag: str = "") -> Adapter:
    """Step 6: ``adapter`` served under a new name (``stage-<t><tag>:<digest>``: the name says which weights),
    proven live; the named adapter."""
    from hamo_ray.serving.objstore import folder_digest

    name = ctx.services.adapter_name(stage, tag, folder_digest(ctx.folder.path / adapter.path))
    ctx.services.publish(name, adapter.path)
    return replace(adapter, name=name)


def explore(
    ctx: StageContext, stage: int, domain: str, trajs: list[Trajectory], adapter_name: str
) -> list[Trajectory]:
    """ETO, first half: the stage's tasks played by the behavioural-cloning adapter ``adapter_name``."""
    cfg = ctx.cfg
    endpoint = _acting(ctx, adapter_name)  # serve.eval_weights: merged weights or LoRA
    spec = endpoint.spec(adapter_name, cfg, seed=stage_seed(cfg.run.seed, stage, "explore"))
    try:
        return _run_checked(
            ctx, domain, [t.task for t in trajs], spec, f"stage {stage} ETO exploration", endpoint
        )
    finally:
        _stop_acting(ctx)  # DPO trains next: the merged engine's memory back


def dpo(
    ctx: StageContext, stage: int, trajs: list[Trajectory], explored: list[Trajectory], bc: Adapter
) -> Adapter:
    """ETO, second half: DPO on (expert, worse explored) pairs from ``bc`` into ``adapters/stage-<t>``.

    Returns:
        The DPO adapter (not yet published).

    Raises:
        StageFailed: no preference pair (the stage would commit its behavioural-cloning adapter as ETO's).
    """
    from hamo_ray.training.dpo import build_pairs

    cfg = ctx.cfg
    encoded = ctx.trainer.encode_pairs(build_pairs(trajs, explored))
    logger.info("eto: %d failure/success pairs from %d explored episodes", len(encoded), len(explored))
    if not encoded:
        lost = sum(1 for t in explored if t.error)
        raise StageFailed(
            f"stage {stage}: ETO found no (expert, failure) preference pair in {len(explored)} explored "
            f"episodes ({lost} failed); without DPO the stage would commit its behavioural-cloning adapter "
            "as ETO's. Not committed: check the exploration episodes, then submit the same command again"
        )
    rel = f"adapters/stage-{stage}"
    result = ctx.trainer.dpo(
        encoded, ctx.folder.path / bc.path, ctx.folder.path / rel, seed=stage_seed(cfg.run.seed, stage, "dpo"),
        name=f"stage-{stage}-dpo",
    )  # fmt: skip
    ctx.tracker.log_steps(result.step_metrics, "dpo")
    return Adapter(path=rel, loss=result.loss)


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
    endpoint = _acting(ctx, adapter_name)  # kept for the evaluation that follows
    spec = endpoint.spec(adapter_name, cfg, seed=stage_seed(cfg.run.seed, stage, "release"), retrieval=False)
    tasks = [t.task for t in anchors] + [t.task for t in followup]
    by_domain: dict[str, list[int]] = {}  # one rollout per domain (cross-domain follow-ups differ)
    for i, task in enumerate(tasks):
        by_domain.setdefault(task.domain, []).append(i)
    episodes: list[Trajectory | None] = [None] * len(tasks)
    for d, idx in by_domain.items():
        got = _run_checked(
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

    An adapter acts on merged weights when ``serve.eval_weights`` says so (``runtime.Services.acting``:
    an engine checked to state ``model`` before any episode), deleted after the evaluation."""
    cfg = ctx.cfg
    endpoint = _acting(ctx, model)
    spec = endpoint.spec(
        model or cfg.model.name,
        cfg,
        seed=stage_seed(cfg.run.seed, stage, "evaluate"),
        retrieval=cfg.method.retrieval,
    )
    try:
        return evaluate(ctx.pools, ctx.folder, stage, ctx.tasks.test, spec, cfg.eval, _healthy(ctx, endpoint))
    finally:
        _stop_acting(ctx)


def _acting(ctx: StageContext, model: str | None) -> Any:
    """The endpoint whose policy acts as ``model``: ``services.acting`` (merged weights or LoRA), else the run's."""
    acting = getattr(ctx.services, "acting", None)
    return ctx.endpoint if acting is None else acting(model)


def _stop_acting(ctx: StageContext) -> None:
    stop = getattr(ctx.services, "stop_acting", None)
    if stop is not None:
        stop()


def _healthy(ctx: StageContext, endpoint: Any = None) -> Callable[[], None] | None:
    """Blocks until ``endpoint`` (default: the run's) answers healthy (``eval.recover_timeout_s``); None
    without one."""
    wait = getattr(endpoint or ctx.endpoint, "wait_healthy", None)
    return None if wait is None else lambda: wait(ctx.cfg.eval.recover_timeout_s)


def _run_checked(
    ctx: StageContext, domain: str, tasks: list[TaskSpec], spec: PolicySpec, desc: str, endpoint: Any = None
):
    """``pools(domain).run``, with faulted episodes replayed and a stage failure over ``eval``'s allowance."""
    e = ctx.cfg.eval
    wait = _healthy(ctx, endpoint)
    return run_checked(ctx.pools(domain), tasks, spec, desc, e.max_failed_fraction, e.retries, wait)


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
