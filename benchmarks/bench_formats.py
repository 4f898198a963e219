"""Training format and history on a real model: per-step examples vs one sequence per trajectory, and a
sliding history window vs the whole history (prefix caching), side by side in one run.

    python benchmarks/bench_formats.py [--config jobs/configs/smollm2.yaml] [--trajectories 4] [--episodes 8]

On the config's backbone (default: SmolLM2-135M-Instruct, the main job's) and its ScienceWorld task types:

1. **Training.** ``--trajectories`` expert trajectories of the train split (the simulator's gold paths,
   through ``EnvPool``) become behavioural-cloning examples both ways (``train.example_format`` step
   and trajectory, same prompts, same cards: none). The table shows examples, tokens computed per
   epoch (the stage's cost: x ``train.epochs``), and the seconds and tokens/s of one epoch of LoRA
   training of each (``train_model``, the stream's trainer). Both train on the same labelled tokens.
2. **Evaluation.** The base model is served (Ray Serve + vLLM, prefix caching on) and ``--episodes``
   train-split episodes are played by the policy twice: with ``prompt.history_turns=4`` (a sliding
   window: every prompt after the fourth turn is a new prefix) and with the whole history (each prompt
   extends the last). The table shows seconds per episode, prompt tokens, and the prefix-cache hit rate
   from vLLM's own counters (``/metrics``) over each evaluation.

Results also go to ``benchmarks/results/bench_formats.json`` (``--json PATH``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import Results, add_json_argument  # noqa: E402


def _tasks(cfg, split: str, n: int):
    from hamo_ray.envs import get_domain

    domain = get_domain(cfg.env.domain, cfg.env)
    types = cfg.task_types(cfg.env.domain)
    per = -(-n // len(types))
    tasks = [t for tt in types for t in domain.tasks(split, tt, limit=per)]
    return tasks[:n]


def training_rows(cfg, model: str, trajs, results: Results) -> list[dict]:
    from transformers import AutoTokenizer

    from hamo_ray.training.examples import build_examples
    from hamo_ray.training.trainer import train_model

    tok = AutoTokenizer.from_pretrained(model)
    budget = cfg.model.max_model_len - cfg.rollout.max_tokens
    rows = []
    for fmt in ("step", "trajectory"):
        examples = build_examples(
            trajs, {}, tok, cfg.prompt, cfg.train.max_seq_len, cfg.model.template_kwargs(),
            budget=budget, per_step=fmt == "step",
        )  # fmt: skip
        tokens = sum(len(e.input_ids) for e in examples)
        labelled = sum(sum(lab != -100 for lab in e.labels) for e in examples)
        out = Path(f"/tmp/hamo-bench-formats/{fmt}")
        start = time.perf_counter()
        result = train_model(
            model,
            examples,
            out,
            cfg.train.model_copy(update={"epochs": 1}),
            pad_id=tok.pad_token_id,
            name=f"bench-{fmt}",
        )
        wall = time.perf_counter() - start
        row = {
            "table": "training",
            "format": fmt,
            "trajectories": len(trajs),
            "examples": len(examples),
            "tokens_per_epoch": tokens,
            "labelled_tokens": labelled,
            "tokens_per_stage": tokens * cfg.train.epochs,
            "epoch_s": result.seconds,
            "epoch_wall_s": wall,
            "tokens_per_s": tokens / max(result.seconds, 1e-9),
            "loss": result.loss,
        }
        rows.append(results.add(row))
        print(
            f"training, {fmt}: {len(examples)} examples, {tokens} tokens, {result.seconds:.1f}s", flush=True
        )
    return rows


def evaluation_rows(cfg, model: str, tasks, results: Results) -> list[dict]:
    from hamo_ray.rollout.client import PolicySpec
    from hamo_ray.rollout.pool import EnvPool
    from hamo_ray.serving import shutdown_policy_server, start_policy_server
    from hamo_ray.serving.client import hit_rate, prefix_cache_counters

    serve_cfg = cfg.serve.model_copy(update={"app_name": "hamo-bench-formats", "port": 18490})
    url = start_policy_server(model, cfg.model, serve_cfg, adapter_root="/tmp/hamo-bench-formats/adapters")
    rows = []
    try:
        for label, turns in (("window of 4 turns", 4), ("whole history", None)):
            pcfg = cfg.prompt.model_copy(update={"history_turns": turns})
            pool = EnvPool(cfg.env.domain, cfg.env, pcfg, cfg.rollout)
            spec = PolicySpec(
                base_url=url, model=cfg.model.name, temperature=cfg.rollout.temperature,
                max_tokens=cfg.rollout.max_tokens, seed=0, chat_template_kwargs=cfg.model.template_kwargs(),
                tokenizer=model, prompt_budget=cfg.model.max_model_len - cfg.rollout.max_tokens,
            )  # fmt: skip
            pool.run(tasks[:1], spec, desc="warm-up")
            before = prefix_cache_counters(url)
            start = time.perf_counter()
            trajs = pool.run(tasks, spec, desc=f"evaluation, {label}")
            wall = time.perf_counter() - start
            after = prefix_cache_counters(url)
            pool.shutdown()
            row = {
                "table": "evaluation",
                "history": label,
                "episodes": len(trajs),
                "turns": sum(t.num_turns for t in trajs),
                "seconds_per_episode": wall / len(trajs),
                "prompt_tokens": (after[0] - before[0]) if before and after else None,
                "prefix_cache_hit_rate": hit_rate(before, after),
                "mean_score": sum(t.score for t in trajs) / len(trajs),
            }
            rows.append(results.add(row))
            print(f"evaluation, {label}: {wall:.1f}s, hit rate {row['prefix_cache_hit_rate']}", flush=True)
    finally:
        shutdown_policy_server(serve_cfg)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", default="jobs/configs/smollm2.yaml")
    parser.add_argument("--trajectories", type=int, default=4, help="expert trajectories to train on")
    parser.add_argument("--episodes", type=int, default=8, help="policy episodes per evaluation")
    parser.add_argument("--skip-training", action="store_true")
    parser.add_argument("--skip-evaluation", action="store_true")
    parser.add_argument("overrides", nargs="*", help="dotted config overrides (train.epochs=1 ...)")
    add_json_argument(parser, __file__)
    args = parser.parse_args()
    results = Results(__file__, args)

    import ray

    from hamo_ray.backbones.sources import resolve_model_path
    from hamo_ray.config import load_config
    from hamo_ray.rollout.pool import EnvPool

    cfg = load_config(args.config, args.overrides)
    model = resolve_model_path(cfg.model.path, cfg.model.cache_dir)
    ray.init(address="local", num_cpus=max(8, 2 * (os.cpu_count() or 1)), include_dashboard=False)
    train_rows, eval_rows = [], []
    try:
        if not args.skip_training:
            pool = EnvPool(cfg.env.domain, cfg.env, cfg.prompt, cfg.rollout)
            experts = pool.run(_tasks(cfg, "train", args.trajectories), None, desc="expert trajectories")
            pool.shutdown()
            trajs = [t for t in experts if t.error is None and t.actions]
            train_rows = training_rows(cfg, model, trajs, results)
        if not args.skip_evaluation:
            eval_rows = evaluation_rows(cfg, model, _tasks(cfg, "train", args.episodes), results)
    finally:
        ray.shutdown()
    print(f"\nbackbone {cfg.model.path} ({model}), {cfg.env.domain} {cfg.task_types(cfg.env.domain)}")
    if train_rows:
        step, seq = train_rows
        print("\n| format | examples | tokens / epoch | tokens / stage | epoch s | tokens/s |")
        print("|---|---:|---:|---:|---:|---:|")
        for r in train_rows:
            print(
                f"| {r['format']} | {r['examples']} | {r['tokens_per_epoch']} | {r['tokens_per_stage']} | "
                f"{r['epoch_s']:.1f} | {r['tokens_per_s']:.0f} |"
            )
        print(
            f"| step / trajectory | | {step['tokens_per_epoch'] / seq['tokens_per_epoch']:.2f}x | | "
            f"{step['epoch_s'] / max(seq['epoch_s'], 1e-9):.2f}x | |"
        )
    if eval_rows:
        print("\n| history | episodes | turns | s / episode | prompt tokens | prefix-cache hit rate |")
        print("|---|---:|---:|---:|---:|---:|")
        for r in eval_rows:
            rate = "n/a" if r["prefix_cache_hit_rate"] is None else f"{r['prefix_cache_hit_rate']:.3f}"
            print(
                f"| {r['history']} | {r['episodes']} | {r['turns']} | {r['seconds_per_episode']:.1f} | "
                f"{r['prompt_tokens']} | {rate} |"
            )
        if len(eval_rows) == 2:
            a, b = eval_rows
            print(f"| window / whole | | | {a['seconds_per_episode'] / b['seconds_per_episode']:.2f}x | | |")
    results.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
