"""Everything that runs beside a stream: the Ray connection, the Serve apps, adapter publishing.

One owner for the stream, ``jobs/serve.py`` and ``jobs/sweep.py``, so that they start Ray, name
their Serve applications, guard their routes and publish adapters the same way::

    start_ray(cfg.ray)                          # join a running cluster, else a private local Ray
    services = Services(cfg, folder)            # a run's own endpoint
    endpoint = services.start(model_path)       # harness app (when asked), then the policy app
    services.publish("stage-1", "adapters/stage-1")   # through serve.adapter_store, proven live
    spec = endpoint.spec("stage-1", cfg, seed=0, retrieval=True)   # what rollout actors act with
    services.stop()

**Ray.** ``ray.address`` set: that cluster (``auto``, ``host:6379``, ``ray://...``), or ``local``
for a private instance. Unset: ``RAY_ADDRESS`` (``ray job submit`` sets it), else the cluster a
``ray start`` runs on this machine, as ``ray.init()`` finds it; with neither, a private local Ray.
A private Ray advertises :func:`local_cpus` CPUs.

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

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from hamo_ray.config import ConfigError, HamoConfig, RayConfig
from hamo_ray.rollout.client import PolicySpec
from hamo_ray.run_folder import RunFolder

logger = logging.getLogger(__name__)

LOCAL = "local"  # ray.address value that forces a private Ray
_started_private = False  # this process started a private Ray (no Serve of ours can be running yet)


def local_cpus(ray_cfg: RayConfig) -> int:
    """CPUs a private local Ray advertises: ``ray.num_cpus``, else 4 x the cores (at least 8).

    Oversubscribed on purpose: rollout actors, the harness and idle Serve replicas hold CPU shares
    while they mostly wait; with only the physical count a cross-domain stream's actors leave no
    room for the embedding actor and the memory pipeline stalls.
    """
    return ray_cfg.num_cpus or max(8, 4 * (os.cpu_count() or 1))


def job_working_dir() -> str | None:
    """The runtime_env ``working_dir`` of the Ray job this driver runs in (``ray job submit``), else None."""
    raw = os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR")  # what Ray's job supervisor gives its driver
    try:
        return (json.loads(raw)["runtime_env"].get("working_dir") or None) if raw else None
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


def check_cluster_paths(root: str, key: str = "run.root") -> None:
    """Refuse a relative ``run.root`` in a job with a working_dir.

    The driver's cwd is then Ray's copy of the working_dir inside the head node's Ray session folder:
    a run folder there is seen by no other node (Serve replicas load adapters from it), is deleted
    with the session and is not found by a resubmission with changed code (a new copy).

    Raises:
        ConfigError: naming ``key`` (``run.root``, or a sweep's ``root``).
    """
    if not Path(root).expanduser().is_absolute() and job_working_dir():
        raise ConfigError(
            f"{key}: {root!r} is relative, and this job runs in Ray's temporary copy of its working_dir "
            "on the head node; give a folder every node sees, e.g. {key}=/mnt/shared/hamo/runs"
        )


def cluster_address(ray_cfg: RayConfig) -> str | None:
    """The cluster to join, or None for a private local Ray (see the module docstring).

    A ``ray start`` on this machine is found the way ``ray.init()`` finds it: through the address
    file it writes in Ray's temp folder.
    """
    if ray_cfg.address:
        return None if ray_cfg.address == LOCAL else ray_cfg.address
    if os.environ.get("RAY_ADDRESS"):
        return os.environ["RAY_ADDRESS"]
    try:  # private to Ray, but it is what ray.init() itself reads; a Ray without it: no cluster
        from ray._private.utils import read_ray_address

        return read_ray_address() or None
    except Exception:
        return None


def start_ray(ray_cfg: RayConfig) -> bool:
    """Connect this process to Ray, unless it already is.

    Args:
        ray_cfg: ``ray.address`` and ``ray.num_cpus``.

    Returns:
        True when this call connected (the caller may ``ray.shutdown()`` at its end).

    Raises:
        ConnectionError: a configured address (``ray.address`` or ``RAY_ADDRESS``) does not answer.
    """
    import ray

    if ray.is_initialized():
        return False
    address = cluster_address(ray_cfg)
    if address is not None:
        try:
            ray.init(address=address, configure_logging=False)
            logger.info("joined the Ray cluster at %s", address)
            return True
        except ConnectionError:
            if ray_cfg.address or os.environ.get("RAY_ADDRESS"):
                raise
            # Only found on disk: a `ray start` that has since died left its address file behind.
            logger.warning(
                "no Ray cluster answers at %s (stale address file); starting a private one", address
            )
    cpus = local_cpus(ray_cfg)
    ray.init(address=LOCAL, num_cpus=cpus, include_dashboard=False, configure_logging=False)
    logger.info("started a private local Ray with %d CPUs", cpus)
    global _started_private
    _started_private = True
    return True


def check_serve_port(cfg: HamoConfig) -> None:
    """Refuse, before any work, a ``serve.port`` that another process on this machine listens on.

    Only after this process started a private Ray: then nothing of ours can be listening there yet, and
    a second run or sweep on the same machine would otherwise build its backbone (minutes) before its
    endpoint fails to start. A joined cluster may already run Serve on that port: no check.

    Raises:
        ConfigError: the port is taken, naming ``serve.port``.
    """
    import socket

    if not _started_private:
        return
    host = "127.0.0.1" if cfg.serve.host in ("0.0.0.0", "::", "") else cfg.serve.host
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.settimeout(2.0)
        taken = sock.connect_ex((host, cfg.serve.port)) == 0
    if taken:
        raise ConfigError(
            f"serve.port={cfg.serve.port}: {host}:{cfg.serve.port} is already taken by another process "
            "(another run or sweep on this machine?); choose a free serve.port"
        )


@dataclass(frozen=True)
class Endpoint:
    """Where a run's policy and harness answer, and the key they want."""

    base_url: str  # the policy endpoint, e.g. http://127.0.0.1:8000
    harness_url: str | None = None  # None: this run has no harness
    api_key: str | None = None

    def spec(self, model: str, cfg: HamoConfig, *, seed: int | None, retrieval: bool = False) -> PolicySpec:
        """The ``PolicySpec`` rollout actors act with: served ``model``, the run's sampling, the key.

        Args:
            model: a served name (the base model's or an adapter's).
            cfg: the run's config (``rollout`` sampling, ``memory.top_k``, the model's template variables).
            seed: the episodes' base seed.
            retrieval: inject the harness's cards (needs a harness).
        """
        return PolicySpec(
            base_url=self.base_url,
            model=model,
            temperature=cfg.rollout.temperature,
            max_tokens=cfg.rollout.max_tokens,
            harness_url=self.harness_url if retrieval else None,
            top_k=cfg.memory.top_k,
            timeout_s=cfg.rollout.request_timeout_s,
            seed=seed,
            api_key=self.api_key,
            chat_template_kwargs=cfg.model.template_kwargs(),
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
        self.endpoint = Endpoint(url, harness_url, scfg.api_key)
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
            self.endpoint.base_url, name, path, scfg.probe_prompt, scfg.probe_tokens, api_key=scfg.api_key
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
