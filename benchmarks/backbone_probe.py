"""How a backbone scores in each domain before any training, measured off the test split.

The learning experiment needs a backbone that scores above 0 in every domain of its stream before
training (else no method can move). Choosing the backbone's size or pre-training by its *test* scores
would tune on the test split, so this probe evaluates the untrained backbone (no adapter, no injected
experience: the ``base`` policy) on the first ``--per-task`` **train**-split variations of each task
type instead: tasks no backbone pre-training uses (that is the dev split), and whose episodes no policy
has been trained on before stage 1. It runs the real stream machinery (the cached or freshly built
embedded backbone, the Serve endpoint, the rollout actors) for stage 0 only, into
``runs/probes/<backbone>-train<N>`` (reused when it holds the result), and prints one row per domain::

    python benchmarks/backbone_probe.py --config jobs/configs/learning-cross.yaml \
        'backbone.per_task={scienceworld: 20, alfworld: 60, webshop: 60}' [--per-task 12]
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import cached_property
from pathlib import Path

from common import Results, add_json_argument

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def probe_config(config: str | None, overrides: list[str], per_task: int, root: str):
    """The probe's config: the stream's, as method ``base``, evaluated before any stage, in its own run folder.

    Raises:
        ConfigError: a bad config, or a model that is not the embedded backbone.
    """
    from hamo_ray.config import ConfigError, load_config
    from hamo_ray.training.backbone import backbone_path

    forced = [
        "method.name=base",
        "protocol.eval_initial=true",
        f"protocol.train_per_task={per_task}",
        f"run.root={root}",
        "run.resume=true",
    ]
    cfg = load_config(config, [*overrides, *forced])
    if cfg.model.path != "embedded":
        raise ConfigError(f"model.path={cfg.model.path!r}: the probe measures the embedded backbone")
    run_id = f"{backbone_path(cfg).name}-train{per_task}"
    return cfg.model_copy(update={"run": cfg.run.model_copy(update={"id": run_id})})


def make_probe(cfg):
    """A ``Stream`` that runs stage 0 only, with the train split standing in for the test split."""
    from hamo_ray.steps import domain_tasks
    from hamo_ray.stream import Stream

    class Probe(Stream):
        expected_stages = [0]

        @cached_property
        def test_tasks(self):
            return {name: domain_tasks(self.cfg, self.domains, name, "train") for name in self.domains}

    return Probe(cfg, config_name="probe")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="the stream's YAML config")
    parser.add_argument("--per-task", type=int, default=12, help="train variations per task type")
    parser.add_argument("--root", default="runs/probes", help="where the probe's run folders go")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. backbone.num_layers=4")
    add_json_argument(parser, __file__)
    args = parser.parse_args()

    from hamo_ray.config import ConfigError
    from hamo_ray.logs import setup_logging
    from hamo_ray.training.backbone import backbone_path

    setup_logging()
    try:
        cfg = probe_config(args.config, args.overrides, args.per_task, args.root)
        probe = make_probe(cfg)
        results = Results(__file__, args)
        (initial,) = probe.run()
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    bb = backbone_path(cfg)
    build = json.loads((bb / "build.json").read_text())
    print(f"backbone: {bb}")
    print(
        f"  {build['trajectories']} expert trajectories, {build['examples']} examples, "
        f"final loss {build['losses'][-1]:.3f}, built in {build['seconds'] / 60:.0f} min"
    )
    print(f"{'domain':<14} {'episodes':>8} {'score':>6} {'succeeded':>9}")
    for domain, score in initial.scores.items():
        episodes = probe.folder.path / "episodes" / f"stage-0-{domain}.jsonl"
        trajs = [json.loads(line) for line in episodes.read_text().splitlines() if line.strip()]
        won = sum(t["score"] >= 100 for t in trajs)
        print(f"{domain:<14} {len(trajs):>8} {score:6.1f} {won:>5}/{len(trajs)}")
        results.add(
            {
                "backbone": bb.name,
                "domain": domain,
                "episodes": len(trajs),
                "score": score,
                "succeeded": won,
                "nonzero": sum(t["score"] > 0 for t in trajs),
                "final_loss": build["losses"][-1],
            }
        )
    results.finish()


if __name__ == "__main__":
    main()
