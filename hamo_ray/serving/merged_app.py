"""The driver's side of acting on merged weights (``hamo_ray.serving.merged`` has the replica's side and
says why): the merged app deployed for one adapter at a time (:class:`MergedApp`), the check that its
engine states the weights asked for (:func:`check_serves`), and the greedy agreement probe of LoRA
against merged (:func:`probe_agreement`).
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import httpx

from hamo_ray.serving.client import auth_headers, greedy_probe
from hamo_ray.serving.merged import AGREEMENT_TOLERANCE, MergedWeightsError

logger = logging.getLogger(__name__)


def check_serves(url: str, name: str, *, api_key: str | None = None, timeout_s: float = 60.0) -> None:
    """Raise MergedWeightsError unless the engine at ``url`` states it holds the weights named ``name``:
    ``/health`` says ``model == name`` and ``/v1/models`` lists exactly ``name``."""
    headers = auth_headers(api_key)
    try:
        health = httpx.get(f"{url}/health", headers=headers, timeout=timeout_s)
        models = httpx.get(f"{url}/v1/models", headers=headers, timeout=timeout_s)
    except httpx.HTTPError as exc:
        raise MergedWeightsError(f"merged engine at {url} unreachable: {exc!r}") from exc
    if health.status_code != 200 or models.status_code != 200:
        raise MergedWeightsError(
            f"merged engine at {url}: /health {health.status_code}, /v1/models {models.status_code}"
        )
    served = health.json().get("model")
    ids = sorted(m["id"] for m in models.json().get("data", []))
    if served != name or ids != [name]:
        raise MergedWeightsError(
            f"the merged engine at {url} serves {served!r} (models {ids}), not {name!r}: stale weights"
        )


def probe_agreement(
    url: str, name: str, merged_url: str, prompt: str, tokens: int, *, api_key: str | None = None
) -> dict[str, Any]:
    """A greedy probe of ``name`` through LoRA (``url``) and merged (``merged_url``): ``{"tokens_equal",
    "max_logprob_diff" (over the common prefix), "agree" (tokens equal or diff <= AGREEMENT_TOLERANCE)}``."""
    with httpx.Client(timeout=600.0, headers=auth_headers(api_key)) as client:
        lora = greedy_probe(client, url, name, prompt, tokens)
        merged = greedy_probe(client, merged_url, name, prompt, tokens)
    n = 0
    while n < min(len(lora["tokens"]), len(merged["tokens"])) and lora["tokens"][n] == merged["tokens"][n]:
        n += 1
    diffs = [abs(a - b) for a, b in zip(lora["logprobs"][: n + 1], merged["logprobs"][: n + 1], strict=False)]
    equal = lora["tokens"] == merged["tokens"]
    max_diff = max(diffs, default=0.0)
    return {
        "tokens_equal": equal,
        "max_logprob_diff": max_diff,
        "agree": equal or max_diff <= AGREEMENT_TOLERANCE,
        "lora_text": lora["text"],
        "merged_text": merged["text"],
    }


@dataclass
class MergedApp:
    """One run's merged-weights policy app (at most one adapter at a time), deployed by the driver.

    ``ensure(name, path)`` serves adapter ``name`` (``path`` as publishing gave it: inside the adapter
    root) merged, replacing whatever the app served, and checks the engine states ``name``; ``stop()``
    deletes the app. Returns ``(url, direct_url)``: Serve's route and the replica's own port.

    ``swap`` (``serve.merged_swap``, one replica): the app's engine starts once, from the base folder,
    and each later adapter's merged weights are loaded into it in place (``PolicyServer.swap``, a few
    seconds); a failed swap deploys the app again (a new engine from the merged folder's weights).
    ``ensure(None, None)`` serves the base weights as ``base_name``. Without ``swap`` every adapter gets
    a new deployment (an engine started from its merged folder).
    """

    model_path: str
    model_cfg: Any  # ModelConfig
    serve_cfg: Any  # ServeConfig: app_name/route_prefix are the merged app's
    adapter_root: str
    max_lora_rank: int
    timeout_s: float = 600.0
    swap: bool = False
    base_name: str = ""
    serving: str | None = None  # the name the app serves (an adapter's, or base_name)
    url: str | None = None
    direct: str | None = None
    swaps: list = field(default_factory=list)  # each in-place load's timings (PolicyServer.swap)

    def ensure(self, name: str | None, path: str | None) -> tuple[str, str | None]:
        served = name if name is not None else self.base_name
        if self.serving == served and self.url is not None:
            try:
                check_serves(self.url, served, api_key=self.serve_cfg.api_key)
                return self.url, self.direct
            except MergedWeightsError as exc:  # replaced replica, or someone else's app: redeploy
                logger.warning("%s; deploying it again", exc)
        elif self.url is not None and self.swap and self.serve_cfg.num_replicas == 1:
            try:
                self.swap_to(name, path)
                return self.url, self.direct
            except Exception as exc:  # noqa: BLE001 (any failure: a fresh engine is always right)
                logger.warning(
                    "in-place weights of %r failed (%r); deploying the merged app again", served, exc
                )
        if name is None and not self.swap:
            raise MergedWeightsError("the base weights are served merged only by a swapping app")
        self.deploy(name, path)
        return self.url, self.direct

    def swap_to(self, name: str | None, path: str | None) -> None:
        """Load ``name``'s merged weights (the base weights for None) into the running app's engine."""
        from ray import serve

        t0, served = time.monotonic(), name if name is not None else self.base_name
        self.serving = None
        handle = serve.get_app_handle(self.serve_cfg.app_name)
        info = handle.swap.remote(name, path).result(timeout_s=self.timeout_s)
        check_serves(self.url, served, api_key=self.serve_cfg.api_key)
        self.serving = served
        self.swaps.append({**info, "wall_s": round(time.monotonic() - t0, 2)})
        logger.info("merged weights of %r loaded in place at %s in %.1fs: %s", served, self.url,
                    time.monotonic() - t0, info)  # fmt: skip

    def deploy(self, name: str | None, path: str | None) -> None:
        from ray import serve

        from hamo_ray.serving.app import build_app
        from hamo_ray.serving.client import base_url, direct_url, wait_healthy
        from hamo_ray.serving.deploy import running_http

        t0, scfg, instance = time.monotonic(), self.serve_cfg, uuid.uuid4().hex
        served = name if name is not None else self.base_name
        self.serving = None
        app = build_app(
            self.model_path,
            self.model_cfg.model_copy(update={"name": served}),
            scfg,
            self.adapter_root,
            self.max_lora_rank,
            instance,
            merged={
                "name": name, "path": None if path is None else str(path), "slot": scfg.app_name,
                "swap": self.swap, "base_name": self.base_name,
            },
        )  # fmt: skip
        serve.run(
            app,
            name=scfg.app_name,
            route_prefix=scfg.route_prefix,
            blocking=False,
            logging_config={"enable_access_log": scfg.access_log},
        )
        url = base_url(running_http(scfg))
        try:
            wait_healthy(url, self.timeout_s, instance, api_key=scfg.api_key)
        except Exception as exc:
            raise MergedWeightsError(f"merged engine for {name!r} did not come up: {exc}") from exc
        check_serves(url, served, api_key=scfg.api_key)
        self.url, self.serving = url, served
        self.direct = direct_url(url, api_key=scfg.api_key) if scfg.num_replicas == 1 else None
        logger.info("merged weights of %r served at %s after %.1fs", name, url, time.monotonic() - t0)

    def stop(self) -> None:
        from ray import serve

        self.serving = self.url = self.direct = None
        try:
            serve.delete(self.serve_cfg.app_name)
        except Exception:  # Serve gone
            logger.debug("deleting the merged app failed", exc_info=True)
