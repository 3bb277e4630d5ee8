"""Tool calls in a chat answer: the formats models write them in, parsed into OpenAI's
``tool_calls``, and the constraint that makes a model write one (``tool_choice`` ``required`` or
a named function).

* ``hermes``: ``<tool_call>\\n{"name": …, "arguments": {…}}\\n</tool_call>`` blocks, any text
  before the first (Hermes, Qwen 2.5/3, Granite and many other templates);
* ``json``: the whole answer is one JSON object ``{"name": …, "arguments": {…}}`` (or
  ``"parameters"``), or a list of them, optionally in a ```json fence.

``choose_parser("auto", template)`` takes ``hermes`` when the chat template mentions
``<tool_call>``, else ``json``. A call whose name is not one of the request's tools is not a tool
call (the text stays content). A call's ``arguments`` are the model's own JSON text of them
(``scan_call`` finds it, in a finished answer or in one still being written, so that a stream
can send it piece by piece and the pieces add up to what the whole answer reports).
Torch-free, like every server module.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from mcserve.engine.sampling_params import JSON_OPTIONS

__all__ = ["PARSERS", "CallScan", "HermesParser", "closed_schema", "JsonParser", "ParsedCall",
           "ToolParser", "choose_parser", "scan_call", "tool_call_id"]


def tool_call_id() -> str:
    """A new tool call id, OpenAI style: ``call_`` and 24 hex digits."""
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ParsedCall:
    name: str
    arguments: str  # JSON text of an object
    id: str = field(default_factory=tool_call_id)
    pos: int = -1  # which call object of the answer (``ToolParser.call_texts``) it came from


@dataclass
class CallScan:
    """What ``scan_call`` read of one call object, finished or not."""

    name: str | None = None  # the "name" value, once its string is closed
    args: tuple[int, int] | None = None  # span of the arguments value read so far
    args_kind: str | None = None  # its first character: "{" for an object
    args_closed: bool = False
    end: int | None = None  # just past the object's closing brace, once read


_ARG_KEYS = ("arguments", "parameters")


def scan_call(s: str) -> CallScan:
    """Read the call object that ``s`` begins with (``{``; ``s`` may stop anywhere inside it):
    its name once written, and where its arguments' value lies, as far as it is written. Only
    the object's own keys count; nested ones are skipped."""
    out = CallScan()
    if not s.startswith("{"):
        return out
    depth, in_str, esc = 0, False, False
    mode, key, str_start, val_start = "key", None, 0, None
    for i, ch in enumerate(s):
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
                if depth == 1:
                    token = s[str_start:i + 1]
                    if mode == "key":
                        key, mode = _decode(token), "colon"
                    elif mode == "value" and val_start == str_start and key == "name":
                        name = _decode(token)
                        out.name = name if isinstance(name, str) else None
                if depth == 1 and key in _ARG_KEYS and val_start == str_start and \
                        out.args is not None and mode == "value":
                    out.args, out.args_closed = (val_start, i + 1), True
            continue
        if ch == '"':
            in_str, str_start = True, i
        if depth == 1 and mode == "value_start" and not ch.isspace():
            val_start, mode = i, "value"
            if key in _ARG_KEYS and out.args is None:
                out.args, out.args_kind = (i, i), ch
        if ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 1 and key in _ARG_KEYS and out.args is not None \
                    and out.args[0] == val_start and not out.args_closed:
                out.args, out.args_closed = (val_start, i + 1), True
            if depth == 0:
                out.end = i + 1
                break
        elif depth == 1 and not in_str:
            if mode == "colon" and ch == ":":
                mode = "value_start"
            elif mode == "value" and ch == ",":
                mode, key = "key", None
    if out.args is not None and not out.args_closed:
        out.args = (out.args[0], len(s) if out.end is None else out.end - 1)
    return out


def _decode(token: str) -> Any:
    try:
        return json.loads(token)
    except ValueError:
        return None


def _call(obj: Any, names: set[str], text: str | None = None, pos: int = -1
          ) -> ParsedCall | None:
    """One call from a decoded ``{"name", "arguments" | "parameters"}`` object; None if it is
    not one (no name, a name not among the tools, arguments that are not an object). ``text``:
    the object as the model wrote it, whose arguments' own text is kept when it is the object
    that was decoded."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    if obj["name"] not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    raw = None
    if text is not None:
        sc = scan_call(text)
        if sc.args is not None and sc.args_kind == "{" and sc.args_closed:
            raw = text[sc.args[0]:sc.args[1]]
            if _decode(raw) != args:
                raw = None
    return ParsedCall(obj["name"], raw if raw is not None else json.dumps(args,
                                                                         ensure_ascii=False),
                      pos=pos)


def _function(tool: dict[str, Any]) -> dict[str, Any]:
    return tool.get("function", tool)


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    """A tool's argument schema; OpenAI's default when absent: an object without properties."""
    params = _function(tool).get("parameters")
    return params if isinstance(params, dict) else {"type": "object", "properties": {}}


_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")


def closed_schema(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object schema that does not say
    otherwise: a function's arguments are the parameters it declares (what OpenAI's strict
    mode demands), and a model is not free to add keys of its own for as long as it likes."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: closed_schema(v) for k, v in out[key].items()}
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed_schema(v) for v in out[key]]
    for key in ("items", "not", "if", "then", "else"):
        if isinstance(out.get(key), dict):
            out[key] = closed_schema(out[key])
    if (out.get("type") == "object" or "properties" in out) \
            and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _call_schema(tool: dict[str, Any]) -> dict[str, Any]:
    """The JSON schema of one call of ``tool``: its name, and arguments that follow its
    parameters' schema (closed: ``closed_schema``)."""
    return {"type": "object",
            "properties": {"name": {"const": _function(tool)["name"]},
                           "arguments": closed_schema(_parameters(tool))},
            "required": ["name", "arguments"], "additionalProperties": False}


def _calls_schema(tools: list[dict[str, Any]]) -> dict[str, Any]:
    schemas = [_call_schema(t) for t in tools]
    return schemas[0] if len(schemas) == 1 else {"anyOf": schemas}


class ToolParser:
    """One tool-call format: parse an answer, find where a call begins while streaming, and
    the constraint and the instructions that make a model write calls in it."""

    name = ""

    def parse(self, text: str, names: set[str]) -> tuple[str | None, list[ParsedCall]] | None:
        """``(content, calls)`` when ``text`` holds tool calls of the tools ``names``, else
        None. ``content`` is the text outside the calls (None when there is none)."""
        raise NotImplementedError

    def start(self, text: str) -> int | None:
        """Where in ``text`` (the answer so far) a tool call begins, if one does: a streamed
        answer sends the text before it as content and streams the calls from there."""
        raise NotImplementedError

    def call_texts(self, text: str) -> list[str]:
        """The call objects in ``text`` (an answer from ``start`` on, finished or not), each
        from its ``{`` to the end of what is written of its block."""
        raise NotImplementedError

    def holdback(self, text: str) -> int:
        """How many trailing characters of ``text`` may begin a tool call (not streamed until
        the next token tells)."""
        raise NotImplementedError

    def constraint(self, tools: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
        """The structured-outputs constraint (``{"json": …}`` or ``{"grammar": …}``) under
        which the answer is one call of one of ``tools`` (several with ``parallel``)."""
        raise NotImplementedError

    def example(self) -> str:
        """How one call is written, for the instructions of a template without tools."""
        raise NotImplementedError

    def render(self, calls: list[tuple[str, Any]]) -> str:
        """Earlier calls ``(name, arguments)`` written as the model writes them (for templates
        that do not render an assistant message's ``tool_calls``)."""
        raise NotImplementedError

    def instructions(self, tools: list[dict[str, Any]]) -> str:
        """A system-prompt text that lists ``tools`` and says how to call them, for chat
        templates that do not render tools themselves."""
        lines = [json.dumps({k: v for k, v in (("name", _function(t)["name"]),
                                               ("description", _function(t).get("description")),
                                               ("parameters", _parameters(t)))
                             if v is not None}, ensure_ascii=False) for t in tools]
        return ("You can call these functions (JSON Schema of their arguments):\n"
                + "\n".join(lines) + "\nTo call a function, answer with " + self.example())


class HermesParser(ToolParser):
    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    _BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str, names: set[str]) -> tuple[str | None, list[ParsedCall]] | None:
        i = text.find(self.OPEN)
        if i < 0:
            return None
        calls = []
        for pos, block in enumerate(self._BLOCK.findall(text, i)):
            block = block.strip()
            call = _call(_decode(block), names, block, pos)
            if call is not None:
                calls.append(call)
        if not calls:
            return None
        content = text[:i].strip()
        return (content or None), calls

    def call_texts(self, text: str) -> list[str]:
        return [b.lstrip() for b in self._BLOCK.findall(text)]

    def start(self, text: str) -> int | None:
        i = text.find(self.OPEN)
        return None if i < 0 else i

    def holdback(self, text: str) -> int:
        for k in range(min(len(self.OPEN) - 1, len(text)), 0, -1):
            if text.endswith(self.OPEN[:k]):
                return k
        return 0

    def constraint(self, tools: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
        schema = {**_calls_schema(tools), "x-guidance": JSON_OPTIONS}
        call = f'"<tool_call>\\n" %json {json.dumps(schema)} "\\n</tool_call>"'
        start = 'start: call ("\\n" call)*' if parallel else "start: call"
        return {"grammar": f"{start}\ncall: {call}\n"}

    def example(self) -> str:
        return ('<tool_call>\n{"name": <function name>, "arguments": <arguments as a JSON '
                'object>}\n</tool_call> (one block per call).')

    def render(self, calls: list[tuple[str, Any]]) -> str:
        return "\n".join(
            f"{self.OPEN}\n{json.dumps({'name': n, 'arguments': a}, ensure_ascii=False)}\n"
            f"{self.CLOSE}" for n, a in calls)


class JsonParser(ToolParser):
    name = "json"
    _FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.DOTALL)

    def parse(self, text: str, names: set[str]) -> tuple[str | None, list[ParsedCall]] | None:
        body = text.strip()
        fenced = self._FENCE.match(body)
        if fenced:
            body = fenced.group(1)
        if not body.startswith(("{", "[")):
            return None
        try:
            obj = json.loads(body)
        except ValueError:
            return None
        items = obj if isinstance(obj, list) else [obj]
        texts = self.call_texts(body)
        if len(texts) != len(items):
            texts = [None] * len(items)
        calls = [_call(o, names, t, pos) for pos, (o, t) in enumerate(zip(items, texts))]
        if not calls or any(c is None for c in calls):
            return None
        return None, [c for c in calls if c is not None]

    def call_texts(self, text: str) -> list[str]:
        body = text.lstrip()
        if body.startswith("```"):
            body = body[3:]
            body = body[4:] if body.startswith("json") else body
            body = body.lstrip()
        if body.startswith("{"):
            return [body]
        if not body.startswith("["):
            return []
        out, i = [], 1
        while True:
            while i < len(body) and (body[i].isspace() or body[i] == ","):
                i += 1
            if i >= len(body) or body[i] != "{":
                return out
            end = scan_call(body[i:]).end
            out.append(body[i:] if end is None else body[i:i + end])
            if end is None:
                return out
            i += end

    def start(self, text: str) -> int | None:
        stripped = text.lstrip()
        if stripped.startswith(("{", "[", "`")):
            return 0
        return None

    def holdback(self, text: str) -> int:
        # an answer that is only whitespace so far may still open a JSON call
        return len(text) if not text.strip() else 0

    def constraint(self, tools: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
        schema = _calls_schema(tools)
        if parallel:
            schema = {"type": "array", "items": schema, "minItems": 1}
        return {"json": schema}

    def example(self) -> str:
        return ('{"name": <function name>, "arguments": <arguments as a JSON object>} (a list of '
                'them for several calls), and nothing else.')

    def render(self, calls: list[tuple[str, Any]]) -> str:
        objs = [{"name": n, "arguments": a} for n, a in calls]
        return json.dumps(objs[0] if len(objs) == 1 else objs, ensure_ascii=False)


PARSERS: dict[str, type[ToolParser]] = {"hermes": HermesParser, "json": JsonParser}


def choose_parser(name: str, chat_template: str | None) -> ToolParser:
    """The parser ``name`` (``hermes``, ``json``), or for ``auto`` the one the chat template
    writes: ``hermes`` when it mentions ``<tool_call>``, else ``json``."""
    if name == "auto":
        name = "hermes" if chat_template and HermesParser.OPEN in chat_template else "json"
    if name not in PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r} (choose from auto, "
                         f"{', '.join(PARSERS)})")
    return PARSERS[name]()
