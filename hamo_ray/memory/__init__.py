"""The harness memory: distil trajectories into experience cards, embed them, store and retrieve them.

Importing this package is light: sentence-transformers (torch), Ray and LanceDB load only when an
``Embedder``, a pipeline function or a ``MemoryStore`` is used. See ``pipeline`` for the stage flow.
"""

from __future__ import annotations

from hamo_ray.memory.distill import (
    Distiller,
    OutlineDistiller,
    card_from_trajectory,
    get_distiller,
    outline_from_trajectory,
    register_distiller,
)
from hamo_ray.memory.distill_llm import LLMDistiller
from hamo_ray.memory.embed import Embedder, key_text
from hamo_ray.memory.pipeline import (
    Rejection,
    WriteReport,
    add_stage_cards,
    build_cards_dataset,
    distil_batch,
    internalised,
    release_internalised,
    write_cards,
    write_cards_report,
)
from hamo_ray.memory.recall import Recalled, gate, recall, retrieve, training_experience
from hamo_ray.memory.schema import card_schema, to_card_table
from hamo_ray.memory.store import MemoryStore

__all__ = [
    "Distiller",
    "Embedder",
    "LLMDistiller",
    "MemoryStore",
    "OutlineDistiller",
    "Recalled",
    "Rejection",
    "WriteReport",
    "add_stage_cards",
    "build_cards_dataset",
    "card_from_trajectory",
    "card_schema",
    "distil_batch",
    "gate",
    "get_distiller",
    "internalised",
    "key_text",
    "outline_from_trajectory",
    "recall",
    "register_distiller",
    "release_internalised",
    "retrieve",
    "to_card_table",
    "training_experience",
    "write_cards",
    "write_cards_report",
]
