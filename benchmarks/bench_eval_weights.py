"""Evaluation on merged weights vs through the LoRA adapter vs the base model, side by side in one run.

    python benchmarks/bench_eval_weights.py [--config jobs/configs/learning-smollm2-within.yaml]
        [--episodes 12] [--train-trajectories 12] [--epochs 2] [--adapter PATH] [--skip-decode]

On the config's backbone (default: SmolLM2-135M-Instruct) and ScienceWorld task types:

0. **An adapter.** ``--adapter PATH`` (a peft folder), else one trained here: ``--train-trajectories``
   expert trajectories of the train split, behavioural cloning without cards for ``--epochs`` epochs
   with the stream's trainer and LoRA settings (r16 on every projection): a trained stage's adapter.
1. **Decode** (the profile of docs/performance.md, item 1 of issue 42): vLLM engines started in this
   process (``vllm.LLM`` with the endpoint's engine arguments, prefix caching off), 8 chats of the
   domain's ~600-token prompt, greedy, ``ignore_eos``: prefill seconds (``max_tokens=1``) and decode
   tokens/s ((32 - 1) x 8 tokens over the time a 32-token answer takes beyond the prefill), median of
   ``--rounds`` rounds. Engines: LoRA enabled (as the endpoint) serving the base and the adapter, the
   same with ``max_loras=1`` and with ``max_lora_rank`` equal to the adapter's rank, and without LoRA
   (CPU: compiled) serving the base and the merged weights.
2. **Episodes.** The policy endpoint (Ray Serve + vLLM, LoRA on, the stream's) plays ``--episodes``
   test-split episodes with the base model, then with the adapter published on it; then the adapter is
   merged (a Ray task) and served by a second app without LoRA (``hamo_ray.serving.merged.MergedApp``,
   what ``serve.eval_weights=merged`` does in a stage) and the same episodes are played on it. Same
   seeds, temperature and concurrency (``rollout.*``) each time; no cards (no harness). The table shows
   seconds per episode, turns, turns per second of the whole evaluation, the mean score,
   and the merged app's merge + start-up seconds; the greedy probe of the merged and the LoRA policy is
   compared (tokens equal, largest logprob difference).

Results also go to ``benchmarks/results/bench_eval_weights.json`` (``--json PATH``).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import Results, add_json_argument  # noqa: E402

WORK = Path("/tmp/hamo-bench-eval-weights")


def _tasks(cfg, split: str, n: int):
    from hamo_ray.envs import get_domain

    domain = get_domain(cfg.env.domain, cfg.env)
    types = cfg.task_types(cfg.env.domain)
    per = -(-n // len(types))
    tasks = [t for tt in types for t in domain.tasks(split, tt, limit=per)]
    return tasks[:n]


def train_adapter(cfg, model: str, n: int, epochs: int) -> Path:
    """``n`` expert trajectories of the train split, BC without cards: the adapter folder."""
    from transformers import AutoTokenizer

    from hamo_ray.rollout.pool import EnvPool
    from hamo_ray.training.examples import build_examples
    from hamo_ray.training.trainer import train_model

    pool = EnvPool(cfg.env.domain, cfg.env, cfg.prompt, cfg.rollout)
    experts = pool.run(_tasks(cfg, "train", n), None, desc="expert trajectories")
    pool.shutdown()
    trajs = [t for t in experts if t.error is None and t.actions]
    tok = AutoTokenizer.from_pretrained(model)
    examples = build_examples(
        trajs, {}, tok, cfg.prompt, cfg.train.max_seq_len, cfg.model.template_kwargs(),
        budget=cfg.model.max_model_len - cfg.rollout.max_tokens,
    )  # fmt: skip
    out = WORK / "adapters" / "stage-1"
    result = train_model(
        model,
        examples,
        out,
        cfg.train.model_copy(update={"epochs": epochs}),
        pad_id=tok.pad_token_id,
        name="bench",
    )
    print(f"adapter: {len(trajs)} trajectories, {epochs} epochs, loss {result.loss:.3f} -> {out}", flush=True)
    return out


def _chats(cfg, n: int):
    from hamo_ray.envs import get_domain
    from hamo_ray.prompting import build_messages

    domain = get_domain(cfg.env.domain, cfg.env)
    tasks = _tasks(cfg, "test", n)
    out = []
    for i, task in enumerate(tasks):
        goal = f"Your task is to {task.task.replace('-', ' ')} (variation {task.variation})."
        obs = f"This room is called the hallway. In it, you see: a picture {i}, a substance called air."
        out.append(build_messages(goal, obs, [], [], [], cfg.prompt, domain=domain.name))
    return out


def decode_rows(
    cfg, model: str, adapter: Path, merged: Path, rounds: int, results: Results, profile: bool = False
) -> list[dict]:
    """Item 1: prefill seconds and decode tokens/s of engines with and without LoRA."""
    import json

    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    from hamo_ray.serving.engine import engine_env, engine_kwargs

    for key, value in engine_env(cfg.serve).items():
        os.environ.setdefault(key, value)
    if profile:  # the engine core in this process, so torch's profiler sees its ops
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    rank = int(json.loads((adapter / "adapter_config.json").read_text())["r"])
    chats = _chats(cfg, 8)
    tmpl = cfg.model.template_kwargs()
    one = SamplingParams(temperature=0.0, max_tokens=1)
    full = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    scfg = cfg.serve.model_copy(update={"enable_prefix_caching": False, "engine_kwargs": {}})
    engines = [  # (label, weights folder, lora engine?, serve overrides, [(row label, LoRARequest?)])
        ("LoRA engine (endpoint: max_loras 2, rank 16)", model, True, {}, ["base", "adapter"]),
        ("LoRA engine, max_loras 1", model, True, {"max_loras": 1}, ["adapter"]),
        (f"LoRA engine, max_lora_rank {rank}", model, True, {"max_loras": 1, "rank": rank}, ["adapter"]),
        ("engine without LoRA (CPU: compiled)", model, False, {}, ["base"]),
        ("engine without LoRA, merged weights", str(merged), False, {}, ["merged"]),
    ]
    rows = []
    for label, weights, lora, over, kinds in engines:
        rank_ = over.pop("rank", 16)
        kwargs = engine_kwargs(
            weights, cfg.model, scfg.model_copy(update=over), max_lora_rank=rank_, lora=lora
        )
        t0 = time.perf_counter()
        llm = LLM(**kwargs)
        start_s = time.perf_counter() - t0
        for kind in kinds:
            req = LoRARequest("adapter", 1, str(adapter)) if kind == "adapter" else None

            def go(params, llm=llm, req=req):
                return llm.chat(chats, params, lora_request=req, use_tqdm=False, chat_template_kwargs=tmpl)

            go(full)  # warm-up (the adapter's first load, compiled shapes)
            pre, tot = [], []
            for _ in range(rounds):
                t = time.perf_counter()
                go(one)
                pre.append(time.perf_counter() - t)
                t = time.perf_counter()
                outs = go(full)
                tot.append(time.perf_counter() - t)
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            prefill, total = statistics.median(pre), statistics.median(tot)
            row = {
                "table": "decode", "engine": label, "weights": kind, "engine_start_s": start_s,
                "prefill_s": prefill, "total_s": total, "completion_tokens": tokens,
                "decode_tok_s": (tokens - len(chats)) / max(total - prefill, 1e-9),
                "end_to_end_tok_s": tokens / total,
            }  # fmt: skip
            rows.append(results.add(row))
            print(
                f"decode: {label} / {kind}: {row['decode_tok_s']:.1f} tok/s, prefill {prefill:.2f}s",
                flush=True,
            )
            if profile and (kind != "adapter" or "endpoint" in label):
                _profile(go, full, label, kind, results)
        llm = None  # the engine's processes end with it
        gc.collect()
    return rows


def _profile(go, params, label: str, kind: str, results: Results, top: int = 12) -> None:
    """torch's profiler over one 8-chat, 32-token round: the ops with the most self CPU time."""
    import torch

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        go(params)
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events) or 1
    print(f"profile: {label} / {kind} (self CPU time of one round)", flush=True)
    for e in events[:top]:
        share = e.self_cpu_time_total / total
        print(f"  {e.key[:60]:60s} {e.self_cpu_time_total / 1e6:8.3f}s {share:6.1%} x{e.count}", flush=True)
        results.add({"table": "profile", "engine": label, "weights": kind, "op": e.key,
                     "self_cpu_s": e.self_cpu_time_total / 1e6, "share": share, "calls": e.count})  # fmt: skip


def episode_rows(cfg, model: str, adapter: Path, n: int, results: Results) -> list[dict]:
    """Item 3: ``n`` test episodes with the base, the adapter (LoRA) and the merged weights."""
    from hamo_ray.naming import merged_app_names
    from hamo_ray.rollout.client import PolicySpec
    from hamo_ray.rollout.pool import EnvPool
    from hamo_ray.serving import publish_adapter, shutdown_policy_server, start_policy_server
    from hamo_ray.serving.client import hit_rate, prefix_cache_counters
    from hamo_ray.serving.merged_app import MergedApp, probe_agreement
    from hamo_ray.serving.objstore import folder_digest

    scfg = cfg.serve.model_copy(
        update={"app_name": "hamo-bench-eval", "route_prefix": "/bench", "port": 18491}
    )
    root = adapter.parent
    url = start_policy_server(model, cfg.model, scfg, adapter_root=root)
    name = f"stage-1:{folder_digest(adapter)[:12]}"
    publish_adapter(url, name, adapter, scfg.probe_prompt, scfg.probe_tokens)
    app, route = merged_app_names(scfg.app_name, scfg.route_prefix)
    merged = MergedApp(model, cfg.model, scfg.model_copy(update={"app_name": app, "route_prefix": route}),
                       str(root), scfg.max_lora_rank)  # fmt: skip
    tasks = _tasks(cfg, "test", n)
    pool = EnvPool(cfg.env.domain, cfg.env, cfg.prompt, cfg.rollout)
    rows = []
    try:
        for weights in ("base", "adapter", "merged"):
            setup_s, target = 0.0, url
            if weights == "merged":
                t0 = time.perf_counter()
                target, _ = merged.ensure(name, str(adapter))
                setup_s = time.perf_counter() - t0
                agree = probe_agreement(url, name, target, scfg.probe_prompt, scfg.probe_tokens)
                print(f"agreement merged vs LoRA: {agree}", flush=True)
            spec = PolicySpec(
                base_url=target, model=cfg.model.name if weights == "base" else name,
                temperature=cfg.rollout.temperature, max_tokens=cfg.rollout.max_tokens, seed=0,
                chat_template_kwargs=cfg.model.template_kwargs(), tokenizer=model,
                timeout_s=cfg.rollout.request_timeout_s,
                prompt_budget=cfg.model.max_model_len - cfg.rollout.max_tokens,
            )  # fmt: skip
            before = prefix_cache_counters(target)
            start = time.perf_counter()
            trajs = pool.run(tasks, spec, desc=f"evaluation, {weights}")
            wall = time.perf_counter() - start
            after = prefix_cache_counters(target)
            row = {
                "table": "episodes", "weights": weights, "episodes": len(trajs),
                "failed": sum(1 for t in trajs if t.error), "turns": sum(t.num_turns for t in trajs),
                "seconds": wall, "seconds_per_episode": wall / len(trajs),
                "mean_score": sum(t.score for t in trajs) / len(trajs), "setup_s": setup_s,
                "prefix_cache_hit_rate": hit_rate(before, after),
            }  # fmt: skip
            if weights == "merged":
                row |= {
                    "probe_tokens_equal": agree["tokens_equal"],
                    "probe_max_logprob_diff": agree["max_logprob_diff"],
                }
            rows.append(results.add(row))
            print(
                f"episodes, {weights}: {row['seconds_per_episode']:.1f} s/episode, {row['turns']} turns",
                flush=True,
            )
    finally:
        pool.shutdown()
        merged.stop()
        shutdown_policy_server(scfg)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", default="jobs/configs/learning-smollm2-within.yaml")
    parser.add_argument("--episodes", type=int, default=12, help="test episodes per evaluation")
    parser.add_argument(
        "--adapter", type=Path, default=None, help="a peft adapter folder (default: train one)"
    )
    parser.add_argument("--train-trajectories", type=int, default=12)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3, help="decode rounds per engine (median)")
    parser.add_argument("--skip-decode", action="store_true")
    parser.add_argument("--profile", action="store_true", help="torch profiler tables of the decode rounds")
    parser.add_argument("--skip-episodes", action="store_true")
    parser.add_argument("overrides", nargs="*", help="dotted config overrides")
    add_json_argument(parser, __file__)
    args = parser.parse_args()
    results = Results(__file__, args)

    import ray

    from hamo_ray.backbones.sources import resolve_model_path
    from hamo_ray.config import load_config
    from hamo_ray.serving.merged import merge_adapter

    cfg = load_config(args.config, args.overrides)
    model = str(resolve_model_path(cfg.model.path, cfg.model.cache_dir))
    ray.init(address="local", num_cpus=max(8, 2 * (os.cpu_count() or 1)), include_dashboard=False)
    decode, episodes = [], []
    try:
        adapter = args.adapter or train_adapter(cfg, model, args.train_trajectories, args.epochs)
        adapter = Path(adapter).resolve()
        t0 = time.perf_counter()
        merged = merge_adapter(model, adapter, WORK / "merged")
        print(f"merge_and_unload + save: {time.perf_counter() - t0:.1f}s -> {merged}", flush=True)
        if not args.skip_decode:
            decode = decode_rows(cfg, model, adapter, merged, args.rounds, results, args.profile)
        if not args.skip_episodes:
            episodes = episode_rows(cfg, model, adapter, args.episodes, results)
    finally:
        ray.shutdown()
    print(f"\nbackbone {cfg.model.path} ({model}), adapter {adapter}")
    if decode:
        base = next((r["decode_tok_s"] for r in decode if r["weights"] == "base"), None)
        print(
            "\n| engine | weights | prefill s (8 chats) | decode tok/s | x base (LoRA engine) | engine start s |"
        )
        print("|---|---|---:|---:|---:|---:|")
        for r in decode:
            print(
                f"| {r['engine']} | {r['weights']} | {r['prefill_s']:.2f} | {r['decode_tok_s']:.1f} | "
                f"{r['decode_tok_s'] / base:.2f}x | {r['engine_start_s']:.0f} |"
            )
    if episodes:
        base = episodes[0]["seconds_per_episode"]
        print("\n| weights | episodes | turns | s / episode | x base speed | turns/s | score | set-up s |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        for r in episodes:
            print(
                f"| {r['weights']} | {r['episodes']} | {r['turns']} | {r['seconds_per_episode']:.1f} | "
                f"{base / r['seconds_per_episode']:.2f}x | {r['turns'] / r['seconds']:.2f} | "
                f"{r['mean_score']:.1f} | {r['setup_s']:.0f} |"
            )
    results.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
