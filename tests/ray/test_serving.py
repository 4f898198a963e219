"""The policy endpoint, live: Ray Serve + vLLM (CPU build) on a random tiny backbone and two LoRA adapters.

One server per module (startup ~1 min); clients are the official ``openai`` package and httpx.
The key check: greedy outputs of the served base model and of each served adapter equal
transformers + peft greedy outputs of the same weights, token id for token id.

    pytest tests/ray/test_serving.py -x -q
"""

from __future__ import annotations

import socket

import httpx
import openai
import pytest

from hamo_ray.config import ModelConfig, ServeConfig
from hamo_ray.serving import AdapterNotLiveError, publish_adapter, shutdown_policy_server, start_policy_server


def _free_port() -> int:
    """A free local port: the machine may run other servers on Serve's default 8000."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPTS = [
    "Your task is to focus on the animal. This room is called the kitchen.",
    "open door to hallway",
    "pick up thermometer. focus on orange.",
]
MAX_TOKENS = 20
MAX_LOGPROBS = 8  # passed to the engine through serve.engine_kwargs; a request above it gets 400
SERVE = ServeConfig(
    max_num_seqs=16,
    kv_cache_gib=1,
    num_cpus=1,
    port=_free_port(),
    app_name="hamo-serving-test",
    # max_logprobs: an engine argument; the others are vLLM frontend arguments (tool calls need a parser),
    # and no free whitespace in structured output, so a random model's JSON ends within a few tokens.
    engine_kwargs={
        "max_logprobs": MAX_LOGPROBS,
        "tool_call_parser": "hermes",
        "enable_auto_tool_choice": True,
        "structured_outputs_config": {"backend": "xgrammar", "disable_any_whitespace": True},
    },
)
MODEL = ModelConfig(name="base", max_model_len=512, dtype="float32")


def _make_adapter(base, path, seed: int, init_lora_weights: bool = False) -> None:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(r=16, lora_alpha=32, target_modules=TARGETS, init_lora_weights=init_lora_weights)
    get_peft_model(model, config).save_pretrained(path)


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    from hamo_ray.backbones.tiny_lm import make_random_backbone

    root = tmp_path_factory.mktemp("serving")
    base = make_random_backbone(root / "base")
    adapters = root / "adapters"
    _make_adapter(base, adapters / "stage-1", seed=1)
    _make_adapter(base, adapters / "stage-2", seed=2)
    _make_adapter(base, adapters / "noop", seed=3, init_lora_weights=True)  # B = 0: identical to base
    return {"base": base, "adapters": adapters}


@pytest.fixture(scope="module")
def server(ray_session, weights):
    url = start_policy_server(weights["base"], MODEL, SERVE, weights["adapters"], timeout_s=300)
    yield url
    shutdown_policy_server(SERVE)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="EMPTY", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def published(server, weights):
    """Both adapters published under new names (absolute and root-relative paths)."""
    prompt, tokens = SERVE.probe_prompt, SERVE.probe_tokens
    return {
        "s1": publish_adapter(server, "s1", weights["adapters"] / "stage-1", prompt, tokens),
        "s2": publish_adapter(server, "s2", "stage-2", prompt, tokens),
        "stage-1": publish_adapter(server, "stage-1", "stage-1", prompt, tokens),  # a stage's name
    }


def test_models_and_chat_format(client):
    assert [m.id for m in client.models.list().data][0] == "base"
    r = client.chat.completions.create(
        model="base", messages=[{"role": "user", "content": PROMPTS[0]}], temperature=0, max_tokens=8, seed=3
    )
    assert r.object == "chat.completion" and r.model == "base"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens <= 8 and r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens

    c = client.completions.create(model="base", prompt="open door", temperature=0, max_tokens=5, logprobs=1)
    assert c.object == "text_completion" and c.usage.completion_tokens <= 5
    assert len(c.choices[0].logprobs.token_logprobs) == c.usage.completion_tokens


def test_errors_are_openai_json(client, server):
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    assert err.value.body["param"] == "model" and err.value.body["code"] == 404
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.chat.completions.create(model="base", messages=[{"role": "user", "content": "kitchen " * 600}])
    for bad in (b"{not json", b'{"model": "base"}'):
        r = httpx.post(
            f"{server}/v1/chat/completions", content=bad, headers={"content-type": "application/json"}
        )
        assert r.status_code == 400 and "message" in r.json()["error"]
    assert httpx.get(f"{server}/health").json()["status"] == "ok"
    for method, path in (("GET", "/nope"), ("GET", "/v1/chat/completions"), ("POST", "/v1/responses")):
        r = httpx.request(method, f"{server}{path}")  # unknown routes, wrong methods, vLLM routes not served
        assert r.status_code in (404, 405) and "message" in r.json()["error"]


def test_publish_adapters_live(client, published):
    assert {m.id for m in client.models.list().data} >= {"base", "s1", "s2"}
    for name, info in published.items():
        assert info["name"] == name and info["status"] == "loaded"
        assert info["tokens_differ"] or info["max_logprob_diff"] > 1e-4
    assert published["s1"]["lora_int_id"] != published["s2"]["lora_int_id"]


def test_adapter_paths_and_names_checked(server, weights, published):
    def load(name: str, path: str) -> httpx.Response:
        return httpx.post(f"{server}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})

    assert load("x", str(weights["base"])).status_code == 400  # outside the root
    assert load("x", "../base").status_code == 400
    assert load("x", "stage-1/../../base").status_code == 400
    assert load("x", "missing").status_code == 400
    assert load("base", "stage-1").status_code == 400  # the base name is taken
    assert load("s1", "stage-2").status_code == 409  # a name is never reused for other weights
    again = load("s1", str(weights["adapters"] / "stage-1"))
    assert again.status_code == 200 and again.json()["status"] == "already_loaded"
    with pytest.raises(AdapterNotLiveError, match="outside"):
        publish_adapter(server, "y", str(weights["base"]), "x", 4)
    with pytest.raises(AdapterNotLiveError, match="not provably live"):
        publish_adapter(server, "noop", "noop", SERVE.probe_prompt, SERVE.probe_tokens)


def test_registry_shared_between_replicas(weights, tmp_path):
    """What one replica publishes, another (or a restarted one) adopts from served_adapters.json."""
    import shutil

    from hamo_ray.serving.adapters import AdapterError, AdapterRegistry

    shutil.copytree(weights["adapters"] / "stage-1", tmp_path / "stage-1")
    first, second = (AdapterRegistry(tmp_path, {"base"}, max_lora_rank=16) for _ in range(2))
    path, known = first.check("s1", "stage-1")
    assert not known and path == tmp_path.resolve() / "stage-1"
    first.add("s1", path)
    assert second.sync() == [("s1", path)] and second.sync() == []
    with pytest.raises(AdapterError, match="max_lora_rank"):
        AdapterRegistry(tmp_path, {"base"}, max_lora_rank=8).check("s9", "stage-1")


def test_load_through_serve_handle(server, weights):
    from ray import serve

    handle = serve.get_app_handle(SERVE.app_name)
    info = handle.load_adapter.remote("s1-handle", str(weights["adapters"] / "stage-1")).result()
    assert info["status"] == "loaded" and info["lora_int_id"] >= 1
    models = httpx.get(f"{server}/v1/models").json()["data"]
    assert "s1-handle" in {m["id"] for m in models}


def test_stream_matches_non_stream(client, published):
    messages = [{"role": "user", "content": PROMPTS[1]}]
    full = client.chat.completions.create(model="s1", messages=messages, temperature=0, max_tokens=12)
    chunks = list(
        client.chat.completions.create(
            model="s1",
            messages=messages,
            temperature=0,
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def _served_greedy(client, model: str, prompt: str) -> list[int]:
    r = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        temperature=0,
        max_tokens=MAX_TOKENS,
        logprobs=True,
        extra_body={"return_tokens_as_token_ids": True},
    )
    return [int(t.token.removeprefix("token_id:")) for t in r.choices[0].logprobs.content]


def _hf_greedy(model, tokenizer, prompt: str) -> list[int]:
    import torch

    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            do_sample=False,
            max_new_tokens=MAX_TOKENS,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    return out[0, len(ids) :].tolist()


def _strip_eos(tokens: list[int], eos: int) -> list[int]:
    return tokens[: tokens.index(eos)] if eos in tokens else tokens


@pytest.mark.parametrize("served, folder", [("base", None), ("s1", "stage-1"), ("s2", "stage-2")])
def test_greedy_equals_transformers_peft(client, published, weights, served, folder):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(weights["base"])
    model = AutoModelForCausalLM.from_pretrained(weights["base"], dtype=torch.float32)
    if folder is not None:
        model = PeftModel.from_pretrained(model, weights["adapters"] / folder)
    model.eval()
    eos = tokenizer.eos_token_id
    lengths = []
    for prompt in PROMPTS:
        expected = _strip_eos(_hf_greedy(model, tokenizer, prompt), eos)
        got = _strip_eos(_served_greedy(client, served, prompt), eos)
        assert got == expected, f"{served} on {prompt!r}"
        lengths.append(len(got))
    assert max(lengths) > 0  # the comparison covered generated tokens, not only empty answers


def _running(metrics_text: str, name: str = "vllm:num_requests_running") -> float:
    """The value of a gauge (default: vLLM's running requests) in a Prometheus text page."""
    values = [float(line.rsplit(" ", 1)[1]) for line in metrics_text.splitlines() if line.startswith(name)]
    assert values, f"{name} is not exported"
    return max(values)


def test_load_200_concurrent_chats_are_batched(server, published):
    """200 concurrent chat requests all succeed, and vLLM ran more than one at a time."""
    import asyncio

    async def run() -> tuple[list, float]:
        aclient = openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="EMPTY", max_retries=0, timeout=300)
        peak, done = 0.0, False

        async def watch() -> None:
            nonlocal peak
            # A poll that queues behind the load past its timeout is a missed sample, not a failure:
            # the wall-time comparison below still judges batching.
            async with httpx.AsyncClient(timeout=10) as http:
                while not done:
                    try:
                        peak = max(peak, _running((await http.get(f"{server}/metrics")).text))
                    except httpx.TimeoutException:
                        pass
                    await asyncio.sleep(0.05)

        async def one(i: int):
            model = ("base", "s1", "s2")[i % 3]
            content = f"{PROMPTS[i % len(PROMPTS)]} step {i}"
            return await aclient.chat.completions.create(
                model=model, messages=[{"role": "user", "content": content}], temperature=0.7, max_tokens=8
            )

        watcher = asyncio.create_task(watch())
        try:
            results = await asyncio.gather(*(one(i) for i in range(200)))
        finally:
            done = True
            await watcher
            await aclient.close()
        return results, peak

    import time

    sequential_start = time.perf_counter()
    for i in range(4):
        openai.OpenAI(base_url=f"{server}/v1", api_key="EMPTY").chat.completions.create(
            model="base", messages=[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}], max_tokens=8
        )
    one_at_a_time = (time.perf_counter() - sequential_start) / 4
    start = time.perf_counter()
    results, polled = asyncio.run(run())
    wall = time.perf_counter() - start
    assert len(results) == 200
    assert all(r.choices[0].finish_reason in ("stop", "length") for r in results)
    # Batched: vLLM's running-requests gauge went above 1. Polls during the burst queue behind it,
    # so the replica also samples the gauge itself and reports the peak once the burst is over.
    peak = _running(httpx.get(f"{server}/metrics").text, "hamo:num_requests_running_peak")
    print(f"peak running requests: {peak} (polled during the burst: {polled})")
    assert max(peak, polled) > 1, (
        f"no sign of batching: peak running {peak} (polled {polled}), {wall:.1f}s for 200 vs "
        f"{one_at_a_time:.2f}s each"
    )
    assert peak <= SERVE.max_num_seqs  # the sampled gauge is the engine's, bounded by its batch size


def test_limits(client, server):
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.chat.completions.create(
            model="base", messages=[{"role": "user", "content": "x"}], max_tokens=SERVE.max_tokens_limit + 1
        )
    big = b'{"model": "base", "messages": [{"role": "user", "content": "' + b"x" * 1_100_000 + b'"}]}'
    r = httpx.post(f"{server}/v1/chat/completions", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error"
    assert httpx.get(f"{server}/nope").status_code == 404
    # The server builds no prompts: the old server-side injection field is an unknown field now.
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="base", messages=[{"role": "user", "content": "x"}],
                                       extra_body={"hamo": {"goal": "g"}})  # fmt: skip
    assert err.value.body["param"] == "hamo"


# --- Every OpenAI/vLLM sampling field through the official client: honoured, or 400 naming it ---

CHAT = [{"role": "user", "content": PROMPTS[0]}]


def _ids(r, i: int = 0) -> list[int]:
    return list(r.choices[i].model_extra["token_ids"])


def _greedy(client, **fields):
    """A chat request for ``CHAT``: greedy and ``MAX_TOKENS`` long unless ``fields`` say otherwise."""
    extra = {"return_token_ids": True, **fields.pop("extra_body", {})}
    request = {"temperature": 0, "max_tokens": MAX_TOKENS, **fields}
    return client.chat.completions.create(model="base", messages=CHAT, extra_body=extra, **request)


def test_sampling_fields_are_honoured(client):
    base = _greedy(client)
    ref = _ids(base)
    assert len(ref) >= 4 and base.model_extra["prompt_token_ids"]
    # top_k=1 and min_p=1 leave only the most likely token: greedy even at temperature 1.
    hot = {"temperature": 1.0, "seed": 5}
    assert _ids(_greedy(client, extra_body={"top_k": 1}, **hot)) == ref
    assert _ids(_greedy(client, extra_body={"min_p": 1.0}, **hot)) == ref
    # Seeds: the same seed samples the same tokens.
    a, b = (_ids(_greedy(client, **hot)) for _ in range(2))
    assert a == b
    # Penalties change what greedy decoding picks (the random backbone repeats itself).
    penalised = [
        _ids(_greedy(client, presence_penalty=2.0)),
        _ids(_greedy(client, frequency_penalty=2.0)),
        _ids(_greedy(client, extra_body={"repetition_penalty": 2.0})),
    ]
    assert any(p != ref for p in penalised)
    # logit_bias: the greedy first token, banned.
    assert _ids(_greedy(client, logit_bias={str(ref[0]): -100}))[0] != ref[0]
    # stop_token_ids / stop strings end the output there.
    stopped = _greedy(client, extra_body={"stop_token_ids": [ref[0]]})  # greedy's first token stops it
    assert len(_ids(stopped)) <= 1 and stopped.choices[0].finish_reason == "stop"
    text = base.choices[0].message.content
    if len(text.strip()) > 2:
        cut = text.strip()[1:3]
        r = _greedy(client, stop=[cut])
        assert cut not in r.choices[0].message.content and r.choices[0].finish_reason == "stop"
    # min_tokens + ignore_eos: exactly max_tokens tokens.
    r = _greedy(client, max_tokens=12, extra_body={"min_tokens": 12, "ignore_eos": True})
    assert r.usage.completion_tokens == 12 and r.choices[0].finish_reason == "length"
    r = _greedy(client, max_completion_tokens=3)
    assert r.usage.completion_tokens <= 3
    # logprobs / top_logprobs.
    r = _greedy(client, logprobs=True, top_logprobs=3)
    assert all(len(t.top_logprobs) == 3 for t in r.choices[0].logprobs.content)
    # n > 1: n choices, indexed, usage summed.
    r = client.chat.completions.create(
        model="base", messages=CHAT, n=3, max_tokens=5, seed=1, temperature=1.0
    )
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert r.usage.completion_tokens >= 3 and len({c.message.content for c in r.choices}) > 1
    chunks = list(
        client.chat.completions.create(model="base", messages=CHAT, n=2, max_tokens=4, stream=True, seed=1)
    )
    assert {c.choices[0].index for c in chunks if c.choices} == {0, 1}
    # chat_template_kwargs are accepted (this template has no variables; the Qwen3 test shows the effect).
    assert _ids(_greedy(client, extra_body={"chat_template_kwargs": {"enable_thinking": False}})) == ref
    # Engine arguments from serve.engine_kwargs reached the engine: its max_logprobs is enforced.
    with pytest.raises(openai.BadRequestError):
        _greedy(client, logprobs=True, top_logprobs=MAX_LOGPROBS + 1)


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"extra_body": {"chat_template": "{{ 1 }}"}}, "chat_template"),
        ({"extra_body": {"truncate_prompt_tokens": 4}}, "truncate_prompt_tokens"),
        ({"extra_body": {"add_special_tokens": True}}, "add_special_tokens"),
        ({"extra_body": {"chat_template_kwargs": {"tokenize": False}}}, "chat_template_kwargs"),
        ({"extra_body": {"frobnicate": 1}}, "frobnicate"),
    ],
)
def test_fields_breaking_the_training_format_get_400_naming_them(client, fields, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="base", messages=CHAT, max_tokens=2, **fields)
    assert err.value.body["param"] == param and param in err.value.body["message"]


def test_bad_values_and_completion_truncation_get_400(client):
    with pytest.raises(openai.BadRequestError, match="top_k"):  # vLLM's own validation
        client.chat.completions.create(model="base", messages=CHAT, max_tokens=2, extra_body={"top_k": -5})
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(
            model="base", prompt="x", max_tokens=2, extra_body={"truncate_prompt_tokens": 1}
        )
    assert err.value.body["param"] == "truncate_prompt_tokens"


ROOM = {
    "type": "object",
    "properties": {"room": {"type": "string", "enum": ["kitchen", "hallway"]}},
    "required": ["room"],
    "additionalProperties": False,
}


def test_openai_protocol_on_a_stage_adapter(client, server, published):
    """What users of an OpenAI endpoint reach for, on ``stage-1``: vLLM's protocol end to end."""
    import json

    model, chat = "stage-1", [{"role": "user", "content": PROMPTS[1]}]
    chunks = list(
        client.chat.completions.create(
            model=model, messages=chat, max_tokens=6, stream=True, stream_options={"include_usage": True}
        )
    )
    assert {c.object for c in chunks} == {"chat.completion.chunk"} and chunks[-1].usage.completion_tokens <= 6
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-2].choices[0].finish_reason
    done = client.completions.create(model=model, prompt="open door", max_tokens=4, echo=True)
    assert done.object == "text_completion" and done.choices[0].text.startswith("open door")
    two = client.chat.completions.create(model=model, messages=chat, max_tokens=4, n=2, seed=3)
    assert [c.index for c in two.choices] == [0, 1]
    lp = client.chat.completions.create(
        model=model, messages=chat, max_tokens=4, logprobs=True, top_logprobs=2
    )
    assert len(lp.choices[0].logprobs.content) == lp.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 for t in lp.choices[0].logprobs.content)
    schema = {"type": "json_schema", "json_schema": {"name": "room", "schema": ROOM}}
    r = client.chat.completions.create(model=model, messages=chat, max_tokens=32, response_format=schema)
    assert json.loads(r.choices[0].message.content)["room"] in ("kitchen", "hallway")
    tools = [
        {"type": "function", "function": {"name": "go", "description": "go to a room", "parameters": ROOM}}
    ]
    r = client.chat.completions.create(
        model=model,
        messages=chat,
        max_tokens=128,  # <tool_call>{"name": ..., "arguments": ...}</tool_call> in a 512-token vocabulary
        tools=tools,
        tool_choice={"type": "function", "function": {"name": "go"}},
    )
    assert r.choices[0].message.tool_calls, r.choices[0]
    (call,) = r.choices[0].message.tool_calls
    json.loads(call.function.arguments)  # a random model's arguments: valid JSON, whatever they say
    assert call.function.name == "go" and call.type == "function" and call.id
    # /tokenize renders a chat exactly as the chat route does (the training format).
    served = client.chat.completions.create(
        model=model, messages=chat, max_tokens=1, extra_body={"return_token_ids": True}
    ).model_extra["prompt_token_ids"]
    tokens = httpx.post(f"{server}/tokenize", json={"model": model, "messages": chat}).json()["tokens"]
    assert tokens == served


def test_rollouts_constrained_to_the_admissible_commands(server, published, weights):
    """``rollout.constrain_actions``: a real rollout actor's episodes (WebShop stand-in) on a stage adapter,
    every reply held to the page's clickables and the search template by vLLM's structured outputs."""
    import asyncio
    import re
    from dataclasses import replace

    from hamo_ray.config import EnvConfig, PromptConfig
    from hamo_ray.envs import get_domain
    from hamo_ray.prompting import action_regex
    from hamo_ray.rollout.client import PolicySpec
    from hamo_ray.rollout.worker import EnvWorker

    env_cfg = EnvConfig(domain="webshop", max_turns=4, webshop={"products": 60})
    domain = get_domain("webshop", env_cfg)
    tasks = domain.tasks("train", domain.task_types()[0], limit=2)
    spec = PolicySpec(
        base_url=server, model="stage-1", temperature=1.0, max_tokens=80, seed=5, constrain_actions=True,
        tokenizer=str(weights["base"]), prompt_budget=MODEL.max_model_len - 80,
    )  # fmt: skip

    def replay(trajectories) -> list[bool]:
        """Whether each action was admissible where it was taken (the stand-in is deterministic)."""
        admissible = []
        for traj in trajectories:
            assert not traj.error, traj.error
            env = domain.make_env()
            env.reset(traj.task)
            for action in traj.actions:
                admissible.append(bool(re.fullmatch(action_regex(env.valid_actions()), action)))
                env.step(action)
        return admissible

    prompt = PromptConfig(init_obs_max_chars=100, obs_max_chars=60)  # the tiny tokenizer is ~1 token a byte
    worker = EnvWorker("webshop", env_cfg, prompt, 2)
    try:
        constrained = asyncio.run(worker.run(tasks, spec))
        free = asyncio.run(worker.run(tasks, replace(spec, constrain_actions=False)))
    finally:
        worker.close()
    summary = [(t.actions, t.done, t.error) for t in constrained]
    assert all(t.actions and (len(t.actions) == 4 or t.done) for t in constrained), summary  # done: bought
    assert all(replay(constrained))
    assert not any(replay(free))  # the random model's free text is never a command


def test_direct_url_serves_the_same_app(server, published):
    """A replica's own port (no Serve proxy hop): the same models, routes and answers."""
    from hamo_ray.serving import direct_url

    direct = direct_url(server)
    assert direct and direct != server
    assert (
        httpx.get(f"{direct}/health").json()["instance"] == httpx.get(f"{server}/health").json()["instance"]
    )
    listed = {m["id"] for m in httpx.get(f"{direct}/v1/models").json()["data"]}
    assert listed == {m["id"] for m in httpx.get(f"{server}/v1/models").json()["data"]} >= {"s1", "stage-1"}
    body = {"model": "s1", "messages": CHAT, "temperature": 0, "max_tokens": 8, "return_token_ids": True}
    answers = [
        httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json() for url in (direct, server)
    ]
    assert answers[0]["choices"][0]["token_ids"] == answers[1]["choices"][0]["token_ids"]
    assert httpx.post(f"{direct}/v1/chat/completions", json={**body, "chat_template": "x"}).status_code == 400


def test_health_and_metrics_need_no_key_by_default(server):
    assert httpx.get(f"{server}/health").status_code == 200
    assert "vllm:" in httpx.get(f"{server}/metrics").text
