"""Everything that runs beside a stream on Ray: the Serve apps, adapter publishing (connecting to Ray
and the pre-flight checks are ``hamo_ray.run.cluster``).

One owner for the stream, ``jobs/serve.py`` and ``jobs/sweep.py``, so that they start Ray, name
their Serve applications, guard their routes and publish adapters the same way::

    start_ray(cfg.ray)                          # join a running cluster, else a private local Ray
    services = Services(cfg, folder)            # a run's own endpoint
    endpoint = services.start(model_path)       # harness app (when asked), then the policy app
    services.publish("stage-1", "adapters/stage-1")   # through serve.adapter_store, proven live
    spec = endpoint.spec("stage-1", cfg, seed=0, retrieval=True)   # what rollout actors act with
    services.stop()

**Serve applications.** Named after the run id (``hamo_ray.naming``): the policy app
``hamo-<run id>`` at ``/<run id>`` (or ``serve.app_name`` at ``serve.route_prefix`` when given), the
harness app ``<app>-harness`` at ``<route>/harness``. A run on a shared endpoint (a sweep cell) names
its harness app and route and its adapter names after its run id, so cells never collide. A job
deploys only names no app on the cluster has (a leftover of a killed attempt of the same run folder
excepted) and deletes only the apps it deployed; it stops Serve only if it started it and nothing else
runs there. Every route is behind ``serve.api_key`` when it is set, and the key travels in every
``PolicySpec``.

**Adapters.** Without ``serve.adapter_store`` the replicas read the run folder's ``adapters/``.
With a store (a folder every node sees, or an object-store URI), the run has its own prefix there
(``<store>/<run id>/``, its registry of served names too): each stage folder is copied there unless the
store already holds the same files, and published by its name in the store.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from urllib.parse import urlsplit

from hamo_ray.config import ConfigError, HamoConfig
from hamo_ray.naming import (
    APPS_FILE,
    cell_harness_names,
    memory_table,
    merged_names,
    serve_names,
    store_prefix,
    sweep_name,
)
from hamo_ray.rollout.client import PolicySpec
from hamo_ray.run.folder import RunFolder
from hamo_ray.run.serve_apps import delete_apps, delete_leftovers, lease_and_claim, start_serve
from hamo_ray.serving.adapters import DIGEST_CHARS

logger = logging.getLogger(__name__)

PUBLISH_RETRY_S = 30.0  # a following server's first retry of an adapter not proven live
PUBLISH_RETRY_MAX_S = 600.0


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

    def wait_healthy(self, timeout_s: float) -> None:
        """Block until the policy app (Serve's route: a replaced replica too) and the harness answer healthy.

        Raises:
            PolicyServerError: not healthy within ``timeout_s``.
        """
        from hamo_ray.serving.client import wait_healthy

        wait_healthy(self.base_url, timeout_s, api_key=self.api_key)
        if self.harness_url:
            wait_healthy(self.harness_url, timeout_s, api_key=self.api_key)

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
            chat_template=cfg.model.template_text(),
            tokenizer=self.tokenizer,
            prompt_budget=cfg.prompt_budget,
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
        run_id: names this run's apps, adapter-store prefix and shared adapter names (default: the
            run folder's name, which is the run id).
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
    # Stages whose adapter was not proven live: stage -> (attempts, monotonic time of the next try). A
    # following server tries again after PUBLISH_RETRY_S * 2^(attempts - 1) (at most PUBLISH_RETRY_MAX_S).
    failed: dict[int, tuple[int, float]] = field(default_factory=dict, init=False)
    # Adapter name -> the path it was published from (what a merged engine loads; hamo_ray/serving/merged.py)
    published: dict[str, str] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        from hamo_ray.serving.objstore import ObjectStore, ObjectStoreError, is_uri

        self.run_id = self.run_id or self.folder.path.name
        location = self.cfg.serve.adapter_store
        self._store = None
        self.adapter_root: str = str(self.folder.adapters_dir)
        if location and not is_uri(location):
            if Path(location).expanduser().resolve() == self.folder.adapters_dir:
                location = None  # the run's own adapters/: nothing to copy
        if location and self.shared_url is None:
            location = store_prefix(location, self.run_id)  # runs sharing a store never share a name
            uri = location if is_uri(location) else Path(location).expanduser().resolve().as_uri()
            try:
                self._store = ObjectStore(uri)
            except ObjectStoreError as exc:
                raise ConfigError(f"serve.adapter_store: {exc}") from None
            # A URI: replicas download what they serve; a folder: they read it in place.
            self.adapter_root = location if is_uri(location) else str(Path(location).expanduser().resolve())
        self._harness_app: str | None = None
        self._created: list[str] = []  # the Serve apps this object deployed (stop() deletes them)
        self._merged = None  # serving.merged.MergedApp, once a stage acts on merged weights
        self._model_path: str | None = None

    @property
    def owns_endpoint(self) -> bool:
        return self.shared_url is None

    def app_names(self) -> tuple[str | None, str | None, str, str]:
        """(policy app, its route, harness app, its route) of this run; the policy pair is None on a shared
        endpoint (the sweep's). See ``hamo_ray.naming``."""
        scfg = self.cfg.serve
        if self.owns_endpoint:
            return serve_names(scfg, self.run_id)
        sweep = sweep_name(self.cfg.run.root)
        return (None, None, *cell_harness_names(scfg, sweep, self.shared_url or "", self.run_id))

    def adapter_name(self, stage: int, tag: str = "", digest: str = "") -> str:
        """The served name of a stage's adapter: ``stage-<t><tag>:<digest>``, prefixed by the run id when
        shared.

        ``digest``: the adapter folder's content hash (``objstore.folder_digest``); its first 12 hex
        digits name the weights, so a redone stage's new weights are served under a new name (never the
        first attempt's under the old one), and a replica refuses a folder whose files no longer match.
        """
        name = f"stage-{stage}{tag}" + (f":{digest[:DIGEST_CHARS]}" if digest else "")
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
        policy_app, policy_route, harness_app, route = self.app_names()
        wanted = [n for n in (harness_app if self.harness else None, policy_app) if n]
        # Refused before anything is deployed: an app of one of these names that this job did not create
        # (the lease first: no other job can pass the check for these names until this one deletes them).
        running = lease_and_claim(wanted, self.folder.path / APPS_FILE)
        self._created = wanted
        delete_leftovers(self.folder.path / APPS_FILE, set(wanted), running)
        if self.owns_endpoint:  # before any app: the HTTP proxy takes serve.host:port
            start_serve(scfg)
        if self.harness:
            self._harness_app = harness_app
            # The harness reads the run's own table (named after the run id in a shared memory.uri).
            memory = cfg.memory.model_copy(update={"table": memory_table(cfg.memory, self.run_id)})
            app = build_harness_app(
                self.folder.memory_uri,
                memory,
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
            scfg.model_copy(update={"app_name": policy_app, "route_prefix": policy_route}),
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
        self._model_path = str(model_path)
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
        info = publish_adapter(
            self.endpoint.base_url,
            name,
            path,
            scfg.probe_prompt,
            scfg.probe_tokens,
            timeout_s=scfg.publish_timeout_s,
            api_key=scfg.api_key,
        )
        self.published[name] = path
        return info

    def eval_weights(self) -> str:
        """``serve.eval_weights`` resolved: ``merged`` or ``adapter`` (``auto``: merged without GPUs)."""
        from hamo_ray.serving.merged import resolve_eval_weights

        scfg = self.cfg.serve
        gpus = scfg.num_gpus > 0
        if not gpus and scfg.eval_weights == "auto":
            import ray

            gpus = ray.is_initialized() and ray.cluster_resources().get("GPU", 0) > 0
        return resolve_eval_weights(scfg.eval_weights, gpus=gpus)

    def acting(self, name: str | None) -> Endpoint:
        """The endpoint a stage's rollouts act on as served ``name`` (None: the base model).

        With merged weights (:meth:`eval_weights`) and an adapter this object published (or the base,
        with ``serve.merged_swap``): the run's merged app serving ``name`` (its ``/health`` and
        ``/v1/models`` checked to state it, its greedy probe against the run's endpoint's); else, or when
        any of that fails (logged), the run's endpoint. Either way the rollouts ask for ``name``."""
        from hamo_ray.serving.merged_app import MergedApp, probe_agreement

        if self.endpoint is None:
            raise RuntimeError("Services.acting before Services.start")
        scfg = self.cfg.serve
        if self.eval_weights() != "merged" or (name not in self.published if name else not scfg.merged_swap):
            return self.endpoint
        try:
            if self._merged is None:
                app, route = merged_names(*self.app_names())
                lease_and_claim([app], self.folder.path / APPS_FILE)
                self._created.append(app)
                mcfg = scfg.model_copy(update={"app_name": app, "route_prefix": route})
                self._merged = MergedApp(
                    self._model_path or "", self.cfg.model, mcfg, self.adapter_root, scfg.max_lora_rank,
                    scfg.publish_timeout_s, swap=scfg.merged_swap, base_name=self.cfg.model.name,
                )  # fmt: skip
            url, direct = self._merged.ensure(name, None if name is None else self.published[name])
            served = self.cfg.model.name if name is None else name
            base, prompt, tokens = self.endpoint.base_url, scfg.probe_prompt, scfg.probe_tokens
            agree = probe_agreement(base, served, url, prompt, tokens, api_key=scfg.api_key)
            if not agree["agree"]:
                raise RuntimeError(f"merged and LoRA answers of {served!r} disagree: {agree}")
        except Exception:
            logger.exception("acting as %r on the run's endpoint (merged weights failed)", name)
            self.stop_acting(force=True)
            return self.endpoint
        logger.info("acting as %r on merged weights at %s (probe: %s)", name, url, agree)
        return replace(self.endpoint, base_url=url, direct_url=direct)

    def stop_acting(self, force: bool = False) -> None:
        """After a stage's acting: delete the merged app (if one runs), so its engine's memory goes back
        before the next stage; an app that takes weights in place (``serve.merged_swap``) stays up for
        the next stage unless ``force`` (it is deleted with the run's other apps by :meth:`stop`)."""
        if self._merged is not None and (force or not self._merged.swap):
            self._merged.stop()

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

        published, now = [], time.monotonic()
        for result in self.folder.stages():
            stage = result.stage
            if not result.adapter or stage in self.served or now < self.failed.get(stage, (0, 0.0))[1]:
                continue
            if self.max_stage is not None and stage > self.max_stage:
                continue
            try:
                info = self.publish(result.adapter_name, result.adapter)
            except AdapterNotLiveError:
                if strict:
                    raise
                attempts = self.failed.get(stage, (0, 0.0))[0] + 1
                wait = min(PUBLISH_RETRY_MAX_S, PUBLISH_RETRY_S * 2 ** (attempts - 1))
                self.failed[stage] = (attempts, now + wait)
                logger.exception(
                    "stage %d adapter %s not published (attempt %d); trying again in %.0f s",
                    stage, result.adapter, attempts, wait,
                )  # fmt: skip
                continue
            self.failed.pop(stage, None)
            self.served[stage] = result.adapter_name
            published.append(result.adapter_name)
            logger.info("published stage %d as %r (%s)", stage, result.adapter_name, info["status"])
        return published

    def stop(self) -> None:
        """Delete the Serve apps this object deployed, and no other; stop Serve when this process started
        it and no app is left."""
        created, self._created = self._created, []
        self._merged = None
        delete_apps(created, self.folder.path / APPS_FILE)
