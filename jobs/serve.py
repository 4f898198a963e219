"""Serve a run: its backbone, every stage adapter and its harness, behind one OpenAI-compatible API.

On this machine (starts a local Ray; Ctrl-C stops it)::

    python jobs/serve.py --run runs/tiny-hamo-s0 [--stage 2] [--port 8000] [--api-key KEY] [serve.x=y ...]

Against a running cluster (the run folder, or ``serve.adapter_store``, on storage every node sees;
the store may be an object-store URI such as ``s3://bucket/adapters``: the run's stage adapters
missing there are uploaded, and every replica downloads what it serves)::

    ray job submit --working-dir . -- python jobs/serve.py --run /shared/runs/tiny-hamo-s0 serve.host=0.0.0.0

``/v1/models`` lists the base model (``model.name``) and one name per committed stage adapter, the
names the stream used (``stage-<t>``); the latest stage is the current adapter. Without
``--stage`` the job keeps reading ``state.json`` (every ``serve.poll_interval_s``) and publishes the
stages a still-running stream commits, each proven live before it is listed; ``--stage t`` serves
stages 1..t only and retrieves only their cards. The harness answers ``POST /harness/retrieve``,
and a chat request with a ``"hamo": {"goal", "init_obs", "k"}`` field gets the retrieved cards
injected in the training format. The API key comes from ``--api-key``, else ``HAMO_API_KEY``, else
``serve.api_key``; dotted overrides apply to the run's config.yaml (e.g. ``serve.num_replicas=2``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from hamo_ray.config import ConfigError, HamoConfig, load_config  # noqa: E402
from hamo_ray.logs import setup_logging  # noqa: E402

logger = logging.getLogger("hamo_ray.jobs.serve")


def _model_path(cfg: HamoConfig, run: Path) -> str:
    """The base model folder: ``model.path``, else the embedded backbone's cache folder.

    The cache folder is named by a hash of the settings; when code changes moved that name, the
    folder the run's adapters were trained on (peft's ``base_model_name_or_path``) is used.
    """
    if cfg.model.path != "embedded":
        return cfg.model.path
    from hamo_ray.training.backbone import backbone_path

    state = run / "state.json"
    recorded_state = json.loads(state.read_text()).get("backbone") if state.is_file() else None
    if recorded_state and (Path(recorded_state) / "config.json").is_file():
        return recorded_state  # the stream records the backbone it resolved
    path = backbone_path(cfg)
    if (path / "config.json").is_file():
        return str(path)
    for adapter_config in sorted((run / "adapters").glob("*/adapter_config.json")):
        recorded = Path(
            json.loads(adapter_config.read_text()).get("base_model_name_or_path") or "/nonexistent"
        )
        if (recorded / "config.json").is_file():
            logger.warning(
                "backbone not at %s; using %s, the base of %s", path, recorded, adapter_config.parent
            )
            return str(recorded)
    raise ConfigError(f"the run's embedded backbone is not built at {path} (run the stream first)")


def _start_ray(cfg: HamoConfig) -> bool:
    """Connect to ``ray.address``/RAY_ADDRESS, else start a local Ray; True when started here."""
    import ray

    address = cfg.ray.address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, configure_logging=False)
        return False
    cpus = cfg.ray.num_cpus or max(4, 2 * (os.cpu_count() or 1))
    # address="local": our own Ray even when `ray start` runs a cluster here (join it: ray.address=auto)
    ray.init(address="local", num_cpus=cpus, include_dashboard=False, configure_logging=False)
    return True


class RunServer:
    """Serves one run folder; ``publish_new`` publishes the committed stages not served yet."""

    def __init__(self, run: Path, cfg: HamoConfig, max_stage: int | None) -> None:
        from hamo_ray.run_state import RunFolder

        self.folder = RunFolder(run, cfg)
        self.cfg = cfg
        self.max_stage = max_stage
        from hamo_ray.serving.objstore import ObjectStore, ObjectStoreError, is_uri

        store = cfg.serve.adapter_store
        self.remote = None
        if is_uri(store):  # replicas download from the store; missing stages are uploaded first
            try:
                self.remote = ObjectStore(store)
            except ObjectStoreError as exc:
                raise ConfigError(f"serve.adapter_store: {exc}") from None
            self.adapter_root: str | Path = store
        else:
            self.adapter_root = Path(store).expanduser().resolve() if store else self.folder.adapters_dir
        self.served: dict[int, str] = {}
        self.failed: set[int] = set()
        self.url = ""

    def start(self) -> str:
        from ray import serve

        from hamo_ray.serving import start_policy_server, wait_healthy
        from hamo_ray.serving.harness import build_harness_app

        cfg, scfg = self.cfg, self.cfg.serve
        serve.start(http_options={"host": scfg.host, "port": scfg.port})
        harness_app = None
        prefix = scfg.route_prefix.rstrip("/")
        if Path(self.folder.memory_uri).exists() or "://" in self.folder.memory_uri:
            harness_app = f"{scfg.app_name}-harness"
            app = build_harness_app(
                self.folder.memory_uri,
                cfg.memory,
                scfg.harness_num_cpus,
                api_key=scfg.api_key,
                max_request_bytes=scfg.max_request_bytes,
                max_stage=self.max_stage,
            )
            serve.run(app, name=harness_app, route_prefix=f"{prefix}/harness", blocking=False)
        else:
            logger.warning("no memory at %s: serving without the harness", self.folder.memory_uri)
        self.url = start_policy_server(
            _model_path(cfg, self.folder.path),
            cfg.model,
            scfg,
            self.adapter_root,
            max_lora_rank=scfg.max_lora_rank,
            harness_app=harness_app,
            prompt_cfg=cfg.prompt,
            top_k=cfg.memory.top_k,
        )
        if harness_app:
            wait_healthy(f"{self.url}/harness", api_key=scfg.api_key)
        return self.url

    def publish_new(self, strict: bool) -> list[str]:
        """Publish (and prove live) the committed stages not served yet; returns their names.

        Raises:
            AdapterNotLiveError: with ``strict``, the first adapter that cannot be proven live.
        """
        from hamo_ray.serving import AdapterNotLiveError, publish_adapter

        published = []
        for result in self.folder.stages():
            stage = result.stage
            if not result.adapter or stage in self.served or stage in self.failed:
                continue
            if self.max_stage is not None and stage > self.max_stage:
                continue
            try:
                path = self._adapter_path(result.adapter)
                info = publish_adapter(
                    self.url,
                    result.adapter_name,
                    str(path),
                    self.cfg.serve.probe_prompt,
                    self.cfg.serve.probe_tokens,
                    api_key=self.cfg.serve.api_key,
                )
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

    def _adapter_path(self, adapter: str) -> str:
        """The path a replica loads a stage's adapter from: in the store (uploaded if missing), or local."""
        from hamo_ray.serving import AdapterNotLiveError
        from hamo_ray.serving.objstore import ObjectStoreError

        name = Path(adapter).name
        if self.remote is None:
            return str(Path(self.adapter_root) / name)
        local = self.folder.path / adapter
        try:
            if local.is_dir():  # uploaded unless the store holds the same files
                self.remote.put(local, name)
            elif not self.remote.exists(name):
                raise AdapterNotLiveError(f"{name} is neither in the adapter store nor at {local}")
        except (ObjectStoreError, OSError) as exc:
            raise AdapterNotLiveError(f"cannot put {local} into serve.adapter_store: {exc}") from exc
        return name

    def current(self) -> str:
        return self.served[max(self.served)] if self.served else self.cfg.model.name

    def stop(self) -> None:
        from ray import serve

        from hamo_ray.serving import shutdown_policy_server

        try:
            serve.delete(f"{self.cfg.serve.app_name}-harness")
        except Exception:
            logger.debug("no harness to delete", exc_info=True)
        shutdown_policy_server(self.cfg.serve)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--run", required=True, help="the run folder (holds config.yaml and state.json)")
    parser.add_argument("--stage", type=int, help="serve stages 1..STAGE only (default: all, and follow)")
    parser.add_argument("--host", help="overrides serve.host")
    parser.add_argument("--port", type=int, help="overrides serve.port")
    parser.add_argument(
        "--api-key", help="bearer key for every route (default: $HAMO_API_KEY, serve.api_key)"
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
        cfg = load_config(run / "config.yaml", args.overrides)
        update = {"api_key": args.api_key or os.environ.get("HAMO_API_KEY") or cfg.serve.api_key}
        update |= {k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
        cfg = cfg.model_copy(update={"serve": cfg.serve.model_copy(update=update)})
        server = RunServer(run, cfg, args.stage)
        committed = {s.stage for s in server.folder.stages()}
        if args.stage is not None and args.stage not in committed:
            raise ConfigError(
                f"stage {args.stage} is not committed in {run}/state.json (has {sorted(committed)})"
            )
        _model_path(cfg, run)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    started_ray = _start_ray(cfg)
    try:
        url = server.start()
        server.publish_new(strict=True)
        names = [cfg.model.name, *server.served.values()]
        print(f"serving {run.name} at {url}/v1: models {names}, current {server.current()!r}", flush=True)
        while not stop.wait(cfg.serve.poll_interval_s):
            if args.stage is None:
                for name in server.publish_new(strict=False):
                    print(f"new adapter {name!r} live; current {server.current()!r}", flush=True)
    finally:
        server.stop()
        if started_ray:
            import ray

            ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
