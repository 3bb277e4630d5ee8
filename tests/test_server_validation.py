"""Malformed or hostile requests get a 4xx in OpenAI's error shape naming the field, never a 500."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")

from fastapi.testclient import TestClient  # noqa: E402
from server_helpers import API_KEY, FakeEngine, fake_app_client, tiny_app_client  # noqa: E402

from mcserve.engine.tokenizer import Tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def app_client() -> Iterator[TestClient]:
    yield from tiny_app_client()


@pytest.fixture
def fake() -> Iterator[tuple[FakeEngine, TestClient]]:
    yield from fake_app_client()


def _big(n: int) -> str:
    return "a" * n


# (name, method, path, body (dict -> JSON, str/bytes -> raw), headers, status, param)
MALFORMED: list[tuple[str, str, str, Any, dict[str, str] | None, int, str | None]] = [
    ("bad json", "POST", "/v1/completions", '{"prompt": "x",', None, 400, None),
    ("json not an object", "POST", "/v1/completions", "[1, 2]", None, 400, None),
    ("empty body", "POST", "/v1/completions", "", None, 400, None),
    ("not JSON at all", "POST", "/v1/completions", "prompt=hello", None, 400, None),
    ("missing prompt", "POST", "/v1/completions", {"max_tokens": 3}, None, 400, "prompt"),
    ("prompt wrong type", "POST", "/v1/completions", {"prompt": 5}, None, 400, "prompt"),
    ("prompt mixed list", "POST", "/v1/completions", {"prompt": [1, "a"]}, None, 400, "prompt"),
    ("prompt strings and ids", "POST", "/v1/completions", {"prompt": ["a", [1]]}, None, 400,
     "prompt"),
    ("empty prompt list", "POST", "/v1/completions", {"prompt": []}, None, 400, "prompt"),
    ("empty token list in batch", "POST", "/v1/completions", {"prompt": [[1], []]}, None, 400,
     "prompt"),
    ("token id out of vocab", "POST", "/v1/completions", {"prompt": [1, 99999]}, None, 400,
     "prompt"),
    ("negative token id", "POST", "/v1/completions", {"prompt": [-1]}, None, 400, "prompt"),
    ("max_tokens string", "POST", "/v1/completions", {"prompt": "x", "max_tokens": "16"}, None,
     400, "max_tokens"),
    ("max_tokens negative", "POST", "/v1/completions", {"prompt": "x", "max_tokens": -1}, None,
     400, "max_tokens"),
    ("max_tokens zero without echo", "POST", "/v1/completions",
     {"prompt": "x", "max_tokens": 0}, None, 400, "max_tokens"),
    ("max_tokens huge", "POST", "/v1/completions", {"prompt": "x", "max_tokens": 10**30}, None,
     400, "max_tokens"),
    ("max_tokens over context", "POST", "/v1/completions",
     {"prompt": "x" * 100, "max_tokens": 200}, None, 400, "max_tokens"),
    ("max_tokens float", "POST", "/v1/completions", {"prompt": "x", "max_tokens": 2.5}, None,
     400, "max_tokens"),
    ("n zero", "POST", "/v1/completions", {"prompt": "x", "n": 0}, None, 400, "n"),
    ("n huge", "POST", "/v1/completions", {"prompt": "x", "n": 10**6}, None, 400, "n"),
    ("temperature negative", "POST", "/v1/completions", {"prompt": "x", "temperature": -1},
     None, 400, "temperature"),
    ("temperature bool", "POST", "/v1/completions", {"prompt": "x", "temperature": True},
     None, 400, "temperature"),
    ("top_p zero", "POST", "/v1/completions", {"prompt": "x", "top_p": 0}, None, 400, "top_p"),
    ("top_p > 1", "POST", "/v1/completions", {"prompt": "x", "top_p": 1.5}, None, 400, "top_p"),
    ("logprobs too many", "POST", "/v1/completions", {"prompt": "x", "logprobs": 50}, None, 400,
     "logprobs"),
    ("stop wrong type", "POST", "/v1/completions", {"prompt": "x", "stop": 3}, None, 400,
     "stop"),
    ("empty stop string", "POST", "/v1/completions", {"prompt": "x", "stop": [""]}, None, 400,
     "stop"),
    ("penalty out of range", "POST", "/v1/completions",
     {"prompt": "x", "presence_penalty": 5}, None, 400, "presence_penalty"),
    ("seed out of range", "POST", "/v1/completions", {"prompt": "x", "seed": 2**70}, None, 400,
     "seed"),
    ("stream not a bool", "POST", "/v1/completions", {"prompt": "x", "stream": "yes"}, None, 400,
     "stream"),
    ("stream_options without stream", "POST", "/v1/completions",
     {"prompt": "x", "stream_options": {"include_usage": True}}, None, 400, "stream_options"),
    ("unknown mc field with wrong type", "POST", "/v1/completions",
     {"prompt": "x", "mc_top_k": [1, 2]}, None, 400, "mc_top_k"),
    ("mc override the model refuses", "POST", "/v1/completions",
     {"prompt": "x", "mc_no_such_setting": 3}, None, 400, "mc_no_such_setting"),
    ("mc_overrides not an object", "POST", "/v1/completions",
     {"prompt": "x", "mc_overrides": [1]}, None, 400, "mc_overrides"),
    ("logit_bias unsupported", "POST", "/v1/completions",
     {"prompt": "x", "logit_bias": {"1": 2.0}}, None, 400, "logit_bias"),
    ("over-long prompt", "POST", "/v1/completions", {"prompt": "y" * 300}, None, 400, "prompt"),
    ("wrong model", "POST", "/v1/completions", {"prompt": "x", "model": "gpt-4"}, None, 404,
     "model"),
    ("missing auth", "POST", "/v1/completions", {"prompt": "x"}, {"Authorization": ""}, 401,
     None),
    ("wrong key", "POST", "/v1/completions", {"prompt": "x"},
     {"Authorization": "Bearer nope"}, 401, None),
    ("wrong auth scheme", "GET", "/v1/models", None, {"Authorization": f"Basic {API_KEY}"}, 401,
     None),
    ("body too large", "POST", "/v1/completions", {"prompt": _big(70 * 1024)}, None, 413, None),
    ("unknown route", "GET", "/v1/nothing", None, None, 404, None),
    ("wrong method", "GET", "/v1/completions", None, None, 405, None),
    ("chat empty messages", "POST", "/v1/chat/completions", {"messages": []}, None, 400,
     "messages"),
    ("chat message without role", "POST", "/v1/chat/completions",
     {"messages": [{"content": "hi"}]}, None, 400, "messages"),
    ("chat image part", "POST", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     None, 400, "messages"),
    ("chat bad role", "POST", "/v1/chat/completions",
     {"messages": [{"role": "wizard", "content": "hi"}]}, None, 400, "messages"),
    ("chat top_logprobs without logprobs", "POST", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, None, 400,
     "top_logprobs"),
    ("chat wrong model", "POST", "/v1/chat/completions",
     {"model": "x", "messages": [{"role": "user", "content": "hi"}]}, None, 404, "model"),
    ("detokenize bad id", "POST", "/detokenize", {"tokens": [1, 10**9]}, None, 400, "tokens"),
    ("tokenize neither prompt nor messages", "POST", "/tokenize", {}, None, 400, "prompt"),
]


@pytest.mark.parametrize("case", MALFORMED, ids=[c[0] for c in MALFORMED])
def test_malformed_requests(app_client: TestClient, case: tuple) -> None:
    _, method, path, body, headers, status, param = case
    kwargs: dict[str, Any] = {"headers": headers}
    if isinstance(body, (str, bytes)):
        kwargs["content"] = body
        kwargs["headers"] = {"Content-Type": "application/json", **(headers or {})}
    elif body is not None:
        kwargs["json"] = body
    r = app_client.request(method, path, **kwargs)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert "pydantic" not in r.text and "errors.pydantic.dev" not in r.text
    assert '"loc"' not in r.text and '"ctx"' not in r.text and '"detail"' not in r.text
    if param is not None:
        assert err["param"] == param, err
    if status == 401:
        assert err["type"] == "authentication_error"


def test_json_without_content_type_is_accepted(app_client: TestClient) -> None:
    """``curl -d '{...}'`` sends application/x-www-form-urlencoded: still read as JSON."""
    r = app_client.post("/v1/completions", content=b'{"prompt": "hi", "max_tokens": 2}',
                        headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert r.status_code == 200, r.text
    r = app_client.post("/v1/completions", content=b"", headers={"Content-Type": ""})
    assert r.status_code == 400 and "missing" in r.json()["error"]["message"]


def test_open_routes_need_no_key(app_client: TestClient) -> None:
    nokey = {"Authorization": ""}
    assert app_client.get("/health", headers=nokey).status_code == 200
    assert app_client.get("/metrics", headers=nokey).status_code == 200
    assert app_client.get("/v1/models", headers=nokey).status_code == 401


def test_openapi_has_no_422(app_client: TestClient) -> None:
    schema = app_client.get("/openapi.json").json()
    assert "/v1/completions" in schema["paths"]
    assert "422" not in json.dumps(schema["paths"])


def test_mc_overrides_reach_the_engine(fake: tuple[FakeEngine, TestClient]) -> None:
    engine, client = fake
    r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "mc_top_k": 3})
    assert r.status_code == 200
    assert engine.last_mc_overrides == {"mc_top_k": 3}
    r = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
        "mc_overrides": {"mc_top_k": 1}})
    assert r.status_code == 200 and engine.last_mc_overrides == {"mc_top_k": 1}
    r = client.post("/v1/completions", json={"prompt": "x", "mc_magic": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "mc_magic"
    assert "mc_top_k" in r.json()["error"]["message"]  # says what a request may set


@pytest.mark.parametrize("body", [
    {"segment_len": 16},
    {"mc_overrides": {"segment_len": 16}},
    {"mc_top_k": 2, "segment_len": 16},
], ids=["top-level", "in mc_overrides", "with mc_top_k"])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_segment_len_per_request_is_refused(fake: tuple[FakeEngine, TestClient], path: str,
                                            body: dict[str, Any]) -> None:
    """Segment boundaries belong to the cached checkpoints: fixed per server, never per request
    (the engine would refuse it; the API says why before it gets there)."""
    engine, client = fake
    prompt = {"prompt": "x"} if path == "/v1/completions" else {
        "messages": [{"role": "user", "content": "x"}]}
    r = client.post(path, json={**prompt, "max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "segment_len" and err["type"] == "invalid_request_error"
    assert "cached checkpoints" in err["message"] and "--segment-len" in err["message"]
    assert engine.last_mc_overrides is None  # refused before the engine saw it


@pytest.mark.parametrize("key", ["mc_variant", "mc_mode"])
def test_fixed_mc_settings_per_request_are_refused(fake: tuple[FakeEngine, TestClient],
                                                   key: str) -> None:
    _, client = fake
    r = client.post("/v1/completions", json={"prompt": "x", key: "ssc"})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == key and "--" + key.replace("_", "-") in err["message"]


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", {"prompt": "a\ud800b", "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"prompt": ["ok", "\udfff"], "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2, "stop": ["\ud800"]}, "stop"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a\ud800b"}],
                              "max_tokens": 2}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "\udbff"}]}], "max_tokens": 2}, "messages"),
    ("/tokenize", {"prompt": "a\ud800b"}, "prompt"),
], ids=["prompt", "prompt list", "stop", "chat", "chat part", "tokenize"])
def test_lone_surrogate_is_a_400(app_client: TestClient, path: str, body: dict[str, Any],
                                 param: str) -> None:
    """JSON allows a lone surrogate (``"\\ud800"``); no tokenizer can encode it."""
    r = app_client.post(path, content=json.dumps(body),  # ASCII: the escape goes as is
                        headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and "surrogate" in err["message"]


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "f"}}])
def test_tool_choice_without_tools_is_a_400(app_client: TestClient, choice: Any) -> None:
    r = app_client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "tool_choice": choice})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    for ok in ("none", "auto", None):
        r = app_client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "tool_choice": ok})
        assert r.status_code == 200, r.text


def test_stop_token_ids_error_names_them(app_client: TestClient) -> None:
    for ids in ([-1], [1, "x"]):
        r = app_client.post("/v1/completions", json={"prompt": "x", "stop_token_ids": ids})
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["param"] == "stop_token_ids" and err["message"].startswith("stop_token_ids")
    r = app_client.post("/v1/completions", json={"prompt": "x", "stop": [1]})
    assert r.json()["error"]["message"].startswith("stop:")


def test_mc_top_k_on_a_model_that_reads_every_segment(app_client: TestClient) -> None:
    """The tiny model's variant is grm: mc_top_k (ssc) has no meaning there, and the 400 says
    so."""
    r = app_client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "mc_top_k": 4})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "mc_top_k"
    assert "ssc" in err["message"] and "'grm'" in err["message"]


def test_prompt_forms_are_validated_cheaply(fake: tuple[FakeEngine, TestClient]) -> None:
    """A long list of prompts or ids is refused without one error per item."""
    _, app_client = fake
    cases = [
        ({"prompt": [[1]] * 100_000}, "at most 256 prompts"),
        ({"prompt": ["x"] * 100_000}, "at most 256 prompts"),
        ({"prompt": [1, "x"] * 100_000}, "prompt"),
        ({"prompt": {"a": 1}}, "prompt"),
        ({"prompt": list(range(300))}, "longer than max_model_len"),
    ]
    for body, words in cases:
        t0 = time.perf_counter()
        r = app_client.post("/v1/completions", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
        assert words in r.json()["error"]["message"]
        assert len(r.content) < 2000  # one error, not 100000
        assert time.perf_counter() - t0 < 5


def test_large_bodies_are_refused_by_their_shape(fake: tuple[FakeEngine, TestClient]) -> None:
    """A body over 64 KiB is held to the caps on its lists before it is parsed (shape.py): a
    400 naming the field, in OpenAI's shape; the caps the models know of hold for small bodies
    too, in the same words; a large body within the caps, or one that is not JSON, goes on to
    the usual validation."""
    from mcserve.server.shape import MAX_OTHER_VALUES, SHAPE_CHECK_BYTES

    _, client = fake
    msg = {"role": "user", "content": "hi"}
    part = {"type": "text", "text": "hi"}
    cases: list[tuple[str, dict[str, Any], str, str]] = [
        ("/v1/completions", {"prompt": [[5]] * 100_000}, "prompt",
         "prompt: at most 256 prompts per request"),
        ("/v1/completions", {"prompt": ["x", 1] * 100_000}, "prompt",
         "prompt: at most 256 prompts per request"),
        ("/v1/completions", {"prompt": [7] * 100_000}, "prompt",
         "prompt[0] is 100000 tokens, longer than max_model_len=64"),
        ("/v1/completions", {"prompt": [[7], [7] * 30_000]}, "prompt",
         "prompt[1] is 30000 tokens, longer than max_model_len=64"),
        ("/v1/completions", {"prompt": "x", "stop": ["s"] * 20_000}, "stop",
         "stop: at most 4 stop strings"),
        ("/v1/completions", {"prompt": "x", "stop_token_ids": [1] * 40_000}, "stop_token_ids",
         "stop_token_ids: 40000 ids, more than the vocabulary"),
        ("/v1/completions", {"prompt": "x", "logit_bias": {str(i): 1 for i in range(9000)}},
         "logit_bias", f"logit_bias: more than {MAX_OTHER_VALUES} values"),
        ("/v1/completions", {"prompt": "x", "junk": [[1]] * 40_000}, "junk",
         f"junk: more than {MAX_OTHER_VALUES} values"),
        ("/v1/chat/completions", {"messages": [msg] * 20_000}, "messages",
         "messages: more than max_model_len=64 messages"),
        ("/v1/chat/completions", {"messages": [{**msg, "content": [part] * 3000}]}, "messages",
         "messages: at most 2048 content parts per request"),
        ("/v1/chat/completions", {"messages": [{**msg, "tool_calls": [[1]] * 20_000}]},
         "messages", f"messages: more than {MAX_OTHER_VALUES} values"),
        ("/tokenize", {"messages": [msg] * 20_000}, "messages",
         "messages: more than max_model_len=64 messages"),
    ]
    for path, body, param, words in cases:
        raw = json.dumps(body).encode()
        assert len(raw) > SHAPE_CHECK_BYTES
        r = client.post(path, content=raw, headers={"Content-Type": "application/json"})
        assert r.status_code == 400, (path, r.text)
        err = r.json()["error"]
        assert err["param"] == param and err["message"].startswith(words), (words, err)
        assert err["type"] == "invalid_request_error"
    # small bodies: the models' own caps, in the same words
    small = [({"messages": [{"role": "user"}] * 2049}, "messages: at most 2048 messages"),
             ({"messages": [{"role": "user", "content": [part] * 1025}] * 2},
              "messages: at most 2048 content parts")]
    for body, words in small:
        raw = json.dumps(body, separators=(",", ":")).encode()
        assert len(raw) < SHAPE_CHECK_BYTES
        r = client.post("/v1/chat/completions", content=raw,
                        headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["message"].startswith(words), r.text
    # within the caps, or not JSON at all: the usual answers
    r = client.post("/v1/completions", json={"prompt": "x" * 100_000, "max_tokens": 2})
    assert r.status_code == 400 and "max_model_len=64" in r.json()["error"]["message"]
    r = client.post("/v1/completions", json={"prompt": [[1, 2]] * 256, "max_tokens": 1,
                                             "pad": "y" * SHAPE_CHECK_BYTES})
    assert r.status_code == 200 and len(r.json()["choices"]) == 256, r.text
    broken = b'{"prompt": [[1] [2]], "pad": "' + b"y" * SHAPE_CHECK_BYTES + b'"}'
    r = client.post("/v1/completions", content=broken,
                    headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"], r.text


def test_prompt_encoder_matches_the_tokenizer() -> None:
    """The tokenizer of the embedded default model: the GIL-free encode gives the same ids, and
    the bytes-per-token bound it refuses long prompts by holds."""
    from mcserve.engine.llm_engine import DEFAULT_MODEL_DIR
    from mcserve.engine.tokenizer import load_tokenizer
    from mcserve.server.prompts import PromptEncoder, max_bytes_per_token

    tok = load_tokenizer(DEFAULT_MODEL_DIR)
    bpt = max_bytes_per_token(tok)
    assert bpt is not None and 1 < bpt < 256
    assert max_bytes_per_token(Tokenizer.byte_level()) == 1
    enc = PromptEncoder(tok, max_model_len=10**9)
    text = "Memory caching: 12345 états\n<|endoftext|> " * 400  # > INLINE_CHARS: threaded
    ids = asyncio.run(enc.encode(text, add_special_tokens=True, param="prompt"))
    assert ids == tok.encode(text)
    assert len(ids) * bpt >= len(text.encode())
    short = PromptEncoder(tok, max_model_len=64)
    with pytest.raises(Exception, match="bytes of UTF-8") as e:
        asyncio.run(short.encode("x" * (64 * bpt), add_special_tokens=True, param="prompt"))
    assert getattr(e.value, "status", None) == 400
    assert asyncio.run(enc.decode(ids, tok.vocab_size)) == tok.decode(ids)
