"""The harness as a service: experience retrieval over the LanceDB memory, on Ray Serve.

Rollout actors (and, through ``jobs/serve.py``, any client) ask it for the top-k cards of a
(goal, initial observation); the embedding model loads once per replica, and each request reads
the table's latest version, so cards written by the stream are visible at once.

    POST {route}/retrieve  {"goal": "...", "init_obs": "...", "k": 2, "max_stage": null, "domain": null}
      -> {"cards": [Card, ...], "scores": [float, ...], "withheld": 0}
    GET  {route}/health

Retrieval matches the query's key (goal, initial observation) against the cards' ``vector`` (their
keys' embeddings), then gates the top-k as training does (``hamo_ray.memory.recall.gate``:
``memory.gate_min_similarity``, ``memory.gate_same_domain``, off by default): ``cards`` are the injected
ones, ``withheld`` counts those the gate held back (``domain``, the query's, is needed with
``gate_same_domain``).

Clients build the prompt from the cards themselves (``hamo_ray.prompting.build_messages``, the
function training uses), so the policy server stays a plain OpenAI-compatible one. Routes are guarded
like the policy endpoint's (``hamo_ray.serving.guard``); ``max_stage`` set at build time caps every
query (a run served at ``--stage t`` retrieves only cards of stages <= t).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from fastapi import FastAPI, HTTPException
from pydantic import BaseModel, ConfigDict, Field
from ray import serve

from hamo_ray.config import MemoryConfig
from hamo_ray.serving.guard import GuardMiddleware, configure_guard

logger = logging.getLogger(__name__)

harness_api = FastAPI(title="hamo harness")
harness_api.add_middleware(GuardMiddleware)


class RetrieveRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    goal: str = Field(max_length=20_000)
    init_obs: str = Field(default="", max_length=100_000)
    k: int = Field(default=2, ge=1, le=50)
    max_stage: int | None = None
    domain: str | None = None  # the query's domain (memory.gate_same_domain)


@serve.deployment(ray_actor_options={"num_cpus": 0.25}, max_ongoing_requests=64)
@serve.ingress(harness_api)
class HarnessServer:
    """Embedder + a reader of the ``cards`` table."""

    def __init__(
        self,
        memory_uri: str,
        memory: MemoryConfig,
        api_key: str | None = None,
        max_request_bytes: int = 1_000_000,
        max_stage: int | None = None,
    ) -> None:
        from hamo_ray.logs import setup_logging
        from hamo_ray.memory.embed import Embedder

        setup_logging()
        configure_guard(api_key, max_request_bytes)
        self.max_stage = max_stage
        self.embedder = Embedder(memory.embedding_model)
        self.memory_uri = memory_uri
        self.memory = memory
        self._store = None
        self._store_lock = threading.Lock()

    def _get_store(self):
        from hamo_ray.memory.store import MemoryStore

        with self._store_lock:  # sync routes run in a thread pool: the first requests come together
            if self._store is None:
                # The run's index settings (nprobes, refine factor, storage options) apply here too.
                self._store = MemoryStore.from_config(self.memory_uri, self.memory, dim=self.embedder.dim)
        return self._store

    @harness_api.get("/health")
    def health(self) -> dict:
        return {"status": "ok"}

    def retrieve_cards(
        self, goal: str, init_obs: str, k: int, max_stage: int | None = None, domain: str | None = None
    ) -> dict[str, Any]:
        """The cards to inject of the top-``k`` for (goal, init_obs), gated (``memory.gate_*``):
        ``{"cards": [Card as JSON], "scores": [cosine], "withheld": n}`` (ValueError when the memory's
        vector width is not the embedding model's, or ``gate_same_domain`` lacks the ``domain``)."""
        from hamo_ray.memory.embed import key_text
        from hamo_ray.memory.recall import recall

        if self.max_stage is not None:
            max_stage = self.max_stage if max_stage is None else min(max_stage, self.max_stage)
        store = self._get_store()
        query = self.embedder.embed([key_text(goal, init_obs)])
        got = recall(store, query, k, self.memory, [domain], max_stage=max_stage)[0]
        hits, withheld = got.injected, got.withheld
        return {
            "cards": [c.model_dump(mode="json") for c, _ in hits],
            "scores": [float(s) for _, s in hits],
            "withheld": len(withheld),
        }

    @harness_api.post("/retrieve")
    def retrieve(self, req: RetrieveRequest) -> dict:
        try:
            return self.retrieve_cards(req.goal, req.init_obs, req.k, req.max_stage, req.domain)
        except ValueError as exc:
            raise HTTPException(status_code=400, detail=str(exc)) from exc


def build_harness_app(
    memory_uri: str,
    memory: MemoryConfig,
    num_cpus: float = 0.25,
    *,
    api_key: str | None = None,
    max_request_bytes: int = 1_000_000,
    max_stage: int | None = None,
):
    """The harness application for ``serve.run(app, name=..., route_prefix=...)``: the LanceDB memory at
    ``memory_uri`` read with the run's ``memory`` settings (table, the embedding model the cards were
    embedded with, index and storage options), ``num_cpus`` per replica, the guard's key and body
    limit, and a cap ``max_stage`` on the stages retrieved from (None: all)."""
    return HarnessServer.options(ray_actor_options={"num_cpus": num_cpus}).bind(
        memory_uri, memory, api_key, max_request_bytes, max_stage
    )
