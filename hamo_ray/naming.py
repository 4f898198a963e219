"""What a run's things are called where other runs see them, and which Serve apps a job may replace.

Everything a run leaves on something shared derives from its run id (a sweep's cell: the cell's name;
a sweep's shared endpoints: the sweep's name, its root folder's name), so two runs on one Ray cluster,
one adapter store or one memory URI never share a name::

    run id tiny-hamo-s0     policy app   hamo-tiny-hamo-s0           at /tiny-hamo-s0
                            harness app  hamo-tiny-hamo-s0-harness   at /tiny-hamo-s0/harness
                            adapters     <serve.adapter_store>/tiny-hamo-s0/stage-<t>
                            cards        table cards-tiny-hamo-s0 in a shared memory.uri
                                         (table cards in the run folder's own memory/)
    sweep root .../sweep-tiny, backbone i
                            shared app   hamo-sweep-tiny-<i>         at /sweep-tiny/<i>
                            a cell's harness  hamo-sweep-tiny-harness-<cell>  at /sweep-tiny/<i>/harness-<cell>

An explicit ``serve.app_name`` or ``serve.route_prefix`` is used as it is (the harness and the shared
endpoints append to it as above). The adapter names a run serves (``stage-<t>``) stay as they are: they
live inside the run's own endpoint and adapter prefix.

**Who may replace an app.** A job deploys an app only under a name no app on the cluster has, with one
exception: an app that this run folder records (``.serve-apps.json``) as deployed on this cluster by a
job on this host that is no longer alive, i.e. the leftover of a killed attempt of the same run, which a
resubmission replaces. Anything else is refused, naming the app (:func:`claim_apps`). A job deletes only
the apps it deployed (``run.services.Services.stop``). Before the check, a job leases each name
cluster-wide (``run.serve_apps.lease_apps``), so two jobs started at one instant cannot both pass it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import socket
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from hamo_ray.config import ConfigError, MemoryConfig, ServeConfig

logger = logging.getLogger(__name__)

APP_PREFIX = "hamo"  # derived app names: hamo-<run id>
APPS_FILE = ".serve-apps.json"  # in a run folder (a sweep's root): the Serve apps its jobs deployed
_SAFE = re.compile(r"[^A-Za-z0-9._-]")


class AppExistsError(ConfigError):
    """A Serve application of the name this job would deploy already runs on the cluster."""


def slug(text: str) -> str:
    """``text`` as a name Serve routes, LanceDB tables and object-store keys all accept.

    Letters, digits, ``.``, ``_`` and ``-`` are kept; a name with anything else has it replaced by
    ``-`` and gets 8 hex digits of its hash, so two different ids never share a slug.
    """
    text = str(text)
    clean = _SAFE.sub("-", text).strip("-.") or "run"
    if clean == text:
        return clean
    return f"{clean}-{hashlib.sha1(text.encode()).hexdigest()[:8]}"


def _route(prefix: str, *parts: str) -> str:
    return "/".join([prefix.rstrip("/"), *parts]) or "/"


def serve_names(scfg: ServeConfig, run_id: str) -> tuple[str, str, str, str]:
    """(policy app, its route, harness app, its route) of a run with its own endpoint."""
    app = scfg.app_name or f"{APP_PREFIX}-{slug(run_id)}"
    route = scfg.route_prefix or f"/{slug(run_id)}"
    return app, route, f"{app}-harness", _route(route, "harness")


def sweep_name(run_root: str | Path) -> str:
    """A sweep's name: its root folder's (the cells' ``run.root`` is ``<root>/cells``)."""
    return slug(Path(run_root).expanduser().resolve().parent.name)


def shared_serve_names(scfg: ServeConfig, sweep: str, index: int) -> tuple[str, str]:
    """(app, route) of a sweep's ``index``-th shared policy endpoint."""
    app = f"{scfg.app_name or f'{APP_PREFIX}-{sweep}'}-{index}"
    return app, _route(scfg.route_prefix or f"/{sweep}", str(index))


def cell_harness_names(scfg: ServeConfig, sweep: str, shared_url: str, run_id: str) -> tuple[str, str]:
    """(harness app, route) of a sweep cell on the shared endpoint at ``shared_url``."""
    base = scfg.app_name or f"{APP_PREFIX}-{sweep}"
    return f"{base}-harness-{slug(run_id)}", _route(
        urlsplit(shared_url).path or "/", f"harness-{slug(run_id)}"
    )


MERGED_SUFFIX = "-merged"  # the merged app is <policy app>-merged at <route>/merged


def merged_app_names(app: str, route: str) -> tuple[str, str]:
    """(app, route) of a run's merged-weights policy app, beside its policy app ``app`` at ``route``."""
    return f"{app}{MERGED_SUFFIX}", "/".join([route.rstrip("/"), MERGED_SUFFIX.lstrip("-")])


def merged_names(
    policy_app: str | None, policy_route: str, harness_app: str, harness_route: str
) -> tuple[str, str]:
    """(app, route) of a run's merged-weights policy app: ``<policy app>-merged`` at ``<route>/merged``; a
    sweep cell (no policy app of its own): ``<sweep app>-merged-<cell>`` at ``<shared route>/merged-<cell>``."""
    if policy_app is not None:
        return merged_app_names(policy_app, policy_route)
    head, _, cell = harness_app.rpartition("-harness-")
    route_head, _, _ = harness_route.rpartition("/")
    return f"{head}-merged-{cell}", f"{route_head}/merged-{cell}"


def memory_table(mcfg: MemoryConfig, run_id: str | None) -> str:
    """The run's LanceDB table: ``memory.table`` in the run folder's own memory (``memory.uri`` unset);
    ``<memory.table>-<run id>`` in a ``memory.uri`` other runs may share. No run id: ``memory.table``."""
    if mcfg.uri is None or not run_id:
        return mcfg.table
    return f"{mcfg.table}-{slug(run_id)}"


def store_prefix(location: str, run_id: str) -> str:
    """The run's own place in an adapter store (a folder or a URI): ``<location>/<run id>``; a URI's
    query (``?region=...``) stays at the end."""
    if "://" not in location:
        return str(Path(location).expanduser().resolve() / slug(run_id))
    parts = urlsplit(location)
    return urlunsplit(parts._replace(path=f"{parts.path.rstrip('/')}/{slug(run_id)}"))


# -- who owns a Serve app --------------------------------------------------------------------------


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` runs on this host (another user's counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True
    return True


def read_record(file: Path) -> dict[str, dict]:
    """The apps a run folder records: name -> {cluster, host, pid, since}; {} when none or unreadable."""
    try:
        data = json.loads(Path(file).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def write_record(file: Path, record: dict[str, dict]) -> None:
    """Replace the record file (a temporary file renamed over it); a failure is logged, not raised."""
    file = Path(file)
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{file.name}.", suffix=".tmp", dir=file.parent)
        with os.fdopen(fd, "w") as f:
            json.dump(record, f, indent=1, sort_keys=True)
        os.replace(tmp, file)
    except OSError as exc:
        logger.warning("could not record the Serve apps in %s: %s", file, exc)


def leftovers(
    names: Iterable[str],
    running: Iterable[str],
    record: dict[str, dict],
    cluster: str,
    *,
    host: str | None = None,
    alive: Callable[[int], bool] = pid_alive,
) -> list[str]:
    """Which of ``names`` already running on the cluster this job may replace; AppExistsError for the first
    it may not.

    An app may be replaced when ``record`` (the run folder's) says a job on this ``host`` deployed it on
    this ``cluster`` and that job is no longer ``alive``: a killed attempt of the same run.

    Raises:
        AppExistsError: naming the app, and who holds it when the record knows.
    """
    host = host or socket.gethostname()
    running = set(running)
    replace = []
    for name in names:
        if name not in running:
            continue
        entry = record.get(name) or {}
        ours = entry.get("cluster") == cluster and entry.get("host") == host
        if ours and isinstance(entry.get("pid"), int) and not alive(entry["pid"]):
            replace.append(name)
            continue
        holder = (
            f" (deployed by pid {entry.get('pid')} on {entry.get('host')}, still running)"
            if ours
            else " (not deployed by a job on this run folder)"
        )
        raise AppExistsError(
            f"serve.app_name: a Serve application {name!r} already runs on this Ray cluster{holder}; "
            "this job never replaces or deletes an app it did not create. Give this run another run.id, "
            "or serve.app_name and serve.route_prefix of its own; if the app is a leftover of yours, "
            f"delete it first (serve.delete({name!r}) from a driver on that cluster)"
        )
    return replace


def claim_apps(names: list[str], record_file: Path, cluster: str, running: Iterable[str]) -> list[str]:
    """Check ``names`` against the apps ``running`` on ``cluster`` (see :func:`leftovers`), then record them
    in ``record_file`` as this job's. Returns the leftovers this job replaces.

    Raises:
        AppExistsError: an app of one of the names runs and is not a leftover of this run folder.
    """
    record = read_record(record_file)
    replace = leftovers(names, running, record, cluster)
    for name in replace:
        logger.warning(
            "Serve app %r was left by a killed job on this run folder (pid %s); replacing it",
            name,
            record[name].get("pid"),
        )
    mine = {"cluster": cluster, "host": socket.gethostname(), "pid": os.getpid(), "since": time.time()}
    write_record(record_file, {**record, **{name: mine for name in names}})
    return replace


def release_apps(names: Iterable[str], record_file: Path) -> None:
    """Drop ``names`` (deleted by this job) from the record."""
    record, gone = read_record(record_file), set(names)
    kept = {k: v for k, v in record.items() if k not in gone}
    if kept != record:
        write_record(record_file, kept)
