"""What completions and chat share to turn engine outputs into responses: Server-Sent Events,
the merging of several request streams, the collection of final outputs, usage, and logprob
values made JSON-safe."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import AsyncIterator, Callable
from typing import Any, overload

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from mcserve.engine.outputs import Logprob, RequestOutput
from mcserve.server import protocol as P
from mcserve.server.async_engine import RequestStream
from mcserve.server.errors import engine_error, error_body

LOGPROB_FLOOR = -9999.0  # JSON has no -inf: vLLM's stand-in


@overload
def logprob_value(x: Logprob | float | None, default: float) -> float: ...


@overload
def logprob_value(x: Logprob | float | None, default: None = None) -> float | None: ...


def logprob_value(x: Logprob | float | None, default: float | None = None) -> float | None:
    """The JSON-safe value of one engine logprob (a ``Logprob``, or a bare float from an engine
    that predates it): floored at ``LOGPROB_FLOOR``; ``default`` when missing or NaN."""
    if x is None:
        return default
    v = float(getattr(x, "logprob", x))
    if math.isnan(v):
        return default
    return max(v, LOGPROB_FLOOR)


def ranked(d: dict[int, Any]) -> list[tuple[int, Any]]:
    """A token's alternatives ``{token_id: logprob}``, most likely first."""

    def key(kv: tuple[int, Any]) -> float:
        v = logprob_value(kv[1])
        return -(LOGPROB_FLOOR if v is None else v)

    return sorted(d.items(), key=key)


def sse(payload: dict[str, Any] | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


def stream_response(
    streams: list[RequestStream], chunks: AsyncIterator[BaseModel],
    usage_chunk: Callable[[], BaseModel | None] | None = None,
) -> StreamingResponse:
    """The SSE response of a streamed request: each of ``chunks``, then ``usage_chunk()`` (when
    given and not None), then ``[DONE]``. An engine failure ends the stream with an error event
    in OpenAI's shape before ``[DONE]``, since the 200 status has already been sent. The engine
    requests are aborted when the stream ends or the client goes away."""

    async def events() -> AsyncIterator[str]:
        try:
            async for chunk in chunks:
                yield sse(chunk.model_dump())
            last = usage_chunk() if usage_chunk is not None else None
            if last is not None:
                yield sse(last.model_dump())
        except Exception as e:  # noqa: BLE001 - fail this stream in-band
            err = engine_error(e)
            yield sse(error_body(err.status, err.message, err.param, err.code))
        finally:
            for s in streams:
                s.abort()
            aclose = getattr(chunks, "aclose", None)
            if aclose is not None:  # stops the stream pumps of merge() now, not at GC
                await aclose()
        yield sse("[DONE]")

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several request streams as (stream index, output)."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
    end = object()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                queue.put_nowait((i, out))
            queue.put_nowait((i, end))
        except Exception as e:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait((i, e))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await queue.get()
            if item is end:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


async def _wait_disconnect(raw: Request) -> None:
    while True:
        message = await raw.receive()
        if message["type"] == "http.disconnect":
            return


async def collect(raw: Request, streams: list[RequestStream]) -> list[RequestOutput] | None:
    """The final output of each stream; None if the client went away (requests aborted)."""
    finals: list[RequestOutput | None] = [None] * len(streams)

    async def run() -> None:
        async for i, out in merge(streams):
            finals[i] = out

    task = asyncio.ensure_future(run())
    watch = asyncio.ensure_future(_wait_disconnect(raw))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
        watch.cancel()
        for s in streams:
            s.abort()
    if not task.done() or task.cancelled():
        return None
    exc = task.exception()
    if exc is not None:
        raise engine_error(exc)
    return [f for f in finals if f is not None]


def usage(outs: list[RequestOutput], drop_generated: bool) -> P.UsageInfo:
    """Token counts of the requests; ``drop_generated``: the one token generated for an echo with
    max_tokens=0 is not reported."""
    prompt = sum(len(o.prompt_token_ids) for o in outs)
    completion = 0 if drop_generated else sum(len(c.token_ids) for o in outs for c in o.outputs)
    cached = sum(o.num_cached_tokens or 0 for o in outs)
    return P.UsageInfo(prompt_tokens=prompt, completion_tokens=completion,
                       total_tokens=prompt + completion,
                       prompt_tokens_details=P.PromptTokensDetails(cached_tokens=cached))
