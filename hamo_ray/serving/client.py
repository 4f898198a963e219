"""Driver-side API of the policy endpoint: start it, publish an adapter and prove it live, stop it.

::

    url = start_policy_server(model_path, cfg.model, cfg.serve, run_dir / "adapters")
    info = publish_adapter(url, "stage-1", run_dir / "adapters/stage-1", cfg.serve.probe_prompt,
                           cfg.serve.probe_tokens)
    client = openai.OpenAI(base_url=url + "/v1", api_key="EMPTY")
    shutdown_policy_server(cfg.serve)

Only ``start_policy_server``/``shutdown_policy_server`` need Ray (a connected driver); the HTTP calls
use httpx from any process that reaches the URL, with ``api_key=`` when the endpoint has one.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import httpx

from hamo_ray.config import ServeConfig

logger = logging.getLogger(__name__)


class PolicyServerError(RuntimeError):
    """The policy endpoint did not come up (or answered something unexpected)."""


class AdapterNotLiveError(RuntimeError):
    """A published adapter could not be shown to be served: not loaded, not listed, or no effect."""


def base_url(serve_cfg: ServeConfig) -> str:
    """``http://host:port[prefix]`` of the endpoint (a wildcard host becomes this node's IP)."""
    host = serve_cfg.host
    if host in ("0.0.0.0", "::", ""):
        import ray

        host = ray.util.get_node_ip_address()
    return f"http://{host}:{serve_cfg.port}{(serve_cfg.route_prefix or '/').rstrip('/')}"


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def wait_healthy(
    url: str, timeout_s: float = 300.0, instance: str | None = None, *, api_key: str | None = None
) -> None:
    """Poll ``GET {url}/health`` until 200 (from deployment ``instance``, when given); else PolicyServerError."""
    deadline, last = time.monotonic() + timeout_s, "no answer"
    while time.monotonic() < deadline:
        try:
            r = httpx.get(f"{url}/health", timeout=10.0, headers=auth_headers(api_key))
            if r.status_code == 200:
                if instance is None or r.json().get("instance") == instance:
                    return
                raise PolicyServerError(
                    f"{url} is answered by another server ({r.text[:200]}); is the port taken by another "
                    "process or Ray cluster? Choose another serve.port."
                )
            last = f"{r.status_code} {r.text[:200]}"
        except httpx.HTTPError as exc:
            last = repr(exc)
        time.sleep(1.0)
    raise PolicyServerError(f"policy server at {url} not healthy after {timeout_s:.0f}s: {last}")


def direct_url(url: str, *, api_key: str | None = None) -> str | None:
    """The URL one replica of the endpoint at ``url`` serves on itself, without Serve's proxy hop.

    Same app and guard, at the root (no route prefix); the replica ``/health`` reached. None from a
    server that has none.
    """
    r = httpx.get(f"{url}/health", timeout=30.0, headers=auth_headers(api_key))
    r.raise_for_status()
    return r.json().get("direct_url")


def greedy_probe(client: httpx.Client, url: str, model: str, prompt: str, tokens: int) -> dict[str, Any]:
    """``model``'s greedy answer to ``prompt`` (``tokens`` tokens): its text, token ids and logprobs."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "temperature": 0.0,
        "max_tokens": tokens,
        "logprobs": True,
        "return_tokens_as_token_ids": True,
    }
    r = client.post(f"{url}/v1/chat/completions", json=body)
    if r.status_code != 200:
        raise AdapterNotLiveError(f"probe request to {model!r} failed: {r.status_code} {r.text[:500]}")
    choice = r.json()["choices"][0]
    content = (choice.get("logprobs") or {}).get("content") or []
    return {
        "text": choice["message"]["content"],
        "tokens": [int(c["token"].removeprefix("token_id:")) for c in content],
        "logprobs": [float(c["logprob"]) for c in content],
    }


def _load_and_probe(base_url, name, path, probe_prompt, probe_tokens, timeout_s, api_key):
    """Load ``name`` from ``path``, check it is listed, probe it and the base: (load answer, base name, probes)."""
    with httpx.Client(timeout=timeout_s, headers=auth_headers(api_key)) as client:
        r = client.post(f"{base_url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})
        if r.status_code != 200:
            raise AdapterNotLiveError(
                f"loading adapter {name!r} from {str(path)!r} failed: {r.status_code} {r.text}"
            )
        loaded = r.json()
        models = client.get(f"{base_url}/v1/models").json()["data"]
        if name not in {m["id"] for m in models}:
            raise AdapterNotLiveError(f"adapter {name!r} loaded but not listed by /v1/models")
        base = next(m["id"] for m in models if m.get("parent") is None)
        live = greedy_probe(client, base_url, name, probe_prompt, probe_tokens)
        ref = greedy_probe(client, base_url, base, probe_prompt, probe_tokens)
    return loaded, base, live, ref


def publish_adapter(
    base_url: str,
    name: str,
    path: str | Path,
    probe_prompt: str,
    probe_tokens: int,
    *,
    min_logprob_diff: float = 1e-4,
    timeout_s: float = 600.0,
    api_key: str | None = None,
) -> dict[str, Any]:
    """Load the adapter in ``path`` (inside the server's adapter root) under ``name`` and prove it live.

    Live: ``/v1/models`` lists ``name``, and a greedy probe (``probe_tokens`` tokens answering
    ``probe_prompt``) naming it differs from the base model's, in its tokens or in a token's logprob
    by more than ``min_logprob_diff`` (an adapter that changes nothing is not provably live).
    Republishing the same name and folder is fine.

    Returns:
        ``{"name", "path", "lora_int_id", "status", "base", "text", "base_text", "tokens",
        "base_tokens", "tokens_differ", "max_logprob_diff", "seconds"}``.

    Raises:
        AdapterNotLiveError: the load was refused, the adapter is not listed or has no effect, or an
        answer took longer than ``timeout_s``.
    """
    t0 = time.monotonic()
    try:
        loaded, base, live, ref = _load_and_probe(
            base_url, name, path, probe_prompt, probe_tokens, timeout_s, api_key
        )
    except httpx.TimeoutException as exc:
        raise AdapterNotLiveError(
            f"publishing adapter {name!r}: no answer from {base_url} within {timeout_s:g} s "
            f"(serve.publish_timeout_s; on CPU the first adapter request compiles vLLM's LoRA kernels): {exc!r}"
        ) from exc
    max_diff = max((abs(a - b) for a, b in zip(live["logprobs"], ref["logprobs"], strict=False)), default=0.0)
    tokens_differ = live["tokens"] != ref["tokens"]
    if not tokens_differ and max_diff <= min_logprob_diff:
        raise AdapterNotLiveError(
            f"adapter {name!r} answers the probe exactly like the base model {base!r} "
            f"(max logprob difference {max_diff:.2e}): it is not provably live"
        )
    logger.info("adapter %r live (tokens differ: %s, max logprob diff %.3g)", name, tokens_differ, max_diff)
    return {
        "lora_int_id": loaded["lora_int_id"],
        "status": loaded["status"],
        "name": name,
        "path": loaded["lora_path"],
        "base": base,
        "text": live["text"],
        "base_text": ref["text"],
        "tokens": live["tokens"],
        "base_tokens": ref["tokens"],
        "tokens_differ": tokens_differ,
        "max_logprob_diff": max_diff,
        "seconds": time.monotonic() - t0,
    }


PREFIX_QUERIES, PREFIX_HITS = "vllm:prefix_cache_queries", "vllm:prefix_cache_hits"


def prefix_cache_counters(url: str, api_key: str | None = None) -> tuple[float, float] | None:
    """vLLM's prefix-cache counters from ``GET {url}/metrics``, summed over replicas and labels:
    (prompt tokens queried, tokens hit); None when not reported or unreachable. The hit rate of a
    piece of work is ``hit_rate(before, after)``."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        resp = httpx.get(f"{url}/metrics", headers=auth_headers(api_key), timeout=30)
        resp.raise_for_status()
    except httpx.HTTPError:
        logger.debug("metrics unreachable at %s", url, exc_info=True)
        return None
    totals = {PREFIX_QUERIES: 0.0, PREFIX_HITS: 0.0}
    seen = False
    for family in text_string_to_metric_families(resp.text):
        for sample in family.samples:
            for name in totals:
                if sample.name in (name, f"{name}_total"):
                    totals[name] += sample.value
                    seen = True
    return (totals[PREFIX_QUERIES], totals[PREFIX_HITS]) if seen else None


def hit_rate(before: tuple[float, float] | None, after: tuple[float, float] | None) -> float | None:
    """The prefix-cache hit rate between two ``prefix_cache_counters`` readings (None if unknown)."""
    if before is None or after is None or after[0] <= before[0]:
        return None
    return (after[1] - before[1]) / (after[0] - before[0])
