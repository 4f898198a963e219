"""Serve a run: its backbone, every stage adapter and its harness, behind one OpenAI-compatible API.

On this machine (a private Ray unless ``RAY_ADDRESS`` or ``ray.address`` names a cluster, e.g.
``ray.address=auto`` for the one a ``ray start`` runs here; the apps are ``hamo-<run id>`` at
``/<run id>``, hamo_ray/naming.py; Ctrl-C stops it)::

    python jobs/serve.py --run runs/tiny-hamo-s0 [--stage 2] [--port 8000] [--api-key KEY] [serve.x=y ...]

Against a running cluster (the run folder, or ``serve.adapter_store``, on storage every node sees;
the store may be an object-store URI such as ``s3://bucket/adapters``: the run's stage adapters
missing there are uploaded, and every replica downloads what it serves)::

    ray job submit --working-dir . -- env HAMO_API_KEY_FILE=/shared/secrets/hamo-key \
        python jobs/serve.py --run /shared/runs/tiny-hamo-s0 serve.host=0.0.0.0

``/v1/models`` lists the base model (``model.name``) and one name per committed stage adapter, the
names the stream used (``stage-<t>``); the latest stage is the current adapter. Without
``--stage`` the job keeps reading ``state.json`` (every ``serve.poll_interval_s``) and publishes the
stages a still-running stream commits, each proven live before it is listed; ``--stage t`` serves
stages 1..t only and retrieves only their cards. The harness answers ``POST /harness/retrieve``;
a client builds HaMo's prompt from the cards with ``hamo_ray.prompting.build_messages`` (the
function training uses), as the rollout workers do. The API key comes from ``--api-key``, else a
``serve.api_key=`` override, else ``HAMO_API_KEY`` or the file ``HAMO_API_KEY_FILE`` names (the run's
config.yaml never holds it); a ``serve.host`` beyond loopback without one is refused. Dotted overrides
apply to the run's config.yaml (e.g. ``serve.num_replicas=2``).

Print the resolved config (the run's config.yaml, the overrides and the flags; the API key shown
as ``***``) and exit, starting nothing::

    python jobs/serve.py --run runs/tiny-hamo-s0 --port 9000 serve.num_replicas=2 --print-config

Exit status 2: not a run folder, a bad override or an uncommitted ``--stage``, named on stderr. The
base model and the services come from ``hamo_ray.run.serve_job``; this file is only the command line.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from hamo_ray.config import ConfigError, load_saved_config  # noqa: E402
from hamo_ray.logs import setup_logging  # noqa: E402
from hamo_ray.run.serve_job import run_model_path, run_services  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--run", required=True, help="the run folder (holds config.yaml and state.json)")
    parser.add_argument("--stage", type=int, help="serve stages 1..STAGE only (default: all, and follow)")
    parser.add_argument("--host", help="overrides serve.host")
    parser.add_argument("--port", type=int, help="overrides serve.port")
    parser.add_argument(
        "--api-key", help="bearer key for every route (default: serve.api_key, $HAMO_API_KEY(_FILE))"
    )
    parser.add_argument(
        "--print-config",
        action="store_true",
        help="print the resolved config (YAML; the API key as ***) and exit",
    )
    parser.add_argument(
        "overrides", nargs="*", help="dotted overrides of the run's config, e.g. serve.num_replicas=2"
    )
    args = parser.parse_args(argv)
    setup_logging()
    run = Path(args.run).expanduser().resolve()
    try:
        if not (run / "config.yaml").is_file():
            raise ConfigError(f"{run} holds no config.yaml: not a run folder")
        # The flags are overrides like the dotted ones (validated: a non-loopback host needs a key); the
        # key: --api-key, else a serve.api_key override, else HAMO_API_KEY(_FILE) (hamo_ray/config/secrets.py)
        flags = (("host", args.host), ("port", args.port), ("api_key", args.api_key))
        overrides = [*args.overrides, *(f"serve.{k}={v}" for k, v in flags if v is not None)]
        cfg = load_saved_config(run / "config.yaml", overrides)
        if args.print_config:  # secrets masked (***): a key never goes to a terminal or a job log
            print(cfg.to_yaml(), end="")
            return 0
        services = run_services(run, cfg, args.stage)
        committed = {s.stage for s in services.folder.stages()}
        if args.stage is not None and args.stage not in committed:
            raise ConfigError(
                f"stage {args.stage} is not committed in {run}/state.json (has {sorted(committed)})"
            )
        model_path = run_model_path(cfg, run)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2

    from hamo_ray.run.cluster import start_ray

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    started_ray = start_ray(cfg.ray)

    def current() -> str:  # the latest stage's adapter is the current model
        return services.served[max(services.served)] if services.served else cfg.model.name

    try:
        url = services.start(model_path).base_url
        services.publish_committed(strict=True)
        names = [cfg.model.name, *services.served.values()]
        print(f"serving {run.name} at {url}/v1: models {names}, current {current()!r}", flush=True)
        if args.stage is None:
            follow(services, stop, cfg.serve.poll_interval_s, lambda name: print(
                f"new adapter {name!r} live; current {current()!r}", flush=True))  # fmt: skip
        else:
            while not stop.wait(cfg.serve.poll_interval_s):
                pass
    finally:
        services.stop()
        if started_ray:
            import ray

            ray.shutdown()
    return 0


def follow(services, stop: threading.Event, interval_s: float, announce, max_backoff_s: float = 60.0) -> None:
    """Publish the stages a still-running stream commits, every ``interval_s`` until ``stop`` is set.

    A round runs only when the endpoint answers ``/health``, so a replica being replaced is waited
    out rather than taken for an adapter that cannot be published. A round that fails on the way (the
    endpoint unreachable or dropping the connection) is logged and tried again, the pause doubling
    from ``interval_s`` up to ``max_backoff_s``; the loop ends only with ``stop``. ``announce`` is
    called with each newly live adapter's name.
    """
    import logging

    import httpx

    log = logging.getLogger("hamo_ray.serve")
    failures = 0
    while not stop.wait(min(max_backoff_s, interval_s * 2**failures) if failures else interval_s):
        try:
            endpoint = services.endpoint
            headers = {"Authorization": f"Bearer {endpoint.api_key}"} if endpoint.api_key else {}
            health = httpx.get(f"{endpoint.base_url}/health", timeout=10.0, headers=headers)
            if health.status_code != 200:
                raise ConnectionError(f"{endpoint.base_url}/health answered {health.status_code}")
            names = services.publish_committed(strict=False)
        except (httpx.TransportError, OSError) as exc:  # ConnectionError, TimeoutError are OSErrors
            failures += 1
            pause = min(max_backoff_s, interval_s * 2**failures)
            log.warning(
                "following the run: the endpoint is not answering (%s: %s; replica restarting?); "
                "trying again in %.0f s (failure %d in a row)", type(exc).__name__, exc, pause, failures,
            )  # fmt: skip
            continue
        if failures:
            log.info("following the run: the endpoint answers again after %d failed rounds", failures)
        failures = 0
        for name in names:
            announce(name)


if __name__ == "__main__":
    sys.exit(main())
