"""Tool calling in ``/v1/chat/completions``: the parsers (hermes ``<tool_call>`` blocks, JSON),
forced calls (``tool_choice`` ``required`` or a named function) whose arguments always parse and
follow the function's schema, ``auto`` and ``none`` (OpenAI's rule), streaming as
``delta.tool_calls``, a round trip with tool results, the chat template's ``tools`` variable,
and the official ``openai`` client and LangChain's ``bind_tools``. The embedded default model."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")
openai = pytest.importorskip("openai")

from fastapi.testclient import TestClient  # noqa: E402

from mcserve.config import EngineConfig  # noqa: E402
from mcserve.engine.llm_engine import DEFAULT_MODEL_DIR, LLMEngine  # noqa: E402
from mcserve.engine.tokenizer import Tokenizer  # noqa: E402
from mcserve.server.app import build_app  # noqa: E402
from mcserve.server.chat_tools import ToolRequest, ToolStream, with_tool_history  # noqa: E402
from mcserve.server.tool_parsers import (  # noqa: E402
    HermesParser,
    JsonParser,
    choose_parser,
    closed_schema,
)

MODEL = "mcserve-default"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]}}}
ADD = {"type": "function", "function": {
    "name": "add", "parameters": {"type": "object", "properties": {
        "a": {"type": "integer", "minimum": -100, "maximum": 100},
        "b": {"type": "integer", "minimum": -100, "maximum": 100}}, "required": ["a", "b"]}}}
NOW = {"type": "function", "function": {"name": "now"}}  # no parameters: no arguments
TOOLS = [WEATHER, ADD, NOW]
SCHEMAS = {t["function"]["name"]: closed_schema(t["function"].get(
    "parameters", {"type": "object", "properties": {}})) for t in TOOLS}
MSGS = [{"role": "user", "content": "What is the weather in Paris?"}]
# Qwen 2.5's way of rendering tools, cut down: the tools in the system turn, calls in
# <tool_call> blocks, results in <tool_response> blocks
QWEN_LIKE = (
    "{%- if tools %}<|system|>\n# Tools\n<tools>\n{%- for tool in tools %}\n"
    "{{ tool | tojson }}{%- endfor %}\n</tools>\nReply with <tool_call></tool_call> blocks."
    "{{ eos_token }}\n{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}<|user|>\n<tool_response>\n{{ message.content }}\n"
    "</tool_response>{{ eos_token }}\n"
    "{%- elif message.tool_calls %}<|assistant|>\n{%- for call in message.tool_calls %}\n"
    "<tool_call>\n{\"name\": \"{{ call.function.name }}\", \"arguments\": "
    "{{ call.function.arguments | tojson }}}\n</tool_call>{%- endfor %}{{ eos_token }}\n"
    "{%- else %}<|{{ message.role }}|>\n{{ message.content }}{{ eos_token }}\n{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|assistant|>\n{%- endif %}")


def app_client(**kw: Any) -> TestClient:
    tok = Tokenizer.from_dir(DEFAULT_MODEL_DIR)
    template = kw.pop("chat_template", None)
    if template is not None:
        tok.chat_template = template
    engine = LLMEngine(EngineConfig(max_model_len=1024, max_num_seqs=8), tokenizer=tok)
    return TestClient(build_app(engine, **kw))


@pytest.fixture(scope="module")
def http() -> Iterator[TestClient]:
    with app_client() as client:  # the default template: no tools, no <tool_call>: json
        yield client


@pytest.fixture(scope="module")
def hermes_http() -> Iterator[TestClient]:
    with app_client(chat_template=QWEN_LIKE) as client:  # auto picks hermes
        yield client


def chat(http: TestClient, **body: Any) -> dict[str, Any]:
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": MSGS,
                                                "max_tokens": 120, **body})
    assert r.status_code == 200, r.text
    return r.json()


def check_calls(message: dict[str, Any], names: set[str]) -> list[dict[str, Any]]:
    calls = message["tool_calls"]
    assert calls
    for call in calls:
        assert re.fullmatch(r"call_[0-9a-f]{24}", call["id"]) and call["type"] == "function"
        name = call["function"]["name"]
        assert name in names
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[name])
    return calls


# --- parsers -------------------------------------------------------------------------------------


def test_hermes_parser() -> None:
    p = HermesParser()
    names = {"get_weather", "add"}
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
            '\n</tool_call>\n<tool_call>\n{"name": "add", "arguments": "{\\"a\\": 1}"}\n'
            '</tool_call>')
    parsed = p.parse(text, names)
    assert parsed is not None
    content, calls = parsed
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("add", {"a": 1})]
    assert calls[0].id != calls[1].id
    assert p.parse("no calls here", names) is None
    assert p.parse('<tool_call>{"name": "unknown", "arguments": {}}</tool_call>', names) is None
    assert p.parse("<tool_call>{not json</tool_call>", names) is None
    # an unterminated last block still counts (the answer ended inside it)
    assert p.parse('<tool_call>{"name": "add", "arguments": {"a": 2}}', names) is not None
    assert p.start("abc <tool_call>") == 4 and p.start("abc") is None
    assert p.holdback("abc <tool_") == len("<tool_") and p.holdback("abc <") == 1
    assert p.holdback("abc") == 0


def test_json_parser() -> None:
    p = JsonParser()
    names = {"get_weather", "add"}
    one = p.parse('  {"name": "add", "parameters": {"a": 1, "b": 2}}', names)
    assert one is not None and one[0] is None and json.loads(one[1][0].arguments) == {"a": 1,
                                                                                      "b": 2}
    fenced = p.parse('```json\n[{"name": "add", "arguments": {}}, '
                     '{"name": "get_weather", "arguments": {"city": "Oslo"}}]\n```', names)
    assert fenced is not None and [c.name for c in fenced[1]] == ["add", "get_weather"]
    for text in ('{"name": "add"', 'The answer is {"name": "add", "arguments": {}}',
                 '{"name": "other", "arguments": {}}', '[{"name": "add", "arguments": 3}]',
                 '{"city": "Paris"}'):
        assert p.parse(text, names) is None, text
    assert p.start('  {"na') == 0 and p.start("Hello") is None
    assert p.holdback("  \n") == 3 and p.holdback("Hi") == 0


def test_choose_parser_reads_the_template() -> None:
    assert choose_parser("auto", QWEN_LIKE).name == "hermes"
    assert choose_parser("auto", "{{ messages }}").name == "json"
    assert choose_parser("json", QWEN_LIKE).name == "json"
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        choose_parser("mistral", None)
    with pytest.raises(ValueError):
        app_client(tool_call_parser="nope")


def test_closed_schema() -> None:
    s = closed_schema({"type": "object", "properties": {
        "a": {"type": "object", "properties": {"x": {"type": "integer"}}},
        "b": {"type": "array", "items": {"type": "object"}},
        "c": {"anyOf": [{"type": "object", "additionalProperties": True}, {"type": "null"}]}}})
    assert s["additionalProperties"] is False
    assert s["properties"]["a"]["additionalProperties"] is False
    assert s["properties"]["b"]["items"]["additionalProperties"] is False
    assert s["properties"]["c"]["anyOf"][0]["additionalProperties"] is True


def _stream(stream: ToolStream, full: str, cuts) -> tuple[str, dict, str | None]:
    """Feed ``stream`` the answer ``full`` cut at ``cuts`` then finished; the content sent and
    the calls as a client accumulates them ({index: [id, name, arguments]})."""
    content, calls, finish = "", {}, None
    for end in [*cuts, len(full)]:
        last = end == len(full) and end == cuts[-1] if cuts else False
        delta, deltas, finish = stream.step(full[:end], "stop" if end == len(full) and
                                            not last else None)
        content += delta
        for d in deltas or []:
            c = calls.setdefault(d.index, [None, None, ""])
            if d.id is not None:
                assert c[0] is None, "a call's id is sent once"
                c[0], c[1] = d.id, d.function.name
            else:
                assert d.function.name is None
            c[2] += d.function.arguments or ""
    return content, calls, finish


def test_stream_sends_the_text_before_a_call_then_the_call_piece_by_piece() -> None:
    tools = ToolRequest(HermesParser(), [WEATHER], {"get_weather"}, None, True)
    full = ('Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", '
            '"unit": "celsius"}}\n</tool_call>')
    stream = ToolStream(tools)
    pieces = []
    for end in range(1, len(full)):
        delta, deltas, finish = stream.step(full[:end], None)
        assert finish is None
        if end < full.index("<"):
            assert deltas is None
        pieces += [d.function.arguments for d in deltas or [] if d.function.arguments]
        assert "<" not in delta
    assert len(pieces) > 5  # the arguments went out as the model wrote them
    stream = ToolStream(tools)
    content, calls, finish = _stream(stream, full, [4, 8, 10, 20, 40, 60, 75])
    assert content == "Sure. " and finish == "tool_calls"  # "<tool_" was held back
    (cid, name, args), = calls.values()
    assert cid.startswith("call_") and name == "get_weather"
    assert json.loads(args) == {"city": "Rome", "unit": "celsius"}
    assert args == tools.parse(full)[1][0].arguments  # what the whole answer reports
    # text that only looked like a call start goes out as content at the end
    stream = ToolStream(tools)
    assert stream.step("a <tool_call> b", None)[0] == "a "
    assert stream.step("a <tool_call> b", "stop") == ("<tool_call> b", None, "stop")


@pytest.mark.parametrize("parallel", [True, False])
def test_stream_of_several_calls_adds_up_to_the_whole_answer(parallel: bool) -> None:
    other = {"type": "function", "function": {"name": "now", "parameters": {
        "type": "object", "properties": {}}}}
    names = {"get_weather", "now"}
    cases = [
        (HermesParser(), 'x<tool_call>\n{"name": "get_weather", "arguments": {"city": "A\\"b", '
         '"n": [1, {"k": "}"}]}}\n</tool_call>\n<tool_call>\n{"name": "nope", "arguments": '
         '{}}\n</tool_call>\n<tool_call>\n{"arguments": {}, "name": "now"}\n</tool_call>'),
        (JsonParser(), '```json\n[{"name": "now", "parameters": {}}, {"name": "get_weather", '
         '"arguments": "{\\"city\\": \\"B\\"}"}]\n```'),
    ]
    for parser, full in cases:
        tools = ToolRequest(parser, [WEATHER, other], names, None, parallel)
        want = tools.parse(full)[1]
        for step in (1, 3, 17):
            content, calls, finish = _stream(ToolStream(tools), full,
                                             list(range(step, len(full), step)))
            assert finish == "tool_calls"
            got = [calls[k] for k in sorted(calls)]
            assert [c[1] for c in got] == [c.name for c in want], (parser.name, step)
            assert [json.loads(c[2]) for c in got] == [json.loads(c.arguments) for c in want]
            assert len({c[0] for c in got}) == len(got)


def test_history_without_template_support() -> None:
    """A template that renders neither tools nor tool calls gets the tools as system text and
    earlier calls written in the parser's format."""
    tools = ToolRequest(JsonParser(), [ADD], {"add"}, None, True)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+2?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "3"}]
    out, kwargs = with_tool_history(msgs, "{{ messages }}", JsonParser(), tools)
    assert kwargs == {}
    assert out[0]["content"].startswith("Be brief.\n\nYou can call these functions")
    assert '"name": "add"' in out[0]["content"]
    assert json.loads(out[2]["content"]) == {"name": "add", "arguments": {"a": 1, "b": 2}}
    out, kwargs = with_tool_history(msgs, QWEN_LIKE, HermesParser(), tools)
    assert kwargs == {"tools": [ADD]} and out == msgs


# --- over HTTP -----------------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["json", "hermes"])
def test_required_and_named_calls_always_parse(which: str, http: TestClient,
                                               hermes_http: TestClient) -> None:
    client = http if which == "json" else hermes_http
    names = {t["function"]["name"] for t in TOOLS}
    for seed in range(4):
        out = chat(client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                   temperature=1.0, seed=seed)
        choice = out["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        assert len(check_calls(choice["message"], names)) == 1
        out = chat(client, tools=TOOLS, temperature=1.0 if seed else 0.0, seed=seed,
                   tool_choice={"type": "function", "function": {"name": "add"}})
        calls = check_calls(out["choices"][0]["message"], {"add"})
        assert [c["function"]["name"] for c in calls] == ["add"]
    # n > 1: every completion is a call
    out = chat(client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, n=3,
               temperature=1.0, seed=9)
    for choice in out["choices"]:
        check_calls(choice["message"], names)


def test_streamed_calls_equal_the_whole_answer(hermes_http: TestClient) -> None:
    body = {"tools": TOOLS, "tool_choice": {"type": "function",
                                            "function": {"name": "get_weather"}},
            "temperature": 0}
    whole = chat(hermes_http, **body)["choices"][0]
    r = hermes_http.post("/v1/chat/completions", json={"model": MODEL, "messages": MSGS,
                                                       "max_tokens": 120, "stream": True,
                                                       **body})
    events = [json.loads(ln[6:]) for ln in r.text.splitlines()
              if ln.startswith("data: ") and ln != "data: [DONE]"]
    deltas = [d for e in events for d in e["choices"][0]["delta"].get("tool_calls") or []]
    assert [d["function"]["name"] for d in deltas if d["function"]["name"]] == ["get_weather"]
    assert {d["index"] for d in deltas} == {0}
    assert "".join(d["function"]["arguments"] or "" for d in deltas) == \
        whole["message"]["tool_calls"][0]["function"]["arguments"]
    assert not any(e["choices"][0]["delta"].get("content") for e in events)
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_auto_parses_calls_and_none_leaves_text(http: TestClient) -> None:
    """``auto`` returns the calls an answer holds; ``none`` never looks for them (nor shows
    the tools). The answer is made a call with a constraint, so that the weak model writes
    one."""
    call = '{"name": "add", "arguments": {"a": 2, "b": 3}}'
    so = {"structured_outputs": {"choice": [call]}}
    auto = chat(http, tools=TOOLS, tool_choice="auto", **so)["choices"][0]
    assert auto["finish_reason"] == "tool_calls" and auto["message"]["content"] is None
    assert json.loads(check_calls(auto["message"], {"add"})[0]["function"]["arguments"]) == {
        "a": 2, "b": 3}
    default = chat(http, tools=TOOLS, **so)["choices"][0]  # auto is the default with tools
    assert default["finish_reason"] == "tool_calls"
    none = chat(http, tools=TOOLS, tool_choice="none", **so)["choices"][0]
    assert none["message"]["content"] == call and none["message"]["tool_calls"] is None
    assert none["finish_reason"] == "stop"
    # no tools: nothing is parsed either
    plain = chat(http, **so)["choices"][0]
    assert plain["message"]["content"] == call and plain["finish_reason"] == "stop"
    # a call of a function the request does not offer is text
    other = chat(http, tools=[WEATHER], **so)["choices"][0]
    assert other["message"]["content"] == call and other["finish_reason"] == "stop"


def test_tools_reach_the_template(hermes_http: TestClient, http: TestClient) -> None:
    """A template that uses ``tools`` gets them as the variable (and not with tool_choice
    none); the default template, which does not, gets them as system-prompt text."""
    def prompt_tokens(client: TestClient, **body: Any) -> int:
        return chat(client, max_tokens=1, **body)["usage"]["prompt_tokens"]

    for client in (hermes_http, http):
        base = prompt_tokens(client)
        assert prompt_tokens(client, tools=TOOLS) > base + 20
        assert prompt_tokens(client, tools=TOOLS, tool_choice="none") == base
    st = hermes_http.app.state.server  # type: ignore[attr-defined]
    assert st.tool_parser.name == "hermes"
    seen: list[dict[str, Any]] = []
    original = st.tokenizer.apply_chat_template

    def spy(messages: Any, **kw: Any) -> str:
        seen.append(kw)
        return original(messages, **kw)

    st.tokenizer.apply_chat_template = spy
    try:
        chat(hermes_http, max_tokens=1, tools=[ADD])
    finally:
        del st.tokenizer.apply_chat_template
    assert seen[0]["tools"] == [ADD]


def test_round_trip_with_the_openai_client(hermes_http: TestClient) -> None:
    """The client sends tools, gets a call, runs it and sends the result back (an assistant
    message with ``tool_calls``, a ``tool`` message with ``tool_call_id``); the template
    renders both."""
    client = openai.OpenAI(base_url=str(hermes_http.base_url) + "/v1", api_key="unused",
                           http_client=hermes_http, max_retries=0)
    first = client.chat.completions.create(
        model=MODEL, messages=MSGS, tools=TOOLS, tool_choice="required",
        parallel_tool_calls=False, temperature=0, max_tokens=120)
    msg = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls" and msg.tool_calls
    call = msg.tool_calls[0]
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, SCHEMAS[call.function.name])
    history = [*MSGS, msg.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "22 degrees, sunny"}]
    second = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS,
                                            temperature=0, max_tokens=8)
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    st = hermes_http.app.state.server  # type: ignore[attr-defined]
    rendered = st.tokenizer.apply_chat_template(
        [*MSGS, {"role": "assistant", "content": "", "tool_calls": [
            {"id": call.id, "type": "function",
             "function": {"name": call.function.name, "arguments": args}}]},
         {"role": "tool", "tool_call_id": call.id, "content": "22 degrees, sunny"}],
        tools=TOOLS)
    assert f'"name": "{call.function.name}"' in rendered and "22 degrees" in rendered
    streamed = client.chat.completions.create(
        model=MODEL, messages=MSGS, tools=TOOLS, tool_choice="required", temperature=0,
        parallel_tool_calls=False, max_tokens=120, stream=True)
    chunks = [c.choices[0].delta.tool_calls for c in streamed if c.choices
              and c.choices[0].delta.tool_calls]
    assert chunks and chunks[0][0].id and chunks[0][0].function.name == call.function.name
    assert "".join(d.function.arguments or "" for ch in chunks for d in ch) == \
        call.function.arguments


def test_tool_requests_refused_with_the_field(http: TestClient) -> None:
    def refused(body: dict[str, Any], param: str) -> None:
        r = http.post("/v1/chat/completions", json={"messages": MSGS, **body})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param, r.json()

    refused({"tool_choice": "required"}, "tool_choice")
    refused({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice")
    refused({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice")
    refused({"tools": [WEATHER, WEATHER]}, "tools")
    refused({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools")
    refused({"tools": [{"type": "retrieval"}]}, "tools")
    bad = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "wat"}}}}}
    refused({"tools": [bad], "tool_choice": "required"}, "tools")
    refused({"tools": TOOLS, "tool_choice": "required",
             "response_format": {"type": "json_object"}}, "response_format")
    refused({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": 3}}]}]}, "messages")


def test_langchain_bind_tools(http: TestClient) -> None:
    lc = pytest.importorskip("langchain_openai")
    llm = lc.ChatOpenAI(model=MODEL, base_url=str(http.base_url) + "/v1", api_key="unused",
                        http_client=http, temperature=0, max_tokens=120, max_retries=0)
    msg = llm.bind_tools(TOOLS, tool_choice="add").invoke("Add 2 and 3.")
    assert [c["name"] for c in msg.tool_calls] == ["add"]
    jsonschema.validate(msg.tool_calls[0]["args"], SCHEMAS["add"])
    msg = llm.bind_tools(TOOLS, tool_choice="required", parallel_tool_calls=False).invoke(
        "Weather in Oslo?")
    assert len(msg.tool_calls) == 1 and msg.tool_calls[0]["name"] in SCHEMAS


def test_langchain_streams_a_tool_call_in_pieces(http: TestClient) -> None:
    # LangChain adds up the pieces of delta.tool_calls into the call the whole answer holds
    lc = pytest.importorskip("langchain_openai")
    llm = lc.ChatOpenAI(model=MODEL, base_url=str(http.base_url) + "/v1", api_key="unused",
                        http_client=http, temperature=0, max_tokens=120, max_retries=0)
    bound = llm.bind_tools(TOOLS, tool_choice="add")
    whole = bound.invoke("Add 2 and 3.")
    chunks = list(bound.stream("Add 2 and 3."))
    assert sum(1 for c in chunks if c.tool_call_chunks) > 2  # the arguments came in pieces
    total = chunks[0]
    for c in chunks[1:]:
        total = total + c
    assert [(c["name"], c["args"]) for c in total.tool_calls] == \
        [(c["name"], c["args"]) for c in whole.tool_calls]
