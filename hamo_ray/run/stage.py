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
(``stage-<t>``). Each random process draws its seed from ``run.resources.stage_seed``.
"""

from __future__ import annotations

import logging
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

from hamo_ray.config import HamoConfig
from hamo_ray.envs.expert_cache import cached_experts, play_experts
from hamo_ray.evaluation.faults import StageFailed
from hamo_ray.memory.pipeline import add_stage_cards
from hamo_ray.memory.recall import training_experience
from hamo_ray.run.acting import evaluate_policy, explore, release
from hamo_ray.run.context import Adapter, Release, StageContext
from hamo_ray.run.folder import PhaseClock, RunFolder
from hamo_ray.run.resources import process_seed, stage_seed
from hamo_ray.selection import sample_replay, select_anchors
from hamo_ray.types import StageResult, Trajectory

logger = logging.getLogger(__name__)


# -- the stage --------------------------------------------------------------------------------------
def initial_stage(ctx: StageContext) -> StageResult:
    """Stage 0 (``protocol.eval_initial``): every domain's test set before any stage, or, with
    ``eval.initial_cache``, the same evaluation of another run copied (``hamo_ray.run.initial``)."""
    from hamo_ray.run.initial import shared_initial

    logger.info("=== stage 0: evaluation before any stage ===")

    def play():
        clock = PhaseClock(tag="stage-0")
        with clock("evaluate"):
            played = evaluate_policy(ctx, 0, None)
        return played, clock.seconds

    cards = lambda: ctx.folder.store(ctx.cfg).count()  # noqa: E731 - asked only with retrieval on
    return shared_initial(ctx.cfg, ctx.folder, ctx.tasks.test, play, cards)


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
        train_cards=adapter.cards if adapter else {},
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
    stage's ``select`` seed (``run.resources.process_seed``).

    Returns:
        The anchors and the budget (how many).
    """
    sc, use = cfg.selection, cfg.method.selection and store is not None
    column = "card_vector" if sc.embed == "card" else "vector"
    vectors = store.vectors([t.card_id for t in trajs], column) if use else None
    floor = max(sc.min_budget, math.ceil(sc.min_fraction * len(trajs)))
    types = [(t.task.domain, t.task.task) for t in trajs]
    seed = process_seed(cfg, stage, "select")
    return select_anchors(trajs, vectors, sc.k, floor, sc.batch_size, groups=types, seed=seed)


def replay(
    cfg: HamoConfig, folder: RunFolder, stage: int, done: list[StageResult], n: int
) -> list[Trajectory]:
    """Step 4: ``replay.ratio`` x ``n`` anchors of earlier stages (none without training)."""
    if not (cfg.method.replay and cfg.method.train):
        return []
    return sample_replay(folder.anchors(done), n, cfg.replay.ratio, seed=process_seed(cfg, stage, "replay"))


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
    return Adapter(path=rel, loss=result.loss, cards={k: float(v) for k, v in counts.items()})


def publish(ctx: StageContext, stage: int, adapter: Adapter, tag: str = "") -> Adapter:
    """Step 6: ``adapter`` served under a new name (``stage-<t><tag>:<digest>``: the name says which weights),
    proven live; the named adapter."""
    from hamo_ray.serving.objstore import folder_digest

    name = ctx.services.adapter_name(stage, tag, folder_digest(ctx.folder.path / adapter.path))
    ctx.services.publish(name, adapter.path)
    return replace(adapter, name=name)


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
    return Adapter(path=rel, loss=result.loss, cards=bc.cards)  # DPO pairs carry no cards
