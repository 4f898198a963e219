"""The OpenAI wire format of the policy endpoint: request bodies, errors, responses and stream chunks.

The requests model the sampling fields vLLM's OpenAI server honours (temperature, top_p, top_k,
min_p, presence/frequency/repetition penalties, stop and stop_token_ids, seed, n, logprobs,
min_tokens, ignore_eos, logit_bias, allowed_token_ids, bad_words, ...), each passed to
``vllm.SamplingParams`` by ``hamo_ray.serving.app``. Nothing is dropped silently: an unknown field
is refused with 400 naming it, and so is a known field the server cannot serve (``UNSUPPORTED``:
``response_format``, ``tools``, beam search, ...) unless it holds its neutral value. vLLM's
extensions are accepted under vLLM's names: ``chat_template_kwargs`` (template variables such as
Qwen3's ``enable_thinking``), ``return_tokens_as_token_ids`` (each logprob token reads
``"token_id:<id>"``), ``return_token_ids`` (``prompt_token_ids`` and each choice's ``token_ids``),
``return_prompt_text``. Responses are built from vLLM's ``CompletionOutput`` objects (duck-typed,
so this module does not import vLLM).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
}


class APIError(Exception):
    """An error answered as OpenAI-style JSON: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": _ERROR_TYPES.get(self.status, "server_error"),
                "param": self.param,
                "code": self.code or self.status,
            }
        }


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None  # OpenAI's participant name; chat templates that read it get it
    reasoning_content: str | None = None  # an earlier turn's reasoning (Qwen3's template reads it)
    tool_calls: list[Any] | None = None  # only empty: tool calling is not served
    refusal: str | None = None  # OpenAI clients echo it back on assistant turns; not rendered

    @field_validator("tool_calls")
    @classmethod
    def _no_tool_calls(cls, value: list[Any] | None) -> list[Any] | None:
        if value:
            raise ValueError("`tool_calls` is not supported by this server: tool calling is not served")
        return value

    def to_template(self) -> dict[str, str]:
        """The ``{"role", "content"}`` dict the chat template reads; text parts are concatenated."""
        if isinstance(self.content, list):
            kinds = {p.get("type") for p in self.content} - {"text"}
            if kinds:
                raise APIError(
                    400,
                    f"only text content parts are served, not {sorted(map(str, kinds))}",
                    param="messages",
                )
            text = "".join(str(p.get("text", "")) for p in self.content)
        else:
            text = self.content or ""
        out = {"role": self.role, "content": text}
        for key in ("name", "reasoning_content"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out


# Fields of OpenAI's and vLLM's APIs this server cannot serve: a request setting one to anything
# but its neutral value gets 400 naming it (never a silent drop). field -> (neutral values, why).
UNSUPPORTED: dict[str, tuple[tuple[Any, ...], str]] = {
    "response_format": ((None, {"type": "text"}), "structured output (JSON mode/schema) is not served"),
    "tools": ((None, []), "tool calling is not served"),
    "tool_choice": ((None, "none"), "tool calling is not served"),
    "functions": ((None, []), "function calling is not served"),
    "function_call": ((None, "none"), "function calling is not served"),
    "parallel_tool_calls": ((None, True, False), ""),  # meaningless without tools: any value is neutral
    "structured_outputs": ((None,), "structured output is not served"),
    "guided_json": ((None,), "structured output is not served"),
    "guided_regex": ((None,), "structured output is not served"),
    "guided_choice": ((None,), "structured output is not served"),
    "guided_grammar": ((None,), "structured output is not served"),
    "use_beam_search": ((None, False), "beam search is not served"),
    "best_of": ((None, 1), "best_of > 1 is not served (vLLM v1 dropped it); use n"),
    "echo": ((None, False), "echo is not served"),
    "suffix": ((None, ""), "suffix (insertion) is not served"),
    "prompt_logprobs": ((None,), "prompt logprobs are not served"),
    "audio": ((None,), "audio output is not served"),
    "modalities": ((None, ["text"]), "only text output is served"),
    "prediction": ((None,), "predicted outputs are not served"),
    "reasoning_effort": ((None,), "this server has no reasoning parser; use chat_template_kwargs"),
    "chat_template": ((None,), "a request's own chat template would break the training format"),
    "documents": ((None, []), "documents are not served"),
    "truncate_prompt_tokens": (
        (None,),
        "prompt truncation is not served (a cut prompt is not the trained one)",
    ),
}

# Arguments of ``apply_chat_template`` itself: not template variables, so never taken from a request.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
        "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
        "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
    }
)  # fmt: skip


class _SamplingRequest(BaseModel):
    """The sampling fields vLLM's OpenAI server honours, each passed to ``vllm.SamplingParams``.

    Unknown fields are refused (``extra="forbid"``: 400 naming the field), as are the fields of
    ``UNSUPPORTED`` set to anything but a neutral value.
    """

    model_config = ConfigDict(extra="forbid")

    model: str
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, description="-1, 0 or None: no top-k cut")
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=2.0)
    max_tokens: int | None = Field(None, ge=1)
    min_tokens: int = Field(0, ge=0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    n: int = Field(1, ge=1, le=16)
    user: str | None = None  # the end user's id (OpenAI); generation does not depend on it
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    return_tokens_as_token_ids: bool = False  # vLLM: logprob tokens read "token_id:<id>"
    return_token_ids: bool = False  # vLLM: prompt_token_ids on the response, token_ids on each choice

    # The refused fields: declared so that a neutral value (e.g. response_format {"type": "text"}) passes.
    response_format: Any = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    parallel_tool_calls: Any = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    use_beam_search: Any = None
    best_of: Any = None
    echo: Any = None
    prompt_logprobs: Any = None
    truncate_prompt_tokens: Any = None

    @field_validator(
        "response_format", "tools", "tool_choice", "functions", "function_call", "parallel_tool_calls",
        "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
        "use_beam_search", "best_of", "echo", "prompt_logprobs", "truncate_prompt_tokens",
    )  # fmt: skip
    @classmethod
    def _refuse(cls, value: Any, info: ValidationInfo) -> Any:
        return refuse_unsupported(info.field_name, value)

    @field_validator("logit_bias")
    @classmethod
    def _token_ids(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (value or {}).items():
            if not key.lstrip("-").isdigit():
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias values must lie in [-100, 100], got {bias}")
        return value

    def include_usage_in_stream(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))


def refuse_unsupported(name: str, value: Any) -> Any:
    """``value`` if it is neutral for the unsupported field ``name``; else a ValueError saying why."""
    neutral, why = UNSUPPORTED[name]
    if value in neutral:
        return value
    raise ValueError(f"`{name}` is not supported by this server: {why}")


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    # Template variables (vLLM's name), e.g. {"enable_thinking": false}; on top of the server's
    # defaults (the run's model.enable_thinking / model.chat_template_kwargs).
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_prompt_text: bool = False  # vLLM: the rendered prompt text on the response
    # Refused chat-only fields (see UNSUPPORTED).
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    chat_template: Any = None
    documents: Any = None

    @field_validator("audio", "modalities", "prediction", "reasoning_effort", "chat_template", "documents")
    @classmethod
    def _refuse_chat(cls, value: Any, info: ValidationInfo) -> Any:
        return refuse_unsupported(info.field_name, value)

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        reserved = sorted(set(value or {}) & RESERVED_TEMPLATE_KWARGS)
        if reserved:
            raise ValueError(f"{reserved} are arguments of the template call, not template variables")
        return value

    @model_validator(mode="after")
    def _generation_prompt(self) -> ChatCompletionRequest:
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message needs add_generation_prompt: false")
        return self

    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str]
    logprobs: int | None = Field(None, ge=0, le=20)
    suffix: Any = None

    @field_validator("suffix")
    @classmethod
    def _refuse_suffix(cls, value: Any, info: ValidationInfo) -> Any:
        return refuse_unsupported(info.field_name, value)

    def token_limit(self) -> int | None:
        return self.max_tokens

    def num_logprobs(self) -> int | None:
        return self.logprobs

    def prompt_text(self) -> str:
        if isinstance(self.prompt, str):
            return self.prompt
        if len(self.prompt) != 1:
            raise APIError(
                400, "only one prompt per request is supported (use n for several samples)", param="prompt"
            )
        return self.prompt[0]


class LoadLoRARequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str
    lora_path: str


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _token_str(token_id: int, logprob: Any, as_ids: bool) -> str:
    if as_ids:
        return f"token_id:{token_id}"
    return logprob.decoded_token if logprob.decoded_token is not None else ""


def _top(entries: dict[int, Any], k: int) -> list[tuple[int, Any]]:
    return sorted(entries.items(), key=lambda kv: kv[1].rank or 0)[:k]


def chat_logprobs(output: Any, k: int | None, as_ids: bool) -> dict[str, Any] | None:
    """OpenAI chat ``logprobs`` (``{"content": [...]}``) of a vLLM ``CompletionOutput``, or None."""
    if k is None or output.logprobs is None:
        return None
    content = []
    for token_id, entries in zip(output.token_ids, output.logprobs, strict=False):
        chosen = entries[token_id]
        token = _token_str(token_id, chosen, as_ids)
        top = [
            {
                "token": (t := _token_str(tid, lp, as_ids)),
                "logprob": lp.logprob,
                "bytes": list(t.encode("utf-8")),
            }
            for tid, lp in _top(entries, k)
        ]
        content.append(
            {"token": token, "logprob": chosen.logprob, "bytes": list(token.encode()), "top_logprobs": top}
        )
    return {"content": content}


def completion_logprobs(output: Any, k: int | None, as_ids: bool, offset: int = 0) -> dict[str, Any] | None:
    """Legacy completions ``logprobs`` (tokens, token_logprobs, top_logprobs, text_offset), or None."""
    if k is None or output.logprobs is None:
        return None
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for token_id, entries in zip(output.token_ids, output.logprobs, strict=False):
        chosen = entries[token_id]
        token = _token_str(token_id, chosen, as_ids)
        tokens.append(token)
        token_logprobs.append(chosen.logprob)
        tops.append({_token_str(tid, lp, as_ids): lp.logprob for tid, lp in _top(entries, k)})
        offsets.append(offset)
        offset += len(chosen.decoded_token or "")
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}


def _token_ids(output: Any, on: bool) -> dict[str, Any]:
    return {"token_ids": list(output.token_ids)} if on else {}


def chat_response(
    rid: str,
    model: str,
    created: int,
    outputs: list[Any],
    prompt_ids: list[int],
    logprobs: list[dict[str, Any] | None],
    return_token_ids: bool = False,
    prompt_text: str | None = None,
) -> dict[str, Any]:
    """A ``chat.completion`` with one choice per vLLM ``CompletionOutput`` (``n`` of them)."""
    choices = [
        {
            "index": out.index,
            "message": {"role": "assistant", "content": out.text},
            "logprobs": lp,
            "finish_reason": out.finish_reason,
            **_token_ids(out, return_token_ids),
        }
        for out, lp in zip(outputs, logprobs, strict=True)
    ]
    response = {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage(len(prompt_ids), sum(len(o.token_ids) for o in outputs)),
    }
    if return_token_ids:
        response["prompt_token_ids"] = list(prompt_ids)
    if prompt_text is not None:
        response["prompt_text"] = prompt_text
    return response


def completion_response(
    rid: str,
    model: str,
    created: int,
    outputs: list[Any],
    prompt_ids: list[int],
    logprobs: list[dict[str, Any] | None],
    return_token_ids: bool = False,
) -> dict[str, Any]:
    """A ``text_completion`` with one choice per vLLM ``CompletionOutput``."""
    choices = [
        {
            "index": out.index,
            "text": out.text,
            "logprobs": lp,
            "finish_reason": out.finish_reason,
            **_token_ids(out, return_token_ids),
            **({"prompt_token_ids": list(prompt_ids)} if return_token_ids else {}),
        }
        for out, lp in zip(outputs, logprobs, strict=True)
    ]
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage(len(prompt_ids), sum(len(o.token_ids) for o in outputs)),
    }


def chunk(
    chat: bool,
    rid: str,
    model: str,
    created: int,
    output: Any,
    logprobs: dict[str, Any] | None = None,
    first: bool = False,
    return_token_ids: bool = False,
) -> dict[str, Any]:
    """One streamed chunk (``chat.completion.chunk`` or ``text_completion``) for one choice's delta."""
    text, finish_reason = output.text, output.finish_reason
    if chat:
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if text:
            delta["content"] = text
        choice: dict[str, Any] = {
            "index": output.index,
            "delta": delta,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
        }
    else:
        choice = {
            "index": output.index,
            "text": text or "",
            "logprobs": logprobs,
            "finish_reason": finish_reason,
        }
    choice.update(_token_ids(output, return_token_ids))
    return {
        "id": rid,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
    }


def usage_chunk(chat: bool, rid: str, model: str, created: int, prompt_tokens: int, completion_tokens: int):
    """The last streamed chunk when ``stream_options.include_usage`` is set: no choices, only usage."""
    return {
        "id": rid,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage(prompt_tokens, completion_tokens),
    }
