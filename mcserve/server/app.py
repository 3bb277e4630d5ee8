"""The OpenAI-compatible HTTP API (FastAPI) over an ``AsyncEngine``.

``build_app(engine)`` returns the app; ``mcserve serve`` runs it with uvicorn. Endpoints:
``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``, ``GET /health``,
``GET /version``, ``POST /tokenize``, ``POST /detokenize``, ``GET /metrics``. See docs/server.md.

Every error is answered in OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``:
400 bad parameters (validation errors included: no 422, no pydantic internals), 401 missing or
wrong API key, 404 unknown model or route, 405 wrong method, 413 body too large, 429 waiting queue
full (``Retry-After``), 503 shutting down (``Retry-After``), 500 only for a failure inside the
engine, which fails that request alone.

Shutdown (``drain``, which ``mcserve serve`` runs on SIGTERM before uvicorn closes anything):
``/health`` and new requests answer 503 at once, requests in flight get the grace period to
finish, the rest are aborted through the engine and answered (a 503, or a final SSE error event
and ``[DONE]``), and only then may the HTTP server close its connections.

The routes live by concern: ``serving_completion`` and ``serving_chat`` (the two generation
endpoints), ``streaming`` (SSE and what both share), ``params`` (request -> SamplingParams and MC
overrides), ``state``, ``errors``, ``middleware`` (auth, body size, and ``shape``: the caps on
a large body's lists, checked before it is parsed) and ``metrics``.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from mcserve import __version__
from mcserve.server import protocol as P
from mcserve.server.async_engine import AsyncEngine
from mcserve.server.errors import APIError, error_response, unavailable, validation_message
from mcserve.server.metrics import EngineStatsCollector, ServerMetrics
from mcserve.server.middleware import (
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_MAX_BODY_BYTES,
    GuardMiddleware,
)
from mcserve.server.serving_chat import chat_prompt, create_chat_completion
from mcserve.server.serving_completion import create_completion
from mcserve.server.shape import ShapeLimits
from mcserve.server.state import ServerState

__all__ = ["DEFAULT_BODY_TIMEOUT_S", "DEFAULT_MAX_BODY_BYTES", "DEFAULT_MAX_WAITING_REQUESTS",
           "build_app"]

logger = logging.getLogger("mcserve.server")

DEFAULT_MAX_WAITING_REQUESTS = 512
# after the grace period, how long the handlers of aborted requests get to write their answer
DRAIN_SETTLE_S = 5.0

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
    tool_call_parser: str = "auto",
    body_timeout_s: float | None = DEFAULT_BODY_TIMEOUT_S,
) -> FastAPI:
    """The OpenAI-compatible app over ``engine`` (an ``LLMEngine``, or an ``AsyncEngine``).

    The engine thread starts with the app (lifespan) or on the first request, and stops when the
    app shuts down: requests still running after ``shutdown_grace_s`` are aborted.
    ``tool_call_parser``: how tool calls are read from answers (``auto``, ``hermes``,
    ``json``; ``tool_parsers.py``). ``body_timeout_s``: the most time a request body may take
    to arrive (408 beyond; None: no limit).
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
    mc = getattr(llm, "mc", None)
    st = ServerState(
        aengine=aengine,
        served_model_name=served_model_name or llm.model_name,
        max_model_len=int(llm.config.max_model_len),
        vocab_size=vocab,
        tokenizer=tok,
        metrics=metrics,
        shutdown_grace_s=shutdown_grace_s,
        mc_variant=getattr(mc, "variant", None),
        mc_selects=getattr(mc, "selects", None),
        # the engine keeps resume points (a remote view of Ray replicas says so itself)
        resume_points=bool(getattr(llm, "resume", None) is not None
                           or getattr(llm, "keeps_resume_points", False)),
        tool_call_parser=tool_call_parser,
    )
    st.tool_parser  # noqa: B018 - an unknown parser name fails here, not on a request
    st.encoder  # noqa: B018 - builds the tokenizer's length bound now, not on a request
    metrics.registry.register(EngineStatsCollector(aengine))

    async def drain(grace_s: float | None = None, settle_s: float = DRAIN_SETTLE_S) -> int:
        """Shut the API down gracefully; returns the number of requests aborted.

        At once: ``/health`` and new requests answer 503 (``Retry-After``). Requests in flight
        get ``grace_s`` (default: ``shutdown_grace_s``) seconds to finish; the rest are aborted
        through the engine, their handlers answer them (503, or an SSE error event and
        ``[DONE]``), and ``drain`` waits up to ``settle_s`` seconds for every HTTP response to
        be sent. The engine thread keeps running (the lifespan's end stops it).
        """
        grace = st.shutdown_grace_s if grace_s is None else grace_s
        aengine.stop_accepting()
        n = aengine.num_in_flight
        if n:
            logger.info("shutting down: %d request(s) in flight get up to %.1f s to finish",
                        n, grace)
        await aengine.wait_idle(grace)
        aborted = aengine.abort_all("the server is shutting down; the request was aborted")
        if aborted:
            logger.info("shutting down: aborted %d request(s) still running after %.1f s",
                        aborted, grace)
        deadline = time.monotonic() + settle_s
        while st.http_in_flight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return aborted

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
    app.state.drain = drain
    app.add_middleware(GuardMiddleware, api_key=api_key, max_body_bytes=max_body_bytes,
                       state=st, shape=ShapeLimits(st.max_model_len, st.vocab_size),
                       body_timeout_s=body_timeout_s)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return error_response(e.status, e.message, param=e.param, code=e.code,
                              headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        message, param = validation_message(list(e.errors()))
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
    @_answered
    async def completions(body: P.CompletionRequest, raw: Request) -> Response:
        """Text completions (streamed as Server-Sent Events with ``stream: true``)."""
        return await create_completion(st, body, raw)

    @app.post("/v1/chat/completions", response_model=P.ChatCompletionResponse,
              responses=_ERROR_RESPONSES)
    @_answered
    async def chat_completions(body: P.ChatCompletionRequest, raw: Request) -> Response:
        """Chat completions through the tokenizer's chat template."""
        return await create_chat_completion(st, body, raw)

    trained = getattr(mcfg, "max_position_embeddings", None)

    def model_card() -> P.ModelCard:
        return P.ModelCard(id=st.served_model_name, created=st.created, root=llm.model_name,
                           max_model_len=st.max_model_len,
                           max_position_embeddings=int(trained) if trained else None)

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
            raise unavailable(f"the engine stopped: {aengine.dead_error}")
        if not aengine.accepting:
            raise unavailable("the server is shutting down")
        return JSONResponse({"status": "ok"})

    @app.get("/version", response_model=P.VersionResponse)
    async def version() -> P.VersionResponse:
        return P.VersionResponse(version=__version__)

    @app.post("/tokenize", response_model=P.TokenizeResponse, responses=_ERROR_RESPONSES)
    @_answered
    async def tokenize(body: P.TokenizeRequest) -> P.TokenizeResponse:
        """Token ids of ``prompt``, or of ``messages`` rendered by the chat template."""
        st.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt and messages", param="prompt")
        if body.messages is not None:
            if not body.messages:
                raise APIError(400, "messages must not be empty", param="messages")
            text = await chat_prompt(st, body.messages, body.add_generation_prompt)
            ids = await st.encoder.encode(text, add_special_tokens=False, param="messages",
                                          limit=False)
        else:
            assert body.prompt is not None
            ids = await st.encoder.encode(body.prompt,
                                          add_special_tokens=body.add_special_tokens,
                                          param="prompt", limit=False)
        return P.TokenizeResponse(count=len(ids), max_model_len=st.max_model_len, tokens=ids)

    @app.post("/detokenize", response_model=P.DetokenizeResponse, responses=_ERROR_RESPONSES)
    @_answered
    async def detokenize(body: P.DetokenizeRequest) -> P.DetokenizeResponse:
        st.check_model(body.model)
        return P.DetokenizeResponse(prompt=await st.encoder.decode(body.tokens, st.vocab_size))

    @app.get("/metrics", include_in_schema=False)
    async def prometheus_metrics() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    _strip_422(app)
    return app


def _answered(route: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    """``route`` with an unexpected exception answered as a 500 in OpenAI's shape, logged once.

    Left to Starlette's catch-all, the exception would be re-raised to the HTTP server after
    the response (a second traceback, and the keep-alive connection dropped without
    ``Connection: close``, which fails the client's next pooled request).
    """

    @functools.wraps(route)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return await route(*args, **kwargs)
        except (APIError, asyncio.CancelledError):
            raise
        except Exception as e:  # noqa: BLE001 - a bug: answer it, keep the connection
            logger.exception("unhandled error in %s", route.__name__)
            return error_response(500, f"internal error: {type(e).__name__}",
                                  code="internal_error")

    return wrapper


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
