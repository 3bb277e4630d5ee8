"""Structured outputs in a request body: OpenAI's ``response_format`` (``json_object``,
``json_schema``), vLLM's ``structured_outputs`` (``json``, ``regex``, ``choice``, ``grammar``,
``json_object``) and its older ``guided_*`` fields, turned into the engine's
``StructuredOutputsParams``; and the compile of a constraint before the request reaches the
engine, on a worker thread, so that a constraint that does not compile is a 400 naming the
field the client sent, and the engine thread finds it compiled."""

from __future__ import annotations

import asyncio
from typing import Any

from mcserve.engine.sampling_params import StructuredOutputsParams
from mcserve.errors import InvalidRequestError
from mcserve.server import protocol as P
from mcserve.server.errors import APIError
from mcserve.server.state import ServerState

ENGINE_PARAM = "structured_outputs"  # the field the engine names in its errors
# options of vLLM's structured_outputs that change nothing here: whitespace is never free, and
# a constraint that does not compile is always an error (there is no fallback backend)
_NO_OP_OPTIONS = ("disable_any_whitespace", "disable_fallback")


def _error(e: InvalidRequestError | str, field: str) -> APIError:
    """A 400 naming ``field`` for an engine error that names ``structured_outputs``."""
    message = str(e)
    if field != ENGINE_PARAM and message.startswith(ENGINE_PARAM):
        message = field + message[len(ENGINE_PARAM):]
    return APIError(400, message, param=field)


def _response_format(rf: dict[str, Any]) -> dict[str, Any] | None:
    """The constraint of OpenAI's ``response_format`` (None for ``text``)."""
    kind = rf.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict):
            raise APIError(400, "response_format: json_schema must be an object with 'name' "
                           "and 'schema'", param="response_format")
        name = spec.get("name")
        if name is not None and not isinstance(name, str):
            raise APIError(400, "response_format: json_schema.name must be a string",
                           param="response_format")
        strict = spec.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise APIError(400, "response_format: json_schema.strict must be a boolean",
                           param="response_format")
        schema = spec.get("schema")
        if schema is None:  # a name alone: any JSON object
            return {"json_object": True}
        if not isinstance(schema, dict):
            raise APIError(400, "response_format: json_schema.schema must be a JSON schema "
                           "(an object)", param="response_format")
        return {"json": schema}
    raise APIError(400, f"response_format: type must be 'text', 'json_object' or "
                   f"'json_schema', got {kind!r}", param="response_format")


def structured_spec(body: P.SamplingFields) -> tuple[StructuredOutputsParams | None, str | None]:
    """The constraint of ``body`` and the field it came from (``response_format``,
    ``structured_outputs``, ``guided_json``...); ``(None, None)`` without one. More than one
    source is a 400, as is a malformed one."""
    found: list[tuple[str, dict[str, Any]]] = []
    if body.response_format is not None:
        rf = _response_format(body.response_format)
        if rf is not None:
            found.append(("response_format", rf))
    if body.structured_outputs is not None:
        so = {k: v for k, v in body.structured_outputs.items() if k not in _NO_OP_OPTIONS}
        found.append(("structured_outputs", so))
    for field, kind in (("guided_json", "json"), ("guided_regex", "regex"),
                        ("guided_choice", "choice"), ("guided_grammar", "grammar")):
        value = getattr(body, field)
        if value is not None:
            found.append((field, {kind: value}))
    if not found:
        return None, None
    if len(found) > 1:
        raise APIError(400, f"{found[1][0]}: give one constraint per request, not "
                       f"{' and '.join(f for f, _ in found)}", param=found[1][0])
    field, spec = found[0]
    try:
        return StructuredOutputsParams(**spec), field
    except InvalidRequestError as e:
        raise _error(e, field) from None
    except TypeError:  # an unknown key of structured_outputs
        allowed = "json, regex, choice, grammar, json_object"
        raise APIError(400, f"{field}: unknown fields {sorted(map(str, spec))} (allowed: "
                       f"{allowed})", param=field) from None


async def precompile(st: ServerState, spec: StructuredOutputsParams, field: str) -> None:
    """Compile ``spec`` into the engine's cache on a worker thread (llguidance releases the
    GIL while it compiles); a constraint that does not compile is a 400 naming ``field``. An
    engine that compiles elsewhere (Ray replicas) checks it when the request arrives there."""
    compile_ = getattr(st.aengine.engine, "compile_structured", None)
    if compile_ is None:
        return
    try:
        await asyncio.to_thread(compile_, spec)
    except InvalidRequestError as e:
        raise _error(e, field) from None
    except BaseException as e:  # noqa: BLE001 - the library refused it in its own way
        # (a Rust panic arrives as pyo3's PanicException, a BaseException)
        if not isinstance(e, Exception) and type(e).__name__ != "PanicException":
            raise
        raise APIError(400, f"{field}: the constraint does not compile: {e}",
                       param=field) from None


def rename_param(e: APIError, field: str | None) -> APIError:
    """An engine refusal that names ``structured_outputs``, renamed to the client's field."""
    if field is not None and e.param == ENGINE_PARAM and field != ENGINE_PARAM:
        return _error(e.message, field)
    return e
