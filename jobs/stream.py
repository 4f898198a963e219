"""Run a whole HaMo continual-learning stream (all stages, all evaluations) into a run folder.

On this machine (starts a local Ray)::

    python jobs/stream.py --config jobs/configs/tiny.yaml [key.sub=value ...]

Against a running cluster (``ray start --head`` or ``ray up cluster.yaml``)::

    ray job submit --working-dir . -- python jobs/stream.py --config jobs/configs/tiny.yaml

The run folder is ``run.root/run.id`` (see hamo_ray/run_state.py); resubmitting the same command
resumes after the last committed stage.
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
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.epochs=1")
    args = parser.parse_args(argv)
    setup_logging()
    try:
        cfg = load_config(args.config, args.overrides)
        from hamo_ray.stream import Stream

        stream = Stream(cfg, config_name=Path(args.config).stem if args.config else "run")
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    results = stream.run()
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
