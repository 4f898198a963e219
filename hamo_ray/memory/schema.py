"""The ``cards`` table schema and the validation of rows written to it.

The schema is the ``Card`` type, a ``released`` flag (docs/method.md step 6: a released card stays stored
but retrieval skips it) and two fixed-size float32 columns of the embedding width: ``vector``, the
embedding of the card's key (goal, first observation), which retrieval searches, and ``card_vector``,
the embedding of the whole card (outline included), which coverage selection compares
(``selection.embed: card``). ``card_vector`` is nullable: rows given without it (a table written before
it existed, rows built by hand) hold null there, and selection on the card refuses them::

    schema = card_schema(384)
    table = to_card_table(rows, dim=384)   # raises ValueError on a missing column, a bad type or width
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from hamo_ray.types import Card

CARD_FIELDS: tuple[str, ...] = tuple(Card.model_fields)
RELEASED = "released"  # store-only column: True once the card was released (never deleted)
VECTOR = "vector"  # the key's embedding (goal, first observation): what retrieval searches
CARD_VECTOR = "card_vector"  # the whole card's embedding (outline included): what selection compares
_ARROW_TYPES = {str: pa.string(), int: pa.int64(), float: pa.float64()}

Rows = Sequence[Mapping[str, Any]] | Mapping[str, Any] | pa.Table


def card_schema(dim: int) -> pa.Schema:
    """The LanceDB table schema: one column per ``Card`` field, ``released``, then ``vector`` and
    ``card_vector`` (float32 x dim; ``card_vector`` nullable).

    Args:
        dim: the embedding width.

    Returns:
        The arrow schema; ``id`` is not nullable.
    """
    fields = [
        pa.field(name, _ARROW_TYPES[info.annotation], nullable=name != "id")
        for name, info in Card.model_fields.items()
    ]
    return pa.schema(
        [
            *fields,
            pa.field(RELEASED, pa.bool_()),
            pa.field(VECTOR, pa.list_(pa.float32(), dim)),
            pa.field(CARD_VECTOR, pa.list_(pa.float32(), dim), nullable=True),
        ]
    )


def _as_columns(rows: Rows) -> dict[str, Any]:
    """Rows as a dict of columns, checking that every card column and ``vector`` is there."""
    required = (*CARD_FIELDS, "vector")
    if isinstance(rows, pa.Table):
        columns = {name: rows.column(name) for name in rows.column_names}
    elif isinstance(rows, Mapping):
        columns = dict(rows)
    else:
        absent = {name for row in rows for name in required if name not in row}
        columns = {name: [row[name] for row in rows] for name in required if name not in absent}
        if rows and all(CARD_VECTOR in row for row in rows):
            columns[CARD_VECTOR] = [row[CARD_VECTOR] for row in rows]
    missing = [name for name in required if name not in columns]
    if missing:
        raise ValueError(f"card rows lack columns {missing}")
    return columns


def as_matrix(vectors: Any) -> np.ndarray:
    """A float32 2-D array from vectors given as a 2-D array, a list of lists or an arrow (fixed-size) list column."""
    if isinstance(vectors, pa.ChunkedArray):
        vectors = vectors.combine_chunks()
    if isinstance(vectors, pa.FixedSizeListArray) and vectors.null_count == 0:
        flat = vectors.flatten().to_numpy(zero_copy_only=False)
        return flat.astype(np.float32).reshape(len(vectors), vectors.type.list_size)
    if isinstance(vectors, pa.Array):
        vectors = vectors.to_pylist()
    if isinstance(vectors, np.ndarray) and vectors.dtype != object:
        return np.asarray(vectors, dtype=np.float32)
    widths = {len(v) for v in vectors}
    if len(widths) > 1:
        raise ValueError(f"vectors of different widths {sorted(widths)} in one write")
    return np.asarray([np.asarray(v, dtype=np.float32) for v in vectors], dtype=np.float32)


def to_card_table(rows: Rows, dim: int | None = None) -> pa.Table:
    """Validate rows and build an arrow table in :func:`card_schema` order, one row per distinct id.

    Args:
        rows: a list of row dicts, a dict of columns (a Ray Data numpy batch) or an arrow table,
            each holding every ``Card`` field and ``vector``; ``card_vector`` when given (else null).
        dim: the expected vector width; None takes it from the rows.

    Returns:
        The table; later duplicates of an id are dropped.

    Raises:
        ValueError: a missing column, a wrong type, a vector of another width, or a non-finite value.
    """
    columns = _as_columns(rows)
    n = len(columns["id"])
    if n == 0:
        return card_schema(dim or 1).empty_table()
    matrix = as_matrix(columns["vector"])
    if matrix.ndim != 2 or matrix.shape[0] != n:
        raise ValueError(f"expected {n} vectors as a 2-D array, got shape {matrix.shape}")
    width = matrix.shape[1]
    if dim is not None and width != dim:
        raise ValueError(f"vector width {width} does not match the memory table's width {dim}")
    if not np.isfinite(matrix).all():
        raise ValueError("vectors hold NaN or infinite values")
    cards = _card_vectors(columns.get(CARD_VECTOR), n, width)
    schema = card_schema(width)
    arrays = []
    for field in schema:
        if field.name == VECTOR:
            arrays.append(pa.FixedSizeListArray.from_arrays(pa.array(matrix.ravel(), pa.float32()), width))
            continue
        if field.name == CARD_VECTOR:
            arrays.append(cards)
            continue
        if field.name == RELEASED and RELEASED not in columns:
            arrays.append(pa.array([False] * n, type=pa.bool_()))
            continue
        values = columns[field.name]
        values = values.to_pylist() if isinstance(values, pa.ChunkedArray | pa.Array) else list(values)
        if field.name == RELEASED:  # never null: search filters on ``released = false`` (indexed)
            values = [bool(v) if v is not None else False for v in values]
        try:
            arrays.append(pa.array(values, type=field.type))
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError) as exc:
            raise ValueError(f"card column {field.name!r} is not {field.type}: {exc}") from exc
    table = pa.Table.from_arrays(arrays, schema=schema)
    ids = table.column("id").to_pylist()
    if None in ids:
        raise ValueError("card rows with a null id")
    first = sorted({card_id: i for i, card_id in reversed(list(enumerate(ids)))}.values())
    return table if len(first) == n else table.take(first)


def _card_vectors(vectors: Any, n: int, width: int) -> pa.Array:
    """The ``card_vector`` column: the given vectors (checked like ``vector``), or n nulls."""
    kind = pa.list_(pa.float32(), width)
    if isinstance(vectors, pa.ChunkedArray | pa.Array) and vectors.null_count:
        if vectors.null_count < len(vectors):
            raise ValueError("card vectors given for some rows and null for others")
        vectors = None
    if vectors is None:
        return pa.nulls(n, type=kind)
    matrix = as_matrix(vectors)
    if matrix.shape != (n, width):
        raise ValueError(f"expected {n} card vectors of width {width}, got shape {matrix.shape}")
    if not np.isfinite(matrix).all():
        raise ValueError("card vectors hold NaN or infinite values")
    return pa.FixedSizeListArray.from_arrays(pa.array(matrix.ravel(), pa.float32()), width)
