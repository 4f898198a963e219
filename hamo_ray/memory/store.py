"""The experience memory: a LanceDB table of cards and their embeddings (docs/memory.md).

The schema is the ``Card`` type, a ``released`` flag and two float32 vectors (``hamo_ray.memory.schema``):
``vector``, the key's embedding, which search uses, and ``card_vector``, the whole card's, which coverage
selection reads (:meth:`MemoryStore.vectors`; a table older than ``card_vector`` works without it, and
asking it for card vectors says so). The store is append-only and idempotent on ``id``. Search is top-k
by cosine: exact below ``index_threshold`` rows, then through the ANN index ``ensure_index`` builds
(``hamo_ray.memory.index``). Released cards (docs/method.md step 6) stay stored and are skipped by
search. ``uri``: a local folder, an object store (``s3://...``) or a LanceDB server. One process writes
a table (the stream driver); any number read it, each read seeing the writer's latest version.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import numpy as np

from hamo_ray.memory.index import INDEX_TYPES
from hamo_ray.memory.schema import (
    CARD_FIELDS,
    CARD_VECTOR,
    RELEASED,
    VECTOR,
    Rows,
    as_matrix,
    card_schema,
    to_card_table,
)
from hamo_ray.types import Card

if TYPE_CHECKING:
    from hamo_ray.config import MemoryConfig

logger = logging.getLogger(__name__)

_QUERY_CHUNK = 256  # query vectors per LanceDB call; bounds the size of one result table
_ID_CHUNK = 512  # ids per "id IN (...)" filter


def _sql_list(values: Sequence[str]) -> str:
    return ", ".join("'" + v.replace("'", "''") + "'" for v in values)


def _id_filters(ids: Sequence[str]):
    """``id IN (...)`` filters over the distinct ``ids``, ``_ID_CHUNK`` at a time."""
    unique = list(dict.fromkeys(ids))
    for start in range(0, len(unique), _ID_CHUNK):
        yield f"id IN ({_sql_list(unique[start : start + _ID_CHUNK])})"


class MemoryStore:
    """Append-only card memory over one LanceDB table.

    Args:
        uri: a LanceDB URI (local folder, object store or server).
        table: the table name.
        dim: the vector width. With None, an existing table gives it, or the first ``add`` does.
        index_threshold: rows from which :meth:`ensure_index` builds the ANN index.
        index_type: the ANN index: ``ivf_sq`` (IVF with 8-bit scalar quantisation, the default),
            ``ivf_pq`` (product quantisation: smaller, less exact) or ``ivf_hnsw_sq``.
        nprobes: IVF partitions searched per query once indexed.
        refine_factor: indexed search re-ranks ``refine_factor * k`` candidates by exact distance.
        storage_options: object-store options for LanceDB (region, endpoint, credentials...).

    Raises:
        ValueError: ``dim`` disagrees with the existing table's vector width.
    """

    def __init__(
        self, uri: str, table: str = "cards", dim: int | None = None, *, index_threshold: int = 50_000,
        index_type: str = "ivf_sq", nprobes: int = 16, refine_factor: int = 10,
        storage_options: dict[str, str] | None = None,
    ) -> None:  # fmt: skip
        import lancedb

        self.uri = str(uri)
        self.table_name = table
        self.index_threshold = index_threshold
        if index_type not in INDEX_TYPES:
            raise ValueError(f"memory index_type {index_type!r} is not one of {sorted(INDEX_TYPES)}")
        self.index_type = index_type
        self.nprobes, self.refine_factor = nprobes, refine_factor
        # interval 0: every read checks for versions committed by other processes.
        self._db = lancedb.connect(
            self.uri, read_consistency_interval=timedelta(0), storage_options=storage_options or None
        )
        self._table: Any = None
        self.dim = dim
        if self._open() is None and dim is not None:
            self._create(dim)

    def _create(self, dim: int, tries: int = 3) -> None:
        """Create the table; when another writer (a thread, a replica, the driver) creates it at the same
        moment, LanceDB refuses one of the two commits: open the winner's table instead."""
        for attempt in range(tries):
            try:
                self._set_table(
                    self._db.create_table(self.table_name, schema=card_schema(dim), exist_ok=True)
                )
                return
            except (RuntimeError, OSError) as exc:  # a width mismatch (ValueError) is no race: it propagates
                if self._open() is not None:
                    return
                if attempt == tries - 1:
                    raise RuntimeError(
                        f"memory table {self.table_name!r} at {self.uri}: could not be created: {exc}"
                    ) from exc
                time.sleep(0.05 * (attempt + 1))

    @classmethod
    def from_config(
        cls, uri: str, mcfg: MemoryConfig, dim: int | None = None, run_id: str | None = None
    ) -> MemoryStore:
        """A store with the table name and index settings of ``mcfg``.

        ``run_id``: the run the store belongs to; in a ``memory.uri`` other runs may share, its table is
        ``<memory.table>-<run id>`` (``hamo_ray.naming.memory_table``), else ``memory.table``.
        """
        from hamo_ray.naming import memory_table

        return cls(
            uri, memory_table(mcfg, run_id), dim, index_threshold=mcfg.index_threshold,
            index_type=mcfg.index_type, nprobes=mcfg.index_nprobes, refine_factor=mcfg.index_refine_factor,
            storage_options=dict(mcfg.storage_options),
        )  # fmt: skip

    def _open(self) -> Any:
        """The LanceDB table, or None while it does not exist yet (another process may create it)."""
        if self._table is None:
            try:
                table = self._db.open_table(self.table_name)
            except (ValueError, FileNotFoundError):
                return None
            self._set_table(table)
        return self._table

    def _set_table(self, table: Any) -> None:
        width = table.schema.field("vector").type.list_size
        if self.dim is not None and width != self.dim:
            raise ValueError(
                f"memory table {self.table_name!r} at {self.uri} has width {width}, not {self.dim}"
            )
        self._table, self.dim = table, width

    def add(self, rows: Rows) -> int:
        """Add cards; rows whose ``id`` is already stored (or repeated in ``rows``) are skipped.

        One LanceDB transaction: a write that fails leaves the table as it was.

        Args:
            rows: a list of row dicts, a dict of columns or an arrow table with every ``Card``
                field and ``vector``.

        Returns:
            How many rows were added.

        Raises:
            ValueError: the rows are invalid (see :func:`to_card_table`); nothing is written.
        """
        table = to_card_table(rows, self.dim)
        if table.num_rows == 0:
            return 0
        if self._open() is None:
            width = table.schema.field("vector").type.list_size
            self._set_table(self._db.create_table(self.table_name, schema=card_schema(width), exist_ok=True))
        if not self._has_released():  # a table written before the released column existed
            table = table.drop_columns([RELEASED])
        if not self.has_card_vectors():  # a table written before the card_vector column existed
            table = table.drop_columns([CARD_VECTOR])
        # "null": keep a null card_vector null (rows given without one); to_card_table has already
        # refused wrong widths and non-finite values in both vector columns.
        result = (
            self._table.merge_insert("id").when_not_matched_insert_all().execute(table, on_bad_vectors="null")
        )
        logger.debug("memory %s: %d of %d rows added", self.uri, result.num_inserted_rows, table.num_rows)
        return int(result.num_inserted_rows)

    def count(self, include_released: bool = True) -> int:
        """Number of cards stored (with ``include_released=False``: those search can return)."""
        table = self._open()
        if table is None:
            return 0
        if include_released or not self._has_released():
            return table.count_rows()
        return table.count_rows(f"{RELEASED} = false")

    def _has_released(self) -> bool:
        return self._open() is not None and RELEASED in self._table.schema.names

    def has_card_vectors(self) -> bool:
        """Whether the table has the ``card_vector`` column (tables created before it lack it)."""
        return self._open() is not None and CARD_VECTOR in self._table.schema.names

    def existing_ids(self, ids: Sequence[str]) -> set[str]:
        """The subset of ``ids`` already stored (used to skip distilling them again)."""
        table, found = self._open(), set()
        for where in _id_filters(ids) if table is not None else ():
            found.update(table.search().where(where).select(["id"]).limit(None).to_arrow()["id"].to_pylist())
        return found

    def release(self, ids: Sequence[str]) -> int:
        """Mark cards as released (docs/method.md step 6): they stay stored, search skips them.

        Args:
            ids: card ids; unknown ids are ignored.

        Returns:
            How many cards were newly marked.
        """
        table = self._open()
        if table is None or not ids:
            return 0
        if not self._has_released():
            from lancedb.index import Bitmap

            table.add_columns({RELEASED: "false"})
            self._table = None
            table = self._open()
            if self.indexed():
                table.create_index(RELEASED, config=Bitmap(), replace=True)
        marked = 0
        for where in _id_filters(ids):
            marked += int(
                table.update(
                    where=f"{where} AND {RELEASED} IS NOT TRUE", values={RELEASED: True}
                ).rows_updated
            )
        logger.info("memory %s: %d cards released", self.uri, marked)
        return marked

    def restore_releases(self, keep: set[str]) -> int:
        """Un-release every released card not in ``keep`` (the releases of committed stages): what an
        uncommitted stage released is undone before it is redone, so the redo trains on the same cards.

        Returns:
            How many cards were un-released.
        """
        table = self._open()
        if table is None or not self._has_released():
            return 0
        rows = table.search().where(f"{RELEASED} = true").select(["id"]).limit(None).to_arrow()
        undo = [i for i in rows["id"].to_pylist() if i not in keep]
        for where in _id_filters(undo):
            table.update(where=where, values={RELEASED: False})
        if undo:
            logger.info(
                "memory %s: %d cards released by an uncommitted stage un-released", self.uri, len(undo)
            )
        return len(undo)

    def indexed(self) -> bool:
        """Whether the vector column has an ANN index."""
        from hamo_ray.memory.index import has_vector_index

        table = self._open()
        return table is not None and has_vector_index(table)

    def ensure_index(self, force: bool = False) -> bool:
        """Build the ANN index once the table reaches ``index_threshold`` rows (``force``: even below it);
        update it later (``hamo_ray.memory.index.ensure_index``). Only the writer calls this.

        Returns:
            Whether the table is indexed now.
        """
        from hamo_ray.memory.index import ensure_index

        table = self._open()
        if table is None:
            return False
        return ensure_index(
            table, self.index_type, self.dim, self.index_threshold, force=force,
            has_released=self._has_released(), uri=self.uri,
        )  # fmt: skip

    def cards(self, stage: int | None = None) -> list[Card]:
        """All cards, or those of one stage, ordered by (stage, trajectory id).

        Args:
            stage: only cards added at this stage; None for all.

        Returns:
            The cards.
        """
        table = self._open()
        if table is None:
            return []
        query = table.search().select(list(CARD_FIELDS)).limit(None)
        if stage is not None:
            query = query.where(f"stage = {int(stage)}")
        cards = [Card(**row) for row in query.to_arrow().to_pylist()]
        return sorted(cards, key=lambda c: (c.stage, c.trajectory_id))

    def vectors(self, ids: Sequence[str], column: str = VECTOR) -> np.ndarray:
        """The stored vectors of some cards.

        Args:
            ids: card ids.
            column: ``vector`` (the key's embedding, what search matches) or ``card_vector`` (the whole
                card's, what coverage selection compares).

        Returns:
            A float32 ``(len(ids), dim)`` array; row i belongs to ``ids[i]``.

        Raises:
            KeyError: some ids are not stored.
            ValueError: ``card_vector`` asked of a table created before that column existed, or of
                cards stored without it.
        """
        if column not in (VECTOR, CARD_VECTOR):
            raise ValueError(f"unknown vector column {column!r} (have {VECTOR!r}, {CARD_VECTOR!r})")
        table, found = self._open(), {}
        if column == CARD_VECTOR and table is not None and not self.has_card_vectors():
            raise ValueError(
                f"memory table {self.table_name!r} at {self.uri} was created before cards had a "
                f"{CARD_VECTOR!r} (the whole card's embedding), so selection cannot compare cards by their "
                "text: set selection.embed=key (the cards' keys, as the table's run did) or start a new memory"
            )
        for where in _id_filters(ids) if table is not None else ():
            result = table.search().where(where).select(["id", column]).limit(None).to_arrow()
            values = result[column]
            if values.null_count:
                lacking = [i for i, v in zip(result["id"].to_pylist(), values.is_null().to_pylist()) if v]
                raise ValueError(
                    f"memory {self.uri}: cards stored without a {column!r}: {lacking[:5]}"
                    f"{' ...' if len(lacking) > 5 else ''}; set selection.embed=key or start a new memory"
                )
            found.update(zip(result["id"].to_pylist(), as_matrix(values), strict=True))
        missing = [i for i in dict.fromkeys(ids) if i not in found]
        if missing:
            raise KeyError(f"cards not in memory: {missing[:5]}{' ...' if len(missing) > 5 else ''}")
        return np.stack([found[i] for i in ids]) if ids else np.zeros((0, self.dim or 0), dtype=np.float32)

    def search(
        self, query_vectors: np.ndarray, k: int, exclude_ids: Sequence[set[str]] | None = None,
        max_stage: int | None = None,
    ) -> list[list[tuple[Card, float]]]:  # fmt: skip
        """Top-k cards by cosine similarity for each query vector (released cards skipped).

        Exact below the index threshold; through the ANN index (with exact re-ranking) above it.

        Args:
            query_vectors: ``(n, dim)`` (or one ``(dim,)``) query embeddings.
            k: cards per query.
            exclude_ids: per query, card ids it must not return (e.g. the example's own card).
            max_stage: only cards with ``stage <= max_stage``.

        Returns:
            For each query, up to k ``(card, cosine similarity)`` pairs, most similar first
            (ties broken by card id).

        Raises:
            ValueError: the query width differs from the table's, or ``exclude_ids`` has another length.
        """
        queries = np.asarray(query_vectors, dtype=np.float32)
        queries = queries[None, :] if queries.ndim == 1 else queries
        n = queries.shape[0]
        if exclude_ids is not None and len(exclude_ids) != n:
            raise ValueError(f"exclude_ids has {len(exclude_ids)} sets for {n} queries")
        table = self._open()
        if table is None or k <= 0 or n == 0:
            return [[] for _ in range(n)]
        if queries.shape[1] != self.dim:
            raise ValueError(
                f"query width {queries.shape[1]} does not match the memory table's width {self.dim}"
            )
        excluded = [set(e) for e in exclude_ids] if exclude_ids is not None else [set() for _ in range(n)]
        limit = k + max(len(e) for e in excluded)
        # "released = false" (never null, see to_card_table) is answered by the bitmap index.
        filters = [f"{RELEASED} = false"] if self._has_released() else []
        if max_stage is not None:
            filters.append(f"stage <= {int(max_stage)}")
        indexed = self.indexed()
        hits: list[list[tuple[Card, float]]] = [[] for _ in range(n)]
        for start in range(0, n, _QUERY_CHUNK):
            chunk = queries[start : start + _QUERY_CHUNK]
            query = (
                table.search(chunk if len(chunk) > 1 else chunk[0], vector_column_name="vector")
                .distance_type("cosine")
                .select([*CARD_FIELDS, "_distance"])
                .limit(limit)
            )
            if indexed:
                query = query.nprobes(self.nprobes).refine_factor(self.refine_factor)
            else:
                query = query.bypass_vector_index()
            if filters:
                query = query.where(" AND ".join(filters), prefilter=True)
            result = query.to_arrow()
            # LanceDB adds "query_index" only when it was given more than one query vector.
            qis = result["query_index"].to_pylist() if len(chunk) > 1 else [0] * result.num_rows
            rows = result.select(list(CARD_FIELDS)).to_pylist()
            for qi, row, distance in zip(qis, rows, result["_distance"].to_pylist(), strict=True):
                if row["id"] not in excluded[start + qi]:
                    hits[start + qi].append((Card(**row), 1.0 - float(distance)))
        return [sorted(h, key=lambda hit: (-hit[1], hit[0].id))[:k] for h in hits]
