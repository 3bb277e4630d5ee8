"""A real uvicorn server process: the openai client, concurrent and dropped streams, SIGTERM."""

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
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

import torch  # noqa: E402
from server_helpers import API_KEY, AUTH, TINY, metric  # noqa: E402

from mcserve.models.native import MCForCausalLM  # noqa: E402


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
