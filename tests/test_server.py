"""Tests of the OpenAI-compatible server (``mcserve.server``).

Three layers:

* in-process, through ``fastapi.testclient.TestClient`` over the real ``LLMEngine`` on a tiny
  random model: the endpoints, the response shapes, streaming, metrics and a table of malformed
  requests;
* a ``FakeEngine`` (same interface, instant, deterministic) where the real engine cannot do what
  is tested: a failure injected inside one request, an engine step that raises, idling;
* a real ``uvicorn`` server process on a free loopback port (module-scoped fixture), driven by the
  official ``openai`` client and by raw ``httpx`` streams: 32 concurrent streaming clients, 20
  clients that drop mid-stream, and a graceful SIGTERM.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

import torch  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402

from mcserve.config import EngineConfig, ModelConfig  # noqa: E402
from mcserve.engine.llm_engine import LLMEngine  # noqa: E402
from mcserve.engine.outputs import CompletionOutput, Logprob, RequestOutput  # noqa: E402
from mcserve.engine.tokenizer import Tokenizer  # noqa: E402
from mcserve.errors import InvalidRequestError  # noqa: E402
from mcserve.models.native import MCForCausalLM  # noqa: E402
from mcserve.server.app import build_app  # noqa: E402
from mcserve.server.async_engine import AsyncEngine  # noqa: E402

TINY = ModelConfig(d_model=32, n_layers=1, n_heads=2, head_dim=16, segment_len=8)
MAX_MODEL_LEN = 256
API_KEY = "sk-test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


def tiny_engine(**config: Any) -> LLMEngine:
    torch.manual_seed(0)
    model = MCForCausalLM(TINY)
    cfg = EngineConfig(**{"max_model_len": MAX_MODEL_LEN, "num_state_blocks": 512, **config})
    return LLMEngine(cfg, model=model, tokenizer=Tokenizer.byte_level(), model_name="tiny")


def sse_events(text: str) -> list[Any]:
    """The ``data:`` payloads of an SSE body (JSON-decoded, ``[DONE]`` kept as a string)."""
    out = []
    for line in text.splitlines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one sample in a Prometheus exposition."""
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    pattern = re.escape(name) + (r"\{" + re.escape(want) + r"\}" if want else "") + r" (\S+)"
    m = re.search(r"^" + pattern + r"$", text, re.MULTILINE)
    assert m is not None, f"{name}{{{want}}} not in metrics"
    return float(m.group(1))


# --- in-process app over the real engine ---------------------------------------------------------


@pytest.fixture(scope="module")
def app_client() -> Iterator[TestClient]:
    app = build_app(tiny_engine(), api_key=API_KEY, max_body_bytes=64 * 1024,
                    max_waiting_requests=64)
    with TestClient(app, headers=AUTH) as client:
        yield client


def post(client: TestClient, path: str, body: dict[str, Any]) -> Any:
    r = client.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_models_health_version(app_client: TestClient) -> None:
    models = app_client.get("/v1/models").json()
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == ["tiny"]
    assert models["data"][0]["max_model_len"] == MAX_MODEL_LEN
    assert app_client.get("/v1/models/tiny").json()["id"] == "tiny"
    assert app_client.get("/v1/models/other").status_code == 404
    assert app_client.get("/health").status_code == 200
    import mcserve

    assert app_client.get("/version").json() == {"version": mcserve.__version__}


def test_tokenize_detokenize(app_client: TestClient) -> None:
    tok = post(app_client, "/tokenize", {"prompt": "héllo"})
    assert tok["tokens"] == list("héllo".encode())
    assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == MAX_MODEL_LEN
    assert post(app_client, "/detokenize", {"tokens": tok["tokens"]})["prompt"] == "héllo"
    chat = post(app_client, "/tokenize", {"messages": [{"role": "user", "content": "hi"}]})
    assert chat["count"] > 2


def test_completion_basic_and_usage(app_client: TestClient) -> None:
    out = post(app_client, "/v1/completions",
               {"model": "tiny", "prompt": "Memory caching", "max_tokens": 6, "temperature": 0})
    assert out["object"] == "text_completion" and out["model"] == "tiny"
    assert out["id"].startswith("cmpl-")
    (choice,) = out["choices"]
    assert choice["index"] == 0 and choice["finish_reason"] == "length"
    usage = out["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == \
        (14, 6, 20)
    again = post(app_client, "/v1/completions",
                 {"prompt": "Memory caching", "max_tokens": 6, "temperature": 0})
    assert again["choices"][0]["text"] == choice["text"]  # greedy is deterministic
    # the second time the prompt's complete segment comes from the prefix cache
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_completion_prompt_forms_and_n(app_client: TestClient) -> None:
    ids = list(b"Hello")
    text = post(app_client, "/v1/completions", {"prompt": "Hello", "max_tokens": 4,
                                                "temperature": 0})["choices"][0]["text"]
    by_ids = post(app_client, "/v1/completions", {"prompt": ids, "max_tokens": 4,
                                                  "temperature": 0})
    assert by_ids["choices"][0]["text"] == text
    many = post(app_client, "/v1/completions",
                {"prompt": [ids, ids, [120]], "max_tokens": 4, "temperature": 0, "n": 2})
    assert [c["index"] for c in many["choices"]] == list(range(6))
    assert many["choices"][0]["text"] == many["choices"][2]["text"] == text
    assert many["usage"]["prompt_tokens"] == 5 + 5 + 1
    assert many["usage"]["completion_tokens"] == 6 * 4
    seeded = post(app_client, "/v1/completions",
                  {"prompt": "Hi", "max_tokens": 8, "n": 2, "seed": 7, "temperature": 1.0})
    seeded2 = post(app_client, "/v1/completions",
                   {"prompt": "Hi", "max_tokens": 8, "n": 2, "seed": 7, "temperature": 1.0})
    assert [c["text"] for c in seeded["choices"]] == [c["text"] for c in seeded2["choices"]]


def test_completion_stop(app_client: TestClient) -> None:
    full = post(app_client, "/v1/completions", {"prompt": "Hello", "max_tokens": 12,
                                                "temperature": 0})["choices"][0]["text"]
    stop = full[3:5]
    cut = post(app_client, "/v1/completions", {"prompt": "Hello", "max_tokens": 12,
                                               "temperature": 0, "stop": [stop]})
    choice = cut["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["text"] == full[:full.index(stop)]


def test_completion_logprobs_echo_lm_eval_style(app_client: TestClient) -> None:
    """What lm-evaluation-harness' local-completions sends for loglikelihood."""
    ctx, cont = list(b"The cat"), list(b" sat")
    out = post(app_client, "/v1/completions",
               {"model": "tiny", "prompt": [ctx + cont], "max_tokens": 1, "temperature": 0,
                "logprobs": 1, "echo": True, "seed": 1234})
    lp = out["choices"][0]["logprobs"]
    n_prompt = len(ctx) + len(cont)
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) \
        == len(lp["text_offset"]) == n_prompt + 1
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["tokens"][:n_prompt] == [chr(t) for t in ctx + cont]
    assert lp["text_offset"][:3] == [0, 1, 2]
    assert out["choices"][0]["text"].startswith("The cat sat")
    for tok_lp, top in zip(lp["token_logprobs"][1:], lp["top_logprobs"][1:]):
        assert tok_lp <= 0 and max(top.values()) >= tok_lp - 1e-6
        assert 1 <= len(top) <= 2
    # max_tokens=0 with echo: the prompt alone
    zero = post(app_client, "/v1/completions",
                {"prompt": "The cat", "max_tokens": 0, "echo": True, "logprobs": 0})
    assert zero["choices"][0]["text"] == "The cat"
    assert zero["usage"]["completion_tokens"] == 0
    assert len(zero["choices"][0]["logprobs"]["tokens"]) == 7


def test_completion_generated_logprobs(app_client: TestClient) -> None:
    out = post(app_client, "/v1/completions",
               {"prompt": "abc", "max_tokens": 5, "temperature": 0, "logprobs": 3})
    lp = out["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == 5 and "".join(lp["tokens"]) == out["choices"][0]["text"]
    for tok, tok_lp, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert max(top.values()) == pytest.approx(tok_lp)  # greedy: the sampled is the top
        assert tok in top and len(top) <= 4
    assert lp["text_offset"] == list(range(5))


def test_completion_stream_matches_and_usage(app_client: TestClient) -> None:
    body = {"prompt": "Streaming", "max_tokens": 8, "temperature": 0}
    full = post(app_client, "/v1/completions", body)["choices"][0]["text"]
    r = app_client.post("/v1/completions", json={**body, "stream": True,
                                                 "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "text_completion" for c in chunks)
    text = "".join(ch["text"] for c in chunks for ch in c["choices"])
    assert text == full
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 8
    assert all(c["usage"] is None for c in chunks[:-1])
    finishes = [ch["finish_reason"] for c in chunks for ch in c["choices"] if ch["finish_reason"]]
    assert finishes == ["length"]


def test_completion_stream_echo_n2(app_client: TestClient) -> None:
    r = app_client.post("/v1/completions", json={
        "prompt": "Hey", "max_tokens": 4, "temperature": 0, "n": 2, "echo": True,
        "logprobs": 1, "stream": True})
    chunks = sse_events(r.text)[:-1]
    for index in (0, 1):
        parts = [ch for c in chunks for ch in c["choices"] if ch["index"] == index]
        text = "".join(p["text"] for p in parts)
        tokens = [t for p in parts for t in p["logprobs"]["tokens"]]
        offsets = [o for p in parts for o in p["logprobs"]["text_offset"]]
        assert text.startswith("Hey") and len(tokens) == 3 + 4
        assert offsets == list(range(7))


def test_echo_logprobs_with_chunked_prefill() -> None:
    """Prompt logprobs computed over several prefill chunks stream out whole and in order."""
    app = build_app(tiny_engine(max_num_batched_tokens=8))
    prompt = "a prompt longer than one prefill chunk of eight tokens"
    body = {"prompt": prompt, "max_tokens": 3, "temperature": 0, "echo": True, "logprobs": 1}
    with TestClient(app) as client:
        full = client.post("/v1/completions", json=body).json()["choices"][0]
        r = client.post("/v1/completions", json={**body, "stream": True})
    parts = [ch for c in sse_events(r.text)[:-1] for ch in c["choices"]]
    lp = {k: [x for p in parts for x in p["logprobs"][k]]
          for k in ("tokens", "token_logprobs", "text_offset")}
    assert "".join(p["text"] for p in parts) == full["text"]
    assert lp["tokens"] == full["logprobs"]["tokens"]
    assert len(lp["tokens"]) == len(prompt) + 3
    assert lp["text_offset"] == list(range(len(prompt) + 3))
    assert lp["token_logprobs"] == pytest.approx(full["logprobs"]["token_logprobs"])


def test_chat_completion_and_stream(app_client: TestClient) -> None:
    msgs = [{"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "Hello"}]}]
    out = post(app_client, "/v1/chat/completions",
               {"messages": msgs, "max_completion_tokens": 6, "temperature": 0,
                "logprobs": True, "top_logprobs": 2})
    assert out["object"] == "chat.completion"
    (choice,) = out["choices"]
    assert choice["message"]["role"] == "assistant"
    content = choice["logprobs"]["content"]
    assert len(content) == 6 and all(len(e["top_logprobs"]) == 2 for e in content)
    assert "".join(e["token"] for e in content) == choice["message"]["content"]
    r = app_client.post("/v1/chat/completions", json={
        "messages": msgs, "max_tokens": 6, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True}})
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    text = "".join(ch["delta"]["content"] or "" for c in chunks for ch in c["choices"])
    assert text == choice["message"]["content"]
    assert chunks[-1]["usage"]["completion_tokens"] == 6


def test_chat_default_max_tokens_fills_context(app_client: TestClient) -> None:
    out = post(app_client, "/v1/chat/completions",
               {"messages": [{"role": "user", "content": "x" * 200}], "temperature": 0,
                "ignore_eos": True})
    usage = out["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == MAX_MODEL_LEN
    assert out["choices"][0]["finish_reason"] == "length"


def test_metrics_names_and_idle_state(app_client: TestClient) -> None:
    post(app_client, "/v1/completions", {"prompt": "metrics " * 4, "max_tokens": 12})
    text = app_client.get("/metrics", headers={"Authorization": ""}).text  # open route
    for name in ("mcserve:num_requests_running", "mcserve:num_requests_waiting",
                 "mcserve:state_cache_usage_perc", "mcserve:prefix_cache_queries_total",
                 "mcserve:prefix_cache_hits_total", "mcserve:prompt_tokens_total",
                 "mcserve:generation_tokens_total", "mcserve:host_bytes_moved_total",
                 "mcserve:time_to_first_token_seconds_count",
                 "mcserve:inter_token_latency_seconds_count",
                 "mcserve:e2e_request_latency_seconds_count",
                 "mcserve:request_queue_time_seconds_count"):
        assert re.search(r"^" + re.escape(name) + r" ", text, re.MULTILINE), name
    assert metric(text, "mcserve:state_blocks_used", tier="device") == 0
    assert metric(text, "mcserve:state_blocks_total", tier="device") == 512
    assert metric(text, "mcserve:num_requests_running") == 0
    assert metric(text, "mcserve:request_success_total", finished_reason="length") >= 1
    assert metric(text, "mcserve:generation_tokens_total") >= 12
    assert metric(text, "mcserve:time_to_first_token_seconds_count") >= 1


def test_queue_full_is_429_with_retry_after(app_client: TestClient) -> None:
    aengine: AsyncEngine = app_client.app.state.async_engine  # type: ignore[attr-defined]
    old = aengine.max_waiting_requests
    aengine.max_waiting_requests = 0
    try:
        r = app_client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
    finally:
        aengine.max_waiting_requests = old
    assert r.status_code == 429 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["type"] == "rate_limit_error"


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


# --- fake engine: what the real one cannot be made to do -----------------------------------------


class FakeEngine:
    """The ``LLMEngine`` interface, instant and deterministic: completion token i of a request is
    ``ord('a') + (len(prompt) + i) % 26``, reported (with logprobs asked for) with logprob 0.0
    and the next letter as the alternative at -1.5. A prompt containing FAIL fails inside the
    engine after one token (``RequestOutput.error``); one containing CRASH makes ``step()``
    raise. Like the real engine it allows ``mc_top_k`` alone per request."""

    def __init__(self, max_model_len: int = 64, step_delay: float = 0.0):
        self.tokenizer = Tokenizer.byte_level()
        self.model_name = "fake"
        self.config = SimpleNamespace(max_model_len=max_model_len)
        self.step_delay = step_delay
        self.requests: dict[str, dict[str, Any]] = {}
        self.num_steps = 0
        self.aborted: list[str] = []
        self.thread_ids: set[int] = set()
        self.last_mc_overrides: dict | None = None

    def describe(self) -> str:
        return "fake engine"

    def add_request(self, request_id: str, prompt: str | None, params: Any, *,
                    prompt_token_ids: list[int] | None = None,
                    mc_overrides: dict | None = None) -> None:
        self.thread_ids.add(threading.get_ident())
        unknown = sorted(set(mc_overrides or ()) - {"mc_top_k"})
        if unknown:
            raise InvalidRequestError(f"unknown mc overrides {unknown}", param=unknown[0])
        self.last_mc_overrides = mc_overrides
        ids = prompt_token_ids if prompt_token_ids is not None else \
            self.tokenizer.encode(prompt or "")
        if not ids:
            raise InvalidRequestError("prompt must not be empty", param="prompt")
        self.requests[request_id] = {"prompt": prompt, "ids": list(ids), "params": params,
                                     "out": [[] for _ in range(params.n)]}

    def abort_request(self, request_id: str) -> None:
        self.thread_ids.add(threading.get_ident())
        if self.requests.pop(request_id, None) is not None:
            self.aborted.append(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[RequestOutput]:
        self.thread_ids.add(threading.get_ident())
        self.num_steps += 1
        if self.step_delay:
            time.sleep(self.step_delay)
        outs = []
        for rid, r in list(self.requests.items()):
            text = r["prompt"] or ""
            if "CRASH" in text:
                raise RuntimeError("injected step failure")
            error = None
            for toks in r["out"]:
                toks.append(ord("a") + (len(r["ids"]) + len(toks)) % 26)
            if "FAIL" in text:
                error = "RuntimeError: injected failure"
            done = error is not None or len(r["out"][0]) >= r["params"].max_tokens
            reason = "error" if error else ("length" if done else None)
            want_lp = r["params"].logprobs is not None
            outs.append(RequestOutput(
                request_id=rid, prompt=r["prompt"], prompt_token_ids=r["ids"],
                outputs=[CompletionOutput(index=i, text=bytes(t).decode(), token_ids=list(t),
                                          logprobs=[self._logprobs(x) for x in t] if want_lp
                                          else None,
                                          finish_reason=reason)
                         for i, t in enumerate(r["out"])],
                finished=done, error=error))
            if done:
                del self.requests[rid]
        return outs

    @staticmethod
    def _logprobs(token: int) -> dict[int, Logprob]:
        alt = token + 1
        return {token: Logprob(0.0, rank=1, decoded_token=chr(token)),
                alt: Logprob(-1.5, rank=2, decoded_token=chr(alt))}

    def stats(self) -> dict[str, int]:
        return {"num_requests_running": len(self.requests), "num_requests_waiting": 0,
                "state_blocks_used": len(self.requests), "state_blocks_total": 100}


@pytest.fixture
def fake() -> Iterator[tuple[FakeEngine, TestClient]]:
    engine = FakeEngine(step_delay=0.002)
    with TestClient(build_app(engine)) as client:
        yield engine, client


def test_failure_inside_one_request_fails_only_it(fake: tuple[FakeEngine, TestClient]) -> None:
    engine, client = fake

    def call(prompt: str, stream: bool = False) -> httpx.Response:
        return client.post("/v1/completions",
                           json={"prompt": prompt, "max_tokens": 20, "stream": stream})

    results: dict[str, Any] = {}
    threads = [threading.Thread(target=lambda p=p: results.__setitem__(p, call(p)))
               for p in ("ok one", "FAIL here", "ok two")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results["ok one"].status_code == 200
    assert results["ok two"].status_code == 200
    bad = results["FAIL here"]
    assert bad.status_code == 500 and "injected failure" in bad.json()["error"]["message"]
    streamed = sse_events(call("FAIL streamed", stream=True).text)
    assert streamed[-1] == "[DONE]" and "error" in streamed[-2]
    assert call("fine after").status_code == 200
    assert engine.thread_ids and len(engine.thread_ids) == 1  # one engine thread only


def test_step_exception_fails_requests_in_flight_not_server(
        fake: tuple[FakeEngine, TestClient]) -> None:
    _, client = fake
    r = client.post("/v1/completions", json={"prompt": "CRASH", "max_tokens": 3})
    assert r.status_code == 500 and r.json()["error"]["code"] == "engine_error"
    assert client.get("/health").status_code == 200
    ok = client.post("/v1/completions", json={"prompt": "after", "max_tokens": 3})
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "fgh"


def test_broken_engine_marks_server_unavailable() -> None:
    """A step that keeps raising even with nothing to fail: the engine thread stops, /health
    and new requests answer 503 with Retry-After, nothing hangs."""

    class Broken(FakeEngine):
        def abort_request(self, request_id: str) -> None:
            pass  # the broken request stays inside the engine

    engine = Broken()
    with TestClient(build_app(engine)) as client:
        r = client.post("/v1/completions", json={"prompt": "CRASH", "max_tokens": 3})
        assert r.status_code == 500
        deadline = time.monotonic() + 5
        while client.get("/health").status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.01)
        health = client.get("/health")
        assert health.status_code == 503 and "retry-after" in health.headers
        r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 3})
        assert r.status_code == 503 and r.headers["retry-after"] == "5"
        assert r.json()["error"]["type"] == "service_unavailable_error"


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


def test_logprob_objects_from_the_engine(fake: tuple[FakeEngine, TestClient]) -> None:
    """The engine reports ``Logprob`` objects; a logprob of exactly 0 stays 0."""
    _, client = fake
    out = client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 2,
                                                "logprobs": 1}).json()
    lp = out["choices"][0]["logprobs"]
    assert lp["tokens"] == ["c", "d"] and lp["token_logprobs"] == [0.0, 0.0]
    assert lp["top_logprobs"] == [{"c": 0.0, "d": -1.5}, {"d": 0.0, "e": -1.5}]
    chat = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "logprobs": True,
        "top_logprobs": 2}).json()
    content = chat["choices"][0]["logprobs"]["content"]
    assert [e["logprob"] for e in content] == [0.0, 0.0]
    assert [[t["logprob"] for t in e["top_logprobs"]] for e in content] == [[0.0, -1.5]] * 2
    assert content[0]["top_logprobs"][1]["token"] == chr(ord(content[0]["token"]) + 1)


def test_engine_thread_sleeps_when_idle(fake: tuple[FakeEngine, TestClient]) -> None:
    engine, client = fake
    assert client.post("/v1/completions", json={"prompt": "x", "max_tokens": 3}).status_code == 200
    steps = engine.num_steps
    time.sleep(0.3)
    assert engine.num_steps == steps  # no busy loop: no step without work


def test_async_engine_abort_and_shutdown() -> None:
    engine = FakeEngine(step_delay=0.01)
    aengine = AsyncEngine(engine, max_waiting_requests=8)
    from mcserve.engine.sampling import SamplingParams

    async def main() -> None:
        got = []
        async for out in aengine.generate("r1", "hello", SamplingParams(max_tokens=1000)):
            got.append(out)
            if len(got) == 3:
                break  # the consumer stops early: the request must be aborted
        deadline = time.monotonic() + 2
        while "r1" not in engine.aborted and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert "r1" in engine.aborted and not engine.requests
        with pytest.raises(ValueError, match="must not be empty"):
            async for _ in aengine.generate("r2", "", SamplingParams()):
                pass
        stream = aengine.submit("r3", "long", SamplingParams(max_tokens=10**6))
        await stream.wait_accepted()
        await aengine.shutdown(grace_s=0.05)
        assert not engine.requests and not aengine.is_running

    asyncio.run(main())


# --- a real server process -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny_model")
    torch.manual_seed(0)
    MCForCausalLM(TINY).save_pretrained(path)
    return path


class ServerProc:
    def __init__(self, proc: subprocess.Popen, url: str, log: Path):
        self.proc = proc
        self.url = url
        self.log = log


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    log = tmp_path_factory.mktemp("server") / "server.log"
    cmd = [sys.executable, "-m", "mcserve.server.cli_serve", str(model_dir),
           "--host", "127.0.0.1", "--port", "0", "--api-key", API_KEY,
           "--served-model-name", "tiny", "--max-model-len", "2048",
           "--num-state-blocks", "2048", "--max-num-seqs", "32",
           "--shutdown-timeout", "5"]
    with open(log, "w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines: list[str] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    deadline = time.monotonic() + 120
    url = None
    while time.monotonic() < deadline and url is None and proc.poll() is None:
        for line in lines:
            m = re.search(r"curl (http://127\.0\.0\.1:\d+)/v1/completions", line)
            if m:
                url = m.group(1)
        time.sleep(0.05)
    if url is None:
        proc.kill()
        pytest.fail(f"the server did not start: {log.read_text()[-3000:]}")
    printed = "".join(lines)
    assert "Authorization: Bearer" in printed and API_KEY not in printed  # never the key
    start_lines = [ln for ln in log.read_text().splitlines() if "listening on" in ln]
    assert len(start_lines) == 1 and url in start_lines[0]
    assert "mc=grm" in start_lines[0] and "device=cpu" in start_lines[0]
    srv = ServerProc(proc, url, log)
    yield srv
    if proc.poll() is None:
        proc.kill()
        proc.wait(10)


def metrics_text(server: ServerProc) -> str:
    return httpx.get(server.url + "/metrics", timeout=10).text


def wait_idle_metrics(server: ServerProc, timeout: float) -> tuple[float, str]:
    """Seconds until state_blocks_used and num_requests_running are both 0."""
    t0 = time.monotonic()
    while True:
        text = metrics_text(server)
        if metric(text, "mcserve:state_blocks_used", tier="device") == 0 and \
                metric(text, "mcserve:num_requests_running") == 0:
            return time.monotonic() - t0, text
        if time.monotonic() - t0 > timeout:
            return time.monotonic() - t0, text
        time.sleep(0.02)


def test_openai_client(server: ServerProc) -> None:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)
    assert [m.id for m in client.models.list()] == ["tiny"]

    plain = client.completions.create(model="tiny", prompt="Memory caching", max_tokens=8,
                                      temperature=0)
    text = plain.choices[0].text
    assert plain.usage is not None and plain.usage.completion_tokens == 8

    two = client.completions.create(model="tiny", prompt="Memory caching", max_tokens=8,
                                    temperature=0, n=2)
    assert [c.text for c in two.choices] == [text, text]

    stop = text[2:4]
    cut = client.completions.create(model="tiny", prompt="Memory caching", max_tokens=8,
                                    temperature=0, stop=[stop])
    assert cut.choices[0].text == text[:text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"

    lp = client.completions.create(model="tiny", prompt="Memory caching", max_tokens=4,
                                   temperature=0, logprobs=2)
    assert lp.choices[0].logprobs is not None
    assert len(lp.choices[0].logprobs.tokens) == 4

    echo = client.completions.create(model="tiny", prompt="Memory caching", max_tokens=1,
                                     temperature=0, logprobs=1, echo=True)
    elp = echo.choices[0].logprobs
    assert echo.choices[0].text.startswith("Memory caching")
    assert elp.token_logprobs[0] is None and len(elp.tokens) == len("Memory caching") + 1

    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(model="tiny", prompt="Memory caching",
                                           max_tokens=8, temperature=0, stream=True)
        if c.choices)
    assert streamed == text

    msgs = [{"role": "user", "content": "Hello there"}]
    chat = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=8,
                                          temperature=0)
    chat_text = chat.choices[0].message.content
    chunks = list(client.chat.completions.create(
        model="tiny", messages=msgs, max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat_text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8

    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=1)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="x", max_tokens=-1)
    bad_key = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad_key.models.list()
    extra = client.completions.create(model="tiny", prompt="x", max_tokens=1,
                                      extra_body={"top_k": 5, "min_p": 0.1})
    assert extra.choices[0].finish_reason == "length"


async def _stream_one(client: httpx.AsyncClient, url: str, i: int) -> tuple[str, str | None]:
    body = {"model": "tiny", "prompt": f"client {i} says", "max_tokens": 12,
            "temperature": 0, "stream": True}
    text, finish = [], None
    async with client.stream("POST", url + "/v1/completions", json=body, headers=AUTH) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                break
            for ch in json.loads(data)["choices"]:
                text.append(ch["text"])
                finish = ch["finish_reason"] or finish
    return "".join(text), finish


def test_32_concurrent_streaming_clients(server: ServerProc) -> None:
    async def main() -> list[tuple[str, str | None]]:
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            return await asyncio.gather(*(_stream_one(client, server.url, i) for i in range(32)))

    results = asyncio.run(main())
    assert len(results) == 32
    assert all(finish == "length" and len(text) > 0 for text, finish in results)
    # the same prompt alone gives the same greedy text
    alone = httpx.post(server.url + "/v1/completions", headers=AUTH, timeout=60, json={
        "prompt": "client 5 says", "max_tokens": 12, "temperature": 0}).json()
    assert alone["choices"][0]["text"] == results[5][0]
    elapsed, text = wait_idle_metrics(server, timeout=5)
    assert metric(text, "mcserve:state_blocks_used", tier="device") == 0
    assert metric(text, "mcserve:num_requests_running") == 0


def test_20_clients_disconnect_mid_stream(server: ServerProc) -> None:
    text = metrics_text(server)
    before = metric(text, "mcserve:request_success_total", finished_reason="abort") \
        if 'finished_reason="abort"' in text else 0.0

    async def main() -> tuple[list[int], str]:
        ready: list[int] = []
        all_ready, release = asyncio.Event(), asyncio.Event()

        async def drop(client: httpx.AsyncClient, i: int) -> int:
            body = {"model": "tiny", "prompt": f"a long story number {i} " * 2,
                    "max_tokens": 1500, "temperature": 0, "stream": True, "ignore_eos": True}
            seen = 0
            async with client.stream("POST", server.url + "/v1/completions", json=body,
                                     headers=AUTH) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        seen += 1
                        if seen == 3:
                            ready.append(i)
                            if len(ready) == 20:
                                all_ready.set()
                            await release.wait()
                            break  # leaving the block closes the connection mid-stream
            return seen

        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=64)) as c:
            tasks = [asyncio.ensure_future(drop(c, i)) for i in range(20)]
            await asyncio.wait_for(all_ready.wait(), 60)
            t0 = time.perf_counter()
            during = (await c.get(server.url + "/metrics")).text
            health = await c.get(server.url + "/health")
            # HTTP stays responsive while the engine computes 20 streams
            assert health.status_code == 200 and time.perf_counter() - t0 < 1.0
            release.set()
            return list(await asyncio.gather(*tasks)), during

    seen, during = asyncio.run(main())
    assert all(s == 3 for s in seen)
    # all 20 were running and held state blocks when they dropped
    assert metric(during, "mcserve:num_requests_running") == 20
    assert metric(during, "mcserve:state_blocks_used", tier="device") > 0
    elapsed, text = wait_idle_metrics(server, timeout=1.0)
    assert metric(text, "mcserve:state_blocks_used", tier="device") == 0, text
    assert metric(text, "mcserve:num_requests_running") == 0
    assert elapsed <= 1.0
    aborted = metric(text, "mcserve:request_success_total", finished_reason="abort")
    assert aborted - before == 20
    # and the server keeps serving
    ok = httpx.post(server.url + "/v1/completions", headers=AUTH, timeout=60,
                    json={"prompt": "still there?", "max_tokens": 4})
    assert ok.status_code == 200


def test_non_streaming_client_disconnect_aborts(server: ServerProc) -> None:
    text = metrics_text(server)
    before = metric(text, "mcserve:request_success_total", finished_reason="abort") \
        if 'finished_reason="abort"' in text else 0.0
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes its connection
        httpx.post(server.url + "/v1/completions", headers=AUTH, timeout=httpx.Timeout(
            60, read=0.5), json={"prompt": "wait for me", "max_tokens": 2000,
                                 "ignore_eos": True})
    elapsed, text = wait_idle_metrics(server, timeout=1.0)
    assert metric(text, "mcserve:num_requests_running") == 0 and elapsed <= 1.0
    assert metric(text, "mcserve:request_success_total", finished_reason="abort") == before + 1


def test_sigterm_graceful_exit_zero(server: ServerProc) -> None:
    """Runs last: SIGTERM while a request streams; it finishes or is aborted, exit status 0."""
    result: dict[str, Any] = {}

    def stream() -> None:
        try:
            with httpx.stream("POST", server.url + "/v1/completions", headers=AUTH, timeout=30,
                              json={"prompt": "bye", "max_tokens": 30, "stream": True}) as r:
                result["body"] = "".join(r.iter_lines())
        except httpx.HTTPError as e:
            result["error"] = e

    t = threading.Thread(target=stream)
    t.start()
    time.sleep(0.3)
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(30) == 0, server.log.read_text()[-3000:]
    t.join(30)
    assert "Traceback" not in server.log.read_text()
    assert result.get("body", "").endswith("data: [DONE]")  # the in-flight request finished


def test_overflowing_model_answers_a_clear_500_and_stays_up() -> None:
    """A model whose logits are NaN (a state that overflowed; here a poisoned final norm): the
    request fails with the engine's message in OpenAI's error shape, streamed or not, and the
    server keeps serving."""
    engine = tiny_engine()
    with torch.no_grad():
        engine.model.norm.weight.fill_(float("nan"))
    with TestClient(build_app(engine)) as client:
        r = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3})
        assert r.status_code == 500
        err = r.json()["error"]
        assert err["code"] == "engine_error" and "not finite" in err["message"]
        events = sse_events(client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
            "stream": True}).text)
        assert events[-1] == "[DONE]" and "not finite" in events[-2]["error"]["message"]
        assert client.get("/health").status_code == 200
        assert engine.cache.is_whole()


# --- client input that must never earn a 500 -----------------------------------------------------


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


def test_top_p_that_underflows_is_served(app_client: TestClient) -> None:
    """top_p=1e-300 is 0 in float32: the top token must stay, not every token be masked."""
    for top_p in (1e-300, 5e-324, 1e-45):
        out = post(app_client, "/v1/completions", {"prompt": "hi", "max_tokens": 3,
                                                   "top_p": top_p, "ignore_eos": True})
        assert out["usage"]["completion_tokens"] == 3
    greedy = post(app_client, "/v1/completions", {"prompt": "hi", "max_tokens": 3,
                                                  "temperature": 0})
    tiny = post(app_client, "/v1/completions", {"prompt": "hi", "max_tokens": 3,
                                                "top_p": 1e-300, "seed": 1})
    assert tiny["choices"][0]["text"] == greedy["choices"][0]["text"]  # only the top token


def test_max_tokens_null_is_the_default_16(app_client: TestClient) -> None:
    out = post(app_client, "/v1/completions", {"prompt": "hi", "max_tokens": None,
                                               "ignore_eos": True})
    assert out["usage"]["completion_tokens"] == 16
    assert out["choices"][0]["finish_reason"] == "length"


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


def test_models_report_the_training_length(app_client: TestClient) -> None:
    card = app_client.get("/v1/models").json()["data"][0]
    assert card["max_model_len"] == MAX_MODEL_LEN
    assert card["max_position_embeddings"] == TINY.max_position_embeddings


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


def test_shutdown_answers_the_requests_it_aborts() -> None:
    """Requests still running when the engine shuts down are told so: the consumer's next read
    raises ``EngineShutdownError`` (a 503 or an SSE error event), never a mute end."""
    from mcserve.engine.sampling import SamplingParams
    from mcserve.server.async_engine import EngineShutdownError

    engine = FakeEngine(step_delay=0.005)
    aengine = AsyncEngine(engine)

    async def main() -> None:
        streams = [aengine.submit(f"r{i}", "long", SamplingParams(max_tokens=10**6))
                   for i in range(3)]
        for s in streams:
            await s.wait_accepted()
        await anext(streams[0])
        aengine.stop_accepting()
        assert aengine.abort_all("bye") == 3
        for s in streams:
            with pytest.raises(EngineShutdownError, match="bye"):
                async for _ in s:
                    pass
        await aengine.shutdown()
        assert not engine.requests and set(engine.aborted) == {"r0", "r1", "r2"}

    asyncio.run(main())


def test_drain_answers_streams_and_plain_requests() -> None:
    """``drain`` (what SIGTERM runs): health 503 at once, requests past the grace period aborted
    and answered (503 JSON, or an SSE error event then [DONE]), then nothing left in flight."""
    engine = FakeEngine(max_model_len=10**6, step_delay=0.01)
    app = build_app(engine, shutdown_grace_s=0.2)
    results: dict[str, Any] = {}
    with TestClient(app) as client:
        def plain() -> None:
            results["plain"] = client.post("/v1/completions",
                                           json={"prompt": "p", "max_tokens": 10**5})

        def stream(path: str, body: dict[str, Any]) -> None:
            with client.stream("POST", path, json={**body, "max_tokens": 10**5,
                                                   "stream": True}) as r:
                results[path] = sse_events("".join(r.iter_text()))

        threads = [threading.Thread(target=plain),
                   threading.Thread(target=stream, args=("/v1/completions", {"prompt": "s"})),
                   threading.Thread(target=stream, args=("/v1/chat/completions", {
                       "messages": [{"role": "user", "content": "c"}]}))]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 5
        while app.state.async_engine.num_in_flight < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        drain = threading.Thread(target=client.portal.call, args=(app.state.drain,))
        drain.start()
        time.sleep(0.05)
        assert client.get("/health").status_code == 503
        late = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert late.status_code == 503 and late.headers["retry-after"] == "5"
        drain.join(10)
        for t in threads:
            t.join(10)
        assert app.state.server.http_in_flight == 0
    r = results["plain"]
    assert r.status_code == 503 and r.headers["retry-after"] == "5"
    assert r.json()["error"]["type"] == "service_unavailable_error"
    for path in ("/v1/completions", "/v1/chat/completions"):
        events = results[path]
        assert events[-1] == "[DONE]", events[-3:]
        assert events[-2]["error"]["code"] == "unavailable", events[-3:]
