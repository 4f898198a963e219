"""A compiled (no-LoRA) vLLM-CPU engine started twice from one folder: vLLM's default compile cache vs
the variants of its cache format, side by side in one run.

    python benchmarks/bench_engine_start.py [--config jobs/configs/learning-smollm2-within.yaml]
        [--variants default no_aot]   (also: no_mega_aot)

A stage's merged evaluation (``serve.eval_weights=merged``) starts an engine without LoRA, which vLLM
compiles on CPU (~100 s on 2 cores for SmolLM2), from the run's slot folder (``$HAMO_MERGED_CACHE``);
the next stage starts from the same folder, so its compile should come from vLLM's cache. With torch
2.13, vLLM 0.32's default cache (``VLLM_USE_MEGA_AOT_ARTIFACT=1``) saves the compiled function but
cannot load it back ("'function' object has no attribute 'finalize_loading'", then "Compiling model
again"); so does ``VLLM_USE_MEGA_AOT_ARTIFACT=0``. ``VLLM_USE_AOT_COMPILE=0`` (vLLM's older compile
cache, which ``hamo_ray.serving.engine.engine_env`` sets on CPU) loads. Each variant here gets a fresh ``VLLM_CACHE_ROOT`` and starts ``vllm.LLM`` (the merged app's
engine arguments: ``hamo_ray.serving.engine.engine_kwargs(lora=False)``) twice, each in its own process:
the first start compiles, the second should load. The table shows both start times, whether vLLM
reported the load or a recompile, and the second start's ratio to the default's; the greedy answers
of every start are compared with the default's first (they must be the same tokens).

Results also go to ``benchmarks/results/bench_engine_start.json`` (``--json PATH``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import Results, add_json_argument  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# vLLM's compile-cache switches; each variant sets them over the engine's environment without them.
CACHE_KEYS = ("VLLM_USE_AOT_COMPILE", "VLLM_USE_MEGA_AOT_ARTIFACT")
VARIANTS = {
    "default": {},  # vLLM's own default (torch >= 2.12: the mega AOT artifact)
    "no_mega_aot": {"VLLM_USE_MEGA_AOT_ARTIFACT": "0"},
    "no_aot": {"VLLM_USE_AOT_COMPILE": "0"},  # the older cache; what hamo_ray.serving.engine.engine_env sets
}
PROMPTS = ["You are in the kitchen. Your task is to boil water. What do you do next?", "Name three animals."]

CHILD = r"""
import json, sys, time
start = time.perf_counter()
from vllm import LLM, SamplingParams
llm = LLM(**json.loads(sys.argv[1]))
ready = time.perf_counter() - start
outs = llm.generate(json.loads(sys.argv[2]), SamplingParams(temperature=0.0, max_tokens=24))
print("RESULT " + json.dumps({"start_s": ready, "tokens": [list(o.outputs[0].token_ids) for o in outs]}))
"""


def start_once(kwargs: dict, env: dict) -> dict:
    """One engine start in its own process: start seconds, answers, and what vLLM said of its cache."""
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(kwargs), json.dumps(PROMPTS)],
        capture_output=True, text=True, env=env, timeout=900,
    )  # fmt: skip
    log = proc.stdout + proc.stderr
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"engine start failed (rc {proc.returncode}): {log[-2000:]}")
    out = json.loads(line[len("RESULT ") :])
    out["cache"] = (
        "recompiled (load failed)"
        if "Compiling model again" in log
        else "loaded"
        if "Directly load" in log
        else "compiled"
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", default=str(ROOT / "jobs" / "configs" / "learning-smollm2-within.yaml"))
    parser.add_argument("--variants", nargs="+", choices=sorted(VARIANTS), default=["default", "no_aot"])
    add_json_argument(parser, __file__)
    args = parser.parse_args()

    from hamo_ray.backbones.sources import resolve_model_path
    from hamo_ray.config import load_config
    from hamo_ray.serving.engine import engine_env, engine_kwargs

    cfg = load_config(args.config, [])
    model = str(resolve_model_path(cfg.model.path, cfg.model.cache_dir))
    kwargs = engine_kwargs(model, cfg.model, cfg.serve, lora=False, device="cpu")
    kwargs["enable_prefix_caching"] = False
    results = Results(__file__, args)
    rows, reference, base_second = [], None, None
    for name in args.variants:
        with tempfile.TemporaryDirectory(prefix=f"vllm-cache-{name}-") as cache:
            env = {**os.environ, **engine_env(cfg.serve, "cpu")}
            env = {k: v for k, v in env.items() if k not in CACHE_KEYS} | VARIANTS[name]
            env["VLLM_CACHE_ROOT"] = cache
            t0 = time.perf_counter()
            first, second = start_once(kwargs, env), start_once(kwargs, env)
            wall = time.perf_counter() - t0
        reference = reference or first["tokens"]
        same = first["tokens"] == reference and second["tokens"] == reference
        base_second = base_second or second["start_s"]
        row = {
            "variant": name, "env": VARIANTS[name], "first_start_s": first["start_s"],
            "second_start_s": second["start_s"], "second_cache": second["cache"],
            "second_vs_default": second["start_s"] / base_second, "same_tokens": same, "wall_s": wall,
        }  # fmt: skip
        rows.append(results.add(row))
    print(
        f"\nmodel {model}; 2 starts per variant, each in its own process, fresh VLLM_CACHE_ROOT per variant\n"
    )
    print(
        "| variant | env | first start s | second start s | second start's cache | vs default | same tokens |"
    )
    print("|---|---|---:|---:|---|---:|---|")
    for r in rows:
        env = " ".join(f"{k}={v}" for k, v in r["env"].items()) or "-"
        print(
            f"| {r['variant']} | {env} | {r['first_start_s']:.1f} | {r['second_start_s']:.1f} | "
            f"{r['second_cache']} | {r['second_vs_default']:.2f}x | {r['same_tokens']} |"
        )
    results.finish()


if __name__ == "__main__":
    main()
