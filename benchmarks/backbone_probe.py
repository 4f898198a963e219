"""How a backbone scores in each domain before any training (and after one stage of behavioural
cloning), measured off the test split.

The learning experiment needs a backbone that scores above 0 in every domain of its stream before
training (else no method can move), and one that learns from a stage. Choosing the backbone, its size or
the experiment's settings by *test* scores would tune on the test split, so this probe evaluates the
untrained backbone (no adapter, no injected experience: the ``base`` policy) on **train**-split
variations of each task type instead: tasks whose episodes no policy has been trained on before stage
1 (the embedded backbone pre-trains on the dev split). It runs the real stream machinery (the backbone:
the embedded one, cached or built, or any ``model.path``; the Serve endpoint, the rollout actors) into
``runs/probes/<backbone>-train<N>`` (reused when it holds the result), and prints one row per domain::

    python benchmarks/backbone_probe.py --config jobs/configs/learning-cross.yaml \
        'backbone.per_task={scienceworld: 20, alfworld: 60, webshop: 60}' [--per-task 12]
    python benchmarks/backbone_probe.py --config jobs/configs/smollm2.yaml --per-task 4 --after-bc 6

``--after-bc M`` (within-domain configs) also trains one stage of plain behavioural cloning
(``agenttuning``: every expert trajectory, no cards) on the first ``M`` train variations of each task
type, and probes on the ``--per-task`` variations after them: the probe tasks are never trained on.
Stage 0 is the base score, stage 1 the score after BC; the wall time of each phase is printed.
``--method harness`` makes that stage the harness's instead (the ``M`` variations' cards, retrieved
for the probe tasks, no training): how a distiller's cards serve the backbone, off the test split::

    python benchmarks/backbone_probe.py --config jobs/configs/learning-smollm2-within.yaml \
        --per-task 4 --after-bc 4 --method harness memory.distiller=outline_general
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import cached_property
from pathlib import Path

from common import Results, add_json_argument

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _backbone_tag(cfg) -> str:
    if cfg.model.path == "embedded":
        from hamo_ray.backbones.toy import backbone_path

        return backbone_path(cfg).name
    return Path(cfg.model.path).name.removesuffix(".gguf") or "model"


def probe_config(
    config: str | None,
    overrides: list[str],
    per_task: int,
    root: str,
    after_bc: int = 0,
    method: str = "agenttuning",
):
    """The probe's config: the stream's, as ``base`` (stage 0 only) or one stage of ``method``.

    Raises:
        ConfigError: a bad config, or ``after_bc`` on a cross-domain config.
    """
    from hamo_ray.config import ConfigError, load_config

    if after_bc:
        forced = [f"method.name={method}", "protocol.num_stages=1", f"protocol.train_per_task={after_bc}"]
    else:
        forced = ["method.name=base", f"protocol.train_per_task={per_task}"]
    forced += ["protocol.eval_initial=true", f"run.root={root}", "run.resume=true"]
    cfg = load_config(config, [*overrides, *forced])
    if after_bc and cfg.protocol.kind != "within_domain":
        raise ConfigError("--after-bc: protocol.kind must be within_domain (one domain, one BC stage)")
    run_id = f"{_backbone_tag(cfg)}-train{per_task}" + (f"-bc{after_bc}" if after_bc else "")
    if after_bc and method != "agenttuning":  # e.g. harness: the stage's cards, no training
        run_id = f"{_backbone_tag(cfg)}-train{per_task}-{method}{after_bc}"
        if cfg.method.uses_memory:
            run_id += f"-{cfg.memory.distiller}"
    return cfg.model_copy(update={"run": cfg.run.model_copy(update={"id": run_id})})


def make_probe(cfg, per_task: int | None = None):
    """A ``Stream`` whose "test" tasks are train-split variations: the first ``protocol.train_per_task``
    of each task type (stage 0 only), or, with a BC stage, the ``per_task`` after the trained ones."""
    from hamo_ray.run.resources import domain_tasks
    from hamo_ray.run.stream import Stream

    bc = cfg.protocol.num_stages == 1 and cfg.method.name != "base"  # one stage, then the probe again

    class Probe(Stream):
        expected_stages = [0, 1] if bc else [0]

        @cached_property
        def test_tasks(self):
            if not bc:
                return {name: domain_tasks(self.cfg, self.domains, name, "train") for name in self.domains}
            skip = self.cfg.protocol.train_per_task
            out = {}
            for name, domain in self.domains.items():
                out[name] = [
                    t
                    for tt in self.cfg.task_types(name)
                    for t in domain.tasks("train", tt, limit=skip + per_task)[skip:]
                ]
            return out

    return Probe(cfg, config_name="probe")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="the stream's YAML config")
    parser.add_argument("--per-task", type=int, default=12, help="train variations per task type")
    parser.add_argument(
        "--after-bc", type=int, default=0, metavar="M", help="also one BC stage on M per type"
    )
    parser.add_argument(
        "--method",
        default="agenttuning",
        help="the stage's method with --after-bc (e.g. harness: its cards, no training)",
    )
    parser.add_argument("--root", default="runs/probes", help="where the probe's run folders go")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. backbone.num_layers=4")
    add_json_argument(parser, __file__)
    args = parser.parse_args()

    from hamo_ray.config import ConfigError
    from hamo_ray.logs import setup_logging

    setup_logging()
    try:
        cfg = probe_config(args.config, args.overrides, args.per_task, args.root, args.after_bc, args.method)
        probe = make_probe(cfg, args.per_task)
        results = Results(__file__, args)
        stages = probe.run()
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    backbone = Path(probe.folder.backbone or cfg.model.path)
    print(f"backbone: {cfg.model.path} ({backbone})")
    build_file = backbone / "build.json"
    final_loss = None
    if build_file.is_file():  # the embedded backbone records its build
        build = json.loads(build_file.read_text())
        final_loss = build["losses"][-1]
        print(
            f"  {build['trajectories']} expert trajectories, {build['examples']} examples, "
            f"final loss {final_loss:.3f}, built in {build['seconds'] / 60:.0f} min"
        )
    print(f"{'stage':<6} {'domain':<14} {'episodes':>8} {'score':>6} {'succeeded':>9} {'seconds':>30}")
    for result in stages:
        for domain, score in result.scores.items():
            episodes = probe.folder.path / "episodes" / f"stage-{result.stage}-{domain}.jsonl"
            trajs = [json.loads(line) for line in episodes.read_text().splitlines() if line.strip()]
            won = sum(t["score"] >= 100 for t in trajs)
            phases = ", ".join(f"{k} {v:.0f}" for k, v in result.seconds.items())
            print(
                f"{result.stage:<6} {domain:<14} {len(trajs):>8} {score:6.1f} {won:>5}/{len(trajs)}   {phases}"
            )
            results.add(
                {
                    "backbone": _backbone_tag(cfg),
                    "stage": result.stage,
                    "method": result.method,
                    "domain": domain,
                    "episodes": len(trajs),
                    "score": score,
                    "succeeded": won,
                    "nonzero": sum(t["score"] > 0 for t in trajs),
                    "final_loss": final_loss,
                    "train_loss": result.train_loss,
                    "seconds": result.seconds,
                    "evaluation": result.evaluation,
                }
            )
    results.finish()


if __name__ == "__main__":
    main()
