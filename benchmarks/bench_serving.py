"""Serving throughput and latency: our endpoint vs vLLM's own server, base vs adapter, batched vs one at a time.

Sends chat requests with the official ``openai`` client at concurrency 1, 16 and 64 and prints, per
level, completion tokens/s and p50/p99 request latency for the base model and a LoRA adapter through
``hamo_ray.serving`` (Ray Serve + vLLM's OpenAI app; ``ours``: a replica's direct URL, ``proxy``: the
same replica through Serve's HTTP proxy) and through vLLM's own OpenAI server (``python -m
vllm.entrypoints.openai.api_server``) on the same engine settings (one CPU thread on CPU, the same batch
size, LoRA slots, prefix caching, context length and chat-template settings). ``--ray-llm`` adds
``ray.serve.llm``'s own OpenAI app (``build_openai_app``, base model only: its adapters load only from
cloud URIs).

vLLM's server runs at the niceness Ray gives its workers (15 by default), as the replica's engine does:
on a busy machine, a server at niceness 0 against one at 15 measures the scheduler, not the servers.
All servers run at once and are measured in turns: each (model, level) is measured ``--rounds`` times
per server, the servers taking turns in a rotating order, and the median round is reported; on a shared
machine this keeps slow spells from landing on one server only. Ratios: adapter/base, level/one at a
time, ours/vLLM's (the overhead of our layer), proxy/vLLM's (plus Serve's proxy), ray.serve.llm/vLLM's::

    python benchmarks/bench_serving.py                      # a random tiny backbone and adapter
    python benchmarks/bench_serving.py --model PATH --adapter PATH --max-tokens 32
    python benchmarks/bench_serving.py --levels 1 16 --skip-vllm --ray-llm

Results also go to ``benchmarks/results/bench_serving.json`` (``--json PATH``), one row per level.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import Results, add_json_argument  # noqa: E402

from hamo_ray.config import ModelConfig, ServeConfig  # noqa: E402

PROMPTS = [
    "Your task is to focus on the animal. This room is called the kitchen. You see a table.",
    "open door to hallway. go to hallway. look around.",
    "pick up thermometer. focus on orange. This room is called the greenhouse.",
]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA = "bench-lora"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _weights(tmp: Path) -> tuple[Path, Path]:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from hamo_ray.backbones.tiny_lm import make_random_backbone

    base = make_random_backbone(tmp / "base")
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    lora = LoraConfig(r=16, lora_alpha=32, target_modules=TARGETS, init_lora_weights=False)
    get_peft_model(model, lora).save_pretrained(tmp / "adapters" / LORA)
    return base, tmp / "adapters" / LORA


async def _load(url: str, model: str, concurrency: int, requests: int, max_tokens: int) -> dict[str, float]:
    import openai

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="EMPTY", max_retries=0, timeout=600)
    gate = asyncio.Semaphore(concurrency)
    latencies: list[float] = []
    tokens = 0

    async def one(i: int) -> None:
        nonlocal tokens
        async with gate:
            t0 = time.perf_counter()
            r = await client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": f"{PROMPTS[i % len(PROMPTS)]} ({i})"}],
                temperature=1.0,
                seed=i,
                max_tokens=max_tokens,
            )
            latencies.append(time.perf_counter() - t0)
            tokens += r.usage.completion_tokens

    await one(-1)  # warm-up: the adapter's first load, compiled paths
    latencies.clear()
    tokens = 0
    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(requests)))
    wall = time.perf_counter() - t0
    await client.close()
    latencies.sort()
    return {
        "tok_s": tokens / wall,
        "p50": statistics.median(latencies),
        "p99": latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
    }


def _measure(servers: dict[str, tuple[str, list[str]]], levels: list[int], rounds: int, max_tokens: int):
    """(server, model, level) -> the median round of ``_load``; servers take turns in a rotating order."""
    results = {}
    names = list(servers)
    for model in ("base", LORA):
        for c in levels:
            runs: dict[str, list[dict]] = {s: [] for s in names if model in servers[s][1]}
            for r in range(rounds):
                for s in names[r % len(names) :] + names[: r % len(names)]:
                    if s in runs:
                        runs[s].append(
                            asyncio.run(_load(servers[s][0], model, c, max(32, 4 * c), max_tokens))
                        )
            for s, rs in runs.items():
                med = sorted(rs, key=lambda x: x["tok_s"])[len(rs) // 2]
                results[(s, model, c)] = med
                spread = ", ".join(f"{x['tok_s']:.0f}" for x in rs)
                print(
                    f"  {s:>6} {model:>10} c={c:<3} {med['tok_s']:8.1f} tok/s  p50 {med['p50']:.3f}s  "
                    f"p99 {med['p99']:.3f}s  (rounds: {spread})",
                    flush=True,
                )
    return results


def _start_ours(base: Path, adapter: Path, model_cfg: ModelConfig, serve_cfg: ServeConfig) -> tuple[str, str]:
    """Our endpoint: (the replica's direct URL, Serve's proxy URL)."""
    from hamo_ray.serving import direct_url, publish_adapter, start_policy_server

    url = start_policy_server(base, model_cfg, serve_cfg, adapter.parent)
    publish_adapter(url, LORA, adapter.name, serve_cfg.probe_prompt, serve_cfg.probe_tokens)
    return direct_url(url), url


def _start_ray_llm(base: Path, model_cfg: ModelConfig, serve_cfg: ServeConfig) -> str:
    """``ray.serve.llm``'s OpenAI app (ingress deployment + LLMServer) on the same engine settings."""
    from ray import serve
    from ray.serve.llm import LLMConfig, build_openai_app

    from hamo_ray.serving.engine import engine_env, engine_kwargs

    kwargs = engine_kwargs(base, model_cfg, serve_cfg)
    for key in ("model", "served_model_name"):
        kwargs.pop(key)
    config = LLMConfig(
        model_loading_config={"model_id": "base", "model_source": str(base)},
        engine_kwargs=kwargs,
        accelerator_config={"kind": "cpu"},
        placement_group_config={"bundles": [{"CPU": serve_cfg.num_cpus}]},
        runtime_env={"env_vars": engine_env(serve_cfg)},
        deployment_config={"max_ongoing_requests": max(8, 2 * serve_cfg.max_num_seqs)},
    )
    serve.run(
        build_openai_app({"llm_configs": [config]}), name="ray-llm", route_prefix="/raylm", blocking=False
    )
    url = f"http://127.0.0.1:{serve_cfg.port}/raylm"
    _wait(url, "/v1/models")
    return url


def _worker_niceness() -> int:
    """The niceness Ray's raylet gives its workers (``RAY_worker_niceness``, 15 by default on Linux)."""
    import ray

    return ray.get(ray.remote(num_cpus=0)(lambda: os.nice(0)).remote())


def _start_vllm(base: Path, adapter: Path, model_cfg: ModelConfig, serve_cfg: ServeConfig, log: Path):
    """vLLM's own server, at the niceness of Ray's workers (the replica's engine runs at it too)."""
    from hamo_ray.serving.engine import engine_env, engine_kwargs

    port = _free_port()
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    for key, value in engine_kwargs(base, model_cfg, serve_cfg).items():  # our engine's settings, as flags
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            cmd.append(flag if value else flag.replace("--", "--no-", 1))
        else:
            cmd += [flag, json.dumps(value) if isinstance(value, dict) else str(value)]
    cmd += ["--lora-modules", f"{LORA}={adapter}", "--chat-template-content-format", "string"]
    env = {**os.environ, **engine_env(serve_cfg)}
    niceness = _worker_niceness() - os.nice(0)
    proc = subprocess.Popen(
        cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, preexec_fn=lambda: os.nice(niceness)
    )
    url = f"http://127.0.0.1:{port}"
    _wait(url, "/health", proc)
    return proc, url


def _wait(url: str, path: str, proc=None, timeout_s: float = 900) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited {proc.returncode}")
        try:
            if httpx.get(f"{url}{path}", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} did not come up")
        time.sleep(2)


def _rows(results: dict, levels: list[int]) -> list[dict]:
    """One row per concurrency level: every server's base and adapter figures and the ratios."""
    rows = []
    for c in levels:
        row: dict = {"concurrency": c}
        for (s, model, level), r in results.items():
            if level == c:
                name = f"{s}_{'base' if model == 'base' else 'lora'}"
                row |= {f"{name}_tok_s": r["tok_s"], f"{name}_p50_s": r["p50"], f"{name}_p99_s": r["p99"]}
        for kind in ("base", "lora"):
            one = results.get(("ours", "base" if kind == "base" else LORA, levels[0]))
            if one and f"ours_{kind}_tok_s" in row:
                row[f"batch_over_one_{kind}"] = row[f"ours_{kind}_tok_s"] / one["tok_s"]
            for s in ("ours", "proxy", "raylm"):
                if f"{s}_{kind}_tok_s" in row and f"vllm_{kind}_tok_s" in row:
                    row[f"{s}_over_vllm_{kind}"] = row[f"{s}_{kind}_tok_s"] / row[f"vllm_{kind}_tok_s"]
        if "ours_lora_tok_s" in row:
            row["lora_over_base"] = row["ours_lora_tok_s"] / row["ours_base_tok_s"]
        rows.append(row)
    return rows


def _table(rows: list[dict]) -> str:
    columns = [
        ("ours base tok/s", "ours_base_tok_s", ".1f"),
        ("p50", "ours_base_p50_s", ".3f"),
        ("ours lora tok/s", "ours_lora_tok_s", ".1f"),
        ("p50", "ours_lora_p50_s", ".3f"),
        ("lora/base", "lora_over_base", ".2f"),
        ("batch/1 base", "batch_over_one_base", ".2f"),
        ("vllm base tok/s", "vllm_base_tok_s", ".1f"),
        ("vllm lora tok/s", "vllm_lora_tok_s", ".1f"),
        ("ours/vllm base", "ours_over_vllm_base", ".2f"),
        ("ours/vllm lora", "ours_over_vllm_lora", ".2f"),
        ("proxy/vllm base", "proxy_over_vllm_base", ".2f"),
        ("proxy/vllm lora", "proxy_over_vllm_lora", ".2f"),
        ("raylm base tok/s", "raylm_base_tok_s", ".1f"),
        ("raylm/vllm base", "raylm_over_vllm_base", ".2f"),
    ]
    columns = [col for col in columns if any(col[1] in r for r in rows)]
    head = f"{'conc':>4} | " + " | ".join(f"{title:>{max(len(title), 8)}}" for title, _, _ in columns)
    lines = [head, "-" * len(head)]
    for r in rows:
        cells = [
            f"{format(r[key], fmt) if key in r else '-':>{max(len(title), 8)}}" for title, key, fmt in columns
        ]
        lines.append(f"{r['concurrency']:>4} | " + " | ".join(cells))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", help="base model folder (default: a random tiny backbone)")
    parser.add_argument("--adapter", help="peft adapter folder (default: a random r=16 adapter)")
    parser.add_argument(
        "--levels", type=int, nargs="+", default=[1, 16, 64], help="concurrency levels (space-separated)"
    )
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5, help="measurements per server, model and level")
    parser.add_argument("--skip-vllm", action="store_true", help="not vLLM's own server")
    parser.add_argument("--ray-llm", action="store_true", help="also ray.serve.llm's OpenAI app (base only)")
    add_json_argument(parser, __file__)
    args = parser.parse_args()
    results = Results(__file__, args)
    tmp = Path(tempfile.mkdtemp(prefix="bench_serving_"))
    if args.model and args.adapter:
        base, adapter = Path(args.model), Path(args.adapter)
    else:
        base, adapter = _weights(tmp)
    model_cfg = ModelConfig(name="base", max_model_len=512, dtype="float32")
    serve_cfg = ServeConfig(
        max_num_seqs=max(args.levels), num_cpus=1, port=_free_port(), app_name=f"bench-{os.getpid()}"
    )
    import logging

    import ray

    from hamo_ray.serving import shutdown_policy_server

    logging.getLogger("httpx").setLevel(logging.WARNING)  # no log line per request in the load client

    ray.init(
        address="local", num_cpus=4, include_dashboard=False, configure_logging=False, log_to_driver=False
    )
    proc = None
    try:
        print(f"model {base}, adapter {adapter}; starting the servers", flush=True)
        direct, proxied = _start_ours(base, adapter, model_cfg, serve_cfg)
        servers = {"ours": (direct, ["base", LORA]), "proxy": (proxied, ["base", LORA])}
        if args.ray_llm:
            servers["raylm"] = (_start_ray_llm(base, model_cfg, serve_cfg), ["base"])
        if not args.skip_vllm:
            proc, url = _start_vllm(base, adapter, model_cfg, serve_cfg, tmp / "vllm_server.log")
            servers["vllm"] = (url, ["base", LORA])
        measured = _measure(servers, args.levels, args.rounds, args.max_tokens)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=60)
        shutdown_policy_server(serve_cfg)
        ray.shutdown()
    rows = [results.add(r) for r in _rows(measured, args.levels)]
    print()
    print(_table(rows))
    results.finish()


if __name__ == "__main__":
    main()
