"""Ray Data pipeline that turns trajectories into stored experience cards, and retrieval.

Stage step 2 (docs/architecture.md: distil)::

    trajectories (minus those already stored) -> from_items -> map_batches(distil, bounded task pool)
        -> map_batches(Embedder, actor pool) -> rows
    rows -> iter_batches on the driver -> MemoryStore.add (the single writer) -> ensure_index

Run it inside a Ray session (the driver owns the store)::

    ds = build_cards_dataset(trajectories, stage=1, mcfg=cfg.memory, store=store)
    report = write_cards_report(ds, store)      # added, rejected rows with reasons, fallbacks
    hits = retrieve(store, Embedder(), goal, init_obs, k=2)

Bad input is rejected row by row, never fatal: a row that is not UTF-8, not JSON, misses a field
of ``Trajectory`` or has no action is reported as a :class:`Rejection` (input row, trajectory id
when known, reason) and is not written. Each write is one LanceDB transaction; a failing write
raises and leaves the rows already in the table as they were.

Ray is imported only when a function here runs.
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from hamo_ray.config import MemoryConfig
from hamo_ray.memory.distill import card_from_trajectory, get_distiller
from hamo_ray.memory.embed import Embedder, key_text
from hamo_ray.memory.schema import CARD_FIELDS
from hamo_ray.memory.store import MemoryStore
from hamo_ray.memory.worlds import world_of_card, world_of_trajectory
from hamo_ray.types import Card, TaskSpec, Trajectory, trajectory_id

if TYPE_CHECKING:
    import ray.data

logger = logging.getLogger(__name__)

_COLUMN_TYPES = {"variation": np.int64, "stage": np.int64, "score": np.float64}
TrajectoryInput = Trajectory | dict | str | bytes  # objects, or raw JSON (e.g. lines of a file)


@dataclass(frozen=True)
class Rejection:
    """An input row the pipeline did not turn into a card."""

    row: int  # index in the input sequence
    trajectory_id: str | None  # when the row parsed far enough to tell
    reason: str


@dataclass
class WriteReport:
    """What :func:`write_cards_report` did with a card dataset."""

    added: int = 0  # new cards written
    seen: int = 0  # valid cards offered to the store (already stored ones are skipped there)
    rejected: list[Rejection] = field(default_factory=list)
    sources: dict[str, int] = field(default_factory=dict)  # outline source -> count ("llm", "fallback", ...)
    indexed: bool = False  # whether the table has an ANN index after the write

    @property
    def fallbacks(self) -> int:
        return self.sources.get("fallback", 0)


def _parse(raw: Any) -> tuple[Trajectory | None, str | None, str]:
    """(trajectory, id, "") for a valid row, else (None, id or None, reason)."""
    try:
        text = raw.decode("utf-8") if isinstance(raw, bytes | bytearray) else str(raw)
    except UnicodeDecodeError as exc:
        return None, None, f"not UTF-8: {exc.reason} at byte {exc.start}"
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        return None, None, f"not JSON: {exc.msg}"
    tid = None  # the trajectory's id, when its task parses even though the rest may not
    if isinstance(data, dict) and isinstance(data.get("task"), dict):
        try:
            tid = trajectory_id(TaskSpec.model_validate(data["task"]), data.get("source", "policy"))
        except ValueError:
            pass
    try:
        traj = Trajectory.model_validate(data)
    except ValueError as exc:
        errors = getattr(exc, "errors", lambda: [])()
        missing = [".".join(map(str, e["loc"])) for e in errors if e.get("type") == "missing"]
        reason = f"missing fields {missing}" if missing else f"invalid: {str(exc).splitlines()[-1].strip()}"
        return None, tid, reason
    if not traj.actions:
        return None, traj.id, "empty action list"
    return traj, traj.id, ""


def distil_batch(batch: dict[str, np.ndarray], stage: int, distiller: str, mcfg: MemoryConfig | None = None):
    """Ray Data UDF: raw trajectory rows -> card columns, plus ``reject_reason`` and ``outline_source``.

    Args:
        batch: a numpy batch with ``row`` (input index) and ``trajectory`` (UTF-8 JSON bytes) columns.
        stage: the stage the cards belong to.
        distiller: a registered distiller name.
        mcfg: memory settings for distillers built from config (the LLM distiller).

    Returns:
        A numpy batch with one column per ``Card`` field, ``row``, ``reject_reason`` ("" for a valid
        row) and ``outline_source`` (who wrote the outline). Rejected rows carry empty card fields.
    """
    parsed = [_parse(raw) for raw in batch["trajectory"]]
    valid = [t for t, _, _ in parsed if t is not None]
    engine = get_distiller(distiller, mcfg)
    if hasattr(engine, "distill_with_sources"):
        outlines, sources = engine.distill_with_sources(valid)
    else:
        outlines, sources = engine.distill(valid), [distiller] * len(valid)
    if hasattr(engine, "close"):
        engine.close()
    done = iter(zip(outlines, sources, strict=True))
    rows: list[dict[str, Any]] = []
    for traj, tid, reason in parsed:
        if traj is None:
            empty = Card(
                id="", trajectory_id=tid or "", domain="", task="", variation=0, stage=stage,
                goal="", init_obs="", outline="", score=0.0,
            )  # fmt: skip
            rows.append({**empty.model_dump(), "reject_reason": reason, "outline_source": ""})
            continue
        outline, source = next(done)
        card = card_from_trajectory(traj, stage, outline)
        rows.append({**card.model_dump(), "reject_reason": "", "outline_source": source})
    out = {
        name: np.array([r[name] for r in rows], dtype=_COLUMN_TYPES.get(name, object))
        for name in (*CARD_FIELDS, "reject_reason", "outline_source")
    }
    out["row"] = np.asarray(batch["row"], dtype=np.int64)
    return out


def _encode(item: TrajectoryInput) -> bytes:
    if isinstance(item, bytes | bytearray):
        return bytes(item)
    if isinstance(item, Trajectory):
        text = json.dumps(item.model_dump(mode="json"), ensure_ascii=False)
    elif isinstance(item, dict):
        text = json.dumps(item, ensure_ascii=False, default=str)
    else:
        text = str(item)
    # Lone surrogates (undecodable bytes smuggled into str) become invalid UTF-8: rejected later.
    return text.encode("utf-8", errors="surrogateescape")


def build_cards_dataset(
    trajectories: Sequence[TrajectoryInput],
    stage: int,
    mcfg: MemoryConfig,
    *,
    store: MemoryStore | None = None,
) -> ray.data.Dataset:
    """The lazy Ray Data pipeline from trajectories to card rows with their ``vector``.

    Args:
        trajectories: this stage's trajectories, as objects or raw JSON (str, bytes or dicts).
        stage: the stage number stored in each card.
        mcfg: memory settings (distiller, embedding model, batch size, LLM settings).
        store: when given, trajectories whose card is already stored are skipped before distilling
            (a re-run of a stage costs no distillation).

    Returns:
        A dataset of rows holding every ``Card`` field, ``vector`` (float32, unit norm), ``row``,
        ``reject_reason`` and ``outline_source``. Nothing runs until it is consumed (e.g. by
        :func:`write_cards_report`).
    """
    import ray.data

    items = [{"row": i, "trajectory": _encode(t)} for i, t in enumerate(trajectories)]
    if store is not None:
        known = {i: t.card_id for i, t in enumerate(trajectories) if isinstance(t, Trajectory)}
        stored = store.existing_ids(list(known.values()))
        if stored:
            items = [it for it in items if known.get(it["row"]) not in stored]
            logger.info("distil: %d of %d trajectories already in memory, skipped", len(stored), len(known))
    if not items:  # e.g. a re-run of a stored stage: no distiller, no embedding model to load
        return ray.data.from_items([])
    if not sys.stdout.isatty():
        # Off a terminal Ray Data logs its progress table every few seconds; the card counts that
        # ``add_stage_cards`` logs say the same in one line a tenth, so job logs stay readable.
        ray.data.DataContext.get_current().enable_progress_bars = False
    blocks = max(1, math.ceil(len(items) / mcfg.batch_size))
    ds = ray.data.from_items(items, override_num_blocks=blocks)
    ds = ds.map_batches(
        distil_batch,
        fn_kwargs={"stage": stage, "distiller": mcfg.distiller, "mcfg": mcfg},
        batch_size=mcfg.batch_size,
        batch_format="numpy",
        compute=ray.data.TaskPoolStrategy(size=mcfg.distil_tasks),
        udf_modifying_row_count=False,
    )
    ds = ds.map_batches(
        Embedder,
        fn_constructor_kwargs={"model_name": mcfg.embedding_model, "batch_size": mcfg.batch_size},
        compute=ray.data.ActorPoolStrategy(size=mcfg.embed_actors),
        batch_size=mcfg.batch_size,
        batch_format="numpy",
        udf_modifying_row_count=False,
    )
    # Keep the progress bars; skip the execution-plan banner printed at start.
    ds.context.print_on_execution_start = False
    return ds


def write_cards_report(
    ds: ray.data.Dataset, store: MemoryStore, batch_size: int = 256, total: int | None = None
) -> WriteReport:
    """Stream a card dataset into the store from the driver (the single writer), then index.

    Args:
        ds: a dataset from :func:`build_cards_dataset`.
        store: the memory to add to; cards already there are skipped; past its index threshold the
            ANN index is built (or updated) after the last write.
        batch_size: rows per write (one transaction each).
        total: the dataset's rows, when known: progress lines (cards done, rate, ETA) every tenth.
            On a terminal Ray Data's own bars show the distillation and embedding operators.

    Returns:
        A :class:`WriteReport`: cards added, rejected rows with their reasons, outline sources.
    """
    from hamo_ray.logs import Progress

    start, report, sources = time.perf_counter(), WriteReport(), Counter()
    progress = Progress(total or 0, "distil + embed", unit="card", log=logger, enabled=bool(total), bar=False)
    for batch in ds.iter_batches(batch_size=batch_size, batch_format="numpy"):
        reasons = batch.get("reject_reason")
        ok = np.ones(len(batch["id"]), dtype=bool) if reasons is None else reasons == ""
        if not ok.all():
            for row, tid, reason in zip(batch["row"][~ok], batch["trajectory_id"][~ok], reasons[~ok]):
                report.rejected.append(Rejection(int(row), str(tid) or None, str(reason)))
        good = {name: column[ok] for name, column in batch.items()}
        if "outline_source" in good:
            sources.update(str(s) for s in good["outline_source"])
        report.added += store.add(good)
        report.seen += int(ok.sum())
        progress.update(len(batch["id"]), figures={"added": report.added, "rejected": len(report.rejected)})
    progress.close()
    report.sources = dict(sources)
    report.indexed = store.ensure_index()
    report.rejected.sort(key=lambda r: r.row)
    if report.rejected:
        reasons = Counter(r.reason.split(":")[0] for r in report.rejected)
        logger.warning("memory: %d trajectories rejected (%s)", len(report.rejected), dict(reasons))
    logger.info(
        "memory %s: %d of %d cards added in %.1f s (outlines: %s)",
        store.uri,
        report.added,
        report.seen,
        time.perf_counter() - start,
        report.sources,
    )
    return report


def add_stage_cards(store: MemoryStore, trajectories: Sequence[Trajectory], stage: int, mcfg: MemoryConfig):
    """Stage step 2: distil and embed a stage's trajectories into ``store`` and log what happened.

    Returns:
        The :class:`WriteReport`.
    """
    stored = store.existing_ids([t.card_id for t in trajectories])
    if stored:  # a redone stage: its stored cards cost no distillation
        logger.info(
            "distil: %d of %d trajectories already in memory, skipped", len(stored), len(trajectories)
        )
    new = [t for t in trajectories if t.card_id not in stored]
    report = write_cards_report(build_cards_dataset(new, stage, mcfg), store, total=len(new))
    logger.info(
        "distil: %d new cards, %d rejected, %d distiller fallbacks (memory holds %d)",
        report.added, len(report.rejected), report.fallbacks, store.count(),
    )  # fmt: skip
    for rejection in report.rejected[:5]:
        logger.warning("distil: rejected %s", rejection)
    return report


def write_cards(ds: ray.data.Dataset, store: MemoryStore, batch_size: int = 256) -> int:
    """Like :func:`write_cards_report`, returning only how many cards were added."""
    return write_cards_report(ds, store, batch_size).added


def internalised(replay: Trajectory, mcfg: MemoryConfig) -> bool:
    """Whether a replay episode (a trained task played again without cards) counts as solved.

    Solved: it ran to the end (no ``error``) and scored at least ``mcfg.release_min_score``.
    """
    return replay.error is None and replay.score >= mcfg.release_min_score


def release_internalised(
    store: MemoryStore, anchors: Sequence[Trajectory], replays: Sequence[Trajectory], mcfg: MemoryConfig
) -> list[str]:
    """docs/method.md step 6: release the cards of the anchors the trained model has internalised.

    Called after training when ``method.release`` is on. ``replays`` are the anchors' tasks played
    again by the new adapter with no card injected (``hamo_ray.stage.release`` runs them with retrieval
    off); they are matched to the anchors by task id (``TaskSpec.id``). An anchor's card is released
    when its task has at least one replay and every replay of it is :func:`internalised` (no error,
    score >= ``mcfg.release_min_score``); an anchor without a replay keeps its card. Released cards
    stay in the table; search skips them from then on.

    Args:
        store: the memory (the writer's).
        anchors: the trajectories just trained on (the stage's anchors).
        replays: the replay episodes, any order.
        mcfg: its ``release_min_score`` threshold.

    Returns:
        The card ids released, in anchor order (all passed to ``store.release``, which counts as new
        only those not released before, e.g. on a redone stage).

    Raises:
        ValueError: a replay whose task is no anchor's task (nothing is released then).
    """
    by_task: dict[str, list[Trajectory]] = {a.task.id: [] for a in anchors}
    for r in replays:
        if r.task.id not in by_task:
            raise ValueError(f"release: replay of task {r.task.id!r} belongs to no anchor")
        by_task[r.task.id].append(r)
    ids = [
        a.card_id
        for a in anchors
        if by_task[a.task.id] and all(internalised(r, mcfg) for r in by_task[a.task.id])
    ]
    store.release(ids)
    return ids


def gate(
    hits: Sequence[tuple[Card, float]], mcfg: MemoryConfig, domain: str | None = None
) -> tuple[list[tuple[Card, float]], list[tuple[Card, float]]]:
    """Experience gating: split retrieved cards into those injected and those withheld.

    A card is injected when its cosine similarity to the query reaches ``mcfg.gate_min_similarity``
    (None: any) and, with ``mcfg.gate_same_domain``, when it is of the query's ``domain``. Both off (the
    default), every card is injected. The harness (inference) and :func:`training_experience` (training)
    gate alike.

    Args:
        hits: ``(card, cosine similarity)`` pairs, most similar first.
        mcfg: the memory settings.
        domain: the query's domain (needed with ``gate_same_domain``).

    Returns:
        ``(injected, withheld)``, each in the order of ``hits``.

    Raises:
        ValueError: ``gate_same_domain`` is on and ``domain`` is not given.
    """
    threshold, same = mcfg.gate_min_similarity, mcfg.gate_same_domain
    if same and not domain:
        raise ValueError("memory.gate_same_domain needs the query's domain")
    injected, withheld = [], []
    for card, score in hits:
        ok = (threshold is None or score >= threshold) and (not same or card.domain == domain)
        (injected if ok else withheld).append((card, score))
    return injected, withheld


def training_experience(
    store: MemoryStore,
    trajectories: Sequence[Trajectory],
    k: int,
    max_stage: int | None = None,
    mcfg: MemoryConfig | None = None,
    counts: dict[str, int] | None = None,
) -> dict[str, list[Card]]:
    """The cards injected into each trajectory's training example: retrieved, never of its own world.

    The query is the trajectory's own stored card vector (its key embedding), so the trajectories
    must already be in ``store`` (distilled by this pipeline). Every card of the trajectory's world
    (``hamo_ray.memory.worlds``: the same environment instance under any task type, its own card
    included) is skipped, as inference never finds one: the k nearest of the other cards are retrieved,
    then gated as the harness gates (:func:`gate`, with ``mcfg``).

    Args:
        store: the memory holding the trajectories' cards.
        trajectories: the training trajectories.
        k: cards retrieved per trajectory.
        max_stage: only cards of stages up to this one (the memory ``M_t`` of stage t).
        mcfg: the memory settings whose gate applies (None: no gating).
        counts: when given, ``injected``, ``withheld`` (by the gate) and ``same_world`` (cards of the
            trajectory's world that ranked among its nearest and were skipped; its own card not
            counted) are added to it.

    Returns:
        Trajectory id -> up to ``k`` cards, most similar first.
    """
    if not trajectories:
        return {}
    ids = [t.card_id for t in trajectories]
    worlds = [world_of_trajectory(t) for t in trajectories]
    queries = store.vectors(ids)
    found: dict[int, list[tuple[Card, float]]] = {}
    skipped = [0] * len(trajectories)
    pending, limit = list(range(len(trajectories))), k + 8
    while pending:  # ask for more than k; again, for more, where the world's cards took too many
        excluded = [{ids[i]} for i in pending]
        hits = store.search(queries[pending], k=limit, exclude_ids=excluded, max_stage=max_stage)
        retry = []
        for i, h in zip(pending, hits, strict=True):
            kept, same = [], 0
            for card, score in h:
                if len(kept) == k:
                    break
                if world_of_card(card) == worlds[i]:
                    same += 1
                else:
                    kept.append((card, score))
            if len(kept) == k or len(h) < limit:  # enough, or the memory holds no more
                found[i], skipped[i] = kept, same
            else:
                retry.append(i)
        pending, limit = retry, limit * 4
    out, tally = {}, {"injected": 0, "withheld": 0, "same_world": 0}
    for i, t in enumerate(trajectories):
        injected, withheld = gate(found[i], mcfg, t.task.domain) if mcfg is not None else (found[i], [])
        out[t.id] = [c for c, _ in injected]
        tally["injected"] += len(injected)
        tally["withheld"] += len(withheld)
        tally["same_world"] += skipped[i]
    if counts is not None:
        for key, value in tally.items():
            counts[key] = counts.get(key, 0) + value
    logger.info(
        "training experience: %d cards injected, %d withheld by the gate, %d of the examples' own worlds skipped",
        tally["injected"], tally["withheld"], tally["same_world"],
    )  # fmt: skip
    return out


def retrieve(
    store: MemoryStore,
    embedder: Embedder,
    goal: str,
    init_obs: str,
    k: int,
    exclude_ids: set[str] | None = None,
    max_stage: int | None = None,
) -> list[tuple[Card, float]]:
    """The k cards nearest to one task's key ``(goal, init_obs)``.

    Args:
        store: the memory.
        embedder: embeds the query key (same model as the stored vectors).
        goal: the task request.
        init_obs: the initial observation.
        k: cards to return.
        exclude_ids: card ids not to return (e.g. the trajectory's own card in training).
        max_stage: only cards of stages up to this one.

    Returns:
        Up to k ``(card, cosine similarity)`` pairs, most similar first.
    """
    query = embedder.embed([key_text(goal, init_obs)])
    excluded = [exclude_ids] if exclude_ids is not None else None
    return store.search(query, k, exclude_ids=excluded, max_stage=max_stage)[0]
