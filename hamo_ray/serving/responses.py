"""The OpenAI responses of the policy endpoint: completions, logprobs, and the SSE stream of chunks.

Built from vLLM's ``RequestOutput`` / ``CompletionOutput`` objects, duck-typed (``.outputs``,
``.index``, ``.text``, ``.token_ids``, ``.logprobs``, ``.finish_reason``), so this module does not
import vLLM. ``hamo_ray.serving.app`` answers with ``response`` or, for ``stream=true``, with the
events of ``sse_events``.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from hamo_ray.serving.protocol import ChatCompletionRequest, CompletionRequest, engine_error


def new_id(prefix: str) -> str:
    """A fresh response id, e.g. ``chatcmpl-<hex>``."""
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    """The ``created`` timestamp: seconds since the epoch."""
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """OpenAI ``usage``: prompt, completion and total token counts."""
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


def response(
    chat: bool,
    rid: str,
    model: str,
    created: int,
    outputs: list[Any],
    prompt_ids: list[int],
    logprobs: list[dict[str, Any] | None],
    return_token_ids: bool = False,
    prompt_text: str | None = None,
) -> dict[str, Any]:
    """A ``chat.completion`` (or, with ``chat`` false, a ``text_completion``) with one choice per vLLM
    ``CompletionOutput`` (``n`` of them).

    With ``return_token_ids`` each choice carries its ``token_ids`` and the prompt's ids ride on the
    response (chat) or on each choice (completions, as vLLM does); ``prompt_text`` (chat only) is the
    rendered prompt.
    """
    choices = []
    for out, lp in zip(outputs, logprobs, strict=True):
        text = {"message": {"role": "assistant", "content": out.text}} if chat else {"text": out.text}
        choice = {"index": out.index, **text, "logprobs": lp, "finish_reason": out.finish_reason}
        choice.update(_token_ids(out, return_token_ids))
        if return_token_ids and not chat:
            choice["prompt_token_ids"] = list(prompt_ids)
        choices.append(choice)
    body = {
        "id": rid,
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage(len(prompt_ids), sum(len(o.token_ids) for o in outputs)),
    }
    if return_token_ids and chat:
        body["prompt_token_ids"] = list(prompt_ids)
    if prompt_text is not None:
        body["prompt_text"] = prompt_text
    return body


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


def usage_chunk(
    chat: bool, rid: str, model: str, created: int, prompt_tokens: int, completion_tokens: int
) -> dict[str, Any]:
    """The last streamed chunk when ``stream_options.include_usage`` is set: no choices, only usage."""
    return {
        "id": rid,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage(prompt_tokens, completion_tokens),
    }


def request_logprobs(
    body: ChatCompletionRequest | CompletionRequest, chat: bool, output: Any, offset: int = 0
) -> dict[str, Any] | None:
    """The ``logprobs`` of one choice in the shape the request's route uses (chat or legacy)."""
    k, as_ids = body.num_logprobs(), body.return_tokens_as_token_ids
    if chat:
        return chat_logprobs(output, k, as_ids)
    return completion_logprobs(output, k, as_ids, offset)


async def sse_events(
    gen: AsyncIterator[Any],
    body: ChatCompletionRequest | CompletionRequest,
    rid: str,
    prompt_ids: list[int],
    chat: bool,
    prompt_text: str | None = None,
) -> AsyncIterator[str]:
    """Server-sent events of a streamed request: one chunk per choice delta, usage, then ``[DONE]``.

    Args:
        gen: the engine's ``generate`` iterator, with ``RequestOutputKind.DELTA`` outputs.
        body: the request (model name, logprobs, token-id and usage options).
        rid: the response id every chunk carries.
        prompt_ids: the prompt's token ids (usage; ``prompt_token_ids`` on the first chunk if asked).
        chat: ``chat.completion.chunk`` when true, else ``text_completion``.
        prompt_text: the rendered prompt, carried by the first chunk when the request asked for it.

    Returns:
        The ``data: ...`` lines. An engine error mid-stream becomes one error event before ``[DONE]``.
    """
    created, n_tokens = now(), 0
    offsets: dict[int, int] = {}  # completions: text offset per choice
    first: set[int] = set()  # choices that got their first chunk
    try:
        async for out in gen:
            for delta in out.outputs:
                n_tokens += len(delta.token_ids)
                logprobs = request_logprobs(body, chat, delta, offsets.get(delta.index, 0))
                offsets[delta.index] = offsets.get(delta.index, 0) + len(delta.text)
                is_first = delta.index not in first
                first.add(delta.index)
                piece = chunk(
                    chat, rid, body.model, created, delta, logprobs, is_first, body.return_token_ids
                )
                if len(first) == 1 and is_first:  # the stream's first chunk carries the prompt
                    if body.return_token_ids:
                        piece["prompt_token_ids"] = list(prompt_ids)
                    if prompt_text is not None:
                        piece["prompt_text"] = prompt_text
                yield f"data: {json.dumps(piece)}\n\n"
    except Exception as exc:
        yield f"data: {json.dumps(engine_error(exc).body())}\n\n"
    else:
        if body.include_usage_in_stream():
            last = usage_chunk(chat, rid, body.model, created, len(prompt_ids), n_tokens)
            yield f"data: {json.dumps(last)}\n\n"
    yield "data: [DONE]\n\n"
