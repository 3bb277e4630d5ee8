"""Errors in OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``.

``APIError`` carries an HTTP status and is answered as such by the app's exception handler;
``engine_error`` maps what the engine raises to one; ``validation_message`` turns pydantic's
errors into a short message without internals (validation errors are 400s here, never 422s).
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

from mcserve.errors import InvalidRequestError
from mcserve.server import protocol as P
from mcserve.server.async_engine import EngineDeadError, EngineShutdownError, RequestFailedError

RETRY_AFTER_QUEUE_S = 1
RETRY_AFTER_UNAVAILABLE_S = 5

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_error",
    503: "service_unavailable_error",
}


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


def unavailable(message: str) -> APIError:
    """A 503 that tells the client when to retry."""
    return APIError(503, message, code="unavailable",
                    headers={"Retry-After": str(RETRY_AFTER_UNAVAILABLE_S)})


def engine_error(e: BaseException) -> APIError:
    """The API error for an exception out of the engine (refusal, failure or shutdown)."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, InvalidRequestError):
        return APIError(400, str(e) or "invalid request", param=e.param)
    if isinstance(e, ValueError):
        # an untyped refusal: still the client's fault, but no field to name
        return APIError(400, str(e) or "invalid request")
    if isinstance(e, (EngineShutdownError, EngineDeadError)):
        return unavailable(str(e))
    if isinstance(e, RequestFailedError):
        return APIError(500, f"the request failed inside the engine: {e}", code="engine_error")
    return APIError(500, f"internal error: {type(e).__name__}", code="internal_error")


# --- validation errors ---------------------------------------------------------------------------

_FIELD_NAMES: set[str] = set()
for _cls in (P.CompletionRequest, P.ChatCompletionRequest, P.TokenizeRequest,
             P.DetokenizeRequest, P.ChatMessage, P.TextPart, P.StreamOptions,
             P.ToolDefinition, P.FunctionDefinition, P.NamedToolChoice, P.ToolCallIn,
             P.ToolCallFunction):
    _FIELD_NAMES.update(_cls.model_fields)

# union fields fail once per member type: these say once what would have been accepted
_EXPECTED = {
    "prompt": "a string, a list of strings, a list of token ids or a list of token-id lists",
    "stop": "a string or a list of strings",
    "content": "a string or a list of text parts",
    "tool_choice": "'none', 'auto', 'required' or {'type': 'function', 'function': {'name': …}}",
}


def _component(path: str, name: str) -> int:
    """Where field ``name`` is a whole component of ``path`` (in ``stop[0]``: yes; in
    ``stop_token_ids``: no), the last such place; -1 if nowhere."""
    i = path.rfind(name)
    while i >= 0:
        end = i + len(name)
        if (i == 0 or path[i - 1] == ".") and (end == len(path) or path[end] in ".["):
            return i
        i = path.rfind(name, 0, i)
    return -1


def validation_message(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
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
    collapsed: dict[str, list[str]] = {}
    for path, msgs in by_path.items():
        top = params.get(path)
        hits = [(i, name) for name in _EXPECTED if (i := _component(path, name)) >= 0]
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
