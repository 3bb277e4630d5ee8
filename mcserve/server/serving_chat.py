"""POST /v1/chat/completions: the messages rendered by the tokenizer's chat template, then
generated like a completion, streamed or not, with OpenAI's chat logprobs, structured outputs
(``response_format``, ``structured_outputs``) and tool calls (``chat_tools.py``)."""

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
from mcserve.server.chat_tools import (
    ToolRequest,
    ToolStream,
    answer_message,
    arguments_for_template,
    tool_request,
    with_tool_history,
)
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
from mcserve.server.structured import precompile, rename_param, structured_spec

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
        if m.tool_calls:
            msg["tool_calls"] = [
                {"id": c.id, "type": "function",
                 "function": {"name": c.function.name,
                              "arguments": arguments_for_template(c.function.arguments)}}
                for c in m.tool_calls]
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        out.append(msg)
    return out


def _template_inputs(st: ServerState, msgs: list[P.ChatMessage], tools: ToolRequest | None
                     ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The messages and extra template variables (``tools``) the prompt is rendered with."""
    return with_tool_history(_messages(msgs), st.chat_template, st.tool_parser, tools)


async def chat_prompt(st: ServerState, msgs: list[P.ChatMessage],
                      add_generation_prompt: bool, tools: ToolRequest | None = None) -> str:
    """The prompt text of ``msgs`` (and ``tools``) through the tokenizer's chat template
    (rendered on a worker thread when the messages are long, so that the event loop goes on
    meanwhile)."""

    def render() -> str:
        messages, kwargs = _template_inputs(st, msgs, tools)
        for i, m in enumerate(messages):
            for key in ("content", "name"):
                if key in m:
                    check_utf8(m[key], "messages", what=f"messages[{i}].{key}")
        try:
            return st.tokenizer.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, **kwargs)
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from None

    if len(msgs) <= _INLINE_MESSAGES and sum(_chars(m) for m in msgs) <= INLINE_CHARS:
        return render()
    return await asyncio.to_thread(render)


async def message_ends(st: ServerState, msgs: list[P.ChatMessage], ids: list[int],
                       tools: ToolRequest | None = None) -> list[int] | None:
    """Where messages end in the prompt's tokens (``chat_resume_positions``), for the engine
    to keep resume points there: the next turn, and other conversations with the same system
    prompt, compute only what follows. None when the engine keeps none (prefix caching off)
    or the template is not the tokenizer's own kind (no ``apply_chat_template``)."""
    if not st.resume_points or not hasattr(st.tokenizer, "apply_chat_template"):
        return None
    from mcserve.engine.tokenizer import chat_resume_positions

    messages, kwargs = _template_inputs(st, msgs, tools)
    if len(msgs) <= _INLINE_MESSAGES and sum(_chars(m) for m in msgs) <= INLINE_CHARS:
        return chat_resume_positions(st.tokenizer, messages, ids, **kwargs)
    return await asyncio.to_thread(chat_resume_positions, st.tokenizer, messages, ids,
                                   **kwargs)


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
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs requires logprobs=true", param="top_logprobs")
    tools = tool_request(body, st.tool_parser)
    spec, spec_field = structured_spec(body)
    forced = tools.constraint() if tools is not None else None
    if forced is not None:
        spec, spec_field = forced, "tools"
    prompt = await chat_prompt(st, body.messages, body.add_generation_prompt, tools)
    ids = await st.encoder.encode(prompt, add_special_tokens=False, param="messages")
    if not ids:
        raise APIError(400, "messages: the chat template rendered an empty prompt",
                       param="messages")
    marks = await message_ends(st, body.messages, ids, tools)
    # a 400 about the length names the field the client sent it in
    length_field = "max_completion_tokens" if body.max_completion_tokens is not None \
        else "max_tokens"
    max_tokens = body.max_completion_tokens or body.max_tokens
    if max_tokens is None:
        max_tokens = st.max_model_len - len(ids)
    top_n = body.top_logprobs or 0
    params = sampling_params(st, body, max_tokens, top_n if body.logprobs else None, None,
                             structured=spec, max_tokens_param=length_field)
    mc = mc_overrides(st, body)
    if spec is not None and spec_field is not None:
        await precompile(st, spec, spec_field)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    try:
        streams = await st.submit([(rid, prompt, ids)], params, mc, resume_positions=marks)
    except APIError as e:
        e = rename_param(e, spec_field)
        if e.param == "max_tokens" and length_field != "max_tokens":
            e = APIError(e.status, e.message.replace("max_tokens", length_field),
                         param=length_field)
        raise e from None
    model = st.served_model_name

    if body.stream:
        final: list[RequestOutput] = []  # the finished output, for the usage chunk

        async def chunks() -> AsyncIterator[P.ChatCompletionChunk]:
            sent_chars: dict[int, int] = {}
            sent_tokens: dict[int, int] = {}
            done: set[int] = set()  # choices whose finish was sent (n > 1: others go on)
            tool_streams = {i: ToolStream(tools) for i in range(body.n)} if tools else {}
            first = [P.ChatStreamChoice(index=i, delta=P.DeltaMessage(role="assistant",
                                                                      content=""))
                     for i in range(body.n)]
            yield P.ChatCompletionChunk(id=rid, created=created, model=model, choices=first)
            async for _, out in merge(streams):
                if out.finished:
                    final[:] = [out]
                choices = []
                for c in out.outputs:
                    if c.index in done:
                        continue
                    calls = None
                    finish = c.finish_reason
                    if tools is not None:
                        delta, calls, finish = tool_streams[c.index].step(c.text, finish)
                    else:
                        sent = sent_chars.get(c.index, 0)
                        delta = c.text[sent:] if len(c.text) > sent else ""
                        sent_chars[c.index] = max(sent, len(c.text))
                    ntok = sent_tokens.get(c.index, 0)
                    lp = None
                    if body.logprobs and len(c.token_ids) > ntok:
                        lp = _chat_logprobs(st, c.token_ids[ntok:],
                                            c.logprobs[ntok:] if c.logprobs else None, top_n)
                    sent_tokens[c.index] = len(c.token_ids)
                    if not delta and not calls and lp is None and finish is None:
                        continue
                    if finish is not None:
                        done.add(c.index)
                    choices.append(P.ChatStreamChoice(
                        index=c.index,
                        delta=P.DeltaMessage(content=delta or None, tool_calls=calls),
                        logprobs=lp, finish_reason=finish))
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
    choices = []
    for c in out.outputs:
        message, finish = answer_message(tools, c.text, c.finish_reason)
        choices.append(P.ChatChoice(
            index=c.index, message=message,
            logprobs=_chat_logprobs(st, c.token_ids, c.logprobs, top_n) if body.logprobs
            else None,
            finish_reason=finish, stop_reason=c.stop_reason))
    resp = P.ChatCompletionResponse(id=rid, created=created, model=model, choices=choices,
                                    usage=usage([out], False))
    return JSONResponse(resp.model_dump())
