"""Run a whole HaMo continual-learning stream (all stages, all evaluations) into a run folder.

On this machine (starts a local Ray)::

    python jobs/stream.py --config jobs/configs/tiny.yaml [key.sub=value ...]

Against a running cluster (``ray start --head`` or ``ray up cluster.yaml``)::

    ray job submit --working-dir . -- python jobs/stream.py --config jobs/configs/tiny.yaml \
        run.root=/mnt/shared/hamo/runs

The run folder is ``run.root/run.id`` (see hamo_ray/run/folder.py); resubmitting the same command
resumes after the last committed stage. In a job submitted with a working_dir, ``run.root`` must be
absolute (a folder every node sees): a relative one would resolve inside Ray's temporary copy of the
working_dir on the head node, so the job refuses it (exit status 2).

Check a config first, without a GPU or a run (data sources, one rendered training example and
inference prompt per domain with token counts, the resource plan; see hamo_ray/run/dryrun.py)::

    python jobs/stream.py --config jobs/configs/paper-qwen3-8b-cross.yaml --dry-run

Print the resolved config (defaults, the file's differences and the overrides, as one YAML; secrets
shown as ``***``)::

    python jobs/stream.py --config jobs/configs/tiny.yaml train.epochs=1 --print-config

Secrets come from the environment too: ``HAMO_API_KEY`` (or ``HAMO_API_KEY_FILE``, a file holding it)
supplies ``serve.api_key``, ``HAMO_LLM_API_KEY(_FILE)`` ``memory.llm_api_key`` and
``HAMO_STORAGE_OPTIONS(_FILE)`` ``memory.storage_options``; none is written to the run folder. A
``serve.host`` beyond loopback without a key is refused (the ``paper-*`` presets need ``HAMO_API_KEY``).
See docs/configuration.md and docs/serving.md.

Exit status 2: a configuration error or a missing data source, named on stderr.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from hamo_ray.config import ConfigError, load_config  # noqa: E402
from hamo_ray.logs import setup_logging  # noqa: E402

logger = logging.getLogger("hamo_ray.jobs.stream")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", help="YAML file with the settings that differ from the defaults")
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="check data sources, render one prompt per domain, plan resources; no GPU, no run",
    )
    parser.add_argument(
        "--print-config", action="store_true", help="print the resolved config (YAML) and exit"
    )
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.epochs=1")
    args = parser.parse_args(argv)
    setup_logging()
    try:
        cfg = load_config(args.config, args.overrides)
        if args.print_config:
            print(cfg.to_yaml(), end="")
            return 0
        if args.dry_run:
            from hamo_ray.run.dryrun import dry_run

            dry_run(cfg)
            return 0
        from hamo_ray.run.cluster import check_cluster_paths
        from hamo_ray.run.stream import Stream

        check_cluster_paths(cfg.run.root)
        stream = Stream(cfg, config_name=Path(args.config).stem if args.config else "run")
        results = stream.run()  # a taken serve.port is refused here, before any work
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"run folder: {stream.folder.path}")
    print("stage  domain          score")
    for r in results:
        for domain, score in sorted(r.scores.items()):
            print(f"{r.stage:>5}  {domain:<14} {score:6.2f}")
    metrics = json.loads((stream.folder.path / "results" / "metrics.json").read_text())
    print("average over stages:", {d: round(v, 2) for d, v in metrics["average"].items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
