"""Endpoints of the in-process app over the real engine: completions, chat, streams, metrics."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")

from fastapi.testclient import TestClient  # noqa: E402
from server_helpers import (  # noqa: E402
    MAX_MODEL_LEN,
    TINY,
    FakeEngine,
    fake_app_client,
    metric,
    sse_events,
    tiny_app_client,
    tiny_engine,
)

from mcserve.server.app import build_app  # noqa: E402
from mcserve.server.async_engine import AsyncEngine  # noqa: E402


@pytest.fixture(scope="module")
def app_client() -> Iterator[TestClient]:
    yield from tiny_app_client()


@pytest.fixture
def fake() -> Iterator[tuple[FakeEngine, TestClient]]:
    yield from fake_app_client()


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


def test_models_report_the_training_length(app_client: TestClient) -> None:
    card = app_client.get("/v1/models").json()["data"][0]
    assert card["max_model_len"] == MAX_MODEL_LEN
    assert card["max_position_embeddings"] == TINY.max_position_embeddings
