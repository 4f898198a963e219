"""The OpenAI wire format of the policy endpoint: request bodies, errors, responses and stream chunks.

Only the fields HaMo's clients use are modelled; unknown fields are ignored, as OpenAI-compatible
servers do. Responses are built from vLLM's ``CompletionOutput`` objects (duck-typed, so this module
does not import vLLM). One vLLM extension is accepted: ``return_tokens_as_token_ids`` makes each
logprob token read ``"token_id:<id>"``, which lets a client compare outputs token id by token id.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

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
    model_config = ConfigDict(extra="ignore")

    role: str
    content: str | list[dict[str, Any]] | None = None

    def to_template(self) -> dict[str, str]:
        """The ``{"role", "content"}`` dict the chat template reads; text parts are concatenated."""
        if isinstance(self.content, list):
            text = "".join(str(p.get("text", "")) for p in self.content if p.get("type") == "text")
        else:
            text = self.content or ""
        return {"role": self.role, "content": text}


class _SamplingRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    max_tokens: int | None = Field(None, ge=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=1, description="only n=1 is supported")
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    return_tokens_as_token_ids: bool = False

    def include_usage_in_stream(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))


class HamoInjection(BaseModel):
    """The ``hamo`` field of a chat request: build the prompt in the training format, with retrieval.

    The server retrieves the top-``k`` cards for (``goal``, ``init_obs``) from the run's memory and
    builds the conversation with ``hamo_ray.prompting.build_messages`` (first user turn = instruction,
    task, initial observation, injected experience; then the (action, observation) turns so far,
    under the run's context rule), exactly as training and the stream's evaluations do. The
    request's ``messages`` must then be empty.
    """

    model_config = ConfigDict(extra="forbid")

    goal: str = Field(min_length=1, max_length=20_000)
    init_obs: str = Field(default="", max_length=100_000)
    k: int | None = Field(default=None, ge=0, le=50, description="cards to inject; None: the run's top_k")
    max_stage: int | None = Field(default=None, description="only cards of stages <= max_stage")
    actions: list[str] = Field(default_factory=list, max_length=10_000)
    observations: list[str] = Field(default_factory=list, max_length=10_000)

    @model_validator(mode="after")
    def _same_length(self) -> HamoInjection:
        if len(self.actions) != len(self.observations):
            raise ValueError(f"{len(self.actions)} actions but {len(self.observations)} observations")
        return self


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(default_factory=list)
    hamo: HamoInjection | None = None
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)

    @model_validator(mode="after")
    def _messages_or_hamo(self) -> ChatCompletionRequest:
        if self.hamo is None and not self.messages:
            raise ValueError("messages must hold at least one message (or pass a `hamo` field)")
        if self.hamo is not None and self.messages:
            raise ValueError("with a `hamo` field the server builds the messages: send messages=[]")
        return self

    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str]
    logprobs: int | None = Field(None, ge=0, le=20)

    def token_limit(self) -> int | None:
        return self.max_tokens

    def num_logprobs(self) -> int | None:
        return self.logprobs

    def prompt_text(self) -> str:
        if isinstance(self.prompt, str):
            return self.prompt
        if len(self.prompt) != 1:
            raise APIError(400, "only one prompt per request is supported", param="prompt")
        return self.prompt[0]


class LoadLoRARequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

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


def chat_response(
    rid: str, model: str, created: int, output: Any, prompt_tokens: int, logprobs: dict[str, Any] | None
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": output.text},
                "logprobs": logprobs,
                "finish_reason": output.finish_reason,
            }
        ],
        "usage": usage(prompt_tokens, len(output.token_ids)),
    }


def completion_response(
    rid: str, model: str, created: int, output: Any, prompt_tokens: int, logprobs: dict[str, Any] | None
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [
            {"index": 0, "text": output.text, "logprobs": logprobs, "finish_reason": output.finish_reason}
        ],
        "usage": usage(prompt_tokens, len(output.token_ids)),
    }


def chunk(
    chat: bool,
    rid: str,
    model: str,
    created: int,
    text: str | None,
    finish_reason: str | None,
    logprobs: dict[str, Any] | None = None,
    first: bool = False,
) -> dict[str, Any]:
    """One streamed chunk (``chat.completion.chunk`` or ``text_completion``) with one choice."""
    if chat:
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if text:
            delta["content"] = text
        choice: dict[str, Any] = {
            "index": 0,
            "delta": delta,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
        }
    else:
        choice = {"index": 0, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
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
