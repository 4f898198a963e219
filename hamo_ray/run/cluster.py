"""Connecting to Ray, and the checks a job makes before it starts any work.

``ray.address`` set: that cluster (``auto``: the one a ``ray start`` runs on this machine, as
``ray.init()`` finds it; ``host:6379``, ``ray://...``), or ``local`` for a private instance. Unset:
``RAY_ADDRESS`` when the environment sets it (``ray job submit`` does, for the job's own cluster), else a
private local Ray advertising :func:`local_cpus` CPUs. A ``ray start`` on this machine is not joined
unasked: Ray's current-cluster file is per machine, and the cluster it names may be another user's (whose
Serve apps, CPUs and port a run would then share). Before any work a job refuses a relative run root under ``ray job submit
--working-dir`` (:func:`check_cluster_paths`) and, on a private Ray, a ``serve.port`` another process
holds (:func:`check_serve_port`). What runs on the cluster (Serve apps, adapters) is ``hamo_ray.run.services``.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from hamo_ray.config import ConfigError, HamoConfig, RayConfig

logger = logging.getLogger(__name__)

LOCAL = "local"  # ray.address value that forces a private Ray
WORKER_SETUP_HOOK = "hamo_ray.logs.ray_worker_setup"  # every worker of a private Ray runs it first
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
            f"on the head node; give a folder every node sees, e.g. {key}=/mnt/shared/hamo/runs"
        )


def cluster_address(ray_cfg: RayConfig) -> str | None:
    """The cluster to join, or None for a private local Ray (see the module docstring).

    ``ray.address=auto`` is passed to ``ray.init`` as it is: Ray then finds the cluster through
    ``RAY_ADDRESS`` or the address file a ``ray start`` writes in its temp folder.
    """
    if ray_cfg.address:
        return None if ray_cfg.address == LOCAL else ray_cfg.address
    return os.environ.get("RAY_ADDRESS") or None


def start_ray(ray_cfg: RayConfig) -> bool:
    """Connect this process to Ray, unless it already is.

    Args:
        ray_cfg: ``ray.address`` and ``ray.num_cpus``.

    Returns:
        True when this call connected (the caller may ``ray.shutdown()`` at its end).

    Raises:
        ConnectionError: the cluster to join (``ray.address`` or ``RAY_ADDRESS``) does not answer.
    """
    import ray

    if ray.is_initialized():
        return False
    address = cluster_address(ray_cfg)
    if address is not None:
        ray.init(address=address, configure_logging=False)
        logger.info("joined the Ray cluster at %s", address)
        return True
    cpus = local_cpus(ray_cfg)
    ray.init(
        address=LOCAL,
        num_cpus=cpus,
        include_dashboard=False,  # no web UI, and so no state API: see logs.REPEATED_WARNINGS
        configure_logging=False,
        runtime_env={"worker_process_setup_hook": WORKER_SETUP_HOOK},
    )
    logger.info("started a private local Ray with %d CPUs (ray.address=auto joins a `ray start`)", cpus)
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
