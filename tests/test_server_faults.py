"""Engine failures and shutdown: a failing request or step, a NaN model, idling, aborts, drain."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

import torch  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402
from server_helpers import FakeEngine, fake_app_client, sse_events, tiny_engine  # noqa: E402

from mcserve.server.app import build_app  # noqa: E402
from mcserve.server.async_engine import AsyncEngine  # noqa: E402


@pytest.fixture
def fake() -> Iterator[tuple[FakeEngine, TestClient]]:
    yield from fake_app_client()


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
