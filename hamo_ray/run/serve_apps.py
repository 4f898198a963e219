"""The Serve applications of the cluster a run is connected to: starting Serve, deleting a job's own
apps (and Serve, when this process started it and nothing else runs there), and a sweep's shared policy
endpoints (one per backbone, named after the sweep: ``hamo_ray.naming.shared_serve_names``).
"""

from __future__ import annotations

import logging
from pathlib import Path

from hamo_ray.config import HamoConfig
from hamo_ray.naming import APPS_FILE, claim_apps, release_apps, shared_serve_names, sweep_name

logger = logging.getLogger(__name__)

_serve_started_here = False  # this process started Serve on its cluster (so it may stop it when idle)
_shared_created: set[str] = set()  # the shared endpoints' apps this process deployed


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


def delete_apps(names: list[str], record_file: Path) -> None:
    from ray import serve

    try:
        for name in names:
            serve.delete(name)
        release_apps(names, record_file)
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
    from ray import serve

    from hamo_ray.serving import start_policy_server

    scfg = shared_serve_cfg(cfg, index)
    claim_apps([scfg.app_name], _sweep_record(cfg), cluster_id(), serve.status().applications)
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
