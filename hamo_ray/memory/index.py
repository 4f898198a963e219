"""The memory table's ANN index: IVF_SQ (default), IVF_PQ or IVF_HNSW_SQ on ``vector``, with scalar
indices on ``released`` and ``stage`` that search prefilters on (``MemoryStore.ensure_index``)."""

from __future__ import annotations

import logging
import time
from typing import Any

from hamo_ray.memory.schema import RELEASED, VECTOR

logger = logging.getLogger(__name__)

PARTITION_ROWS = 4096  # rows per IVF partition of the ANN index
INDEX_TYPES = ("ivf_sq", "ivf_pq", "ivf_hnsw_sq")


def has_vector_index(table: Any) -> bool:
    """Whether ``table``'s key vector column has an ANN index."""
    return any(i.columns == [VECTOR] for i in table.list_indices())


def ensure_index(
    table: Any, index_type: str, dim: int, threshold: int, *, force: bool = False, has_released: bool = False,
    uri: str = "",
) -> bool:  # fmt: skip
    """Build the ANN index once ``table`` reaches ``threshold`` rows; update it later.

    With the vector index come scalar indices on ``released`` (bitmap, when the table has the column)
    and ``stage`` (btree): search prefilters on both, and without them every query would scan those
    columns. Rows added after the build are searched exactly until the next call folds them into the
    indices (``optimize``).

    Args:
        force: build even below the threshold (never below 256 rows: IVF needs them).

    Returns:
        Whether the table is indexed now.
    """
    from lancedb.index import Bitmap, BTree

    n = table.count_rows()
    if (n < threshold and not force) or n < 256:
        return has_vector_index(table)
    if has_vector_index(table):
        table.optimize()
        return True
    start = time.perf_counter()
    table.create_index(VECTOR, config=index_config(index_type, dim, n))
    if has_released:
        table.create_index(RELEASED, config=Bitmap(), replace=True)
    table.create_index("stage", config=BTree(), replace=True)
    logger.info(
        "memory %s: %s index over %d rows in %.1f s", uri, index_type.upper(), n, time.perf_counter() - start
    )
    return True


def index_config(index_type: str, dim: int, n: int) -> Any:
    """The LanceDB index config for ``n`` rows of width ``dim``."""
    from lancedb.index import IvfHnswSq, IvfPq, IvfSq

    # ~4,096 rows a partition: k-means stays cheap at 10^6 rows, and nprobes partitions scan a
    # few percent of the table; the exact re-ranking (refine_factor * k) fixes the order that
    # quantisation blurs. HNSW graphs search large partitions well: 16x fewer of them.
    partitions = max(1, round(n / PARTITION_ROWS))
    if index_type == "ivf_sq":
        return IvfSq(distance_type="cosine", num_partitions=partitions)
    if index_type == "ivf_hnsw_sq":
        return IvfHnswSq(distance_type="cosine", num_partitions=max(1, partitions // 16))
    sub_vectors = next(s for s in (48, 32, 24, 16, 12, 8, 4, 2, 1) if dim % s == 0)
    return IvfPq(distance_type="cosine", num_partitions=partitions, num_sub_vectors=sub_vectors)
