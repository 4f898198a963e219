"""The harness as a service: experience retrieval over the LanceDB memory, on Ray Serve.

Rollout actors (and, through ``jobs/serve.py``, any client) ask it for the top-k cards of a
(goal, initial observation); the embedding model loads once per replica, and each request reads
the table's latest version, so cards written by the stream are visible at once.

    POST {route}/retrieve  {"goal": "...", "init_obs": "...", "k": 2, "max_stage": null}
      -> {"cards": [Card, ...], "scores": [float, ...]}
    GET  {route}/health
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, HTTPException
from pydantic import BaseModel, ConfigDict, Field
from ray import serve

logger = logging.getLogger(__name__)

harness_api = FastAPI(title="hamo harness")


class RetrieveRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    goal: str = Field(max_length=20_000)
    init_obs: str = Field(default="", max_length=100_000)
    k: int = Field(default=2, ge=1, le=50)
    max_stage: int | None = None


@serve.deployment(ray_actor_options={"num_cpus": 0.25}, max_ongoing_requests=64)
@serve.ingress(harness_api)
class HarnessServer:
    """Embedder + a reader of the ``cards`` table."""

    def __init__(self, memory_uri: str, table: str, embedding_model: str) -> None:
        from hamo_ray.logs import setup_logging
        from hamo_ray.memory.embed import Embedder

        setup_logging()
        self.embedder = Embedder(embedding_model)
        self.memory_uri = memory_uri
        self.table = table
        self._store = None

    def _get_store(self):
        from hamo_ray.memory.store import MemoryStore

        if self._store is None:
            self._store = MemoryStore(self.memory_uri, self.table, dim=self.embedder.dim)
        return self._store

    @harness_api.get("/health")
    def health(self) -> dict:
        return {"status": "ok"}

    @harness_api.post("/retrieve")
    def retrieve(self, req: RetrieveRequest) -> dict:
        from hamo_ray.memory.embed import key_text

        store = self._get_store()
        if store.count() == 0:
            return {"cards": [], "scores": []}
        vector = self.embedder.embed([key_text(req.goal, req.init_obs)])
        try:
            hits = store.search(vector, k=req.k, max_stage=req.max_stage)[0]
        except ValueError as exc:
            raise HTTPException(status_code=400, detail=str(exc)) from exc
        return {"cards": [c.model_dump(mode="json") for c, _ in hits], "scores": [float(s) for _, s in hits]}


def build_harness_app(memory_uri: str, table: str, embedding_model: str, num_cpus: float = 0.25):
    """The harness application, ready for ``serve.run(app, name=..., route_prefix=...)``."""
    return HarnessServer.options(ray_actor_options={"num_cpus": num_cpus}).bind(
        memory_uri, table, embedding_model
    )
