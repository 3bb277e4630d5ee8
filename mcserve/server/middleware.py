"""ASGI middleware run before any parsing: the API-key check (401), the request-body size
limit (413), the time to receive the whole body (408: a client that stalls half-way through its
body is not held open for ever) and, for a large body, the caps on its shape (400,
``shape.py``), so that neither an unauthorised client, nor an oversized body, nor 4 MiB of tiny
JSON values costs a JSON parse.
It also counts the HTTP requests whose response is not fully sent (a shutdown waits for them)
and, once the server drains, asks clients to close their connection after each response."""

from __future__ import annotations

import asyncio
import hmac
from typing import Protocol

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mcserve.server.errors import error_response
from mcserve.server.shape import ShapeLimits, check_shape

DEFAULT_MAX_BODY_BYTES = 4 * 2**20
DEFAULT_BODY_TIMEOUT_S = 60.0  # to receive a whole request body, from its first byte asked for
# routes behind the API key; /health, /metrics, /version and the docs stay open to probes
_AUTH_PREFIXES = ("/v1/", "/tokenize", "/detokenize")


class InFlight(Protocol):
    """What the middleware updates: ``ServerState``."""

    http_in_flight: int

    @property
    def draining(self) -> bool: ...


class GuardMiddleware:
    """API-key check (401), request-body size limit (413), body receive time limit (408;
    ``body_timeout_s`` None or 0: none) and, with ``shape``, the caps on a large body's shape
    (400), before any parsing."""

    def __init__(self, app: ASGIApp, *, api_key: str | None, max_body_bytes: int,
                 state: InFlight | None = None, shape: ShapeLimits | None = None,
                 body_timeout_s: float | None = DEFAULT_BODY_TIMEOUT_S):
        self.app = app
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.state = state
        self.shape = shape
        self.body_timeout_s = body_timeout_s or None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        st = self.state
        if st is None:
            await self._guard(scope, receive, send)
            return
        st.http_in_flight += 1

        async def send_closing(message: Message) -> None:
            # while draining, no connection is kept alive for a next request: the client
            # opens a new one, which finds the server gone or answering 503
            if message["type"] == "http.response.start" and st.draining:
                headers = [(k, v) for k, v in message.get("headers", [])
                           if k.lower() != b"connection"]
                message = {**message, "headers": [*headers, (b"connection", b"close")]}
            await send(message)

        try:
            await self._guard(scope, receive, send_closing)
        finally:
            st.http_in_flight -= 1

    async def _guard(self, scope: Scope, receive: Receive, send: Send) -> None:
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
            loop = asyncio.get_running_loop()
            deadline = None if self.body_timeout_s is None else loop.time() + self.body_timeout_s
            while True:
                if deadline is None:
                    message = await receive()
                else:
                    try:
                        message = await asyncio.wait_for(receive(), deadline - loop.time())
                    except asyncio.TimeoutError:
                        slow = error_response(
                            408, f"the request body did not arrive within "
                            f"{self.body_timeout_s:g} s", code="request_timeout",
                            headers={"Connection": "close"})
                        await slow(scope, receive, send)
                        return
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
            if self.shape is not None:
                over = check_shape(path, body, self.shape)
                if over is not None:
                    await error_response(400, over.message, param=over.param)(
                        scope, receive, send)
                    return
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
