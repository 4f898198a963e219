"""The request models of the policy endpoint: what is honoured, what is refused, and how it is named.

pytest tests/unit/test_protocol.py -q
"""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from hamo_ray.serving.protocol import UNSUPPORTED, ChatCompletionRequest, CompletionRequest

MSG = [{"role": "user", "content": "hi"}]


def _chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "base", "messages": MSG, **fields})


def _refused(fields: dict) -> tuple[str, str]:
    with pytest.raises(ValidationError) as err:
        _chat(**fields)
    e = err.value.errors()[0]
    return ".".join(str(p) for p in e["loc"]), e["msg"]


def test_sampling_fields_are_accepted():
    r = _chat(
        top_k=5, min_p=0.1, presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2,
        stop=["\n"], stop_token_ids=[3], seed=1, n=3, logprobs=True, top_logprobs=2, ignore_eos=True,
        min_tokens=2, logit_bias={"7": -100}, chat_template_kwargs={"enable_thinking": False},
        response_format={"type": "text"}, tool_choice="none", user="u1", bad_words=["x"],
    )  # fmt: skip
    assert (r.top_k, r.n, r.num_logprobs(), r.chat_template_kwargs) == (5, 3, 2, {"enable_thinking": False})


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"use_beam_search": True}, "use_beam_search"),
        ({"chat_template": "{{ messages }}"}, "chat_template"),
        ({"reasoning_effort": "low"}, "reasoning_effort"),
        ({"guided_json": {"type": "object"}}, "guided_json"),
    ],
)
def test_unsupported_fields_are_refused_by_name(fields, param):
    loc, msg = _refused(fields)
    assert loc == param and f"`{param}` is not supported" in msg
    assert param in UNSUPPORTED


def test_unknown_and_bad_fields_are_named():
    assert _refused({"frobnicate": 1})[0] == "frobnicate"
    assert _refused({"top_k": -2})[0] == "top_k"
    assert _refused({"logit_bias": {"word": 1.0}})[0] == "logit_bias"
    assert _refused({"n": 100})[0] == "n"
    loc, msg = _refused({"chat_template_kwargs": {"tokenize": False}})
    assert loc == "chat_template_kwargs" and "tokenize" in msg
    with pytest.raises(ValidationError, match="suffix"):
        CompletionRequest.model_validate({"model": "base", "prompt": "x", "suffix": "y"})
    with pytest.raises(ValidationError, match="messages"):
        ChatCompletionRequest.model_validate({"model": "base", "messages": []})
