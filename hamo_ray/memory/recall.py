"""Retrieval, one function for every caller: the k nearest cards of a query, none of a world the query
must not see, gated.

:func:`recall` is what runs: the harness server answers ``/retrieve`` with it (the query: the
embedded key ``(goal, first observation)``), training retrieves each example's cards with it
(:func:`training_experience`: the query is the trajectory's own stored key vector, and every card of
its own world is skipped, as inference never finds one), and the tests call the same function
(:func:`retrieve`, the key embedded first). Gating (:func:`gate`, ``memory.gate_*``) applies alike in
all of them.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from hamo_ray.config import MemoryConfig
from hamo_ray.memory.embed import key_text
from hamo_ray.memory.worlds import world_of_card, world_of_trajectory
from hamo_ray.types import Card, Trajectory

if TYPE_CHECKING:
    from hamo_ray.memory.embed import Embedder
    from hamo_ray.memory.store import MemoryStore

logger = logging.getLogger(__name__)


@dataclass
class Recalled:
    """What one query recalled: the cards ``injected`` and ``withheld`` by the gate (``(card, cosine)``,
    most similar first), and how many cards of the query's own world ranked among its nearest and were
    skipped."""

    injected: list[tuple[Card, float]] = field(default_factory=list)
    withheld: list[tuple[Card, float]] = field(default_factory=list)
    same_world: int = 0


def gate(
    hits: Sequence[tuple[Card, float]], mcfg: MemoryConfig | None, domain: str | None = None
) -> tuple[list[tuple[Card, float]], list[tuple[Card, float]]]:
    """Experience gating: split retrieved cards into those injected and those withheld.

    A card is injected when its cosine similarity to the query reaches ``mcfg.gate_min_similarity``
    (None: any) and, with ``mcfg.gate_same_domain``, when it is of the query's ``domain``. Both off (the
    default) or no ``mcfg``, every card is injected.

    Returns:
        ``(injected, withheld)``, each in the order of ``hits``.

    Raises:
        ValueError: ``gate_same_domain`` is on and ``domain`` is not given.
    """
    if mcfg is None:
        return list(hits), []
    threshold, same = mcfg.gate_min_similarity, mcfg.gate_same_domain
    if same and not domain:
        raise ValueError("memory.gate_same_domain needs the query's domain")
    injected, withheld = [], []
    for card, score in hits:
        ok = (threshold is None or score >= threshold) and (not same or card.domain == domain)
        (injected if ok else withheld).append((card, score))
    return injected, withheld


def recall(
    store: MemoryStore,
    queries: np.ndarray,
    k: int,
    mcfg: MemoryConfig | None = None,
    domains: Sequence[str | None] | None = None,
    *,
    max_stage: int | None = None,
    exclude_ids: Sequence[set[str]] | None = None,
    worlds: Sequence[str | None] | None = None,
) -> list[Recalled]:
    """The ``k`` nearest cards of each query vector, then gated.

    Args:
        store: the memory.
        queries: ``(n, dim)`` query vectors (key embeddings).
        k: cards retrieved per query (before the gate).
        mcfg: the memory settings whose gate applies (None: no gating).
        domains: each query's domain (for ``memory.gate_same_domain``).
        max_stage: only cards of stages up to this one (the memory ``M_t`` of stage t).
        exclude_ids: per query, card ids never returned.
        worlds: per query, the world (``hamo_ray.memory.worlds``) none of whose cards is returned.

    Returns:
        One :class:`Recalled` per query, in order.
    """
    n = len(queries)
    domains = list(domains) if domains is not None else [None] * n
    if mcfg is not None and mcfg.gate_same_domain and not all(domains):
        raise ValueError("memory.gate_same_domain needs the query's domain")
    if n == 0 or store.count() == 0:
        return [Recalled() for _ in range(n)]
    excluded = [set(e) for e in exclude_ids] if exclude_ids is not None else [set() for _ in range(n)]
    found: dict[int, tuple[list[tuple[Card, float]], int]] = {}
    pending, limit = list(range(n)), k + (8 if worlds is not None else 0)
    while pending:  # ask for more than k; again, for more, where the world's cards took too many
        hits = store.search(
            queries[pending], k=limit, exclude_ids=[excluded[i] for i in pending], max_stage=max_stage
        )
        retry = []
        for i, h in zip(pending, hits, strict=True):
            kept, same = [], 0
            for card, score in h:
                if len(kept) == k:
                    break
                if worlds is not None and worlds[i] is not None and world_of_card(card) == worlds[i]:
                    same += 1
                else:
                    kept.append((card, score))
            if len(kept) == k or len(h) < limit:  # enough, or the memory holds no more
                found[i] = (kept, same)
            else:
                retry.append(i)
        pending, limit = retry, limit * 4
    out = []
    for i in range(n):
        kept, same = found[i]
        injected, withheld = gate(kept, mcfg, domains[i])
        out.append(Recalled(injected, withheld, same))
    return out


def retrieve(
    store: MemoryStore,
    embedder: Embedder,
    goal: str,
    init_obs: str,
    k: int,
    exclude_ids: set[str] | None = None,
    max_stage: int | None = None,
    mcfg: MemoryConfig | None = None,
    domain: str | None = None,
) -> list[tuple[Card, float]]:
    """The cards injected for one task's key ``(goal, init_obs)``: :func:`recall` of its embedding.

    Returns:
        Up to k ``(card, cosine similarity)`` pairs, most similar first (gated by ``mcfg`` when given).
    """
    query = embedder.embed([key_text(goal, init_obs)])
    excluded = [exclude_ids] if exclude_ids is not None else None
    return recall(store, query, k, mcfg, [domain], max_stage=max_stage, exclude_ids=excluded)[0].injected


def training_experience(
    store: MemoryStore,
    trajectories: Sequence[Trajectory],
    k: int,
    max_stage: int | None = None,
    mcfg: MemoryConfig | None = None,
    counts: dict[str, int] | None = None,
) -> dict[str, list[Card]]:
    """The cards injected into each trajectory's training example: recalled, never of its own world.

    The query is the trajectory's own stored card vector (its key embedding), so the trajectories
    must already be in ``store``. Every card of the trajectory's world (the same environment instance
    under any task type, its own card included) is skipped, as inference never finds one; the k nearest
    of the other cards are gated as the harness gates.

    Args:
        counts: when given, ``injected``, ``withheld`` (by the gate) and ``same_world`` (cards of the
            trajectory's world that ranked among its nearest and were skipped; its own card not
            counted) are added to it.

    Returns:
        Trajectory id -> up to ``k`` cards, most similar first.
    """
    if not trajectories:
        return {}
    ids = [t.card_id for t in trajectories]
    got = recall(
        store, store.vectors(ids), k, mcfg, [t.task.domain for t in trajectories], max_stage=max_stage,
        exclude_ids=[{i} for i in ids], worlds=[world_of_trajectory(t) for t in trajectories],
    )  # fmt: skip
    out, tally = {}, {"injected": 0, "withheld": 0, "same_world": 0}
    for t, r in zip(trajectories, got, strict=True):
        out[t.id] = [c for c, _ in r.injected]
        tally["injected"] += len(r.injected)
        tally["withheld"] += len(r.withheld)
        tally["same_world"] += r.same_world
    if counts is not None:
        for key, value in tally.items():
            counts[key] = counts.get(key, 0) + value
    logger.info(
        "training experience: %d cards injected, %d withheld by the gate, %d of the examples' own worlds skipped",
        tally["injected"], tally["withheld"], tally["same_world"],
    )  # fmt: skip
    return out
