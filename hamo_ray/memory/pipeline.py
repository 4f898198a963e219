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
from hamo_ray.memory.embed import Embedder
from hamo_ray.memory.schema import CARD_FIELDS
from hamo_ray.memory.store import MemoryStore
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


def encode_input(item: TrajectoryInput) -> bytes:
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

    items = [{"row": i, "trajectory": encode_input(t)} for i, t in enumerate(trajectories)]
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
    again by the new adapter with no card injected (``hamo_ray.run.stage.release`` runs them with retrieval
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
