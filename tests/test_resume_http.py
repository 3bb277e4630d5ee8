"""Resume points over HTTP: a chat's next turn, and another conversation with the same system
prompt, compute only their new tokens (``usage.prompt_tokens_details.cached_tokens``), with
the answers of a server that reuses nothing; a restarted server with ``state_cache_dir``
resumes a known conversation from disk. The embedded default model and its chat template."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from mcserve.config import EngineConfig  # noqa: E402
from mcserve.engine.llm_engine import LLMEngine  # noqa: E402
from mcserve.server.app import build_app  # noqa: E402

SYSTEM = ("You are a helpful assistant who answers in the manner of a Victorian novelist, "
          "with long sentences and many commas. ") * 3


def client_for(**config: Any) -> TestClient:
    eng = LLMEngine(EngineConfig(max_model_len=2048, max_num_seqs=4, **config))
    return TestClient(build_app(eng))


@pytest.fixture(scope="module")
def clients() -> Iterator[tuple[TestClient, TestClient]]:
    with client_for() as on, client_for(enable_prefix_caching=False) as off:
        yield on, off


def chat(client: TestClient, messages: list[dict], stream: bool) -> tuple[str, dict]:
    body = {"model": "mcserve-default", "messages": messages, "max_tokens": 12,
            "temperature": 0}
    if not stream:
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        out = r.json()
        return out["choices"][0]["message"]["content"], out["usage"]
    body.update(stream=True, stream_options={"include_usage": True})
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    chunks = [json.loads(line[6:]) for line in r.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    text = "".join(c["choices"][0]["delta"].get("content") or ""
                   for c in chunks if c["choices"])
    return text, chunks[-1]["usage"]


def metric(client: TestClient, name: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


@pytest.mark.parametrize("stream", [False, True])
def test_each_turn_computes_only_its_new_tokens(clients, stream):
    on, off = clients
    msgs = [{"role": "system", "content": SYSTEM}]
    prev = None
    for turn in range(4):
        msgs.append({"role": "user", "content": f"Tell me about the weather on day {turn}, "
                     f"and of the roads to town after the rain of day {turn}."})
        text, usage = chat(on, msgs, stream)
        want, usage_off = chat(off, msgs, stream)
        assert text == want, turn  # the same greedy answer as a server that reuses nothing
        assert usage_off["prompt_tokens_details"]["cached_tokens"] == 0
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        if prev is not None:
            assert cached >= prev - 4, (turn, cached, prev)
        prev = usage["prompt_tokens"]
        msgs.append({"role": "assistant", "content": text})
    assert metric(on, "mcserve:prompt_tokens_cached_total") > 0
    assert metric(on, "mcserve:resume_points_taken_total") > 0
    assert metric(off, "mcserve:prompt_tokens_cached_total") == 0


def test_shared_system_prompt_hits_exactly_at_its_end(clients):
    on, off = clients
    tok = on.app.state.mcserve.tokenizer if hasattr(on.app.state, "mcserve") else None
    first = [{"role": "system", "content": SYSTEM},
             {"role": "user", "content": "Where is the station?"}]
    chat(on, first, False)
    other = [{"role": "system", "content": SYSTEM},
             {"role": "user", "content": "What does the vicar eat for breakfast?"}]
    text, usage = chat(on, other, False)
    assert text == chat(off, other, False)[0]
    eng_tok = LLMEngine(EngineConfig(max_model_len=64)).tokenizer if tok is None else tok
    sys_ids = eng_tok.encode(eng_tok.apply_chat_template(other[:1], add_generation_prompt=False),
                             add_special_tokens=False)
    assert usage["prompt_tokens_details"]["cached_tokens"] == len(sys_ids)


def test_restarted_server_resumes_from_disk(tmp_path):
    msgs = [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": "How far is it to Meryton?"}]
    with client_for(state_cache_dir=str(tmp_path)) as c:
        text, usage = chat(c, msgs, False)
    assert list(tmp_path.glob("*.safetensors")), "shutdown writes the resume points"
    msgs += [{"role": "assistant", "content": text},
             {"role": "user", "content": "And to London?"}]
    with client_for(state_cache_dir=str(tmp_path)) as c:
        text2, usage2 = chat(c, msgs, False)
        assert usage2["prompt_tokens_details"]["cached_tokens"] >= usage["prompt_tokens"] - 4
        assert metric(c, "mcserve:resume_points_loaded_disk_total") == 1
    with client_for(enable_prefix_caching=False) as off:
        assert chat(off, msgs, False)[0] == text2
