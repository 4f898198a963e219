"""How far one stage's LoRA update moves the training loss at each learning rate (training data only).

The learning experiment (docs/results-toy.md, superseded) deviates from the paper's learning rate (2e-4) on
the embedded ~0.5M-parameter backbone. This probe is the measurement behind that choice: it takes a
finished run folder, rebuilds a stage's training examples exactly as the stream did (the stage's
anchors, with the experience retrieved from the run's memory when the method conditions), trains a
fresh adapter on them with the real trainer at each learning rate, and prints the per-epoch training
loss. No test episode is run, so the choice is not tuned on the test split.

    python benchmarks/lr_probe.py --run runs/learning-within/cells/hamo-embedded-default-s0 \
        --lrs 2e-4 2e-3 [--stage 1]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from common import Results, add_json_argument


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", required=True, help="a finished run folder (holds config.yaml)")
    parser.add_argument("--stage", type=int, default=1)
    parser.add_argument("--lrs", type=float, nargs="+", default=[2e-4, 2e-3])
    add_json_argument(parser, __file__)
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from hamo_ray.config import load_saved_config
    from hamo_ray.memory.recall import training_experience
    from hamo_ray.run.cluster import start_ray
    from hamo_ray.run.folder import RunFolder
    from hamo_ray.training.examples import build_examples
    from hamo_ray.training.trainer import train_model

    run = Path(args.run)
    if not (run / "config.yaml").exists():
        raise SystemExit(f"--run {run}: no config.yaml there (not a run folder)")
    cfg = load_saved_config(run / "config.yaml", ["ray.address=local"])
    folder = RunFolder(run, cfg)
    done = {r.stage: r for r in folder.stages()}
    if args.stage not in done:
        raise SystemExit(f"--run {run}: stage {args.stage} is not committed (have {sorted(done)})")
    chosen = set(done[args.stage].anchors)
    batch = [t for t in folder.load_trajectories(args.stage) or [] if t.id in chosen]
    model_path = json.loads(folder.state_file.read_text()).get("backbone")  # what the stream resolved
    if not model_path or not Path(model_path).exists():
        raise SystemExit(f"--run {run}: its backbone {model_path!r} is not there")
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    store = folder.store(cfg) if cfg.method.conditioning else None
    cards = training_experience(store, batch, cfg.memory.top_k, max_stage=args.stage) if store else {}
    examples = build_examples(
        batch, cards, tokenizer, cfg.prompt, cfg.train.max_seq_len, cfg.model.template_kwargs()
    )
    start_ray(cfg.ray)
    results = Results(__file__, args)
    print(f"stage {args.stage}: {len(batch)} anchors -> {len(examples)} examples, {cfg.train.epochs} epochs")
    print(f"{'lr':>10} | per-epoch training loss | last / first")
    for lr in args.lrs:
        out = run / "lr-probe" / f"lr-{lr:g}"
        r = train_model(
            model_path, examples, out, cfg.train.model_copy(update={"lr": lr}), pad_id=tokenizer.pad_token_id,
            seed=cfg.run.seed + args.stage, name=f"lr-probe-{lr:g}",
        )  # fmt: skip
        ratio = r.losses[-1] / r.losses[0]
        print(f"{lr:>10.1e} | {', '.join(f'{x:.3f}' for x in r.losses)} | {ratio:.2f}")
        results.add({"lr": lr, "losses": r.losses, "last_over_first": ratio, "examples": len(examples)})
    results.finish()


if __name__ == "__main__":
    main()
