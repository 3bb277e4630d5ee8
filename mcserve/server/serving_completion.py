"""POST /v1/completions: text completions of one or more prompts, ``n`` each, streamed or not,
with logprobs and echo as lm-evaluation-harness uses them."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from mcserve.engine.outputs import CompletionOutput, Logprob, RequestOutput
from mcserve.server import protocol as P
from mcserve.server.errors import APIError
from mcserve.server.params import mc_overrides, sampling_params
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


class _CompletionBuilder:
    """Turns the cumulative outputs of completions requests into choices and stream deltas."""

    def __init__(self, st: ServerState, body: P.CompletionRequest, drop_generated: bool):
        self.st = st
        self.body = body
        self.drop = drop_generated
        self.want_lp = body.logprobs is not None
        # per choice: characters and tokens already sent, text offset for logprobs
        self.sent_chars: dict[int, int] = {}
        self.sent_tokens: dict[int, int] = {}
        self.offset: dict[int, int] = {}
        self.echoed: set[int] = set()
        self.done: set[int] = set()

    def prompt_text(self, out: RequestOutput) -> str:
        if out.prompt is not None:
            return out.prompt
        return self.st.tokenizer.decode(out.prompt_token_ids)

    def _logprobs(self, ids: list[int], dicts: list[dict[int, Logprob] | None] | None,
                  start: int, first_is_none: bool = False) -> tuple[P.CompletionLogprobs, int]:
        lp = P.CompletionLogprobs()
        off = start
        for k, tid in enumerate(ids):
            s = self.st.token_str(tid)
            d = dicts[k] if dicts is not None and k < len(dicts) else None
            lp.tokens.append(s)
            if d is None or (first_is_none and k == 0):
                lp.token_logprobs.append(None)
                lp.top_logprobs.append(None)
            else:
                lp.token_logprobs.append(logprob_value(d.get(tid)))
                top: dict[str, float] = {}
                for t, v in ranked(d):
                    key = self.st.token_str(t)
                    if key not in top:  # two ids with one text: the likelier one speaks
                        top[key] = logprob_value(v, LOGPROB_FLOOR)
                lp.top_logprobs.append(top)
            lp.text_offset.append(off)
            off += len(s)
        return lp, off

    def echo_ready(self, out: RequestOutput) -> bool:
        """False while the prompt logprobs an echo needs are still being computed (a chunked
        prefill reports them piece by piece)."""
        if not (self.body.echo and self.want_lp) or out.finished:
            return True
        plp = out.prompt_logprobs
        return plp is not None and len(plp) >= len(out.prompt_token_ids)

    def choice_delta(self, index: int, out: RequestOutput, c: CompletionOutput,
                     final: bool) -> P.CompletionChoice | None:
        """The text (and logprobs) of choice ``index`` not sent yet; None when nothing new."""
        text_parts: list[str] = []
        lps: list[P.CompletionLogprobs] = []
        off = self.offset.get(index, 0)
        if self.body.echo and index not in self.echoed:
            self.echoed.add(index)
            ptext = self.prompt_text(out)
            text_parts.append(ptext)
            if self.want_lp:
                lp, off = self._logprobs(out.prompt_token_ids, out.prompt_logprobs, off,
                                         first_is_none=True)
                lps.append(lp)
            else:
                off += len(ptext)
        if not self.drop:
            sent = self.sent_chars.get(index, 0)
            if len(c.text) > sent:
                text_parts.append(c.text[sent:])
                self.sent_chars[index] = len(c.text)
            ntok = self.sent_tokens.get(index, 0)
            if self.want_lp and len(c.token_ids) > ntok:
                new_ids = c.token_ids[ntok:]
                new_lps = c.logprobs[ntok:] if c.logprobs is not None else None
                lp, off = self._logprobs(new_ids, new_lps, off)
                lps.append(lp)
            self.sent_tokens[index] = len(c.token_ids)
        self.offset[index] = off
        finish = None
        if c.finish_reason is not None and index not in self.done:
            self.done.add(index)
            finish = "length" if self.drop else c.finish_reason
        if not text_parts and not lps and finish is None and not final:
            return None
        merged = None
        if self.want_lp:
            merged = P.CompletionLogprobs()
            for lp in lps:
                merged.tokens += lp.tokens
                merged.token_logprobs += lp.token_logprobs
                merged.top_logprobs += lp.top_logprobs
                merged.text_offset += lp.text_offset
        return P.CompletionChoice(index=index, text="".join(text_parts), logprobs=merged,
                                  finish_reason=finish,
                                  stop_reason=None if self.drop else c.stop_reason)


async def _completion_prompts(
    st: ServerState, prompt: Any
) -> list[tuple[str | None, list[int]]]:
    """(text or None, token ids) per prompt; texts are tokenized here (off the event loop when
    long), so that the engine thread never tokenizes."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise APIError(400, "prompt must not be empty", param="prompt")
    if all(isinstance(p, str) for p in prompt):
        given: list[tuple[str | None, list[int] | None]] = [(p, None) for p in prompt]
    elif all(isinstance(p, int) for p in prompt):
        given = [(None, list(prompt))]
    else:
        given = [(None, list(p)) for p in prompt]
    if len(given) > P.MAX_PROMPTS:
        raise APIError(400, f"prompt: at most {P.MAX_PROMPTS} prompts per request",
                       param="prompt")
    L = st.max_model_len
    out: list[tuple[str | None, list[int]]] = []
    for i, (text, ids) in enumerate(given):
        if ids is None:
            assert text is not None
            ids = await st.encoder.encode(text, add_special_tokens=True, param="prompt")
        else:
            if len(ids) >= L:  # before the id check: a huge list is refused at its length
                raise APIError(400, f"prompt[{i}] is {len(ids)} tokens, longer than "
                               f"max_model_len={L} minus one generated token", param="prompt")
            st.check_token_ids(ids, "prompt")
        if not ids:
            raise APIError(400, f"prompt[{i}] must not be empty", param="prompt")
        out.append((text, ids))
    return out


async def create_completion(st: ServerState, body: P.CompletionRequest, raw: Request) -> Response:
    st.check_model(body.model)
    if body.suffix:
        raise APIError(400, "suffix is not supported", param="suffix")
    if body.best_of is not None and body.best_of != body.n:
        raise APIError(400, "best_of must equal n (beam search and best-of are not supported)",
                       param="best_of")
    if isinstance(body.prompt, list) and body.prompt and not isinstance(body.prompt[0], int) \
            and len(body.prompt) * body.n > P.MAX_PROMPTS:
        raise APIError(400, f"n times the number of prompts must be at most {P.MAX_PROMPTS}",
                       param="n")
    # null means the default, as OpenAI's API has it (16), not "up to the context's end"
    max_tokens = P.DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens
    drop = False
    if max_tokens == 0:
        if not body.echo:
            raise APIError(400, "max_tokens must be at least 1 (0 is allowed only with echo)",
                           param="max_tokens")
        max_tokens, drop = 1, True
    prompt_lp = body.logprobs if body.echo else None
    spec, spec_field = structured_spec(body)
    params = sampling_params(st, body, max_tokens, body.logprobs, prompt_lp, structured=spec)
    mc = mc_overrides(st, body)
    # the cheap checks above come first: tokenizing and compiling a constraint are the costly
    # steps before the engine
    prompts = await _completion_prompts(st, body.prompt)
    if spec is not None and spec_field is not None:
        await precompile(st, spec, spec_field)
    rid = f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    subs = [(f"{rid}-{i}", text, ids) for i, (text, ids) in enumerate(prompts)]
    try:
        streams = await st.submit(subs, params, mc)
    except APIError as e:
        raise rename_param(e, spec_field) from None
    builder = _CompletionBuilder(st, body, drop)
    n = body.n

    if body.stream:
        finals: dict[int, RequestOutput] = {}

        async def chunks() -> AsyncIterator[P.CompletionChunk]:
            async for i, out in merge(streams):
                if out.finished:
                    finals[i] = out
                if not builder.echo_ready(out):
                    continue
                choices = []
                for c in out.outputs:
                    ch = builder.choice_delta(i * n + c.index, out, c, final=False)
                    if ch is not None:
                        choices.append(ch)
                if choices:
                    yield P.CompletionChunk(id=rid, created=created, model=st.served_model_name,
                                            choices=choices)

        def usage_chunk() -> P.CompletionChunk:
            return P.CompletionChunk(id=rid, created=created, model=st.served_model_name,
                                     choices=[], usage=usage(list(finals.values()), drop))

        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return stream_response(streams, chunks(), usage_chunk if include_usage else None)

    outs = await collect(raw, streams)
    if outs is None:
        return Response(status_code=499)
    choices = []
    for i, out in enumerate(outs):
        for c in out.outputs:
            ch = builder.choice_delta(i * n + c.index, out, c, final=True)
            assert ch is not None
            choices.append(ch)
    resp = P.CompletionResponse(id=rid, created=created, model=st.served_model_name,
                                choices=choices, usage=usage(outs, drop))
    return JSONResponse(resp.model_dump())

