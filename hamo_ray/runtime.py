"""Everything that runs beside a stream on Ray: the Serve apps, adapter publishing (connecting to Ray
and the pre-flight checks are ``hamo_ray.cluster``).

One owner for the stream, ``jobs/serve.py`` and ``jobs/sweep.py``, so that they start Ray, name
their Serve applications, guard their routes and publish adapters the same way::

    start_ray(cfg.ray)                          # join a running cluster, else a private local Ray
    services = Services(cfg, folder)            # a run's own endpoint
    endpoint = services.start(model_path)       # harness app (when asked), then the policy app
    services.publish("stage-1", "adapters/stage-1")   # through serve.adapter_store, proven live
    spec = endpoint.spec("stage-1", cfg, seed=0, retrieval=True)   # what rollout actors act with
    services.stop()

**Serve applications.** The policy app is ``serve.app_name`` at ``serve.route_prefix``; the harness
app is ``<app_name>-harness`` at ``<route_prefix>/harness``. A run on a shared endpoint (a sweep
cell) suffixes both its harness app and route with ``-<run id>`` and its adapter names with the run
id, so cells never collide. Every route is behind ``serve.api_key`` when it is set, and the key
travels in every ``PolicySpec``.

**Adapters.** Without ``serve.adapter_store`` the replicas read the run folder's ``adapters/``.
With a store (a folder every node sees, or an object-store URI), each stage folder is copied there
unless the store already holds the same files, and published by its name in the store.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from hamo_ray.config import ConfigError, HamoConfig
from hamo_ray.rollout.client import PolicySpec
from hamo_ray.run_folder import RunFolder

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Endpoint:
    """Where a run's policy and harness answer, and the key they want."""

    base_url: str  # the policy endpoint, e.g. http://127.0.0.1:8000
    harness_url: str | None = None  # None: this run has no harness
    api_key: str | None = None
    tokenizer: str | None = None  # the served backbone's folder: rollouts count prompt tokens with it
    # A replica's own port (serve.direct_rollouts, one replica): rollouts send their chats there, with
    # base_url (Serve's route) as the fallback; None: rollouts use base_url.
    direct_url: str | None = None

    def spec(self, model: str, cfg: HamoConfig, *, seed: int | None, retrieval: bool = False) -> PolicySpec:
        """The ``PolicySpec`` rollout actors act with: served ``model``, the run's sampling, the key.

        Args:
            model: a served name (the base model's or an adapter's).
            cfg: the run's config (``rollout`` sampling, ``memory.top_k``, the model's template variables).
            seed: the episodes' base seed.
            retrieval: inject the harness's cards (needs a harness).
        """
        return PolicySpec(
            base_url=self.direct_url or self.base_url,
            fallback_url=self.base_url if self.direct_url else None,
            model=model,
            temperature=cfg.rollout.temperature,
            max_tokens=cfg.rollout.max_tokens,
            harness_url=self.harness_url if retrieval else None,
            top_k=cfg.memory.top_k,
            timeout_s=cfg.rollout.request_timeout_s,
            seed=seed,
            api_key=self.api_key,
            chat_template_kwargs=cfg.model.template_kwargs(),
            tokenizer=self.tokenizer,
            prompt_budget=cfg.model.max_model_len - cfg.rollout.max_tokens,
            constrain_actions=cfg.rollout.constrain_actions,
        )


@dataclass
class Services:
    """The Serve applications of one run folder, and the publishing of its adapters.

    Args:
        cfg: the run's config (``serve``, ``model``, ``memory``, ``prompt``).
        folder: the run folder (adapters, memory, committed stages).
        harness: start the harness app (retrieval over the run's memory).
        shared_url: an endpoint already serving this run's backbone (a sweep's); None starts one.
        run_id: names this run's apps and adapters on a shared endpoint.
        max_stage: serve adapters and retrieve cards of stages up to this one only (None: all).

    Raises:
        ConfigError: ``serve.adapter_store`` cannot be opened.
    """

    cfg: HamoConfig
    folder: RunFolder
    harness: bool = True
    shared_url: str | None = None
    run_id: str = ""
    max_stage: int | None = None
    endpoint: Endpoint | None = field(default=None, init=False)  # set by start()
    served: dict[int, str] = field(default_factory=dict, init=False)  # stage -> published name
    failed: set[int] = field(default_factory=set, init=False)  # stages not proven live (skipped)

    def __post_init__(self) -> None:
        from hamo_ray.serving.objstore import ObjectStore, ObjectStoreError, is_uri

        location = self.cfg.serve.adapter_store
        self._store = None
        self.adapter_root: str = str(self.folder.adapters_dir)
        if location and not is_uri(location):
            if Path(location).expanduser().resolve() == self.folder.adapters_dir:
                location = None  # the run's own adapters/: nothing to copy
        if location and self.shared_url is None:
            uri = location if is_uri(location) else Path(location).expanduser().resolve().as_uri()
            try:
                self._store = ObjectStore(uri)
            except ObjectStoreError as exc:
                raise ConfigError(f"serve.adapter_store: {exc}") from None
            # A URI: replicas download what they serve; a folder: they read it in place.
            self.adapter_root = location if is_uri(location) else str(Path(location).expanduser().resolve())
        self._harness_app: str | None = None

    @property
    def owns_endpoint(self) -> bool:
        return self.shared_url is None

    def _suffix(self) -> str:
        return "" if self.owns_endpoint else f"-{self.run_id}"

    def adapter_name(self, stage: int, tag: str = "") -> str:
        """The served name of a stage's adapter: ``stage-<t>``; prefixed by the run id when shared."""
        name = f"stage-{stage}{tag}"
        return name if self.owns_endpoint else f"{self.run_id}-{name}"

    def start(self, model_path: str) -> Endpoint:
        """Start the harness app (when asked) and the policy app (unless shared); wait until healthy.

        Returns:
            The endpoint; ``harness_url`` is None without a harness.
        """
        from ray import serve

        from hamo_ray.serving import start_policy_server, wait_healthy
        from hamo_ray.serving.harness import build_harness_app

        cfg, scfg = self.cfg, self.cfg.serve
        if self.owns_endpoint:  # before any app: the HTTP proxy takes serve.host:port
            serve.start(
                http_options={"host": scfg.host, "port": scfg.port},
                logging_config={"enable_access_log": scfg.access_log},
            )
        if self.harness:
            self._harness_app = f"{scfg.app_name}-harness{self._suffix()}"
            route = f"{scfg.route_prefix.rstrip('/')}/harness{self._suffix()}"
            app = build_harness_app(
                self.folder.memory_uri,
                cfg.memory,
                scfg.harness_num_cpus,
                api_key=scfg.api_key,
                max_request_bytes=scfg.max_request_bytes,
                max_stage=self.max_stage,
            )
            serve.run(
                app,
                name=self._harness_app,
                route_prefix=route,
                blocking=False,
                logging_config={"enable_access_log": scfg.access_log},
            )
        url = self.shared_url or start_policy_server(
            model_path,
            cfg.model,
            scfg,
            self.adapter_root,
            max_lora_rank=scfg.max_lora_rank,
        )
        harness_url = None
        if self._harness_app:
            parts = urlsplit(url)
            harness_url = f"{parts.scheme}://{parts.netloc}{route}"
            wait_healthy(harness_url, api_key=scfg.api_key)
        direct = None
        if scfg.direct_rollouts and scfg.num_replicas == 1:
            from hamo_ray.serving import direct_url

            direct = direct_url(url, api_key=scfg.api_key)
            logger.info("rollouts chat with the replica's own port %s (fallback: %s)", direct, url)
        self.endpoint = Endpoint(url, harness_url, scfg.api_key, tokenizer=str(model_path), direct_url=direct)
        return self.endpoint

    def publish(self, name: str, adapter: str | Path) -> dict:
        """Publish an adapter folder under ``name`` and prove it live (see ``publish_adapter``).

        Args:
            name: the new served name.
            adapter: the folder, relative to the run folder (``adapters/stage-1``) or absolute.

        Raises:
            AdapterNotLiveError: it could not be stored, loaded or shown to change the answers.
        """
        from hamo_ray.serving import publish_adapter

        if self.endpoint is None:
            raise RuntimeError("Services.publish before Services.start")
        scfg = self.cfg.serve
        path = self._served_path(self.folder.path / adapter)
        return publish_adapter(
            self.endpoint.base_url,
            name,
            path,
            scfg.probe_prompt,
            scfg.probe_tokens,
            timeout_s=scfg.publish_timeout_s,
            api_key=scfg.api_key,
        )

    def _served_path(self, local: Path) -> str:
        """Where a replica loads ``local`` from: the store (copied there unless it holds it) or in place."""
        from hamo_ray.serving import AdapterNotLiveError
        from hamo_ray.serving.objstore import ObjectStoreError

        if self._store is None:
            return str(local)
        try:
            if local.is_dir():
                self._store.put(local, local.name)
            elif not self._store.exists(local.name):
                raise AdapterNotLiveError(f"{local.name} is neither in serve.adapter_store nor at {local}")
        except (ObjectStoreError, OSError) as exc:
            raise AdapterNotLiveError(f"cannot put {local} into serve.adapter_store: {exc}") from exc
        return local.name

    def publish_committed(self, strict: bool = True) -> list[str]:
        """Publish the committed stages' adapters not served yet (a resumed run, a following server).

        Args:
            strict: raise on the first adapter that cannot be proven live; else log it and skip it.

        Returns:
            The names published by this call.

        Raises:
            AdapterNotLiveError: with ``strict``.
        """
        from hamo_ray.serving import AdapterNotLiveError

        published = []
        for result in self.folder.stages():
            stage = result.stage
            if not result.adapter or stage in self.served or stage in self.failed:
                continue
            if self.max_stage is not None and stage > self.max_stage:
                continue
            try:
                info = self.publish(result.adapter_name, result.adapter)
            except AdapterNotLiveError:
                if strict:
                    raise
                logger.exception("stage %d adapter %s not published", stage, result.adapter)
                self.failed.add(stage)
                continue
            self.served[stage] = result.adapter_name
            published.append(result.adapter_name)
            logger.info("published stage %d as %r (%s)", stage, result.adapter_name, info["status"])
        return published

    def stop(self) -> None:
        """Delete this run's harness app and, when it owns it, the policy app (Serve stops when idle)."""
        from ray import serve

        from hamo_ray.serving import shutdown_policy_server

        try:
            if self._harness_app:
                serve.delete(self._harness_app)
            if self.owns_endpoint:
                shutdown_policy_server(self.cfg.serve)
        except Exception:  # Serve already gone (the driver's Ray went down first)
            logger.debug("serve shutdown failed", exc_info=True)


def shared_serve_cfg(cfg: HamoConfig, index: int):
    """The ``ServeConfig`` of a sweep's ``index``-th shared endpoint (one per backbone)."""
    return cfg.serve.model_copy(update={"app_name": f"{cfg.serve.app_name}-{index}"})


def start_shared_policy(cfg: HamoConfig, model_path: str, index: int) -> str:
    """Start a policy endpoint that several runs share (a sweep's cells with one backbone).

    Adapters are published by absolute path inside ``run.root``; each run names its own
    (``Services(shared_url=..., run_id=...)``).

    Returns:
        The endpoint's base URL.
    """
    from ray import serve

    from hamo_ray.serving import start_policy_server

    scfg = shared_serve_cfg(cfg, index)
    serve.start(
        http_options={"host": scfg.host, "port": scfg.port},
        logging_config={"enable_access_log": scfg.access_log},
    )
    return start_policy_server(
        model_path,
        cfg.model,
        scfg,
        str(Path(cfg.run.root).resolve()),
        max_lora_rank=scfg.max_lora_rank,
    )


def stop_shared_policy(cfg: HamoConfig, index: int) -> None:
    """Stop what :func:`start_shared_policy` started."""
    from hamo_ray.serving import shutdown_policy_server

    shutdown_policy_server(shared_serve_cfg(cfg, index))
