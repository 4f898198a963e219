"""Clients that rollout actors use: the policy endpoint and the harness (experience retrieval).

Both speak HTTP to the Ray Serve app, so an actor on any node of the cluster reaches them, and a
request from many concurrent episodes arrives batched at the vLLM engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hamo_ray.types import Card


@dataclass(frozen=True)
class PolicySpec:
    """How rollout actors act: which endpoint, which served model, which sampling, which harness."""

    base_url: str  # the policy endpoint, e.g. http://127.0.0.1:8000 (or one replica's own port)
    model: str  # served model name: the base or a stage adapter
    temperature: float = 0.7
    max_tokens: int = 32
    harness_url: str | None = None  # experience retrieval; None: no injected experience
    # Where chats go when base_url (a replica's own port) refuses connections: Serve's route, which
    # reaches the replica that replaced it. None: no fallback.
    fallback_url: str | None = None
    top_k: int = 2
    timeout_s: float = 120.0
    seed: int | None = None
    # Chat template variables sent with every request (ModelConfig.template_kwargs(): enable_thinking,
    # ...), so the server renders exactly what training rendered, whatever its own defaults.
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    # The template text the server renders with when model.chat_template is set (ModelConfig.template_text());
    # the actors count prompt tokens with it. Never sent: the server has it (a request's own is refused).
    chat_template: str | None = field(default=None, repr=False)
    # The context rule's prompt-token budget (model.max_model_len - rollout.max_tokens) and the tokenizer
    # folder it is counted with (the backbone's); None: only prompt.history_turns trims the history.
    tokenizer: str | None = None
    prompt_budget: int | None = None
    # Constrain each reply to the environment's admissible commands where its domain lists them
    # (rollout.constrain_actions; the actor sends the regex with every chat).
    constrain_actions: bool = False
    # The endpoint's serve.api_key, sent as a bearer token to both apps (kept out of reprs and logs).
    api_key: str | None = field(default=None, repr=False)


class PolicyClient:
    """Async OpenAI-compatible chat client for one ``PolicySpec`` (one per actor, connection-pooled)."""

    def __init__(self, spec: PolicySpec) -> None:
        import httpx

        self.spec = spec
        self.url = spec.base_url
        headers = {"Authorization": f"Bearer {spec.api_key}"} if spec.api_key else {}
        self._http = httpx.AsyncClient(
            timeout=spec.timeout_s, limits=httpx.Limits(max_connections=256), headers=headers
        )

    async def act(
        self, messages: list[dict[str, str]], seed: int | None = None, regex: str | None = None
    ) -> tuple[str, int]:
        """The model's reply to ``messages`` (raw text; the caller cleans it) and its completion tokens.

        ``regex``: a pattern the reply must match (vLLM's ``structured_outputs``), e.g. the admissible
        commands (``hamo_ray.chat.action_regex``).
        """
        body = {
            "model": self.spec.model,
            "messages": messages,
            "temperature": self.spec.temperature,
            "max_tokens": self.spec.max_tokens,
        }
        if self.spec.chat_template_kwargs:
            body["chat_template_kwargs"] = self.spec.chat_template_kwargs
        if seed is not None:
            body["seed"] = seed
        if regex is not None:
            body["structured_outputs"] = {"regex": regex}
        import httpx

        try:
            resp = await self._http.post(f"{self.url}/v1/chat/completions", json=body)
        except httpx.ConnectError:
            if not self.spec.fallback_url or self.url == self.spec.fallback_url:
                raise
            self.url = self.spec.fallback_url  # the replica is gone: Serve's route from now on
            resp = await self._http.post(f"{self.url}/v1/chat/completions", json=body)
        if resp.status_code != 200:
            raise RuntimeError(f"policy endpoint answered {resp.status_code}: {resp.text[:300]}")
        data = resp.json()
        tokens = int((data.get("usage") or {}).get("completion_tokens") or 0)
        return data["choices"][0]["message"]["content"] or "", tokens

    async def retrieve(self, goal: str, init_obs: str, domain: str | None = None) -> list[Card]:
        """Top-k experience cards for (goal, initial observation) from the harness (gated by the harness's
        ``memory.gate_*``; ``domain``, the episode's, for ``gate_same_domain``)."""
        return (await self.recall(goal, init_obs, domain))[0]

    async def recall(self, goal: str, init_obs: str, domain: str | None = None) -> tuple[list[Card], int]:
        """``retrieve``'s cards and how many the harness's gate withheld."""
        if not self.spec.harness_url:
            return [], 0
        body = {"goal": goal, "init_obs": init_obs, "k": self.spec.top_k}
        if domain is not None:
            body["domain"] = domain
        resp = await self._http.post(f"{self.spec.harness_url}/retrieve", json=body)
        if resp.status_code != 200:
            raise RuntimeError(f"harness answered {resp.status_code}: {resp.text[:300]}")
        data = resp.json()
        return [Card.model_validate(c) for c in data["cards"]], int(data.get("withheld", 0))

    async def aclose(self) -> None:
        await self._http.aclose()
