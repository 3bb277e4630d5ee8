"""What the tests/test_server_*.py suites share: the tiny engine, FakeEngine, SSE/metric readers."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import torch
from fastapi.testclient import TestClient

from mcserve.config import EngineConfig, ModelConfig
from mcserve.engine.llm_engine import LLMEngine
from mcserve.engine.outputs import CompletionOutput, Logprob, RequestOutput
from mcserve.engine.tokenizer import Tokenizer
from mcserve.errors import InvalidRequestError
from mcserve.models.native import MCForCausalLM
from mcserve.server.app import build_app

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


def tiny_app_client() -> Iterator[TestClient]:
    """What the module-scoped ``app_client`` fixtures serve: the app in-process over the real
    engine on the tiny model, behind ``API_KEY``, with 64 KiB bodies and 64 waiting requests."""
    app = build_app(tiny_engine(), api_key=API_KEY, max_body_bytes=64 * 1024,
                    max_waiting_requests=64)
    with TestClient(app, headers=AUTH) as client:
        yield client


def fake_app_client() -> Iterator[tuple[FakeEngine, TestClient]]:
    """What the ``fake`` fixtures serve: the app over a fresh ``FakeEngine`` (2 ms a step)."""
    engine = FakeEngine(step_delay=0.002)
    with TestClient(build_app(engine)) as client:
        yield engine, client
