"""Rollout throughput: EnvPool (Ray actors, concurrent episodes) vs a sequential loop, same episodes.

    python benchmarks/bench_rollout.py [--model PATH] [--domain textworld] [--concurrency 1 8 32 128]

For each concurrency C the same ``episodes`` (C x 2, at least 8) of ``--turns`` turns each run
(a) through ``EnvPool`` with C concurrent episodes over ``--actors`` actors against the policy
endpoint (Ray Serve + vLLM), and (b) as a plain sequential loop (one environment, one blocking HTTP
request at a time). It prints environment steps/s and policy tokens/s of both, their ratio, the
server's saturated tokens/s from a pure load test at batch size C (same prompts, no environments),
and the rollout efficiency = rollout tokens/s / saturated tokens/s. It then prints the memory of one
environment per domain and how many fit in 24 GiB.

Results also go to ``benchmarks/results/bench_rollout.json`` (``--json PATH``): one row per
concurrency (``"table": "throughput"``) and per domain (``"table": "memory"``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import Results, add_json_argument  # noqa: E402

from hamo_ray.config import EnvConfig, ModelConfig, PromptConfig, RolloutConfig, ServeConfig  # noqa: E402
from hamo_ray.envs import get_domain  # noqa: E402
from hamo_ray.prompting import build_messages, clean_action  # noqa: E402
from hamo_ray.rollout.client import PolicySpec  # noqa: E402


def sequential(domain, tasks, spec: PolicySpec, pcfg: PromptConfig, max_turns: int):
    import httpx

    env = domain.make_env()
    steps, actions, tokens = 0, [], 0
    with httpx.Client(timeout=120) as http:
        for task in tasks:
            goal, obs0 = env.reset(task)
            acts, obss = [], []
            for _ in range(max_turns):
                body = {
                    "model": spec.model,
                    "messages": build_messages(goal, obs0, [], acts, obss, pcfg),
                    "temperature": spec.temperature,
                    "max_tokens": spec.max_tokens,
                }
                response = http.post(f"{spec.base_url}/v1/chat/completions", json=body)
                if response.status_code != 200:
                    raise RuntimeError(
                        f"policy endpoint answered {response.status_code}: {response.text[:300]}"
                    )
                reply = response.json()
                tokens += reply["usage"]["completion_tokens"]
                action = clean_action(reply["choices"][0]["message"]["content"] or "")
                step = env.step(action)
                acts.append(action)
                obss.append(step.observation)
                steps += 1
                if step.done:
                    break
            actions.append(acts)
    env.close()
    return steps, tokens


async def saturate(spec: PolicySpec, messages: list[list[dict]], concurrency: int, seconds: float) -> float:
    """Completion tokens/s of the endpoint with ``concurrency`` requests always in flight."""
    import httpx

    tokens = 0
    stop = time.perf_counter() + seconds
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=concurrency + 8)) as http:

        async def loop(i: int) -> None:
            nonlocal tokens
            n = i
            while time.perf_counter() < stop:
                body = {
                    "model": spec.model,
                    "messages": messages[n % len(messages)],
                    "temperature": spec.temperature,
                    "max_tokens": spec.max_tokens,
                }
                r = await http.post(f"{spec.base_url}/v1/chat/completions", json=body)
                tokens += r.json()["usage"]["completion_tokens"]
                n += concurrency

        start = time.perf_counter()
        await asyncio.gather(*(loop(i) for i in range(concurrency)))
        return tokens / (time.perf_counter() - start)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", help="HF model folder (default: a random tiny backbone)")
    parser.add_argument("--domain", default="textworld")
    parser.add_argument("--task-type", default="tw-coin_collector")
    parser.add_argument("--games", type=int, default=8, help="distinct games; episodes cycle over them")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--actors", type=int, default=4)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--port", type=int, default=18480)
    add_json_argument(parser, __file__)
    args = parser.parse_args()
    results = Results(__file__, args)

    import ray

    from hamo_ray.backbones.tiny_lm import make_random_backbone
    from hamo_ray.rollout.pool import EnvPool
    from hamo_ray.serving import shutdown_policy_server, start_policy_server

    model = args.model or str(make_random_backbone(Path("/tmp/hamo-bench-rollout/model")))
    env_cfg = EnvConfig(domain=args.domain, task_types=[args.task_type], max_turns=args.turns)
    pcfg = PromptConfig()
    domain = get_domain(args.domain, env_cfg)
    games = domain.tasks("train", args.task_type, limit=args.games)
    if args.domain == "textworld":
        from hamo_ray.envs.textworld import default_games_dir, pregenerate

        pregenerate(Path(env_cfg.textworld.games_dir or default_games_dir()), games)
    ray.init(
        address="local",
        num_cpus=max(8, 2 * (os.cpu_count() or 1)),
        include_dashboard=False,
        configure_logging=False,
    )
    serve_cfg = ServeConfig(port=args.port, app_name="hamo-bench-rollout", max_num_seqs=max(args.concurrency))
    url = start_policy_server(
        model, ModelConfig(max_model_len=2048), serve_cfg, adapter_root="/tmp/hamo-bench-rollout"
    )
    spec = PolicySpec(base_url=url, model="base", temperature=0.7, max_tokens=16, seed=0)
    rows: list[dict] = []
    try:
        for c in args.concurrency:
            tasks = [games[i % len(games)] for i in range(max(8, 2 * c))]
            actors = min(args.actors, c)
            pool = EnvPool(
                args.domain,
                env_cfg,
                pcfg,
                RolloutConfig(num_workers=actors, envs_per_worker=max(1, c // actors), cpus_per_worker=0.5),
            )
            pool.run(tasks[:actors], spec, desc="warm-up")
            start = time.perf_counter()
            trajs = pool.run(tasks, spec, desc=f"concurrency {c}")
            wall = time.perf_counter() - start
            pool.shutdown()
            steps = sum(t.num_turns for t in trajs)
            toks = sum(t.policy_tokens for t in trajs)
            seq_tasks = tasks[: min(len(tasks), 8)]
            start = time.perf_counter()
            seq_steps, seq_toks = sequential(domain, seq_tasks, spec, pcfg, args.turns)
            seq_wall = time.perf_counter() - start
            prompts = [
                build_messages(t.goal, t.init_obs, [], t.actions[:k], t.observations[:k], pcfg)
                for t in trajs
                for k in range(t.num_turns)
            ]
            sat = asyncio.run(saturate(spec, prompts, c, seconds=max(10.0, min(30.0, wall))))
            row = {
                "table": "throughput",
                "concurrency": c,
                "pool_steps_per_s": steps / wall,
                "pool_tok_s": toks / wall,
                "seq_steps_per_s": seq_steps / seq_wall,
                "seq_tok_s": seq_toks / seq_wall,
                "pool_over_seq": (steps / wall) / (seq_steps / seq_wall),
                "server_saturated_tok_s": sat,
                "efficiency": (toks / wall) / sat,
                "pool_steps": steps,
                "pool_s": wall,
                "seq_steps": seq_steps,
                "seq_s": seq_wall,
            }
            rows.append(results.add(row))
            print(
                f"C={c}: {steps} steps in {wall:.1f}s; sequential {seq_steps} steps in {seq_wall:.1f}s; "
                f"saturated {sat:.0f} tok/s",
                flush=True,
            )
    finally:
        shutdown_policy_server(serve_cfg)
    print()
    print(f"rollout throughput, {args.domain}/{args.task_type}, {args.turns} turns, policy {model}")
    print(
        "| conc | pool steps/s | pool tok/s | seq steps/s | seq tok/s | pool/seq | server saturated tok/s | efficiency |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['concurrency']} | {r['pool_steps_per_s']:.1f} | {r['pool_tok_s']:.0f} | "
            f"{r['seq_steps_per_s']:.1f} | {r['seq_tok_s']:.0f} | {r['pool_over_seq']:.1f}x | "
            f"{r['server_saturated_tok_s']:.0f} | {r['efficiency']:.2f} |"
        )
    print()
    memory_table(results)
    results.finish()
    return 0


def memory_table(results: Results) -> None:
    """RSS of one environment per domain (measured in a fresh subprocess) and how many fit in 24 GiB."""
    import subprocess

    code = (
        "import sys\n"
        "from hamo_ray.config import EnvConfig\nfrom hamo_ray.envs import get_domain\n"
        "d=sys.argv[1]; cfg=EnvConfig(domain=d, task_types=[sys.argv[2]], alfworld={'games': 'generated'})\n"
        "dom=get_domain(d,cfg); t=dom.tasks('train',sys.argv[2],limit=1)[0]\n"
        "import psutil,os; p=psutil.Process(); before=p.memory_info().rss\n"
        "env=dom.make_env(); env.reset(t); [env.step(a) for a in env.expert_actions()[:3]]\n"
        "kids=sum(c.memory_info().rss for c in p.children(recursive=True))\n"
        "print((p.memory_info().rss-before+kids)/2**20)\n"
    )
    print("marginal memory of one more environment (RSS after imports and task setup) and how many fit")
    print("| domain | MiB per environment | environments in 24 GiB |")
    print("|---|---:|---:|")
    for domain, task in [
        ("scienceworld", "find-living-thing"),
        ("textworld", "tw-coin_collector"),
        ("webshop", "beauty"),
        ("alfworld", "pick_and_place_simple"),
    ]:
        try:
            out = subprocess.run(
                [sys.executable, "-c", code, domain, task],
                capture_output=True,
                text=True,
                timeout=600,
                cwd=Path(__file__).resolve().parent.parent,
            )
            if out.returncode != 0:  # keep the child's own error (e.g. missing game data), not an IndexError
                lines = out.stderr.strip().splitlines() or [f"exit status {out.returncode}"]
                raise RuntimeError(lines[-1])
            mib = float(out.stdout.strip().splitlines()[-1])
            fits = int(24 * 1024 / max(mib, 1))
            results.add({"table": "memory", "domain": domain, "mib_per_env": mib, "envs_in_24gib": fits})
            print(f"| {domain} | {mib:.0f} | {fits} |")
        except Exception as exc:  # a domain that cannot run here is reported, not fatal
            error = str(exc) if isinstance(exc, RuntimeError) else f"{type(exc).__name__}: {exc}"
            # the table names the error's class ("hamo_ray.config.ConfigError: ..." -> ConfigError)
            short = error.split(":")[0].rsplit(".", 1)[-1] if ":" in error else type(exc).__name__
            results.add({"table": "memory", "domain": domain, "error": error})
            print(f"| {domain} | n/a ({short}) | |")


if __name__ == "__main__":
    sys.exit(main())
