"""Which requests the policy endpoint refuses before vLLM serves them, and how it names the field.

vLLM's own request models (``vllm.entrypoints.openai``) parse the bodies; ``hamo_ray.serving.guard.refusal``
refuses what would break the training format or the server's limits (replaces tests/unit/test_protocol.py,
which tested the hand-written protocol).

pytest tests/unit/test_serving_refusals.py -q
"""

from __future__ import annotations

import pytest

MSG = [{"role": "user", "content": "hi"}]
LIMIT, CONTEXT = 64, 512


def _chat(**fields):
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    return ChatCompletionRequest.model_validate({"model": "base", "messages": MSG, **fields})


def _refused(request) -> str | None:
    from hamo_ray.serving.guard import refusal

    found = refusal(request, LIMIT, CONTEXT)
    if found is not None:
        assert f"`{found[0]}`" in found[1] or found[0] in found[1]
    return None if found is None else found[0]


def test_what_vllm_serves_passes():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    request = _chat(
        top_k=5, min_p=0.1, n=3, logprobs=True, top_logprobs=2, seed=1, response_format={"type": "json_object"},
        tools=tools, tool_choice="auto", chat_template_kwargs={"enable_thinking": False}, return_token_ids=True,
        structured_outputs={"choice": ["a", "b"]}, max_tokens=LIMIT,
    )  # fmt: skip
    assert _refused(request) is None


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"chat_template": "{{ messages }}"}, "chat_template"),
        ({"truncate_prompt_tokens": 8}, "truncate_prompt_tokens"),
        ({"add_special_tokens": True}, "add_special_tokens"),
        ({"chat_template_kwargs": {"tokenize": False}}, "chat_template_kwargs"),
        ({"frobnicate": 1}, "frobnicate"),
        ({"max_tokens": LIMIT + 1}, "max_tokens"),
        ({"max_completion_tokens": LIMIT + 1}, "max_tokens"),
    ],
)
def test_training_format_and_limits_are_refused_by_name(fields, param):
    assert _refused(_chat(**fields)) == param


def test_completions_and_default_length():
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    raw = CompletionRequest.model_validate({"model": "base", "prompt": "x", "truncate_prompt_tokens": 1})
    assert _refused(raw) == "truncate_prompt_tokens"
    assert _refused(CompletionRequest.model_validate({"model": "base", "prompt": "x", "echo": True})) is None
    request = _chat()
    assert _refused(request) is None and request.max_completion_tokens == LIMIT  # the limit is the default
