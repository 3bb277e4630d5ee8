"""The OpenAI-compatible HTTP API (FastAPI) over an ``AsyncEngine``.

``build_app(engine)`` returns the app; ``mcserve serve`` runs it with uvicorn. Endpoints:
``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``, ``GET /health``,
``GET /version``, ``POST /tokenize``, ``POST /detokenize``, ``GET /metrics``. See docs/server.md.

Every error is answered in OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``:
400 bad parameters (validation errors included: no 422, no pydantic internals), 401 missing or
wrong API key, 404 unknown model or route, 405 wrong method, 413 body too large, 429 waiting queue
full (``Retry-After``), 503 shutting down (``Retry-After``), 500 only for a failure inside the
engine, which fails that request alone.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mcserve import __version__
from mcserve.engine.outputs import CompletionOutput, RequestOutput
from mcserve.engine.sampling import SamplingParams
from mcserve.server import protocol as P
from mcserve.server.async_engine import (
    AsyncEngine,
    EngineDeadError,
    EngineShutdownError,
    QueueFullError,
    RequestFailedError,
    RequestStream,
)

logger = logging.getLogger("mcserve.server")

DEFAULT_MAX_BODY_BYTES = 4 * 2**20
DEFAULT_MAX_WAITING_REQUESTS = 512
RETRY_AFTER_QUEUE_S = 1
RETRY_AFTER_UNAVAILABLE_S = 5
LOGPROB_FLOOR = -9999.0  # JSON has no -inf: vLLM's stand-in
_OPEN_PATHS = ("/health", "/metrics", "/version", "/docs", "/openapi.json", "/redoc")
_AUTH_PREFIXES = ("/v1/", "/tokenize", "/detokenize")

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_error",
    503: "service_unavailable_error",
}


# --- errors --------------------------------------------------------------------------------------


class APIError(Exception):
    """An error answered in OpenAI's shape with ``status``."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers


def error_body(status: int, message: str, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": _ERROR_TYPES.get(status, "api_error"),
                      "param": param, "code": code}}


def error_response(status: int, message: str, *, param: str | None = None,
                   code: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status,
                        headers=headers)


def _param_of(message: str) -> str | None:
    """The argument a ValueError names first (SamplingParams messages start with it)."""
    word = message.split(" ", 1)[0].split("=", 1)[0].strip(":,'\"")
    return word if word in _FIELD_NAMES or word.startswith("mc_") else None


_FIELD_NAMES: set[str] = set()
for _cls in (P.CompletionRequest, P.ChatCompletionRequest, P.TokenizeRequest,
             P.DetokenizeRequest, P.ChatMessage, P.TextPart, P.StreamOptions):
    _FIELD_NAMES.update(_cls.model_fields)

_EXPECTED = {
    "prompt": "a string, a list of strings, a list of token ids or a list of token-id lists",
    "stop": "a string or a list of strings",
    "content": "a string or a list of text parts",
}


def _validation_message(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """A short message and the offending parameter for pydantic errors, without internals."""
    if not errors:
        return "invalid request", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return f"the request body is not valid JSON{': ' + str(detail) if detail else ''}", None
    by_path: dict[str, list[str]] = {}
    params: dict[str, str | None] = {}
    for err in errors:
        loc = [p for p in err.get("loc", ()) if p != "body"]
        parts: list[str] = []
        for p in loc:
            if isinstance(p, int):
                parts.append(f"[{p}]")
            elif p in _FIELD_NAMES or (not parts and isinstance(p, str) and p.isidentifier()):
                parts.append(("." if parts else "") + p)
        path = "".join(parts)
        msg = str(err.get("msg", "invalid value"))
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, "):]
        by_path.setdefault(path, [])
        if msg not in by_path[path]:
            by_path[path].append(msg)
        params.setdefault(path, next((p for p in loc if isinstance(p, str)), None))
    # a union field (prompt, stop, content) fails once per member type: say it once
    collapsed: dict[str, list[str]] = {}
    for path, msgs in by_path.items():
        top = params.get(path)
        hits = [(path.rfind(name), name) for name in _EXPECTED if name in path]
        if hits:
            i, name = max(hits)
            key = path[:i + len(name)]
            if len(msgs) > 1 or key in collapsed or key != path:
                collapsed[key] = [f"invalid value, expected {_EXPECTED[name]}"]
                params.setdefault(key, top)
                continue
        if path not in collapsed:
            collapsed[path] = msgs
    pieces = []
    for path, msgs in list(collapsed.items())[:3]:
        if not path:
            if any("required" in m for m in msgs):
                pieces.append("the request body is missing: send a JSON object")
            elif any("dictionary" in m or "object" in m for m in msgs):
                pieces.append("the request body must be a JSON object "
                              "(Content-Type: application/json)")
            else:
                pieces.append(msgs[0])
            continue
        pieces.append(f"{path}: {msgs[0]}")
    return "; ".join(pieces), params.get(next(iter(collapsed)))


# --- middleware ----------------------------------------------------------------------------------


class GuardMiddleware:
    """API-key check (401) and request-body size limit (413), before any parsing."""

    def __init__(self, app: ASGIApp, *, api_key: str | None, max_body_bytes: int):
        self.app = app
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope.get("path", "")
        if self.api_key is not None and path.startswith(_AUTH_PREFIXES):
            if not self._authorised(scope):
                resp = error_response(401, "missing or invalid API key: send the header "
                                      "'Authorization: Bearer <key>'", code="invalid_api_key",
                                      headers={"WWW-Authenticate": "Bearer"})
                await resp(scope, receive, send)
                return
        if scope.get("method") in ("POST", "PUT", "PATCH"):
            too_large = error_response(
                413, f"the request body is larger than {self.max_body_bytes} bytes",
                code="request_too_large")
            for name, value in scope.get("headers", []):
                if name == b"content-length":
                    try:
                        declared = int(value)
                    except ValueError:
                        declared = 0
                    if declared > self.max_body_bytes:
                        await too_large(scope, receive, send)
                        return
            chunks: list[bytes] = []
            size = 0
            while True:
                message = await receive()
                if message["type"] != "http.request":  # disconnected while sending
                    return
                body = message.get("body", b"")
                size += len(body)
                if size > self.max_body_bytes:
                    await too_large(scope, receive, send)
                    return
                chunks.append(body)
                if not message.get("more_body", False):
                    break
            body = b"".join(chunks)
            scope = _json_content_type(scope, body)
            replay: list[Message] = [{"type": "http.request", "body": body,
                                      "more_body": False}]

            async def replay_receive() -> Message:
                if replay:
                    return replay.pop()
                return await receive()

            await self.app(scope, replay_receive, send)
            return
        await self.app(scope, receive, send)

    def _authorised(self, scope: Scope) -> bool:
        assert self.api_key is not None
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                text = value.decode("latin-1").strip()
                scheme, _, token = text.partition(" ")
                if scheme.lower() == "bearer" and hmac.compare_digest(
                        token.strip().encode(), self.api_key.encode()):
                    return True
            elif name == b"x-api-key":
                if hmac.compare_digest(value.strip(), self.api_key.encode()):
                    return True
        return False


def _json_content_type(scope: Scope, body: bytes) -> Scope:
    """Treat a JSON object sent without ``Content-Type: application/json`` (curl -d sends
    ``application/x-www-form-urlencoded``) as JSON, as OpenAI-style servers are used that way."""
    headers = scope.get("headers", [])
    ctype = next((v for k, v in headers if k == b"content-type"), None)
    if ctype is not None and not ctype.startswith(b"application/x-www-form-urlencoded"):
        return scope
    if not body.lstrip().startswith(b"{"):
        return scope
    new = [(k, v) for k, v in headers if k != b"content-type"]
    new.append((b"content-type", b"application/json"))
    return {**scope, "headers": new}


# --- metrics -------------------------------------------------------------------------------------


class _EngineStatsCollector(Collector):
    """Exposes the engine's ``stats()`` snapshot under vLLM-style names (prefix ``mcserve:``)."""

    def __init__(self, aengine: AsyncEngine):
        self.aengine = aengine

    def collect(self) -> Iterable[Any]:
        s = self.aengine.stats()

        def num(key: str, default: float = 0.0) -> float:
            v = s.get(key, default)
            return float(v) if isinstance(v, (int, float)) else default

        yield GaugeMetricFamily("mcserve:num_requests_running",
                                "Requests being computed by the engine.",
                                value=num("num_requests_running"))
        yield GaugeMetricFamily("mcserve:num_requests_waiting",
                                "Requests waiting to be scheduled.",
                                value=num("num_requests_waiting"))
        tiers = _tiers(s)
        used_g = GaugeMetricFamily("mcserve:state_blocks_used",
                                   "Memory-state blocks in use (cached segment checkpoints).",
                                   labels=["tier"])
        total_g = GaugeMetricFamily("mcserve:state_blocks_total",
                                    "Memory-state blocks in the pool.", labels=["tier"])
        for tier, (used, total) in tiers.items():
            used_g.add_metric([tier], used)
            total_g.add_metric([tier], total)
        yield used_g
        yield total_g
        dev_used, dev_total = tiers.get("device", (0.0, 0.0))
        yield GaugeMetricFamily("mcserve:state_cache_usage_perc",
                                "Fraction of the device state-block pool in use (0..1).",
                                value=dev_used / dev_total if dev_total else 0.0)
        for key, name, doc in (
            ("prefix_cache_queries", "prefix_cache_queries", "Prefix-cache block lookups."),
            ("prefix_cache_hits", "prefix_cache_hits", "Prefix-cache block hits."),
            ("prompt_tokens_total", "prompt_tokens", "Prompt tokens taken by the engine."),
            ("generation_tokens_total", "generation_tokens", "Tokens generated."),
            ("num_preemptions", "num_preemptions", "Sequences preempted."),
            ("num_swaps", "num_swaps", "Preempted sequences swapped to the host tier."),
            ("host_bytes_moved", "host_bytes_moved",
             "Bytes of memory states moved between the host tier and the device (swaps, "
             "ssc offloads and fetches of selected blocks)."),
        ):
            yield CounterMetricFamily(f"mcserve:{name}", doc, value=num(key))


def _tiers(s: dict[str, Any]) -> dict[str, tuple[float, float]]:
    """{tier: (used, total)} from the stats: ints mean the device tier; dicts are per tier."""
    used, total = s.get("state_blocks_used", 0), s.get("state_blocks_total", 0)
    out: dict[str, tuple[float, float]] = {}
    if isinstance(used, dict) or isinstance(total, dict):
        u = used if isinstance(used, dict) else {"device": used}
        t = total if isinstance(total, dict) else {"device": total}
        for tier in sorted(set(u) | set(t)):
            out[str(tier)] = (float(u.get(tier, 0)), float(t.get(tier, 0)))
    else:
        out["device"] = (float(used or 0), float(total or 0))
    if "host_blocks_used" in s or "host_blocks_total" in s:
        out["host"] = (float(s.get("host_blocks_used", 0) or 0),
                       float(s.get("host_blocks_total", 0) or 0))
    return out


class ServerMetrics:
    """The app's Prometheus registry (one per app) and the per-request histograms."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.ttft = Histogram(
            "mcserve:time_to_first_token_seconds", "Time to first token.", registry=r,
            buckets=(0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                     2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0))
        self.itl = Histogram(
            "mcserve:inter_token_latency_seconds", "Time between two outputs of a request.",
            registry=r,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
                     0.5, 0.75, 1.0, 2.5, 5.0, 10.0))
        self.e2e = Histogram(
            "mcserve:e2e_request_latency_seconds", "Arrival to finish of a request.",
            registry=r,
            buckets=(0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                     40.0, 50.0, 60.0, 120.0, 240.0, 480.0))
        self.queue = Histogram(
            "mcserve:request_queue_time_seconds",
            "Arrival to the start of the engine step that first scheduled the request.",
            registry=r,
            buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0))
        self.success = Counter(
            "mcserve:request_success", "Finished requests by finish reason.",
            ["finished_reason"], registry=r)

    # RequestMetricsSink (called from the engine thread; prometheus_client is thread-safe)
    def observe_queue_time(self, seconds: float) -> None:
        self.queue.observe(seconds)

    def observe_ttft(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def observe_itl(self, seconds: float) -> None:
        self.itl.observe(seconds)

    def observe_e2e(self, seconds: float) -> None:
        self.e2e.observe(seconds)

    def count_finished(self, reason: str) -> None:
        self.success.labels(finished_reason=reason).inc()


# --- server state --------------------------------------------------------------------------------


@dataclass
class ServerState:
    aengine: AsyncEngine
    served_model_name: str
    max_model_len: int
    vocab_size: int
    tokenizer: Any
    metrics: ServerMetrics
    shutdown_grace_s: float = 5.0
    created: int = field(default_factory=lambda: int(time.time()))
    _token_str: dict[int, str] = field(default_factory=dict)

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.served_model_name:
            raise APIError(404, f"the model '{model}' does not exist; this server serves "
                           f"'{self.served_model_name}' (GET /v1/models)",
                           param="model", code="model_not_found")

    def token_str(self, token_id: int) -> str:
        s = self._token_str.get(token_id)
        if s is None:
            try:
                s = self.tokenizer.decode([token_id], skip_special_tokens=False)
            except TypeError:
                s = self.tokenizer.decode([token_id])
            if len(self._token_str) < 1_000_000:
                self._token_str[token_id] = s
        return s

    def check_token_ids(self, ids: list[int], param: str) -> None:
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise APIError(400, f"{param}: token id {bad} is out of range [0, "
                           f"{self.vocab_size})", param=param)

    async def submit(
        self, requests: list[tuple[str, str | None, list[int] | None]], params: SamplingParams,
        mc_overrides: dict[str, Any] | None,
    ) -> list[RequestStream]:
        """Queue the requests and wait until the engine took them all (or refused one)."""
        try:
            streams = self.aengine.submit_many(requests, params, mc_overrides=mc_overrides)
        except QueueFullError as e:
            raise APIError(429, str(e), code="queue_full",
                           headers={"Retry-After": str(RETRY_AFTER_QUEUE_S)}) from None
        except (EngineShutdownError, EngineDeadError) as e:
            raise APIError(503, str(e), code="unavailable",
                           headers={"Retry-After": str(RETRY_AFTER_UNAVAILABLE_S)}) from None
        try:
            results = await asyncio.gather(*(s.wait_accepted() for s in streams),
                                           return_exceptions=True)
        except BaseException:
            for s in streams:
                s.abort()
            raise
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            for s in streams:
                s.abort()
            raise _engine_error(errors[0], mc_overrides or ())
        return streams


def _engine_error(e: BaseException, mc_keys: Iterable[str] = ()) -> APIError:
    if isinstance(e, APIError):
        return e
    if isinstance(e, ValueError):
        msg = str(e) or "invalid request"
        param = _param_of(msg)
        if param is None:
            if msg.startswith("prompt"):
                param = "prompt"
            elif "max_model_len" in msg:
                param = "max_tokens"
            else:
                param = next((k for k in mc_keys if k in msg), None)
        return APIError(400, msg, param=param)
    if isinstance(e, (EngineShutdownError, EngineDeadError)):
        return APIError(503, str(e), code="unavailable",
                        headers={"Retry-After": str(RETRY_AFTER_UNAVAILABLE_S)})
    if isinstance(e, RequestFailedError):
        return APIError(500, f"the request failed inside the engine: {e}", code="engine_error")
    return APIError(500, f"internal error: {type(e).__name__}", code="internal_error")


# --- helpers -------------------------------------------------------------------------------------


def _lp(x: float | None) -> float | None:
    if x is None:
        return None
    x = float(x)
    if math.isnan(x):
        return None
    return max(x, LOGPROB_FLOOR)


def _sse(payload: dict[str, Any] | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


async def _merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
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


async def _collect(raw: Request, streams: list[RequestStream]) -> list[RequestOutput] | None:
    """The final output of each stream; None if the client went away (requests aborted)."""
    finals: list[RequestOutput | None] = [None] * len(streams)

    async def run() -> None:
        async for i, out in _merge(streams):
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
        raise _engine_error(exc)
    return [f for f in finals if f is not None]


def _usage(outs: list[RequestOutput], drop_generated: bool) -> P.UsageInfo:
    prompt = sum(len(o.prompt_token_ids) for o in outs)
    completion = 0 if drop_generated else sum(len(c.token_ids) for o in outs for c in o.outputs)
    cached = sum(o.num_cached_tokens or 0 for o in outs)
    return P.UsageInfo(prompt_tokens=prompt, completion_tokens=completion,
                       total_tokens=prompt + completion,
                       prompt_tokens_details=P.PromptTokensDetails(cached_tokens=cached))


def _stop_and_finish(
    st: ServerState, body: P.SamplingFields, max_tokens: int | None, logprobs: int | None,
    prompt_logprobs: int | None,
) -> SamplingParams:
    if body.logit_bias:
        raise APIError(400, "logit_bias is not supported", param="logit_bias")
    if body.stream_options is not None and not body.stream:
        raise APIError(400, "stream_options is only allowed when stream is true",
                       param="stream_options")
    if max_tokens is not None and max_tokens > st.max_model_len:
        raise APIError(400, f"max_tokens={max_tokens} is more than the model's context "
                       f"(max_model_len={st.max_model_len})", param="max_tokens")
    if body.stop_token_ids:
        st.check_token_ids(body.stop_token_ids, "stop_token_ids")
    kw: dict[str, Any] = {
        "n": body.n, "max_tokens": max_tokens,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "top_k": 0 if body.top_k is None else body.top_k,
        "min_p": 0.0 if body.min_p is None else body.min_p,
        "seed": body.seed, "stop": body.stop, "stop_token_ids": body.stop_token_ids,
        "ignore_eos": body.ignore_eos,
        "presence_penalty": body.presence_penalty or 0.0,
        "frequency_penalty": body.frequency_penalty or 0.0,
        "repetition_penalty": 1.0 if body.repetition_penalty is None
        else body.repetition_penalty,
        "logprobs": logprobs, "prompt_logprobs": prompt_logprobs,
        "include_stop_str_in_output": body.include_stop_str_in_output,
        "skip_special_tokens": body.skip_special_tokens,
    }
    try:
        return SamplingParams(**kw)
    except (ValueError, TypeError) as e:
        raise APIError(400, str(e), param=_param_of(str(e))) from None


_MC_EXTRA_KEYS = ("segment_len",)


def _mc_overrides(body: P.OpenAIModel) -> dict[str, Any] | None:
    mc = body.mc_fields()
    for key in _MC_EXTRA_KEYS:
        if body.model_extra and key in body.model_extra:
            mc[key] = body.model_extra[key]
    for key, value in mc.items():
        if not isinstance(value, (int, float, str, bool)) or (
                isinstance(value, float) and not math.isfinite(value)):
            raise APIError(400, f"{key} must be a number, a string or a boolean", param=key)
    return mc or None


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


def _chat_prompt(st: ServerState, msgs: list[P.ChatMessage], add_generation_prompt: bool) -> str:
    try:
        return st.tokenizer.apply_chat_template(
            _messages(msgs), add_generation_prompt=add_generation_prompt)
    except ValueError as e:
        raise APIError(400, str(e), param="messages") from None


# --- completions ---------------------------------------------------------------------------------


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

    def _logprobs(self, ids: list[int], dicts: list[dict[int, float] | None] | None,
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
                lp.token_logprobs.append(_lp(d.get(tid)))
                top: dict[str, float] = {}
                for t, v in sorted(d.items(), key=lambda kv: -kv[1]):
                    key = self.st.token_str(t)
                    if key not in top:
                        top[key] = _lp(v) or LOGPROB_FLOOR
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


def _completion_prompts(st: ServerState, prompt: Any) -> list[tuple[str | None, list[int] | None]]:
    if isinstance(prompt, str):
        return [(prompt, None)]
    if not prompt:
        raise APIError(400, "prompt must not be empty", param="prompt")
    if all(isinstance(p, str) for p in prompt):
        out: list[tuple[str | None, list[int] | None]] = [(p, None) for p in prompt]
    elif all(isinstance(p, int) for p in prompt):
        out = [(None, list(prompt))]
    else:
        out = [(None, list(p)) for p in prompt]
    if len(out) > P.MAX_PROMPTS:
        raise APIError(400, f"prompt: at most {P.MAX_PROMPTS} prompts per request",
                       param="prompt")
    for i, (_, ids) in enumerate(out):
        if ids is not None:
            if not ids:
                raise APIError(400, f"prompt[{i}] must not be empty", param="prompt")
            st.check_token_ids(ids, "prompt")
    return out


async def create_completion(st: ServerState, body: P.CompletionRequest, raw: Request) -> Response:
    st.check_model(body.model)
    if body.suffix:
        raise APIError(400, "suffix is not supported", param="suffix")
    if body.best_of is not None and body.best_of != body.n:
        raise APIError(400, "best_of must equal n (beam search and best-of are not supported)",
                       param="best_of")
    prompts = _completion_prompts(st, body.prompt)
    if len(prompts) * body.n > P.MAX_PROMPTS:
        raise APIError(400, f"n times the number of prompts must be at most {P.MAX_PROMPTS}",
                       param="n")
    max_tokens = body.max_tokens
    drop = False
    if max_tokens == 0:
        if not body.echo:
            raise APIError(400, "max_tokens must be at least 1 (0 is allowed only with echo)",
                           param="max_tokens")
        max_tokens, drop = 1, True
    prompt_lp = body.logprobs if body.echo else None
    params = _stop_and_finish(st, body, max_tokens, body.logprobs, prompt_lp)
    mc = _mc_overrides(body)
    rid = f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    subs = [(f"{rid}-{i}", text, ids) for i, (text, ids) in enumerate(prompts)]
    streams = await st.submit(subs, params, mc)
    builder = _CompletionBuilder(st, body, drop)
    n = body.n

    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        async def events() -> AsyncIterator[str]:
            finals: dict[int, RequestOutput] = {}
            try:
                async for i, out in _merge(streams):
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
                        chunk = P.CompletionChunk(id=rid, created=created,
                                                  model=st.served_model_name, choices=choices)
                        yield _sse(chunk.model_dump(exclude_none=False))
                if include_usage:
                    usage = _usage(list(finals.values()), drop)
                    chunk = P.CompletionChunk(id=rid, created=created,
                                              model=st.served_model_name, choices=[],
                                              usage=usage)
                    yield _sse(chunk.model_dump())
            except Exception as e:  # noqa: BLE001 - fail this stream in-band
                err = _engine_error(e)
                yield _sse(error_body(err.status, err.message, err.param, err.code))
            finally:
                for s in streams:
                    s.abort()
            yield _sse("[DONE]")

        return _streaming_response(events())

    outs = await _collect(raw, streams)
    if outs is None:
        return Response(status_code=499)
    choices = []
    for i, out in enumerate(outs):
        for c in out.outputs:
            ch = builder.choice_delta(i * n + c.index, out, c, final=True)
            assert ch is not None
            choices.append(ch)
    resp = P.CompletionResponse(id=rid, created=created, model=st.served_model_name,
                                choices=choices, usage=_usage(outs, drop))
    return JSONResponse(resp.model_dump())


def _streaming_response(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


# --- chat ----------------------------------------------------------------------------------------


def _chat_logprobs(st: ServerState, ids: list[int], dicts: list[dict[int, float]] | None,
                   top_n: int) -> P.ChatLogprobs:
    entries = []
    for k, tid in enumerate(ids):
        d = dicts[k] if dicts is not None and k < len(dicts) else {}
        s = st.token_str(tid)
        tops = [
            P.ChatLogprobTop(token=st.token_str(t), logprob=_lp(v) or LOGPROB_FLOOR,
                             bytes=list(st.token_str(t).encode("utf-8")))
            for t, v in sorted(d.items(), key=lambda kv: -kv[1])[:top_n]
        ]
        entries.append(P.ChatLogprobEntry(
            token=s, logprob=_lp(d.get(tid)) if d.get(tid) is not None else LOGPROB_FLOOR,
            bytes=list(s.encode("utf-8")), top_logprobs=tops))
    return P.ChatLogprobs(content=entries)


async def create_chat_completion(
    st: ServerState, body: P.ChatCompletionRequest, raw: Request
) -> Response:
    st.check_model(body.model)
    if body.tools and body.tool_choice != "none":
        raise APIError(400, "tools are not supported", param="tools")
    if body.response_format and body.response_format.get("type", "text") != "text":
        raise APIError(400, "response_format: only {'type': 'text'} is supported",
                       param="response_format")
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs requires logprobs=true", param="top_logprobs")
    prompt = _chat_prompt(st, body.messages, body.add_generation_prompt)
    ids = st.tokenizer.encode(prompt, add_special_tokens=False)
    if not ids:
        raise APIError(400, "messages: the chat template rendered an empty prompt",
                       param="messages")
    if len(ids) >= st.max_model_len:
        raise APIError(400, f"the prompt is {len(ids)} tokens, longer than max_model_len="
                       f"{st.max_model_len} minus one generated token", param="messages")
    max_tokens = body.max_completion_tokens or body.max_tokens
    if max_tokens is None:
        max_tokens = st.max_model_len - len(ids)
    top_n = body.top_logprobs or 0
    params = _stop_and_finish(st, body, max_tokens, top_n if body.logprobs else None, None)
    mc = _mc_overrides(body)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    streams = await st.submit([(rid, prompt, ids)], params, mc)
    model = st.served_model_name

    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        async def events() -> AsyncIterator[str]:
            sent_chars: dict[int, int] = {}
            sent_tokens: dict[int, int] = {}
            final: RequestOutput | None = None
            try:
                first = [P.ChatStreamChoice(index=i, delta=P.DeltaMessage(role="assistant",
                                                                          content=""))
                         for i in range(body.n)]
                yield _sse(P.ChatCompletionChunk(id=rid, created=created, model=model,
                                                 choices=first).model_dump())
                async for _, out in _merge(streams):
                    if out.finished:
                        final = out
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
                        yield _sse(P.ChatCompletionChunk(id=rid, created=created, model=model,
                                                         choices=choices).model_dump())
                if include_usage and final is not None:
                    yield _sse(P.ChatCompletionChunk(
                        id=rid, created=created, model=model, choices=[],
                        usage=_usage([final], False)).model_dump())
            except Exception as e:  # noqa: BLE001 - fail this stream in-band
                err = _engine_error(e)
                yield _sse(error_body(err.status, err.message, err.param, err.code))
            finally:
                for s in streams:
                    s.abort()
            yield _sse("[DONE]")

        return _streaming_response(events())

    outs = await _collect(raw, streams)
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
                                    usage=_usage([out], False))
    return JSONResponse(resp.model_dump())


# --- the app -------------------------------------------------------------------------------------

_ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {"model": P.ErrorResponse, "description": "Invalid request"},
    401: {"model": P.ErrorResponse, "description": "Missing or wrong API key"},
    404: {"model": P.ErrorResponse, "description": "Unknown model"},
    413: {"model": P.ErrorResponse, "description": "Request body too large"},
    429: {"model": P.ErrorResponse, "description": "Waiting queue full (Retry-After)"},
    503: {"model": P.ErrorResponse, "description": "Shutting down (Retry-After)"},
}


def build_app(
    engine: Any,
    *,
    api_key: str | None = None,
    served_model_name: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_waiting_requests: int | None = DEFAULT_MAX_WAITING_REQUESTS,
    shutdown_grace_s: float = 5.0,
) -> FastAPI:
    """The OpenAI-compatible app over ``engine`` (an ``LLMEngine``, or an ``AsyncEngine``).

    The engine thread starts with the app (lifespan) or on the first request, and stops when the
    app shuts down: requests still running after ``shutdown_grace_s`` are aborted.
    """
    metrics = ServerMetrics()
    if isinstance(engine, AsyncEngine):
        aengine = engine
        aengine.metrics = aengine.metrics or metrics
        if max_waiting_requests is not None:
            aengine.max_waiting_requests = max_waiting_requests
    else:
        aengine = AsyncEngine(engine, max_waiting_requests=max_waiting_requests, metrics=metrics)
    llm = aengine.engine
    tok = llm.tokenizer
    mcfg = getattr(llm, "model_config", None)
    vocab = int(getattr(mcfg, "vocab_size", 0) or getattr(tok, "vocab_size", 0) or 2**31)
    st = ServerState(
        aengine=aengine,
        served_model_name=served_model_name or llm.model_name,
        max_model_len=int(llm.config.max_model_len),
        vocab_size=vocab,
        tokenizer=tok,
        metrics=metrics,
        shutdown_grace_s=shutdown_grace_s,
    )
    metrics.registry.register(_EngineStatsCollector(aengine))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        aengine.start()
        try:
            yield
        finally:
            await aengine.shutdown(st.shutdown_grace_s)

    app = FastAPI(title="mcserve", version=__version__, lifespan=lifespan,
                  description="OpenAI-compatible API of mcserve (recurrent LMs with Memory "
                  "Caching).")
    app.state.server = st
    app.state.async_engine = aengine
    app.add_middleware(GuardMiddleware, api_key=api_key, max_body_bytes=max_body_bytes)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return error_response(e.status, e.message, param=e.param, code=e.code,
                              headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(list(e.errors()))
        return error_response(400, message, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        if e.status_code == 404:
            msg = f"no route {request.method} {request.url.path}"
        elif e.status_code == 405:
            msg = f"method {request.method} is not allowed on {request.url.path}"
        else:
            msg = str(e.detail)
        return error_response(e.status_code, msg, headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, e: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return error_response(500, f"internal error: {type(e).__name__}",
                              code="internal_error")

    @app.post("/v1/completions", response_model=P.CompletionResponse,
              responses=_ERROR_RESPONSES)
    async def completions(body: P.CompletionRequest, raw: Request) -> Response:
        """Text completions (streamed as Server-Sent Events with ``stream: true``)."""
        return await create_completion(st, body, raw)

    @app.post("/v1/chat/completions", response_model=P.ChatCompletionResponse,
              responses=_ERROR_RESPONSES)
    async def chat_completions(body: P.ChatCompletionRequest, raw: Request) -> Response:
        """Chat completions through the tokenizer's chat template."""
        return await create_chat_completion(st, body, raw)

    def model_card() -> P.ModelCard:
        return P.ModelCard(id=st.served_model_name, created=st.created, root=llm.model_name,
                           max_model_len=st.max_model_len)

    @app.get("/v1/models", response_model=P.ModelList, responses=_ERROR_RESPONSES)
    async def models() -> P.ModelList:
        return P.ModelList(data=[model_card()])

    @app.get("/v1/models/{model_id:path}", response_model=P.ModelCard,
             responses=_ERROR_RESPONSES)
    async def model(model_id: str) -> P.ModelCard:
        st.check_model(model_id)
        return model_card()

    @app.get("/health")
    async def health() -> JSONResponse:
        """200 while the engine thread is alive; 503 when it died or the server shuts down."""
        if aengine.dead_error is not None:
            return error_response(503, f"the engine stopped: {aengine.dead_error}",
                                  code="unavailable",
                                  headers={"Retry-After": str(RETRY_AFTER_UNAVAILABLE_S)})
        if not aengine.accepting:
            return error_response(503, "the server is shutting down", code="unavailable",
                                  headers={"Retry-After": str(RETRY_AFTER_UNAVAILABLE_S)})
        return JSONResponse({"status": "ok"})

    @app.get("/version", response_model=P.VersionResponse)
    async def version() -> P.VersionResponse:
        return P.VersionResponse(version=__version__)

    @app.post("/tokenize", response_model=P.TokenizeResponse, responses=_ERROR_RESPONSES)
    async def tokenize(body: P.TokenizeRequest) -> P.TokenizeResponse:
        """Token ids of ``prompt``, or of ``messages`` rendered by the chat template."""
        st.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt and messages", param="prompt")
        if body.messages is not None:
            if not body.messages:
                raise APIError(400, "messages must not be empty", param="messages")
            text = _chat_prompt(st, body.messages, body.add_generation_prompt)
            ids = tok.encode(text, add_special_tokens=False)
        else:
            assert body.prompt is not None
            ids = tok.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        return P.TokenizeResponse(count=len(ids), max_model_len=st.max_model_len,
                                  tokens=list(ids))

    @app.post("/detokenize", response_model=P.DetokenizeResponse, responses=_ERROR_RESPONSES)
    async def detokenize(body: P.DetokenizeRequest) -> P.DetokenizeResponse:
        st.check_model(body.model)
        st.check_token_ids(body.tokens, "tokens")
        return P.DetokenizeResponse(prompt=tok.decode(body.tokens))

    @app.get("/metrics", include_in_schema=False)
    async def prometheus_metrics() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    _strip_422(app)
    return app


def _strip_422(app: FastAPI) -> None:
    """The OpenAPI schema without FastAPI's 422 responses (validation errors are 400s here)."""
    original = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = original()
            for path in schema.get("paths", {}).values():
                for op in path.values():
                    if isinstance(op, dict):
                        op.get("responses", {}).pop("422", None)
            comps = schema.get("components", {}).get("schemas", {})
            comps.pop("HTTPValidationError", None)
            comps.pop("ValidationError", None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
