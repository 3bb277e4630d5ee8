"""Structured outputs over HTTP (``response_format``, vLLM's ``structured_outputs`` and
``guided_*``) with the official ``openai`` client and LangChain, on the embedded default model;
and the request edges next to them: a constraint that does not compile, ``content: []``, stop
bounds, the length field named as sent, and a request body that stalls."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")
openai = pytest.importorskip("openai")
pydantic = pytest.importorskip("pydantic")

import torch  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402

from mcserve.config import EngineConfig, ModelConfig  # noqa: E402
from mcserve.engine.llm_engine import LLMEngine  # noqa: E402
from mcserve.engine.tokenizer import Tokenizer  # noqa: E402
from mcserve.models.native import MCForCausalLM  # noqa: E402
from mcserve.server.app import build_app  # noqa: E402
from mcserve.server.middleware import GuardMiddleware  # noqa: E402

MODEL = "mcserve-default"
MSGS = [{"role": "user", "content": "Describe a person."}]


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=12)
    age: int = pydantic.Field(ge=0, le=120)
    hobbies: list[str] = pydantic.Field(max_length=3)


@pytest.fixture(scope="module")
def http() -> Iterator[TestClient]:
    engine = LLMEngine(EngineConfig(max_model_len=1024, max_num_seqs=8))
    with TestClient(build_app(engine)) as client:
        yield client


@pytest.fixture(scope="module")
def client(http: TestClient) -> Any:
    return openai.OpenAI(base_url=str(http.base_url) + "/v1", api_key="unused", http_client=http,
                         max_retries=0)


def post(http: TestClient, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = http.post(path, json={"model": MODEL, **body})
    assert r.status_code == 200, r.text
    return r.json()


def refused(http: TestClient, path: str, body: dict[str, Any], param: str) -> str:
    """The message of the 400 that ``body`` gets, which must name ``param``."""
    r = http.post(path, json={"model": MODEL, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    return err["message"]


def test_openai_parse_returns_the_pydantic_object(client: Any) -> None:
    """The client's ``parse`` sends the model's strict JSON schema as ``response_format`` and
    reads the answer back into the model: greedy and sampled, it always parses."""
    parse = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse
    for kw in ({"temperature": 0}, {"temperature": 1.0, "seed": 3}, {"temperature": 1.0,
                                                                    "seed": 4}):
        r = parse(model=MODEL, messages=MSGS, response_format=Person, max_tokens=200, **kw)
        choice = r.choices[0]
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, Person)
        assert choice.message.parsed == Person.model_validate_json(choice.message.content)


def test_response_format_json_schema_streams_valid_json(http: TestClient) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                               "n": {"type": "integer", "minimum": 1,
                                                     "maximum": 9}},
              "required": ["ok", "n"], "additionalProperties": False}
    body = {"messages": MSGS, "max_tokens": 50, "stream": True, "temperature": 0,
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "x", "schema": schema, "strict": True}}}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200
    events = [json.loads(ln[6:]) for ln in r.text.splitlines()
              if ln.startswith("data: ") and ln != "data: [DONE]"]
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events)
    jsonschema.validate(json.loads(text), schema)
    assert events[-1]["choices"][0]["finish_reason"] == "stop"
    plain = post(http, "/v1/chat/completions", {**body, "stream": False})
    assert plain["choices"][0]["message"]["content"] == text


def test_streamed_choices_finish_once(http: TestClient) -> None:
    """n > 1 streamed: each choice's finish reason comes once, whenever the others end, and
    every constrained choice is whole."""
    r = http.post("/v1/chat/completions", json={
        "model": MODEL, "messages": MSGS, "n": 4, "temperature": 1.0, "seed": 2,
        "max_tokens": 30, "stream": True,
        "structured_outputs": {"regex": "(a|bb){1,2}|[0-9]{10,20}"}})
    assert r.status_code == 200
    finishes: dict[int, list[str]] = {}
    texts: dict[int, str] = {}
    for line in r.text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            for c in json.loads(line[6:])["choices"]:
                texts[c["index"]] = texts.get(c["index"], "") + (c["delta"].get("content") or "")
                if c["finish_reason"]:
                    finishes.setdefault(c["index"], []).append(c["finish_reason"])
    assert finishes == {i: ["stop"] for i in range(4)}
    for text in texts.values():
        assert re.fullmatch("(a|bb){1,2}|[0-9]{10,20}", text), text


def test_completions_take_every_form(http: TestClient) -> None:
    """Completions take ``response_format``, ``structured_outputs`` (regex, choice, grammar,
    json) and the older ``guided_*`` fields; n > 1 and logprobs under a constraint."""
    schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99},
              "minItems": 2, "maxItems": 4}

    def valid(text: str) -> bool:
        jsonschema.validate(json.loads(text), schema)
        return True

    def matches(rx: str) -> Any:
        return lambda text: re.fullmatch(rx, text) is not None

    cases: list[tuple[dict[str, Any], Any]] = [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "a",
                                                                     "schema": schema}}},
         valid),
        ({"structured_outputs": {"regex": "[A-Z]{2}[0-9]{3}"}}, matches("[A-Z]{2}[0-9]{3}")),
        ({"structured_outputs": {"choice": ["left", "right"]}}, lambda t: t in ("left", "right")),
        ({"structured_outputs": {"grammar": 'root ::= "a" | "b" "c"'}},
         lambda t: t in ("a", "bc")),
        ({"structured_outputs": {"json": schema, "disable_any_whitespace": True}}, valid),
        ({"guided_json": json.dumps(schema)}, valid),
        ({"guided_regex": "[0-9]{4}"}, matches("[0-9]{4}")),
        ({"guided_choice": ["up", "down"]}, lambda t: t in ("up", "down")),
        ({"guided_grammar": 'start: "x"{1,5} "!"'}, matches("x{1,5}!")),
    ]
    for extra, check in cases:
        out = post(http, "/v1/completions", {"prompt": "Value:", "max_tokens": 60, "n": 3,
                                             "temperature": 1.0, "seed": 1, "logprobs": 2,
                                             **extra})
        for choice in out["choices"]:
            assert check(choice["text"]), (extra, choice["text"])
            assert choice["finish_reason"] == "stop", (extra, choice)
            lps = choice["logprobs"]["token_logprobs"]
            assert lps and all(-9999 <= v <= 0 for v in lps)


def test_json_object_and_text(http: TestClient) -> None:
    out = post(http, "/v1/chat/completions", {"messages": MSGS, "max_tokens": 120,
                                              "temperature": 1.0, "seed": 0,
                                              "response_format": {"type": "json_object"}})
    text = out["choices"][0]["message"]["content"]
    assert text.startswith("{")
    if out["choices"][0]["finish_reason"] == "stop":
        assert isinstance(json.loads(text), dict)
    # type text: no constraint
    post(http, "/v1/chat/completions", {"messages": MSGS, "max_tokens": 3,
                                        "response_format": {"type": "text"}})


def test_constraints_that_do_not_compile_are_400s_naming_the_field(http: TestClient) -> None:
    chat = "/v1/chat/completions"
    bad_schema = {"type": "object", "properties": {"a": {"type": "wat"}}}
    msg = refused(http, chat, {"messages": MSGS, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": bad_schema}}},
        "response_format")
    assert msg.startswith("response_format") and "wat" in msg
    refused(http, "/v1/completions", {"prompt": "x", "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": bad_schema}}},
        "response_format")
    refused(http, chat, {"messages": MSGS, "response_format": {"type": "xml"}},
            "response_format")
    refused(http, chat, {"messages": MSGS, "response_format": {"type": "json_schema"}},
            "response_format")
    refused(http, chat, {"messages": MSGS, "structured_outputs": {"regex": "(a"}},
            "structured_outputs")
    refused(http, chat, {"messages": MSGS, "structured_outputs": {"grammar": "start: nope"}},
            "structured_outputs")
    refused(http, chat, {"messages": MSGS, "structured_outputs": {"regex": "a",
                                                                  "choice": ["b"]}},
            "structured_outputs")
    refused(http, chat, {"messages": MSGS, "structured_outputs": {"regexp": "a"}},
            "structured_outputs")
    refused(http, chat, {"messages": MSGS, "structured_outputs": {"choice": []}},
            "structured_outputs")
    refused(http, "/v1/completions", {"prompt": "x", "guided_regex": "[a"}, "guided_regex")
    refused(http, "/v1/completions", {"prompt": "x", "guided_json": "{oops"}, "guided_json")
    refused(http, chat, {"messages": MSGS, "response_format": {"type": "json_object"},
                         "guided_regex": "a"}, "guided_regex")
    # the server keeps serving
    post(http, chat, {"messages": MSGS, "max_tokens": 2})


def test_request_edges(http: TestClient) -> None:
    chat = "/v1/chat/completions"
    msg = refused(http, chat, {"messages": [{"role": "user", "content": []}]}, "messages")
    assert "empty" in msg
    assert "at most 4" in refused(http, chat, {"messages": MSGS, "stop": ["a"] * 5}, "stop")
    assert "at most 512" in refused(http, "/v1/completions",
                                    {"prompt": "x", "stop": "s" * 513}, "stop")
    refused(http, "/v1/completions", {"prompt": "x", "stop": ["ok", "s" * 10_000]}, "stop")
    post(http, "/v1/completions", {"prompt": "x", "max_tokens": 2, "stop": ["a", "b", "c", "d"]})
    # the length field is named as the client sent it: the server's check and the engine's
    for n in (5000, 1020):
        msg = refused(http, chat, {"messages": MSGS, "max_completion_tokens": n},
                      "max_completion_tokens")
        assert msg.startswith("max_completion_tokens")
        assert refused(http, chat, {"messages": MSGS, "max_tokens": n},
                       "max_tokens").startswith("max_tokens")


def test_byte_level_model_refuses_constraints_clearly() -> None:
    torch.manual_seed(0)
    model = MCForCausalLM(ModelConfig(d_model=32, n_layers=1, n_heads=2, head_dim=16,
                                      segment_len=8))
    engine = LLMEngine(EngineConfig(max_model_len=128, num_state_blocks=64), model=model,
                       tokenizer=Tokenizer.byte_level(), model_name="tiny")
    with TestClient(build_app(engine)) as http:
        r = http.post("/v1/chat/completions", json={
            "messages": MSGS, "response_format": {"type": "json_object"}})
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["param"] == "response_format" and "tokenizer" in err["message"]


def test_langchain_with_structured_output(http: TestClient) -> None:
    lc = pytest.importorskip("langchain_openai")
    llm = lc.ChatOpenAI(model=MODEL, base_url=str(http.base_url) + "/v1", api_key="unused",
                        http_client=http, temperature=0, max_tokens=200, max_retries=0)
    for method in ("json_schema", "function_calling"):
        got = llm.with_structured_output(Person, method=method).invoke("Describe a person.")
        assert isinstance(got, Person), method


def test_a_stalled_body_gets_408() -> None:
    """A client that sends part of its body and stops gets a 408 once the body timeout
    passes (``Connection: close``), and the app never sees the request."""
    reached: list[str] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        reached.append(scope["path"])

    guard = GuardMiddleware(app, api_key=None, max_body_bytes=1 << 20, body_timeout_s=0.2)
    sent: list[dict[str, Any]] = []
    parts = [{"type": "http.request", "body": b'{"prompt": "x", ', "more_body": True}]

    async def receive() -> dict[str, Any]:
        if parts:
            return parts.pop()
        await asyncio.sleep(3600)  # the rest of the body never comes
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}
    asyncio.run(asyncio.wait_for(guard(scope, receive, send), 5))
    assert sent[0]["status"] == 408 and (b"connection", b"close") in sent[0]["headers"]
    err = json.loads(sent[1]["body"])["error"]
    assert err["code"] == "request_timeout" and err["type"] == "invalid_request_error"
    assert not reached
