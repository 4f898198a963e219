"""Ray Data pipeline that turns trajectories into stored experience cards, and retrieval.

Stage step 2 (DESIGN.md: distil)::

    trajectories -> from_items -> map_batches(distil) -> map_batches(Embedder, one actor) -> rows
    rows -> iter_batches on the driver -> MemoryStore.add (the single writer)

Run it inside a Ray session (the driver owns the store)::

    ds = build_cards_dataset(trajectories, stage=1, mcfg=cfg.memory)
    added = write_cards(ds, MemoryStore(uri, dim=384))
    hits = retrieve(store, Embedder(), goal, init_obs, k=2)

Ray is imported only when a function here runs.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from hamo_ray.config import MemoryConfig
from hamo_ray.memory.distill import card_from_trajectory, get_distiller
from hamo_ray.memory.embed import Embedder, key_text
from hamo_ray.memory.schema import CARD_FIELDS
from hamo_ray.memory.store import MemoryStore
from hamo_ray.types import Card, Trajectory

if TYPE_CHECKING:
    import ray.data

logger = logging.getLogger(__name__)

_COLUMN_TYPES = {"variation": np.int64, "stage": np.int64, "score": np.float64}


def distil_batch(batch: dict[str, np.ndarray], stage: int, distiller: str) -> dict[str, np.ndarray]:
    """Ray Data UDF: trajectory JSON strings -> card columns (every ``Card`` field).

    Args:
        batch: a numpy batch with a ``trajectory`` column of ``Trajectory`` JSON strings.
        stage: the stage the cards belong to.
        distiller: a registered distiller name.

    Returns:
        A numpy batch with one column per ``Card`` field.
    """
    trajectories = [Trajectory.model_validate_json(text) for text in batch["trajectory"]]
    outlines = get_distiller(distiller).distill(trajectories)
    cards = [card_from_trajectory(t, stage, o) for t, o in zip(trajectories, outlines, strict=True)]
    return {
        name: np.array([getattr(c, name) for c in cards], dtype=_COLUMN_TYPES.get(name, object))
        for name in CARD_FIELDS
    }


def build_cards_dataset(
    trajectories: Sequence[Trajectory], stage: int, mcfg: MemoryConfig
) -> ray.data.Dataset:
    """The lazy Ray Data pipeline from trajectories to card rows with their ``vector``.

    Args:
        trajectories: this stage's trajectories.
        stage: the stage number stored in each card.
        mcfg: memory settings (distiller, embedding model, batch size).

    Returns:
        A dataset of rows holding every ``Card`` field plus ``vector`` (float32, unit norm).
        Nothing runs until it is consumed (e.g. by :func:`write_cards`).
    """
    import ray.data

    # Items are JSON strings: one string column avoids Arrow type inference on nested, partly
    # empty or null fields (e.g. ``cards_used=[]`` in one block and a list of strings in another).
    items = [{"trajectory": t.model_dump_json()} for t in trajectories]
    blocks = max(1, math.ceil(len(items) / mcfg.batch_size))
    ds = ray.data.from_items(items, override_num_blocks=blocks)
    ds = ds.map_batches(
        distil_batch,
        fn_kwargs={"stage": stage, "distiller": mcfg.distiller},
        batch_size=mcfg.batch_size,
        batch_format="numpy",
        udf_modifying_row_count=False,
    )
    ds = ds.map_batches(
        Embedder,
        fn_constructor_kwargs={"model_name": mcfg.embedding_model, "batch_size": mcfg.batch_size},
        compute=ray.data.ActorPoolStrategy(size=1),
        batch_size=mcfg.batch_size,
        batch_format="numpy",
        udf_modifying_row_count=False,
    )
    # Keep the progress bars; skip the execution-plan banner printed at start.
    ds.context.print_on_execution_start = False
    return ds


def write_cards(ds: ray.data.Dataset, store: MemoryStore, batch_size: int = 256) -> int:
    """Stream a card dataset into the store from the driver (the single writer).

    Args:
        ds: a dataset from :func:`build_cards_dataset`.
        store: the memory to add to; cards already there are skipped.
        batch_size: rows per write.

    Returns:
        How many cards were added.
    """
    start, added, seen = time.perf_counter(), 0, 0
    for batch in ds.iter_batches(batch_size=batch_size, batch_format="numpy"):
        added += store.add(batch)
        seen += len(batch["id"])
    logger.info(
        "memory %s: %d of %d cards added in %.1f s", store.uri, added, seen, time.perf_counter() - start
    )
    return added


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
