"""The OpenAI requests of the policy endpoint: bodies, their validation, errors, and vLLM sampling.

The requests model the sampling fields vLLM's OpenAI server honours (temperature, top_p, top_k,
min_p, presence/frequency/repetition penalties, stop and stop_token_ids, seed, n, logprobs,
min_tokens, ignore_eos, logit_bias, allowed_token_ids, bad_words, ...), each passed to
``vllm.SamplingParams`` (``sampling_params``). Nothing is dropped silently: an unknown field
is refused with 400 naming it, and so is a known field the server cannot serve (``UNSUPPORTED``:
``response_format``, ``tools``, beam search, ...) unless it holds its neutral value. vLLM's
extensions are accepted under vLLM's names: ``chat_template_kwargs`` (template variables such as
Qwen3's ``enable_thinking``), ``return_tokens_as_token_ids`` (each logprob token reads
``"token_id:<id>"``), ``return_token_ids`` (``prompt_token_ids`` and each choice's ``token_ids``),
``return_prompt_text``. Responses are built by ``hamo_ray.serving.responses``; vLLM is imported
only inside ``sampling_params`` and ``engine_error``, so the models validate without it.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from typing import Annotated, Any, ClassVar

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

logger = logging.getLogger(__name__)

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


def engine_error(exc: Exception) -> APIError:
    """The HTTP error to answer for an exception from vLLM (its own status, 400 for bad input, else 500)."""
    status = getattr(exc, "http_status", None)
    if status is not None:
        return APIError(int(status), str(exc))
    client_errors: tuple[type[Exception], ...] = (ValueError, TypeError)
    try:
        from vllm.exceptions import VLLMClientError

        client_errors += (VLLMClientError,)
    except ImportError:  # older vLLM: validation errors are ValueErrors
        pass
    if isinstance(exc, client_errors):
        return APIError(400, str(exc))
    logger.exception("generation failed")
    return APIError(500, f"{type(exc).__name__}: {exc}")


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


def refuse_unsupported(name: str, value: Any) -> Any:
    """``value`` if it is neutral for the unsupported field ``name``; else a ValueError saying why."""
    neutral, why = UNSUPPORTED[name]
    if value in neutral:
        return value
    raise ValueError(f"`{name}` is not supported by this server: {why}")


def _refuse_field(value: Any, info: ValidationInfo) -> Any:
    return refuse_unsupported(str(info.field_name), value)


# A field of ``UNSUPPORTED``: declared (so a neutral value passes) but refused with 400 otherwise.
Refused = Annotated[Any, AfterValidator(_refuse_field)]


class _SamplingRequest(BaseModel, ABC):
    """The sampling fields vLLM's OpenAI server honours, each passed to ``vllm.SamplingParams``.

    Unknown fields are refused (``extra="forbid"``: 400 naming the field), as are the fields of
    ``UNSUPPORTED`` set to anything but a neutral value.
    """

    model_config = ConfigDict(extra="forbid")
    prompt_field: ClassVar[str]  # the field an error about the prompt names

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
    response_format: Refused = None
    tools: Refused = None
    tool_choice: Refused = None
    functions: Refused = None
    function_call: Refused = None
    parallel_tool_calls: Refused = None
    structured_outputs: Refused = None
    guided_json: Refused = None
    guided_regex: Refused = None
    guided_choice: Refused = None
    guided_grammar: Refused = None
    use_beam_search: Refused = None
    best_of: Refused = None
    echo: Refused = None
    prompt_logprobs: Refused = None
    truncate_prompt_tokens: Refused = None

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

    @abstractmethod
    def token_limit(self) -> int | None:
        """The requested completion length, if any."""

    @abstractmethod
    def num_logprobs(self) -> int | None:
        """How many top logprobs to return per token (None: no logprobs)."""

    def sampling_params(self, prompt_len: int, max_model_len: int, max_tokens_limit: int) -> Any:
        """``vllm.SamplingParams`` of this request: every sampling field above, checked against the limits.

        Args:
            prompt_len: tokens of the rendered prompt.
            max_model_len: the context window; a longer request is cut to it (finish_reason "length").
            max_tokens_limit: the server's ``serve.max_tokens_limit`` (also the default ``max_tokens``).

        Raises:
            APIError: 400 naming the field when the prompt fills the context, ``max_tokens`` exceeds
                the limit, ``min_tokens`` exceeds ``max_tokens``, or vLLM refuses a value.
        """
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        room = max_model_len - prompt_len
        if room < 1:
            raise APIError(
                400,
                f"the prompt has {prompt_len} tokens; the context window is {max_model_len}",
                param=self.prompt_field,
            )
        limit = self.token_limit()
        if limit is not None and limit > max_tokens_limit:
            raise APIError(
                400, f"max_tokens {limit} exceeds this server's limit {max_tokens_limit}", param="max_tokens"
            )
        limit = limit or max_tokens_limit
        if self.min_tokens > min(limit, room):
            raise APIError(
                400, f"min_tokens {self.min_tokens} exceeds max_tokens {limit}", param="min_tokens"
            )
        bias = {int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None
        try:  # vLLM validates the values too (stop strings, token ids, logprobs count, ...)
            return SamplingParams(
                n=self.n,
                temperature=self.temperature,
                top_p=self.top_p,
                top_k=self.top_k if self.top_k not in (None, -1) else 0,
                min_p=self.min_p,
                presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty,
                repetition_penalty=self.repetition_penalty,
                max_tokens=min(limit, room),
                min_tokens=self.min_tokens,
                seed=self.seed,
                stop=[self.stop] if isinstance(self.stop, str) else (self.stop or None),
                stop_token_ids=self.stop_token_ids or None,
                include_stop_str_in_output=self.include_stop_str_in_output,
                ignore_eos=self.ignore_eos,
                skip_special_tokens=self.skip_special_tokens,
                spaces_between_special_tokens=self.spaces_between_special_tokens,
                logit_bias=bias,
                allowed_token_ids=self.allowed_token_ids or None,
                bad_words=self.bad_words or None,
                logprobs=self.num_logprobs(),
                output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY,
            )
        except Exception as exc:
            raise engine_error(exc) from exc


class ChatCompletionRequest(_SamplingRequest):
    prompt_field: ClassVar[str] = "messages"

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
    audio: Refused = None
    modalities: Refused = None
    prediction: Refused = None
    reasoning_effort: Refused = None
    chat_template: Refused = None
    documents: Refused = None

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
    prompt_field: ClassVar[str] = "prompt"

    prompt: str | list[str]
    logprobs: int | None = Field(None, ge=0, le=20)
    suffix: Refused = None

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
