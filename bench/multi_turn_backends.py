"""The servers ``multi_turn.py`` measures and its clients of them: synthetic text sized in the
served model's tokens (``Texts``, through the server's ``POST /tokenize``), one streamed request
(``sse``) and the two backends the workloads drive (``McserveBackend``: mcserve's OpenAI API;
``LlamaBackend``: llama-server's ``/completion`` on the ids of mcserve's chat template), the
llama-server launcher and its set-up (``LlamaServer``, ``llama_server_setup``: binary, GGUF
conversion through ``llama_cpp_baseline.py``) and the max-RSS monitor of a server process
(``RssMonitor``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

# --------------------------------------------------------------------------- synthetic text


# plain words for synthetic text (tokenizers with a real vocabulary)
WORDS = (
    "memory caching keeps a checkpoint of the recurrent state at the end of every segment and "
    "lets each token read the cached states as well as the online one so that a model forgets "
    "less of what it has read the server resumes a conversation from the last state it kept "
    "instead of reading the whole history again which saves time when chats grow long users "
    "send messages answers come back and every turn repeats what came before"
).split()


class Texts:
    """Synthetic text sized in the served model's tokens (``/tokenize`` when the server has it,
    else ~4 characters a token)."""

    def __init__(self, url: str, timeout: float, id_words: int | None):
        import httpx

        self.url, self.id_words = url, id_words
        self.client = httpx.Client(timeout=httpx.Timeout(timeout, connect=10.0))
        try:
            r = self.client.post(url + "/tokenize", json={"prompt": "probe"})
            self.has_tokenize = r.status_code == 200 and "count" in r.json()
        except (httpx.HTTPError, ValueError):
            self.has_tokenize = False

    def close(self) -> None:
        self.client.close()

    def words(self, seed: int, n: int) -> list[str]:
        rng = random.Random(seed)
        if self.id_words:  # word-level "t<id>" tokenizer: one word, one token
            return [f"t{rng.randrange(1, self.id_words)}" for _ in range(n)]
        return [rng.choice(WORDS) for _ in range(n)]

    def count(self, text: str) -> int:
        if not self.has_tokenize:
            return len(text.split()) if self.id_words else -(-len(text) // 4)
        r = self.client.post(self.url + "/tokenize",
                             json={"prompt": text, "add_special_tokens": False})
        r.raise_for_status()
        return int(r.json()["count"])

    def ids(self, text: str) -> list[int] | None:
        if not self.has_tokenize:
            return None
        r = self.client.post(self.url + "/tokenize",
                             json={"prompt": text, "add_special_tokens": False})
        r.raise_for_status()
        return list(r.json()["tokens"])

    def message_tokens(self, messages: list[dict[str, str]]) -> int:
        """Tokens of ``messages`` rendered by the chat template, no generation prompt."""
        if not self.has_tokenize:
            return sum(self.count(m["content"]) for m in messages)
        r = self.client.post(self.url + "/tokenize",
                             json={"messages": messages, "add_generation_prompt": False})
        r.raise_for_status()
        return int(r.json()["count"])

    def fit(self, seed: int, tokens: int) -> str:
        """The shortest prefix of the word stream of ``seed`` with at least ``tokens`` tokens."""
        hi = max(1, tokens)
        pool = self.words(seed, hi)
        while self.count(" ".join(pool)) < tokens:
            hi *= 2
            pool = self.words(seed, hi)
        lo = 1
        while lo < hi:
            mid = (lo + hi) // 2
            if self.count(" ".join(pool[:mid])) >= tokens:
                hi = mid
            else:
                lo = mid + 1
        return " ".join(pool[:hi])


# --------------------------------------------------------------------------- HTTP clients


async def sse(client: Any, url: str, body: dict[str, Any], timeout: float) -> dict[str, Any]:
    """One streamed request: TTFT (first non-empty content), text, token ids (llama-server),
    usage and timings of the final chunks; bounded by ``timeout`` seconds in all."""
    import httpx

    rec: dict[str, Any] = {"ttft": None, "e2e": None, "text": "", "tokens": [], "usage": None,
                           "timings": None, "error": None}
    t0 = time.perf_counter()

    async def go() -> None:
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                rec["error"] = f"HTTP {r.status_code}: {(await r.aread())[:300]!r}"
                return
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    err = chunk["error"]
                    rec["error"] = err.get("message", str(err)) if isinstance(err, dict) else err
                    continue
                piece, toks = "", []
                if "choices" in chunk:  # OpenAI chunks (mcserve)
                    for ch in chunk["choices"]:
                        piece += (ch.get("delta") or {}).get("content") or ch.get("text") or ""
                else:  # llama-server's /completion
                    piece, toks = chunk.get("content") or "", chunk.get("tokens") or []
                if (piece or toks) and rec["ttft"] is None:
                    rec["ttft"] = time.perf_counter() - t0
                rec["text"] += piece
                rec["tokens"] += toks
                if chunk.get("usage"):
                    rec["usage"] = chunk["usage"]
                if chunk.get("timings"):
                    rec["timings"] = chunk["timings"]
                if chunk.get("stop") is True:
                    break

    try:
        await asyncio.wait_for(go(), timeout)
    except asyncio.TimeoutError:
        rec["error"] = f"no answer within --request-timeout {timeout:g} s"
    except (httpx.HTTPError, ValueError) as e:
        rec["error"] = f"{type(e).__name__}: {e}"
    rec["e2e"] = time.perf_counter() - t0
    return rec


class McserveBackend:
    """mcserve's OpenAI API: streamed chat and completions with the usage chunk."""

    name = "mcserve"

    def __init__(self, url: str, timeout: float):
        self.url, self.timeout = url, timeout

    @staticmethod
    def _usage(rec: dict[str, Any]) -> dict[str, Any]:
        u = rec.pop("usage") or {}
        prompt = u.get("prompt_tokens")
        cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        rec.update(prompt_tokens=prompt, cached_tokens=cached if prompt is not None else None,
                   computed_tokens=prompt - cached if prompt is not None else None)
        rec.pop("tokens"), rec.pop("timings")
        return rec

    async def chat(self, client: Any, messages: list[dict[str, str]], max_tokens: int
                   ) -> dict[str, Any]:
        body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        return self._usage(await sse(client, self.url + "/v1/chat/completions", body,
                                     self.timeout))

    async def complete(self, client: Any, prompt: str | list[int], max_tokens: int
                       ) -> dict[str, Any]:
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        return self._usage(await sse(client, self.url + "/v1/completions", body, self.timeout))


class LlamaBackend:
    """llama-server's ``/completion`` on the token ids mcserve's chat template renders."""

    name = "llama-server"

    def __init__(self, url: str, timeout: float, tokenizer: Any):
        self.url, self.timeout, self.tok = url, timeout, tokenizer

    async def chat(self, client: Any, messages: list[dict[str, str]], max_tokens: int
                   ) -> dict[str, Any]:
        ids = self.tok.encode(self.tok.apply_chat_template(messages, add_generation_prompt=True),
                              add_special_tokens=False)
        body = {"prompt": ids, "n_predict": max_tokens, "temperature": 0, "ignore_eos": True,
                "cache_prompt": True, "return_tokens": True, "stream": True}
        rec = await sse(client, self.url + "/completion", body, self.timeout)
        computed = (rec.pop("timings") or {}).get("prompt_n")
        rec.pop("usage")
        rec.update(prompt_tokens=len(ids), computed_tokens=computed,
                   cached_tokens=len(ids) - computed if computed is not None else None)
        toks = rec.pop("tokens")
        if toks:
            rec["text"] = self.tok.decode(toks)
        return rec


# --------------------------------------------------------------------------- processes


class RssMonitor:
    """Max resident set size of a process (Linux ``/proc``): sampled, and its ``VmHWM``."""

    def __init__(self, pid: int, every_s: float = 0.2):
        self.pid, self.every_s, self.max_bytes = pid, every_s, None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _read(self) -> int | None:
        try:
            text = Path(f"/proc/{self.pid}/status").read_text()
        except OSError:
            return None
        vals = [int(line.split()[1]) * 1024 for line in text.splitlines()
                if line.startswith(("VmRSS:", "VmHWM:"))]
        return max(vals) if vals else None

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.sample()

    def sample(self) -> None:
        v = self._read()
        if v is not None:
            self.max_bytes = max(self.max_bytes or 0, v)

    def stop(self) -> int | None:
        self.sample()
        self._stop.set()
        self._thread.join(5)
        return self.max_bytes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    """``llama-server`` in a subprocess on a free loopback port, its log in a file."""

    def __init__(self, binary: Path, gguf: Path, slots: int, ctx_per_slot: int, threads: int,
                 device: str, log: Path, start_timeout: float = 300.0):
        import httpx

        port = free_port()
        cmd = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
               "-np", str(slots), "-c", str(slots * ctx_per_slot), "-t", str(threads),
               "-tb", str(threads)]
        if device != "cpu":
            cmd += ["-ngl", "999"]
        self.cmd, self.url, self.log = cmd, f"http://127.0.0.1:{port}", log
        self._log = open(log, "wb")  # closed in stop()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + start_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        tail = log.read_text(errors="replace")[-2000:]
        raise RuntimeError(f"llama-server did not start ({' '.join(cmd)}):\n{tail}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()


def llama_server_setup(a: argparse.Namespace, model_dir: str
                       ) -> tuple[Path | None, Path | None, str | None]:
    """(llama-server binary, GGUF of the model, None), or (None, None, why it is skipped)."""
    cfg = Path(model_dir) / "config.json"
    try:
        model_type = json.loads(cfg.read_text()).get("model_type")
    except (OSError, ValueError):
        model_type = None
    if model_type in (None, "mcserve"):
        return None, None, ("llama-server column skipped: the model is not a transformers "
                            "checkpoint that llama.cpp's convert_hf_to_gguf.py converts (use "
                            "--shape mamba2-130m or a transformers Mamba2 --model)")
    from llama_cpp_baseline import gguf_file, llama_cpp_src

    src = llama_cpp_src(a.llama_cpp_src)
    if src is None:
        return None, None, ("llama-server column skipped: no convert_hf_to_gguf.py (pass "
                            "--llama-cpp-src or set LLAMA_CPP_SRC to the llama-cpp-python "
                            "sdist's vendor/llama.cpp folder, bench/README.md)")
    cands = [a.llama_server, os.environ.get("LLAMA_SERVER"),
             str(src / "build" / "bin" / "llama-server"), shutil.which("llama-server")]
    binary = next((Path(c) for c in cands
                   if c and Path(c).is_file() and os.access(c, os.X_OK)), None)
    if binary is None:
        return None, None, ("llama-server column skipped: no llama-server binary (--llama-server, "
                            "$LLAMA_SERVER, <llama-cpp-src>/build/bin/llama-server, or on PATH)")
    try:
        gguf = gguf_file(Path(model_dir), src)
    except (RuntimeError, OSError) as e:
        return None, None, f"llama-server column skipped: GGUF conversion failed: {e}"
    return binary, gguf, None
