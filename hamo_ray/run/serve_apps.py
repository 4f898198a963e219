"""The Serve applications of the cluster a run is connected to: starting Serve, deleting a job's own
apps (and Serve, when this process started it and nothing else runs there), and a sweep's shared policy
endpoints (one per backbone, named after the sweep: ``hamo_ray.naming.shared_serve_names``).

**Leases.** Checking that no app of a name runs and then deploying it is not atomic: two jobs started
at one instant with the same app name could both pass the check. So before the check a job takes a
cluster-wide lease on each name it will deploy: a named actor (:data:`LEASE_NAMESPACE`,
``app:<name>``) that it owns. Ray's GCS registers a named actor synchronously and refuses a second
of the same name, so exactly one job holds a name; the actor dies with its owner (a killed driver
frees its names within seconds) and is killed when the job deletes the app (:func:`delete_apps`).
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Iterable
from pathlib import Path

from hamo_ray.config import HamoConfig
from hamo_ray.naming import (
    APPS_FILE,
    AppExistsError,
    claim_apps,
    release_apps,
    shared_serve_names,
    sweep_name,
)

logger = logging.getLogger(__name__)

LEASE_NAMESPACE = "hamo-serve-apps"  # the named actors that hold a Serve app's name for its job
LEASE_WAIT_S = 30.0  # how long a lease held by a dead job (its actor not yet reaped) is waited for

_serve_started_here = False  # this process started Serve on its cluster (so it may stop it when idle)
_shared_created: set[str] = set()  # the shared endpoints' apps this process deployed
_leases: dict[tuple[str, str], object] = {}  # (cluster, app) -> the lease actor's handle
_lease_class = None


def cluster_id() -> str:
    """The connected cluster's GCS address: what the app record ties a deployment to."""
    import ray

    return str(ray.get_runtime_context().gcs_address)


def serve_running() -> bool:
    """Whether Serve's controller runs on the connected cluster (starts nothing)."""
    from ray import serve

    try:
        from ray.serve.context import _get_global_client  # private; serve.status() reads it the same way

        return _get_global_client(raise_if_no_controller_running=False) is not None
    except Exception:  # another Serve version
        return bool(serve.status().applications)


def start_serve(scfg) -> None:
    """Start Serve's proxy on ``serve.host:port`` unless Serve already runs on the cluster: then every app
    shares its proxy (Serve keeps its own options), as two runs on one cluster do."""
    from ray import serve

    global _serve_started_here
    if not serve_running():
        _serve_started_here = True
    serve.start(
        http_options={"host": scfg.host, "port": scfg.port},
        logging_config={"enable_access_log": scfg.access_log},
    )


def _lease_actor():
    """The lease actor's class (defined once Ray is imported): it only answers who holds it."""
    global _lease_class
    if _lease_class is None:
        import ray

        @ray.remote(num_cpus=0, max_restarts=0)
        class AppLease:
            """Runs on its job's node, so it can tell whether its job's driver still lives: Ray reaps a
            dead owner's actors a moment after the owner dies, and until then the actor still answers."""

            def __init__(self, holder: dict):
                self._holder = holder

            def holder(self) -> dict:
                from hamo_ray.naming import pid_alive

                return {**self._holder, "alive": pid_alive(int(self._holder["pid"]))}

        _lease_class = AppLease
    return _lease_class


def lease_holder(name: str, timeout_s: float = 10.0) -> dict | None:
    """Who holds the lease on app ``name`` on the connected cluster (``{cluster, host, pid, record,
    since}``); None when nobody does, or its holder is dead or dying."""
    import ray

    try:
        actor = ray.get_actor(f"app:{name}", namespace=LEASE_NAMESPACE)
        holder = ray.get(actor.holder.remote(), timeout=timeout_s)
    except (ValueError, ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
        return None
    return holder if holder.pop("alive", True) else None


def _is_mine(holder: dict, cluster: str) -> bool:
    return (holder.get("cluster"), holder.get("host"), holder.get("pid")) == (
        cluster, socket.gethostname(), os.getpid(),
    )  # fmt: skip


def lease_apps(names: Iterable[str], record_file: Path, wait_s: float = LEASE_WAIT_S) -> list[str]:
    """Take this job's cluster-wide lease on each of ``names`` (see the module's docstring); a name this
    process holds already is kept. On a refusal the leases this call took are given back.

    Returns:
        The names newly leased by this call.

    Raises:
        AppExistsError: another live job holds one of the names (naming it, its host, pid and run
            folder), or a dead job's lease was not freed within ``wait_s``.
    """
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    cluster, taken = cluster_id(), []
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    me = {"cluster": cluster, "host": socket.gethostname(), "pid": os.getpid(), "record": str(record_file)}
    try:
        for name in names:
            deadline = time.monotonic() + wait_s
            while True:
                try:
                    handle = (
                        _lease_actor()
                        .options(name=f"app:{name}", namespace=LEASE_NAMESPACE, scheduling_strategy=here)
                        .remote({**me, "since": time.time()})
                    )
                except ValueError:  # the name is taken on the cluster
                    holder = lease_holder(name)
                    if holder is not None and _is_mine(holder, cluster):
                        break
                    if holder is not None:
                        raise AppExistsError(
                            f"serve.app_name: another job is deploying or runs the Serve application {name!r} "
                            f"on this Ray cluster (pid {holder.get('pid')} on {holder.get('host')}, run folder "
                            f"{Path(str(holder.get('record'))).parent}); this job never replaces an app it did "
                            "not create. Give this run another run.id, or serve.app_name and "
                            "serve.route_prefix of its own"
                        ) from None
                    if time.monotonic() > deadline:
                        raise AppExistsError(
                            f"serve.app_name: the lease on the Serve application {name!r} "
                            f"(actor app:{name} in namespace {LEASE_NAMESPACE}) is held by a job that does "
                            f"not answer; it was not freed within {wait_s:.0f} s"
                        ) from None
                    time.sleep(0.5)  # its holder is dead or dying: Ray frees the name shortly
                    continue
                _leases[(cluster, name)] = handle
                taken.append(name)
                break
    except BaseException:
        unlease_apps(taken)
        raise
    return taken


def lease_and_claim(names: list[str], record_file: Path) -> dict:
    """Lease ``names`` (:func:`lease_apps`), then check them against the apps running on the cluster,
    read after the lease (an app a dead holder left is seen), and record them (``naming.claim_apps``);
    a refused check gives back the leases this call took.

    Returns:
        The running applications (Serve's status) the check saw.

    Raises:
        AppExistsError: another job holds a name, or an app of a name runs that this job may not replace.
    """
    from ray import serve

    taken = lease_apps(names, record_file)
    try:
        running = serve.status().applications
        claim_apps(names, record_file, cluster_id(), running)
    except AppExistsError:
        unlease_apps(taken)
        raise
    return running


def unlease_apps(names: Iterable[str]) -> None:
    """Give back this process's leases on ``names`` (a name it does not hold is skipped)."""
    import ray

    if not ray.is_initialized():
        return
    cluster = cluster_id()
    for name in names:
        handle = _leases.pop((cluster, name), None)
        if handle is not None:
            try:
                ray.kill(handle, no_restart=True)
            except Exception:  # already gone
                logger.debug("lease on %r already gone", name, exc_info=True)


def delete_apps(names: list[str], record_file: Path) -> None:
    from ray import serve

    try:
        for name in names:
            serve.delete(name)
        release_apps(names, record_file)
        unlease_apps(names)
        if _serve_started_here and names and not serve.status().applications:
            serve.shutdown()
    except Exception:  # Serve already gone (the driver's Ray went down first)
        logger.debug("serve shutdown failed", exc_info=True)


def delete_leftovers(record_file: Path, wanted: set[str], running) -> None:
    """Delete the apps a killed attempt of this run folder left (``record_file``) that this job does not
    deploy at start (its merged-weights app): they would hold their replicas' CPUs and memory until
    the run acts on merged weights again, or forever if it does not (a resumed sweep cell). An app
    held by a live job is left alone; entries of apps no longer running are dropped."""
    from ray import serve

    from hamo_ray.naming import AppExistsError, leftovers, read_record

    record, cluster = read_record(record_file), cluster_id()
    for name in (n for n in record if n not in wanted):
        try:
            stale = leftovers([name], running, record, cluster)
        except AppExistsError as exc:
            logger.warning("not deleting %r recorded in %s: %s", name, record_file, exc)
            continue
        if stale:
            logger.warning("deleting Serve app %r left by a killed job on this run folder", name)
            serve.delete(name)
        release_apps([name], record_file)


def shared_serve_cfg(cfg: HamoConfig, index: int):
    """The ``ServeConfig`` of a sweep's ``index``-th shared endpoint (one per backbone): named after the
    sweep (``hamo_ray.naming.shared_serve_names``)."""
    app, route = shared_serve_names(cfg.serve, sweep_name(cfg.run.root), index)
    return cfg.serve.model_copy(update={"app_name": app, "route_prefix": route})


def _sweep_record(cfg: HamoConfig) -> Path:
    """Where a sweep records its shared endpoints' apps: its root (the cells' ``run.root`` is <root>/cells)."""
    return Path(cfg.run.root).expanduser().resolve().parent / APPS_FILE


def start_shared_policy(cfg: HamoConfig, model_path: str, index: int) -> str:
    """Start a policy endpoint that several runs share (a sweep's cells with one backbone).

    Adapters are published by absolute path inside ``run.root``; each run names its own
    (``Services(shared_url=..., run_id=...)``).

    Returns:
        The endpoint's base URL.
    """

    from hamo_ray.serving import start_policy_server

    scfg = shared_serve_cfg(cfg, index)
    lease_and_claim([scfg.app_name], _sweep_record(cfg))
    _shared_created.add(scfg.app_name)
    start_serve(scfg)
    return start_policy_server(
        model_path,
        cfg.model,
        scfg,
        str(Path(cfg.run.root).resolve()),
        max_lora_rank=scfg.max_lora_rank,
    )


def stop_shared_policy(cfg: HamoConfig, index: int) -> None:
    """Stop what :func:`start_shared_policy` started (its app; Serve too when this process started it and
    no app is left)."""
    app = shared_serve_cfg(cfg, index).app_name
    if app in _shared_created:  # never one this process was refused (another sweep's)
        _shared_created.discard(app)
        delete_apps([app], _sweep_record(cfg))
