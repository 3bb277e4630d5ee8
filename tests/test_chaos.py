"""Soak and fault suite against a real ``mcserve serve`` process (the embedded default model, on
127.0.0.1 and a free port).

* one large prompt must not freeze the others: ``/health`` probes stay fast while multi-MB
  prompts are refused or tokenized;
* 32 concurrent clients send a bounded mix of valid and hostile requests, some dropping their
  stream midway: no 5xx, every stream read to its end ends with an event a client can parse, and
  afterwards no state block, slot or request is left held;
* SIGTERM in the middle of traffic: ``/health`` answers 503 while draining, every stream in flight
  ends with a final event, every plain request gets an answer, and the process exits 0;
* a restart serves again (and its printed curl line works), and a SIGTERM while idle exits at once.

No server log may hold a traceback. Every loop is bounded in requests and in time.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

SHUTDOWN_S = 1.0  # --shutdown-timeout: the grace of requests in flight at SIGTERM
CLIENTS = 32
REQUESTS_PER_CLIENT = 8
SERVER_ARGS = ["--host", "127.0.0.1", "--port", "0", "--max-num-seqs", "32",
               "--num-state-blocks", "512", "--max-waiting-requests", "256",
               "--shutdown-timeout", str(SHUTDOWN_S)]


class Server:
    def __init__(self, proc: subprocess.Popen, url: str, log: Path, curl: str):
        self.proc = proc
        self.url = url
        self.log = log
        self.curl = curl

    def metrics(self) -> str:
        return httpx.get(self.url + "/metrics", timeout=10).text

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait(10)


def start_server(log: Path) -> Server:
    cmd = [sys.executable, "-m", "mcserve.server.cli_serve", *SERVER_ARGS]
    with open(log, "w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines: list[str] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        for line in list(lines):
            m = re.search(r"curl (http://127\.0\.0\.1:\d+)/v1/completions", line)
            if m:
                return Server(proc, m.group(1), log, line.strip())
        time.sleep(0.05)
    proc.kill()
    pytest.fail(f"the server did not start: {log.read_text()[-3000:]}")


def metric(text: str, name: str, **labels: str) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    pattern = re.escape(name) + (r"\{" + re.escape(want) + r"\}" if want else "") + r" (\S+)"
    m = re.search(r"^" + pattern + r"$", text, re.MULTILINE)
    assert m is not None, f"{name}{{{want}}} not in metrics"
    return float(m.group(1))


HELD = [("mcserve:state_blocks_used", {"tier": "device"}), ("mcserve:state_slots_used", {}),
        ("mcserve:num_requests_in_flight", {}), ("mcserve:num_requests_running", {}),
        ("mcserve:num_requests_waiting", {})]


def wait_nothing_held(server: Server, timeout: float) -> dict[str, float]:
    """The gauges of what requests hold, once they are all 0 (or at ``timeout``)."""
    deadline = time.monotonic() + timeout
    while True:
        text = server.metrics()
        held = {name: metric(text, name, **labels) for name, labels in HELD}
        if not any(held.values()) or time.monotonic() > deadline:
            return held
        time.sleep(0.05)


def assert_no_traceback(server: Server) -> None:
    log = server.log.read_text()
    assert "Traceback" not in log, log[-4000:]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(tmp_path_factory.mktemp("chaos") / "server.log")
    yield srv
    srv.stop()


# --- one large request does not freeze the others ------------------------------------------------


def _text(n: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    words = ["memory", "caching", "the", "state", "of", "a", "recurrent", "model", "is", "12345"]
    out: list[str] = []
    size = 0
    while size < n:
        w = rng.choice(words)
        out.append(w)
        size += len(w) + 1
    return " ".join(out)[:n]


def test_big_prompts_do_not_stall_health(server: Server) -> None:
    """Multi-MB prompts (under the body limit, over the context) are refused while ``/health``
    probes stay fast: the prompt that is provably too long by its size is refused at once, the
    others are tokenized on a worker thread that releases the GIL."""
    big = _text(3_900_000)
    mid = _text(1_300_000, seed=1)  # under the size bound: really tokenized
    requests = [
        ("/v1/completions", {"prompt": big, "max_tokens": 4}, "prompt"),
        ("/v1/completions", {"prompt": mid, "max_tokens": 4}, "prompt"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": mid}],
                                  "max_tokens": 4}, "messages"),
        ("/tokenize", {"prompt": mid}, None),
    ]

    async def main() -> tuple[list[float], list[tuple[int, Any, float]], list[float]]:
        probes: list[float] = []
        gaps: list[float] = []
        done = asyncio.Event()
        async with httpx.AsyncClient(timeout=60) as client:
            async def probe() -> None:
                while not done.is_set():
                    t = time.perf_counter()
                    r = await client.get(server.url + "/health")
                    probes.append(time.perf_counter() - t)
                    assert r.status_code == 200
                    await asyncio.sleep(0.02)

            async def stream() -> None:  # a stream running meanwhile keeps flowing
                body = {"prompt": "a stream beside", "max_tokens": 400, "ignore_eos": True,
                        "stream": True}
                async with client.stream("POST", server.url + "/v1/completions",
                                         json=body) as r:
                    last = None
                    async for line in r.aiter_lines():
                        now = time.perf_counter()
                        if line.startswith("data: ") and last is not None and not done.is_set():
                            gaps.append(now - last)
                        last = now

            tasks = [asyncio.ensure_future(probe()), asyncio.ensure_future(stream())]
            await asyncio.sleep(0.3)
            answers = []
            for path, body, _ in requests:
                raw = json.dumps(body).encode()
                t = time.perf_counter()
                r = await client.post(server.url + path, content=raw,
                                      headers={"Content-Type": "application/json"})
                answers.append((r.status_code, r.json(), time.perf_counter() - t))
            done.set()
            await asyncio.wait_for(asyncio.gather(*tasks), 120)
        return probes, answers, gaps

    probes, answers, gaps = asyncio.run(main())
    for (_, _, param), (status, body, _) in zip(requests, answers, strict=True):
        if param is None:
            assert status == 200 and body["count"] > 100_000
        else:
            assert status == 400 and body["error"]["param"] == param, body
            assert "max_model_len" in body["error"]["message"]
    assert answers[0][2] < 1.0  # refused by its size alone, before any tokenizer
    assert len(probes) >= 10
    # a tokenization on the event loop or the engine thread holds the GIL for a second or more
    # per MB: one probe would wait that long
    assert statistics.median(probes) < 0.1 and max(probes) < 0.5, sorted(probes)[-5:]
    assert not gaps or max(gaps) < 0.5, sorted(gaps)[-5:]


def test_huge_structures_do_not_stall_health(server: Server) -> None:
    """4 MB bodies of many tiny JSON values are refused with a 400 naming the field while
    ``/health`` probes stay fast: ``json.loads`` and pydantic hold the GIL for as long as they
    run (a quarter of a second to parse 400,000 one-id prompts, half a second to validate
    110,000 chat messages), so the caps are checked on the raw body, before either runs."""
    compact = (",", ":")
    cmpl = json.dumps({"prompt": [[123456]] * 400_000, "max_tokens": 4},
                      separators=compact).encode()
    chat = json.dumps({"messages": [{"role": "user", "content": "hello"}] * 110_000,
                       "max_tokens": 2}, separators=compact).encode()
    assert 3_500_000 < len(cmpl) < 4 * 2**20 and 3_500_000 < len(chat) < 4 * 2**20
    rounds = 3

    async def main() -> tuple[list[float], list[tuple[str, int, Any, float]]]:
        probes: list[float] = []
        done = asyncio.Event()
        async with httpx.AsyncClient(timeout=60) as client:
            async def probe() -> None:
                while not done.is_set():
                    t = time.perf_counter()
                    r = await client.get(server.url + "/health")
                    probes.append(time.perf_counter() - t)
                    assert r.status_code == 200
                    await asyncio.sleep(0.02)

            async def send(path: str, raw: bytes, param: str) -> tuple[str, int, Any, float]:
                t = time.perf_counter()
                r = await client.post(server.url + path, content=raw,
                                      headers={"Content-Type": "application/json"})
                return param, r.status_code, r.json(), time.perf_counter() - t

            task = asyncio.ensure_future(probe())
            await asyncio.sleep(0.3)
            answers = []
            for _ in range(rounds):  # both bodies at once: their costs would add up
                answers += await asyncio.gather(send("/v1/completions", cmpl, "prompt"),
                                                send("/v1/chat/completions", chat, "messages"))
                await asyncio.sleep(0.1)
            done.set()
            await asyncio.wait_for(task, 30)
        return probes, answers

    probes, answers = asyncio.run(main())
    print(f"huge structures: answers in {[round(a[3], 3) for a in answers]} s; /health median "
          f"{statistics.median(probes) * 1e3:.1f} ms, max {max(probes) * 1e3:.1f} ms "
          f"({len(probes)} probes)")
    for param, status, body, _ in answers:
        assert status == 400 and body["error"]["param"] == param, body
        assert body["error"]["message"].startswith(f"{param}: "), body
    assert len(probes) >= 10
    assert statistics.median(probes) < 0.1 and max(probes) < 0.5, sorted(probes)[-5:]
    assert_no_traceback(server)


# --- soak: mixed valid and hostile traffic -------------------------------------------------------

# (kind, body or raw bytes); a str body is sent as raw bytes with a JSON content type
VALID: list[tuple[str, Any]] = [
    ("cmpl", {"prompt": "Memory caching", "max_tokens": 8}),
    ("cmpl", {"prompt": ["one", "two"], "max_tokens": 4, "n": 2, "temperature": 0.7,
              "seed": 3}),
    ("cmpl", {"prompt": [72, 105], "max_tokens": 4, "logprobs": 2, "echo": True}),
    ("cmpl", {"prompt": "echo only", "max_tokens": 0, "echo": True, "logprobs": 1}),
    ("cmpl", {"prompt": "stop here", "max_tokens": 12, "stop": [" ", "e"], "top_k": 5}),
    ("cmpl", {"prompt": "unicode ✓ 漢字 🙂", "max_tokens": 6, "top_p": 1e-300}),
    ("cmpl", {"prompt": "tiny temperature", "max_tokens": 6, "temperature": 1e-300}),
    ("cmpl", {"prompt": "null max", "max_tokens": None}),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}),
    ("chat", {"messages": [{"role": "system", "content": "be brief"},
                           {"role": "user", "content": [{"type": "text", "text": "hi"}]}],
              "max_tokens": 6, "logprobs": True, "top_logprobs": 2}),
]
STREAMS: list[tuple[str, Any]] = [
    ("cmpl", {"prompt": "stream me", "max_tokens": 16, "stream": True}),
    ("cmpl", {"prompt": ["a", "b"], "max_tokens": 8, "n": 2, "stream": True,
              "stream_options": {"include_usage": True}}),
    ("chat", {"messages": [{"role": "user", "content": "stream"}], "max_tokens": 16,
              "stream": True}),
    ("cmpl", {"prompt": "long stream", "max_tokens": 200, "ignore_eos": True, "stream": True}),
]
HOSTILE: list[tuple[str, Any]] = [
    ("cmpl", '{"prompt": "a\\ud800b", "max_tokens": 2}'),
    ("chat", '{"messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 2}'),
    ("cmpl", '{"prompt": "x", "temperature": NaN}'),
    ("cmpl", '{"prompt": "x", "max_tokens": 1e999}'),
    ("cmpl", '{"prompt": '),
    ("cmpl", "\x00\xff garbage"),
    ("cmpl", "[]"),
    ("cmpl", {"prompt": {"nested": True}}),
    ("cmpl", {"prompt": ""}),
    ("cmpl", {"prompt": []}),
    ("cmpl", {"prompt": [[]]}),
    ("cmpl", {"prompt": [10**12]}),
    ("cmpl", {"prompt": [-1]}),
    ("cmpl", {"prompt": [1, "x"] * 1000}),
    ("cmpl", {"prompt": [[1]] * 300}),
    ("cmpl", {"prompt": "x", "max_tokens": 10**9}),
    ("cmpl", {"prompt": "x", "max_tokens": -1}),
    ("cmpl", {"prompt": "x", "max_tokens": 0}),
    ("cmpl", {"prompt": "x", "n": 0}),
    ("cmpl", {"prompt": "x", "n": 10**6}),
    ("cmpl", {"prompt": "x", "logprobs": 10**6}),
    ("cmpl", {"prompt": "x", "top_p": 0}),
    ("cmpl", {"prompt": "x", "top_k": -2}),
    ("cmpl", {"prompt": "x", "temperature": -1}),
    ("cmpl", {"prompt": "x", "repetition_penalty": 0}),
    ("cmpl", {"prompt": "x", "seed": 2**70}),
    ("cmpl", {"prompt": "x", "stop": ["s"] * 100}),
    ("cmpl", {"prompt": "x", "stop_token_ids": [-1]}),
    ("cmpl", {"prompt": "x", "logit_bias": {"1": 5}}),
    ("cmpl", {"prompt": "x", "mc_top_k": 4}),
    ("cmpl", {"prompt": "x", "segment_len": 3}),
    ("cmpl", {"prompt": "x", "mc_overrides": {"mc_variant": "ssc"}}),
    ("cmpl", {"prompt": "x", "stream": "yes"}),
    ("cmpl", {"prompt": "x", "stream_options": {"include_usage": True}}),
    ("cmpl", {"prompt": "x", "model": "gpt-4"}),
    ("cmpl", {"prompt": "x", "suffix": "y"}),
    ("cmpl", {"prompt": "x", "best_of": 3}),
    ("chat", {"messages": []}),
    ("chat", {"messages": [{"role": "wizard", "content": "x"}]}),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "x"}]}),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}),
    ("chat", {"messages": [{"role": "user", "content": "x"}],
              "response_format": {"type": "json_schema",
                                  "json_schema": {"name": "x", "schema": {"type": "wat"}}}}),
    ("chat", {"messages": [{"role": "user", "content": "x"}],
              "structured_outputs": {"grammar": "start: undefined"}}),
    ("chat", {"messages": [{"role": "user", "content": "x"}] * 20000, "max_tokens": 2}),
    ("tokenize", {"prompt": "a\ud800b"}),
    ("tokenize", {}),
    ("detokenize", {"tokens": [10**9]}),
    ("detokenize", {"tokens": [1, "x"]}),
]
PATHS = {"cmpl": "/v1/completions", "chat": "/v1/chat/completions", "tokenize": "/tokenize",
         "detokenize": "/detokenize"}


def stream_outcome(lines: list[str]) -> str:
    """How a stream read to its end ended: "done" (a final chunk with finish_reason for every
    choice, then [DONE]), "error" (an error event, then [DONE]) or what is wrong with it."""
    events = [ln[len("data: "):] for ln in lines if ln.startswith("data: ")]
    if not events or events[-1] != "[DONE]":
        return f"no [DONE]: {events[-2:]}"
    payloads = [json.loads(e) for e in events[:-1]]
    if payloads and "error" in payloads[-1]:
        err = payloads[-1]["error"]
        assert {"message", "type", "param", "code"} <= set(err)
        return "error"
    open_choices: dict[int, bool] = {}
    for p in payloads:
        for ch in p.get("choices", []):
            open_choices[ch["index"]] = ch.get("finish_reason") is None
    if open_choices and not any(open_choices.values()):
        return "done"
    return f"choices without finish_reason: {open_choices}"


async def one_request(client: httpx.AsyncClient, url: str, kind: str, body: Any,
                      drop_after: int | None) -> tuple[int, str]:
    """(status, outcome) of one request; ``drop_after``: close a stream after that many events."""
    path = url + PATHS[kind]
    if isinstance(body, str):
        kw: dict[str, Any] = {"content": body.encode("utf-8", "surrogatepass"),
                              "headers": {"Content-Type": "application/json"}}
    else:
        kw = {"content": json.dumps(body).encode(), "headers": {"Content-Type":
                                                                "application/json"}}
    if not (isinstance(body, dict) and body.get("stream") is True):
        r = await client.post(path, **kw)
        if r.status_code >= 400:
            err = r.json()["error"]  # OpenAI's shape, always
            assert set(err) == {"message", "type", "param", "code"}
        return r.status_code, "answered"
    async with client.stream("POST", path, **kw) as r:
        if r.status_code != 200:
            await r.aread()
            return r.status_code, "answered"
        lines: list[str] = []
        async for line in r.aiter_lines():
            lines.append(line)
            if drop_after is not None and sum(ln.startswith("data: ") for ln in lines) \
                    >= drop_after:
                return 200, "dropped"
    return 200, stream_outcome(lines)


def test_soak_mixed_traffic(server: Server) -> None:
    rng = random.Random(1234)
    plan: list[list[tuple[str, Any, int | None]]] = []
    for _ in range(CLIENTS):
        reqs = []
        for _ in range(REQUESTS_PER_CLIENT):
            pick = rng.random()
            if pick < 0.35:
                kind, body = rng.choice(HOSTILE)
                reqs.append((kind, body, None))
            elif pick < 0.65:
                kind, body = rng.choice(STREAMS)
                reqs.append((kind, body, rng.choice([None, None, 1, 2, 3])))
            else:
                kind, body = rng.choice(VALID)
                reqs.append((kind, body, None))
        plan.append(reqs)

    async def client_run(client: httpx.AsyncClient,
                         reqs: list[tuple[str, Any, int | None]]) -> list[tuple[int, str]]:
        return [await one_request(client, server.url, kind, body, drop)
                for kind, body, drop in reqs]

    async def main() -> list[list[tuple[int, str]]]:
        limits = httpx.Limits(max_connections=CLIENTS * 2)
        async with httpx.AsyncClient(timeout=60, limits=limits) as client:
            runs = [client_run(client, reqs) for reqs in plan]
            return await asyncio.wait_for(asyncio.gather(*runs), 150)

    t0 = time.monotonic()
    results = [r for run in asyncio.run(main()) for r in run]
    elapsed = time.monotonic() - t0
    assert len(results) == CLIENTS * REQUESTS_PER_CLIENT
    statuses = sorted({s for s, _ in results})
    assert all(s < 500 for s in statuses), statuses
    outcomes = [o for _, o in results]
    bad = [o for o in outcomes if o not in ("answered", "dropped", "done", "error")]
    assert not bad, bad[:5]
    assert outcomes.count("done") > 10 and outcomes.count("dropped") > 5
    assert any(400 <= s < 500 for s in statuses) and 200 in statuses
    held = wait_nothing_held(server, timeout=5)
    assert not any(held.values()), held
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    assert_no_traceback(server)
    print(f"soak: {len(results)} requests in {elapsed:.1f} s, statuses {statuses}")


# --- SIGTERM in the middle of traffic ------------------------------------------------------------


def test_sigterm_mid_traffic_ends_every_stream(server: Server) -> None:
    """Runs after the others on this server: SIGTERM while 16 streams and 4 plain requests run
    (longer than the grace period) and short requests keep coming."""

    async def main() -> dict[str, Any]:
        out: dict[str, Any] = {"streams": [], "plain": [], "health": [], "late": []}
        started = 0
        all_started = asyncio.Event()
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=64)) as c:
            async def stream(i: int) -> None:
                nonlocal started
                kind = "chat" if i % 2 else "cmpl"
                body: dict[str, Any] = {"max_tokens": 5000, "ignore_eos": True, "stream": True}
                if kind == "chat":
                    body["messages"] = [{"role": "user", "content": f"chat {i}"}]
                else:
                    body["prompt"] = f"stream {i}"
                lines: list[str] = []
                counted = False
                try:
                    async with c.stream("POST", server.url + PATHS[kind], json=body) as r:
                        async for line in r.aiter_lines():
                            lines.append(line)
                            if line.startswith("data: ") and not counted:
                                counted = True
                                started += 1
                                if started == 16:
                                    all_started.set()
                    out["streams"].append(stream_outcome(lines))
                except httpx.HTTPError as e:
                    out["streams"].append(f"transport error {e!r}")

            async def plain(i: int) -> None:
                try:
                    r = await c.post(server.url + "/v1/completions", json={
                        "prompt": f"plain {i}", "max_tokens": 5000, "ignore_eos": True})
                    out["plain"].append((r.status_code, r.headers.get("retry-after"),
                                         r.json().get("error", {}).get("code")))
                except httpx.HTTPError as e:
                    out["plain"].append(("transport error", repr(e), None))

            tasks = [asyncio.ensure_future(stream(i)) for i in range(16)]
            tasks += [asyncio.ensure_future(plain(i)) for i in range(4)]
            await asyncio.wait_for(all_started.wait(), 60)
            server.proc.send_signal(signal.SIGTERM)
            t0 = time.monotonic()
            # while draining: /health 503, new requests 503 (until the listener closes)
            while time.monotonic() - t0 < SHUTDOWN_S + 8 and server.proc.poll() is None:
                try:
                    h = await c.get(server.url + "/health", timeout=2)
                    out["health"].append(h.status_code)
                    late = await c.post(server.url + "/v1/completions", timeout=2,
                                        json={"prompt": "late", "max_tokens": 2})
                    out["late"].append(late.status_code)
                except httpx.HTTPError:
                    break  # the listener closed: the drain is over
                await asyncio.sleep(0.05)
            await asyncio.wait_for(asyncio.gather(*tasks), SHUTDOWN_S + 30)
        return out

    out = asyncio.run(main())
    assert server.proc.wait(30) == 0
    assert len(out["streams"]) == 16
    assert all(o in ("error", "done") for o in out["streams"]), out["streams"]
    assert out["streams"].count("error") == 16  # 5000 tokens outlast the 1 s grace
    assert [p[0] for p in out["plain"]] == [503] * 4, out["plain"]
    assert all(p[1] is not None and p[2] == "unavailable" for p in out["plain"])
    # 503 from the drain's start (the next tick of uvicorn's main loop) to the listener's close
    assert 503 in out["health"], out["health"]
    assert 200 not in out["health"][out["health"].index(503):], out["health"]
    assert out["late"] and set(out["late"]) <= {503, 200}, out["late"]
    assert_no_traceback(server)


# --- restart ----------------------------------------------------------------------------------


def test_restart_serves_and_idle_sigterm_exits_fast(tmp_path: Path) -> None:
    t0 = time.monotonic()
    srv = start_server(tmp_path / "restart.log")
    started = time.monotonic() - t0
    try:
        r = httpx.post(srv.url + "/v1/completions", timeout=60,
                       json={"prompt": "again", "max_tokens": 4})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        if shutil.which("curl"):  # the line printed at start-up works as printed
            done = subprocess.run(shlex.split(srv.curl), capture_output=True, text=True,
                                  timeout=60)
            assert done.returncode == 0, done.stderr
            assert json.loads(done.stdout)["choices"][0]["finish_reason"] in ("length", "stop")
        assert not any(wait_nothing_held(srv, timeout=5).values())
        t1 = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(30) == 0
        assert time.monotonic() - t1 < 5  # nothing in flight: no grace period to wait
    finally:
        srv.stop()
    assert_no_traceback(srv)
    assert started < 120
