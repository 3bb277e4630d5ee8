"""Tools in ``/v1/chat/completions``: the request's ``tools``, ``tool_choice`` and
``parallel_tool_calls`` checked and turned into what the prompt and the engine need, and the
answer turned into OpenAI's ``tool_calls`` (whole, or streamed as ``delta.tool_calls``:
each call's name, then its arguments piece by piece).

The rule (OpenAI's): with ``tool_choice: "none"``, or no tools, tools are neither shown to the
model nor looked for in its answer. Otherwise the chat template renders them (the ``tools``
template variable, as transformers passes it; a template that does not use it gets them as a
system-prompt text in the parser's format), and the answer is parsed with the server's tool-call
parser (``--tool-call-parser``). ``auto`` (the default with tools) leaves the model free and
returns the calls when its answer holds some; ``required``, or a named function, constrains the
answer to calls (of that function) whose arguments follow its ``parameters`` schema, so they
always parse. ``parallel_tool_calls: false`` allows one call per answer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from mcserve.engine.sampling_params import StructuredOutputsParams
from mcserve.server import protocol as P
from mcserve.server.errors import APIError
from mcserve.server.tool_parsers import ParsedCall, ToolParser, scan_call, tool_call_id

__all__ = ["ToolRequest", "ToolStream", "answer_message", "tool_request", "with_tool_history"]


@dataclass
class ToolRequest:
    """The tools of one chat request that uses them (``tool_choice`` not ``none``)."""

    parser: ToolParser
    tools: list[dict[str, Any]]  # as the template sees them: {"type": "function", "function"}
    names: set[str]
    forced: str | None  # "required", or the name of the function that must be called
    parallel: bool

    def constraint(self) -> StructuredOutputsParams | None:
        """The constraint of a forced call (None under ``auto``)."""
        if self.forced is None:
            return None
        tools = self.tools if self.forced == "required" else [
            t for t in self.tools if t["function"]["name"] == self.forced]
        return StructuredOutputsParams(**self.parser.constraint(tools, self.parallel))

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]] | None:
        parsed = self.parser.parse(text, self.names)
        if parsed is not None and not self.parallel:
            parsed = parsed[0], parsed[1][:1]
        return parsed


def tool_request(body: P.ChatCompletionRequest, parser: ToolParser) -> ToolRequest | None:
    """The request's tools, checked (400 naming ``tools`` or ``tool_choice``); None when the
    answer is plain text (no tools, or ``tool_choice: "none"``)."""
    choice = body.tool_choice
    if not body.tools:
        if isinstance(choice, P.NamedToolChoice) or choice == "required":
            raise APIError(400, "tool_choice: a tool call is required, but the request has no "
                           "tools", param="tool_choice")
        return None
    if choice == "none":
        return None
    tools = [t.model_dump(exclude_none=True) for t in body.tools]
    names = [t["function"]["name"] for t in tools]
    dup = next((n for i, n in enumerate(names) if n in names[:i]), None)
    if dup is not None:
        raise APIError(400, f"tools: the function name {dup!r} is given twice", param="tools")
    forced: str | None = None
    if choice == "required":
        forced = "required"
    elif isinstance(choice, P.NamedToolChoice):
        forced = choice.function.name
        if forced not in names:
            raise APIError(400, f"tool_choice: the function {forced!r} is not among the tools "
                           f"({', '.join(names)})", param="tool_choice")
    if forced is not None and body.response_format and \
            body.response_format.get("type", "text") != "text":
        raise APIError(400, "response_format: cannot be combined with a tool_choice that "
                       "requires a tool call", param="response_format")
    parallel = body.parallel_tool_calls is not False and forced in (None, "required")
    return ToolRequest(parser, tools, set(names), forced, parallel)


def with_tool_history(messages: list[dict[str, Any]], template: str, parser: ToolParser,
                      tools: ToolRequest | None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The messages and template variables to render: ``tools`` for a template that uses it,
    else the tools described in the system prompt; earlier tool calls written into their
    assistant message's content when the template does not render ``tool_calls``."""
    out = messages
    if "tool_calls" not in template and any(m.get("tool_calls") for m in messages):
        out = []
        for m in messages:
            calls = m.get("tool_calls")
            if calls and not m.get("content"):
                m = {**m, "content": parser.render(
                    [(c["function"]["name"], c["function"]["arguments"]) for c in calls])}
            out.append(m)
    if tools is None:
        return out, {}
    if "tools" in template:
        return out, {"tools": tools.tools}
    text = parser.instructions(tools.tools)
    if out and out[0].get("role") in ("system", "developer"):
        first = out[0]
        return [{**first, "content": f"{first.get('content') or ''}\n\n{text}".lstrip()},
                *out[1:]], {}
    return [{"role": "system", "content": text}, *out], {}


def _tool_calls(calls: list[ParsedCall]) -> list[P.ToolCall]:
    return [P.ToolCall(id=c.id, function=P.FunctionCall(name=c.name, arguments=c.arguments))
            for c in calls]


def _finish(reason: str | None, has_calls: bool) -> str | None:
    """``tool_calls`` for an answer that ended on its own with calls (a cut one stays
    ``length``)."""
    return "tool_calls" if has_calls and reason == "stop" else reason


def answer_message(tools: ToolRequest | None, text: str, finish_reason: str | None
                   ) -> tuple[P.ChatResponseMessage, str | None]:
    """The assistant message of a finished answer, and its finish reason."""
    parsed = tools.parse(text) if tools is not None else None
    if parsed is None:
        return P.ChatResponseMessage(content=text), finish_reason
    content, calls = parsed
    return (P.ChatResponseMessage(content=content, tool_calls=_tool_calls(calls)),
            _finish(finish_reason, True))


@dataclass
class _Streamed:
    """A call a stream has announced: which call object of the answer, its id, how much of its
    arguments' text went out."""

    pos: int
    id: str
    sent: int = 0


class ToolStream:
    """One streamed choice of a request with tools, as OpenAI streams calls: text before a tool
    call streams as content; from where a call may begin (``<tool_call>``, an answer that opens
    with JSON) the text is read as calls. Each call goes out as a first ``delta.tool_calls``
    entry with its index, id and name once the name is written (and is one of the tools), then
    as pieces of its arguments' JSON text as the model writes them. At the end, text held that
    held no call goes out as content; a call whose arguments came as a string goes out whole.
    A forced call holds everything from the first token."""

    def __init__(self, tools: ToolRequest):
        self.tools = tools
        self.sent = 0  # characters of the text sent as content
        self.held: int | None = 0 if tools.forced is not None else None
        self.calls: list[_Streamed] = []

    def _deltas(self, text: str) -> list[P.DeltaToolCall]:
        """New calls announced and new pieces of arguments, for the answer so far."""
        out = []
        for pos, obj in enumerate(self.tools.parser.call_texts(text[self.held:])):
            k = next((k for k, c in enumerate(self.calls) if c.pos == pos), None)
            sc = scan_call(obj)
            if k is None:
                if (sc.name not in self.tools.names or sc.args_kind != "{"
                        or (self.calls and not self.tools.parallel)):
                    continue
                self.calls.append(_Streamed(pos, tool_call_id()))
                k = len(self.calls) - 1
                out.append(P.DeltaToolCall(index=k, id=self.calls[k].id, type="function",
                                           function=P.DeltaFunctionCall(name=sc.name,
                                                                        arguments="")))
            st = self.calls[k]
            assert sc.args is not None  # an announced call has its arguments' start
            args = obj[sc.args[0]:sc.args[1]] if sc.args_closed else obj[sc.args[0]:].rstrip()
            if len(args) > st.sent:
                out.append(P.DeltaToolCall(index=k, function=P.DeltaFunctionCall(
                    arguments=args[st.sent:])))
                st.sent = len(args)
        return out

    def step(self, text: str, finish_reason: str | None
             ) -> tuple[str, list[P.DeltaToolCall] | None, str | None]:
        """``(content delta, tool-call deltas or None, finish reason)`` for the answer's
        text so far (``finish_reason`` None while it runs)."""
        parser = self.tools.parser
        if self.held is None:
            start = parser.start(text)
            if start is not None:
                self.held = start
        if finish_reason is None:
            if self.held is None:
                end = len(text) - parser.holdback(text)
            else:
                end = self.held
            end = max(end, self.sent)
            delta, self.sent = text[self.sent:end], end
            calls = self._deltas(text) if self.held is not None else []
            return delta, calls or None, None
        parsed = self.tools.parse(text) if self.held is not None else None
        if parsed is None and not self.calls:  # no call after all: the rest is content
            delta, self.sent = text[self.sent:], len(text)
            return delta, None, finish_reason
        start = self.held or 0
        delta = text[self.sent:start] if start > self.sent else ""
        self.sent = len(text)
        calls = self._deltas(text)
        done = {c.pos for c in self.calls}
        for c in parsed[1] if parsed is not None else []:  # calls not streamed: whole
            if c.pos not in done and (self.tools.parallel or not self.calls):
                self.calls.append(_Streamed(c.pos, c.id, len(c.arguments)))
                calls.append(P.DeltaToolCall(
                    index=len(self.calls) - 1, id=c.id, type="function",
                    function=P.DeltaFunctionCall(name=c.name, arguments=c.arguments)))
        return delta, calls or None, _finish(finish_reason, bool(self.calls))


def arguments_for_template(arguments: str) -> Any:
    """A tool call's arguments as an earlier assistant message carries them to the template:
    decoded from their JSON text (templates write ``arguments | tojson``), as vLLM does;
    text that is not JSON stays text."""
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments
