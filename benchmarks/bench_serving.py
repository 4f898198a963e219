"""Serving throughput and latency: base vs adapter, batched vs one at a time, our Ray Serve app vs vLLM's server.

Sends chat requests with the official ``openai`` client at concurrency 1, 16 and 64 and prints,
per level, completion tokens/s and p50/p99 request latency for: the base model and a LoRA adapter
through ``hamo_ray.serving`` (Ray Serve + vLLM ``AsyncLLM``), and the same two through vLLM's own
OpenAI server (``python -m vllm.entrypoints.openai.api_server``) on the same engine settings
(one CPU thread on CPU, the same batch size, LoRA slots, prefix caching and context length).
Ratios: adapter/base, level/one-at-a-time, ours/vLLM's (the overhead of our layer)::

    python benchmarks/bench_serving.py                      # a random tiny backbone and adapter
    python benchmarks/bench_serving.py --model PATH --adapter PATH --max-tokens 32
    python benchmarks/bench_serving.py --levels 1 16 --skip-vllm

Results also go to ``benchmarks/results/bench_serving.json`` (``--json PATH``), one row per level.
"""

from __future__ import annotations

import argparse
import asyncio
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _weights(tmp: Path) -> tuple[Path, Path]:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from hamo_ray.training.tiny_lm import make_random_backbone

    base = make_random_backbone(tmp / "base")
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    lora = LoraConfig(r=16, lora_alpha=32, target_modules=TARGETS, init_lora_weights=False)
    get_peft_model(model, lora).save_pretrained(tmp / "adapters" / "bench-lora")
    return base, tmp / "adapters" / "bench-lora"


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


def _sweep(url: str, adapter: str, levels: list[int], max_tokens: int) -> dict[tuple[str, int], dict]:
    results = {}
    for model in ("base", adapter):
        for c in levels:
            results[(model, c)] = asyncio.run(_load(url, model, c, max(16, 4 * c), max_tokens))
            r = results[(model, c)]
            print(
                f"  {model:>10} c={c:<3} {r['tok_s']:8.1f} tok/s  p50 {r['p50']:.3f}s  p99 {r['p99']:.3f}s",
                flush=True,
            )
    return results


def _ours(base: Path, adapter: Path, model_cfg: ModelConfig, serve_cfg: ServeConfig, args) -> dict:
    import ray

    from hamo_ray.serving import publish_adapter, shutdown_policy_server, start_policy_server

    ray.init(
        address="local", num_cpus=4, include_dashboard=False, configure_logging=False, log_to_driver=False
    )
    try:
        url = start_policy_server(base, model_cfg, serve_cfg, adapter.parent)
        publish_adapter(url, "bench-lora", adapter.name, serve_cfg.probe_prompt, serve_cfg.probe_tokens)
        return _sweep(url, "bench-lora", args.levels, args.max_tokens)
    finally:
        shutdown_policy_server(serve_cfg)
        ray.shutdown()


def _vllm(base: Path, adapter: Path, model_cfg: ModelConfig, serve_cfg: ServeConfig, args) -> dict:
    import httpx

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
            cmd += [flag, str(value)]
    cmd += ["--lora-modules", f"bench-lora={adapter}"]
    env = {**os.environ, **engine_env(serve_cfg)}
    log = open(Path(args.tmp) / "vllm_server.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vLLM server exited {proc.returncode}; see {log.name}")
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("vLLM server did not come up")
            time.sleep(2)
        return _sweep(url, "bench-lora", args.levels, args.max_tokens)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        log.close()


def _rows(ours: dict, theirs: dict | None, levels: list[int]) -> list[dict]:
    """One row per concurrency level: our base and adapter, their ratios, and vLLM's server if it ran."""
    rows = []
    for c in levels:
        b, a = ours[("base", c)], ours[("bench-lora", c)]
        row = {"concurrency": c}
        for name, r in (("ours_base", b), ("ours_lora", a)):
            row |= {f"{name}_tok_s": r["tok_s"], f"{name}_p50_s": r["p50"], f"{name}_p99_s": r["p99"]}
        row |= {
            "lora_over_base": a["tok_s"] / b["tok_s"],
            "batch_over_one_base": b["tok_s"] / ours[("base", levels[0])]["tok_s"],
            "batch_over_one_lora": a["tok_s"] / ours[("bench-lora", levels[0])]["tok_s"],
        }
        if theirs:
            vb, va = theirs[("base", c)], theirs[("bench-lora", c)]
            for name, r in (("vllm_base", vb), ("vllm_lora", va)):
                row |= {f"{name}_tok_s": r["tok_s"], f"{name}_p50_s": r["p50"], f"{name}_p99_s": r["p99"]}
            row |= {
                "ours_over_vllm_base": b["tok_s"] / vb["tok_s"],
                "ours_over_vllm_lora": a["tok_s"] / va["tok_s"],
            }
        rows.append(row)
    return rows


def _table(rows: list[dict]) -> str:
    head = (
        f"{'conc':>4} | {'ours base tok/s':>15} {'p50':>7} {'p99':>7} | {'ours lora tok/s':>15} {'p50':>7} "
        f"{'p99':>7} | {'lora/base':>9} | {'batch/1 base':>12} {'batch/1 lora':>12}"
    )
    theirs = bool(rows) and "vllm_base_tok_s" in rows[0]
    if theirs:
        head += f" | {'vllm base tok/s':>15} {'vllm lora tok/s':>15} | {'ours/vllm base':>14} {'ours/vllm lora':>14}"
    lines = [head, "-" * len(head)]
    for r in rows:
        line = (
            f"{r['concurrency']:>4} | {r['ours_base_tok_s']:>15.1f} {r['ours_base_p50_s']:>7.3f} "
            f"{r['ours_base_p99_s']:>7.3f} | {r['ours_lora_tok_s']:>15.1f} {r['ours_lora_p50_s']:>7.3f} "
            f"{r['ours_lora_p99_s']:>7.3f} | {r['lora_over_base']:>9.2f} | "
            f"{r['batch_over_one_base']:>12.2f} {r['batch_over_one_lora']:>12.2f}"
        )
        if theirs:
            line += (
                f" | {r['vllm_base_tok_s']:>15.1f} {r['vllm_lora_tok_s']:>15.1f} | "
                f"{r['ours_over_vllm_base']:>14.2f} {r['ours_over_vllm_lora']:>14.2f}"
            )
        lines.append(line)
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
    parser.add_argument("--skip-vllm", action="store_true", help="only our app")
    add_json_argument(parser, __file__)
    args = parser.parse_args()
    results = Results(__file__, args)
    args.tmp = tempfile.mkdtemp(prefix="bench_serving_")
    if args.model and args.adapter:
        base, adapter = Path(args.model), Path(args.adapter)
    else:
        base, adapter = _weights(Path(args.tmp))
    model_cfg = ModelConfig(name="base", max_model_len=512, dtype="float32")
    serve_cfg = ServeConfig(
        max_num_seqs=max(args.levels), num_cpus=1, port=_free_port(), app_name=f"bench-{os.getpid()}"
    )
    print(f"ours (Ray Serve + AsyncLLM), model {base}, adapter {adapter}", flush=True)
    ours = _ours(base, adapter, model_cfg, serve_cfg, args)
    theirs = None
    if not args.skip_vllm:
        print("vLLM's OpenAI server, same engine settings", flush=True)
        theirs = _vllm(base, adapter, model_cfg, serve_cfg, args)
    rows = [results.add(r) for r in _rows(ours, theirs, args.levels)]
    print()
    print(_table(rows))
    results.finish()


if __name__ == "__main__":
    main()
