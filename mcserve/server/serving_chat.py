"""POST /v1/chat/completions: the messages rendered by the tokenizer's chat template, then
generated like a completion, streamed or not, with OpenAI's chat logprobs."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from mcserve.engine.outputs import Logprob, RequestOutput
from mcserve.server import protocol as P
from mcserve.server.errors import APIError
from mcserve.server.params import mc_overrides, sampling_params
from mcserve.server.prompts import INLINE_CHARS, check_utf8
from mcserve.server.state import ServerState
from mcserve.server.streaming import (
    LOGPROB_FLOOR,
    collect,
    logprob_value,
    merge,
    ranked,
    stream_response,
    usage,
)

# conversations up to this many messages (and INLINE_CHARS characters) render inline
_INLINE_MESSAGES = 64


def _chars(m: P.ChatMessage) -> int:
    content = m.content
    if isinstance(content, list):
        return sum(len(part.text) for part in content)
    return len(content or "")


def _messages(msgs: list[P.ChatMessage]) -> list[dict[str, Any]]:
    out = []
    for m in msgs:
        content = m.content
        if isinstance(content, list):
            content = "\n".join(part.text for part in content)
        msg: dict[str, Any] = {"role": m.role, "content": content or ""}
        if m.name is not None:
            msg["name"] = m.name
        out.append(msg)
    return out


async def chat_prompt(st: ServerState, msgs: list[P.ChatMessage],
                      add_generation_prompt: bool) -> str:
    """The prompt text of ``msgs`` through the tokenizer's chat template (rendered on a worker
    thread when the messages are long, so that the event loop goes on meanwhile)."""

    def render() -> str:
        messages = _messages(msgs)
        for i, m in enumerate(messages):
            for key in ("content", "name"):
                if key in m:
                    check_utf8(m[key], "messages", what=f"messages[{i}].{key}")
        try:
            return st.tokenizer.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt)
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from None

    if len(msgs) <= _INLINE_MESSAGES and sum(_chars(m) for m in msgs) <= INLINE_CHARS:
        return render()
    return await asyncio.to_thread(render)


async def message_ends(st: ServerState, msgs: list[P.ChatMessage], ids: list[int]
                       ) -> list[int] | None:
    """Where messages end in the prompt's tokens (``chat_resume_positions``), for the engine
    to keep resume points there: the next turn, and other conversations with the same system
    prompt, compute only what follows. None when the engine keeps none (prefix caching off)
    or the template is not the tokenizer's own kind (no ``apply_chat_template``)."""
    if not st.resume_points or not hasattr(st.tokenizer, "apply_chat_template"):
        return None
    from mcserve.engine.tokenizer import chat_resume_positions

    messages = _messages(msgs)
    if len(msgs) <= _INLINE_MESSAGES and sum(_chars(m) for m in msgs) <= INLINE_CHARS:
        return chat_resume_positions(st.tokenizer, messages, ids)
    return await asyncio.to_thread(chat_resume_positions, st.tokenizer, messages, ids)


def _chat_logprobs(st: ServerState, ids: list[int], dicts: list[dict[int, Logprob]] | None,
                   top_n: int) -> P.ChatLogprobs:
    entries = []
    for k, tid in enumerate(ids):
        d = (dicts[k] if dicts is not None and k < len(dicts) else None) or {}
        s = st.token_str(tid)
        tops = [
            P.ChatLogprobTop(token=st.token_str(t), logprob=logprob_value(v, LOGPROB_FLOOR),
                             bytes=list(st.token_str(t).encode("utf-8")))
            for t, v in ranked(d)[:top_n]
        ]
        entries.append(P.ChatLogprobEntry(
            token=s, logprob=logprob_value(d.get(tid), LOGPROB_FLOOR),
            bytes=list(s.encode("utf-8")), top_logprobs=tops))
    return P.ChatLogprobs(content=entries)


async def create_chat_completion(
    st: ServerState, body: P.ChatCompletionRequest, raw: Request
) -> Response:
    st.check_model(body.model)
    if body.tools and body.tool_choice != "none":
        raise APIError(400, "tools are not supported", param="tools")
    if body.tool_choice not in (None, "none", "auto"):
        # "required" or a named function: a tool call is demanded, and there is no tool
        raise APIError(400, f"tool_choice={body.tool_choice!r} requires tools, and tools are "
                       "not supported (tool_choice may be 'none' or 'auto')",
                       param="tool_choice")
    if body.response_format and body.response_format.get("type", "text") != "text":
        raise APIError(400, "response_format: only {'type': 'text'} is supported",
                       param="response_format")
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs requires logprobs=true", param="top_logprobs")
    prompt = await chat_prompt(st, body.messages, body.add_generation_prompt)
    ids = await st.encoder.encode(prompt, add_special_tokens=False, param="messages")
    if not ids:
        raise APIError(400, "messages: the chat template rendered an empty prompt",
                       param="messages")
    marks = await message_ends(st, body.messages, ids)
    max_tokens = body.max_completion_tokens or body.max_tokens
    if max_tokens is None:
        max_tokens = st.max_model_len - len(ids)
    top_n = body.top_logprobs or 0
    params = sampling_params(st, body, max_tokens, top_n if body.logprobs else None, None)
    mc = mc_overrides(st, body)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    streams = await st.submit([(rid, prompt, ids)], params, mc, resume_positions=marks)
    model = st.served_model_name

    if body.stream:
        final: list[RequestOutput] = []  # the finished output, for the usage chunk

        async def chunks() -> AsyncIterator[P.ChatCompletionChunk]:
            sent_chars: dict[int, int] = {}
            sent_tokens: dict[int, int] = {}
            first = [P.ChatStreamChoice(index=i, delta=P.DeltaMessage(role="assistant",
                                                                      content=""))
                     for i in range(body.n)]
            yield P.ChatCompletionChunk(id=rid, created=created, model=model, choices=first)
            async for _, out in merge(streams):
                if out.finished:
                    final[:] = [out]
                choices = []
                for c in out.outputs:
                    sent = sent_chars.get(c.index, 0)
                    delta = c.text[sent:] if len(c.text) > sent else ""
                    sent_chars[c.index] = max(sent, len(c.text))
                    ntok = sent_tokens.get(c.index, 0)
                    lp = None
                    if body.logprobs and len(c.token_ids) > ntok:
                        lp = _chat_logprobs(st, c.token_ids[ntok:],
                                            c.logprobs[ntok:] if c.logprobs else None, top_n)
                    sent_tokens[c.index] = len(c.token_ids)
                    if not delta and lp is None and c.finish_reason is None:
                        continue
                    choices.append(P.ChatStreamChoice(
                        index=c.index, delta=P.DeltaMessage(content=delta or None),
                        logprobs=lp, finish_reason=c.finish_reason))
                if choices:
                    yield P.ChatCompletionChunk(id=rid, created=created, model=model,
                                                choices=choices)

        def usage_chunk() -> P.ChatCompletionChunk | None:
            if not final:
                return None
            return P.ChatCompletionChunk(id=rid, created=created, model=model, choices=[],
                                         usage=usage(final, False))

        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return stream_response(streams, chunks(), usage_chunk if include_usage else None)

    outs = await collect(raw, streams)
    if outs is None:
        return Response(status_code=499)
    out = outs[0]
    choices = [
        P.ChatChoice(
            index=c.index, message=P.ChatResponseMessage(content=c.text),
            logprobs=_chat_logprobs(st, c.token_ids, c.logprobs, top_n) if body.logprobs
            else None,
            finish_reason=c.finish_reason, stop_reason=c.stop_reason)
        for c in out.outputs
    ]
    resp = P.ChatCompletionResponse(id=rid, created=created, model=model, choices=choices,
                                    usage=usage([out], False))
    return JSONResponse(resp.model_dump())
