"""The policy endpoint on CUDA: greedy outputs of the served base model and adapters equal transformers + peft.

Auto-skipped without CUDA (tests/conftest.py). Starts its own local Ray when none is running; the
replica asks for one GPU because the cluster has one. float32 on both sides, so greedy decoding
must agree token for token, as on CPU (tests/ray/test_serving.py).

    pytest tests/gpu/test_serving_gpu.py -q
"""

from __future__ import annotations

import asyncio
import socket

import httpx
import openai
import pytest

from hamo_ray.config import ModelConfig, ServeConfig
from hamo_ray.serving import publish_adapter, shutdown_policy_server, start_policy_server

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPTS = ["Your task is to focus on the animal. This room is called the kitchen.", "open door to hallway"]
MAX_TOKENS = 20


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SERVE = ServeConfig(max_num_seqs=64, gpu_memory_utilization=0.3, port=_free_port(), app_name="hamo-gpu-test")
MODEL = ModelConfig(name="base", max_model_len=512, dtype="float32")


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from hamo_ray.backbones.tiny_lm import make_random_backbone

    root = tmp_path_factory.mktemp("serving_gpu")
    base = make_random_backbone(root / "base")
    for seed, name in ((1, "stage-1"), (2, "stage-2")):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        config = LoraConfig(r=16, lora_alpha=32, target_modules=TARGETS, init_lora_weights=False)
        get_peft_model(model, config).save_pretrained(root / "adapters" / name)
    return {"base": base, "adapters": root / "adapters"}


@pytest.fixture(scope="module")
def client(weights):
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(include_dashboard=False)
    url = start_policy_server(weights["base"], MODEL, SERVE, weights["adapters"], timeout_s=600)
    for name, folder in (("s1", "stage-1"), ("s2", "stage-2")):
        publish_adapter(url, name, folder, SERVE.probe_prompt, SERVE.probe_tokens)
    yield openai.OpenAI(base_url=f"{url}/v1", api_key="EMPTY", max_retries=0, timeout=120)
    shutdown_policy_server(SERVE)
    if started:
        ray.shutdown()


@pytest.mark.parametrize("served, folder", [("base", None), ("s1", "stage-1"), ("s2", "stage-2")])
def test_greedy_equals_transformers_peft_on_cuda(client, weights, served, folder):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(weights["base"])
    model = AutoModelForCausalLM.from_pretrained(weights["base"], dtype=torch.float32)
    if folder is not None:
        model = PeftModel.from_pretrained(model, weights["adapters"] / folder)
    model = model.to("cuda").eval()
    eos = tokenizer.eos_token_id
    for prompt in PROMPTS:
        messages = [{"role": "user", "content": prompt}]
        ids = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        with torch.no_grad():
            out = model.generate(
                torch.tensor([ids], device="cuda"),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long, device="cuda"),
                do_sample=False,
                max_new_tokens=MAX_TOKENS,
                eos_token_id=eos,
                pad_token_id=tokenizer.pad_token_id,
            )
        expected = out[0, len(ids) :].tolist()
        r = client.chat.completions.create(
            model=served,
            messages=messages,
            temperature=0,
            max_tokens=MAX_TOKENS,
            logprobs=True,
            extra_body={"return_tokens_as_token_ids": True},
        )
        got = [int(t.token.removeprefix("token_id:")) for t in r.choices[0].logprobs.content]
        assert _strip(got, eos) == _strip(expected, eos), f"{served} on {prompt!r}"


def _strip(tokens: list[int], eos: int) -> list[int]:
    return tokens[: tokens.index(eos)] if eos in tokens else tokens


def test_load_is_batched_on_cuda(client):
    """200 concurrent chats through Serve all succeed; vLLM's running-requests gauge exceeds 1."""
    url = str(client.base_url).rstrip("/").removesuffix("/v1")

    async def run() -> tuple[list, float]:
        aclient = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="EMPTY", max_retries=0, timeout=300)
        peak, done = 0.0, False

        async def watch() -> None:
            nonlocal peak
            async with httpx.AsyncClient(timeout=10) as http:
                while not done:
                    try:  # a poll queued behind the load past its timeout is a missed sample
                        text = (await http.get(f"{url}/metrics")).text
                    except httpx.TimeoutException:
                        continue
                    for line in text.splitlines():
                        if line.startswith("vllm:num_requests_running"):
                            peak = max(peak, float(line.rsplit(" ", 1)[1]))
                    await asyncio.sleep(0.02)

        async def one(i: int):
            messages = [{"role": "user", "content": f"{PROMPTS[i % 2]} {i}"}]
            return await aclient.chat.completions.create(
                model=("base", "s1", "s2")[i % 3], messages=messages, max_tokens=32
            )

        watcher = asyncio.create_task(watch())
        try:
            results = await asyncio.gather(*(one(i) for i in range(200)))
        finally:
            done = True
            await watcher
            await aclient.close()
        return results, peak

    results, polled = asyncio.run(run())
    lines = httpx.get(f"{url}/metrics").text.splitlines()
    peak = max(float(x.rsplit(" ", 1)[1]) for x in lines if x.startswith("hamo:num_requests_running_peak"))
    assert len(results) == 200 and max(peak, polled) > 1
