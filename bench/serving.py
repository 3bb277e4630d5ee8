"""Serving benchmark: N concurrent streaming clients against the OpenAI-compatible server.

    python bench/serving.py [MODEL] [--clients 16] [--num-requests 64] [--url URL] [--quick]

Without ``--url`` it starts ``mcserve serve`` itself (``python -m mcserve.server.cli_serve``) on a
free loopback port with ``--max-num-seqs`` = the number of clients, and stops it at the end.
Without MODEL it serves the embedded default model, or, when there is none yet, a small random
model (``ModelConfig()``, seed 0) saved to a temporary directory.

Workload: a fixed mix of (prompt length, output length) pairs cycled over ``--num-requests``
requests, greedy with ``ignore_eos`` so every request produces exactly its ``max_tokens``. Each
client is a closed loop: it sends its next request when the previous one finished. Measured on
the client side:

* throughput: generated tokens (from the usage chunk) / wall time, and requests / s;
* TTFT: send to the first chunk with text; ITL: gaps between successive text chunks of a
  request; E2E: send to ``[DONE]``; each as p50 / p90 / p99.

Server overhead: unless ``--no-offline``, the same requests run through the offline API
(``LLM.generate``, same model, ``max_num_seqs`` = clients, on a background thread of this process
as the server's engine runs, before the server starts so that the two never share the CPU), and
the HTTP throughput is reported as a fraction of it (target: >= 85% at 16 clients).

``--compare`` serves the 130M Mamba2 shape (random weights, ``bench/baselines.py``, as-is: no MC)
with prompts of ``--prompt-len`` token ids and ``--new-tokens`` outputs, then runs llama.cpp's
batched decode and transformers ``generate`` on the same weights at ``--clients`` streams in the
same run, and prints the HTTP throughput as a ratio of each (``serving_compare.json``).

Results go to ``bench/results/serving.json`` (``--quick``: ``tmp_serving_quick.json``, not
tracked). ``--quick`` (8 clients, 16 short requests, one repeat, 1 torch thread unless
``--threads``) finishes in well under a minute.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import env_info, env_line, print_table, write_json  # noqa: E402

# (prompt characters, max_tokens): short and long prompts, short and long answers
MIX = [(32, 64), (128, 32), (16, 128), (256, 64), (64, 96), (8, 16)]
QUICK_MIX = [(32, 16), (64, 8), (16, 24), (96, 16)]
TEXT = (
    "Memory caching keeps a checkpoint of the recurrent memory at the end of every segment and "
    "lets each token read the cached memories as well as the online one, so that a recurrent "
    "model forgets less of what it has read. "
)


def make_prompt(i: int, n_chars: int) -> str:
    rot = (i * 7) % len(TEXT)
    base = (TEXT[rot:] + TEXT[:rot]) * (n_chars // len(TEXT) + 1)
    return f"[{i}] " + base[:max(0, n_chars - len(f"[{i}] "))]


def workload(num_requests: int, mix: list[tuple[int, int]]) -> list[tuple[str, int]]:
    return [(make_prompt(i, mix[i % len(mix)][0]), mix[i % len(mix)][1])
            for i in range(num_requests)]


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    pos = q / 100 * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summary(xs: list[float]) -> dict[str, float | None]:
    return {"p50": pct(xs, 50), "p90": pct(xs, 90), "p99": pct(xs, 99),
            "mean": sum(xs) / len(xs) if xs else None, "count": len(xs)}


# --------------------------------------------------------------------------- model / server


def resolve_model(model: str | None, tmp: Path) -> str:
    """MODEL, the embedded default model's directory, or a random model saved under ``tmp``."""
    if model:
        return model
    from mcserve.engine.llm_engine import DEFAULT_MODEL_DIR

    if (Path(DEFAULT_MODEL_DIR) / "config.json").is_file():
        return str(DEFAULT_MODEL_DIR)
    import torch

    from mcserve.config import ModelConfig
    from mcserve.models.native import MCForCausalLM

    torch.manual_seed(0)
    path = tmp / "random_model"
    MCForCausalLM(ModelConfig()).save_pretrained(path)
    print(f"[bench] no default model yet: serving a random ModelConfig() model ({path})",
          file=sys.stderr)
    return str(path)


class Server:
    """``mcserve serve`` in a subprocess on a free loopback port."""

    def __init__(self, model: str, max_num_seqs: int, extra: list[str], api_key: str | None,
                 threads: int | None):
        cmd = [sys.executable, "-m", "mcserve.server.cli_serve", model, "--host", "127.0.0.1",
               "--port", "0", "--max-num-seqs", str(max_num_seqs), "--log-level", "warning",
               *extra]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if api_key:
            env["MCSERVE_API_KEY"] = api_key
        if threads:
            env["OMP_NUM_THREADS"] = str(threads)
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env=env)
        self.lines: list[str] = []
        self.err: list[str] = []
        threading.Thread(target=self._pump, args=(self.proc.stdout, self.lines),
                         daemon=True).start()
        threading.Thread(target=self._pump, args=(self.proc.stderr, self.err),
                         daemon=True).start()
        self.url = self._wait_url(180)

    @staticmethod
    def _pump(stream: Any, into: list[str]) -> None:
        for line in stream:
            into.append(line)

    def _wait_url(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in self.lines:
                m = re.search(r"curl (http://[^/\s]+)/v1/completions", line)
                if m:
                    return m.group(1)
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        self.stop()
        raise SystemExit("the server did not start:\n" + "".join(self.err[-30:]))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


# --------------------------------------------------------------------------- clients


async def one_request(client: Any, url: str, model: str | None, prompt: str, max_tokens: int,
                      headers: dict[str, str]) -> dict[str, Any]:
    body: dict[str, Any] = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                            "ignore_eos": True, "stream": True,
                            "stream_options": {"include_usage": True}}
    if model:
        body["model"] = model
    t0 = time.perf_counter()
    times: list[float] = []
    tokens = 0
    error = None
    async with client.stream("POST", url + "/v1/completions", json=body,
                             headers=headers) as r:
        if r.status_code != 200:
            error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
        else:
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    error = chunk["error"]["message"]
                    continue
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                if any(ch.get("text") for ch in chunk.get("choices", [])):
                    times.append(time.perf_counter())
    t1 = time.perf_counter()
    return {"ttft": times[0] - t0 if times else None,
            "itl": [b - a for a, b in zip(times, times[1:])],
            "e2e": t1 - t0, "tokens": tokens, "error": error}


async def run_clients(url: str, model: str | None, reqs: list[tuple[str, int]], clients: int,
                      api_key: str | None) -> tuple[list[dict[str, Any]], float]:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    queue: asyncio.Queue[tuple[str, int]] = asyncio.Queue()
    for item in reqs:
        queue.put_nowait(item)
    results: list[dict[str, Any]] = []

    async def worker(client: httpx.AsyncClient) -> None:
        while True:
            try:
                prompt, max_tokens = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            results.append(await one_request(client, url, model, prompt, max_tokens, headers))

    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        # warm up (first-request costs: imports, allocations) outside the measurement
        await one_request(client, url, model, "warm up", 4, headers)
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(clients)))
        wall = time.perf_counter() - t0
    return results, wall


class Offline:
    """The same requests through ``LLM.generate`` (one warm ``LLM``, reused across repeats)."""

    def __init__(self, model: str, max_num_seqs: int, threads: int | None):
        self.model = model
        self.max_num_seqs = max_num_seqs
        self.threads = threads
        self.llm: Any = None

    def run(self, reqs: list[tuple[str, int]]) -> dict[str, Any]:
        import torch

        from mcserve.engine.llm import LLM
        from mcserve.engine.sampling import SamplingParams

        result: dict[str, Any] = {}

        def run() -> None:
            if self.threads:
                torch.set_num_threads(self.threads)
            if self.llm is None:
                self.llm = LLM(self.model, max_num_seqs=self.max_num_seqs)
                self.llm.generate(["warm up"], SamplingParams(max_tokens=4, temperature=0,
                                                              ignore_eos=True))
            params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True)
                      for _, m in reqs]
            c0, t0 = time.process_time(), time.perf_counter()
            outs = self.llm.generate([p for p, _ in reqs], params)
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
            result.update(wall_s=wall, cpu_s=cpu, tokens=tokens, tokens_per_s=tokens / wall)

        # The server steps its engine on a background thread, where torch's intra-op pool can
        # behave differently from the main thread's (on a loaded 2-core machine the main
        # thread's OpenMP team was many times slower for a small model). Run the baseline the
        # same way, so that the ratio measures the HTTP layer and not the threading.
        t = threading.Thread(target=run, name="offline-engine")
        t.start()
        t.join()
        if not result:
            raise SystemExit("the offline baseline failed (see the traceback above)")
        return result


def proc_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of a process (Linux), None elsewhere."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def http_summary(results: list[dict[str, Any]], wall: float) -> dict[str, Any]:
    errors = [r["error"] for r in results if r["error"]]
    tokens = sum(r["tokens"] for r in results)
    return {"wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall,
            "requests_per_s": len(results) / wall, "errors": len(errors),
            "first_error": errors[0] if errors else None,
            "ttft_s": summary([r["ttft"] for r in results if r["ttft"] is not None]),
            "itl_s": summary([x for r in results for x in r["itl"]]),
            "e2e_s": summary([r["e2e"] for r in results])}


# --------------------------------------------------------------------------- baselines


def compare_baselines(args: argparse.Namespace, shape: dict[str, Any], ids: list[list[int]],
                      http_tps: float) -> dict[str, Any]:
    """llama.cpp and transformers at ``--clients`` streams on the served weights (after the
    server has stopped, so nothing shares the CPU), and the HTTP throughput's ratio to each."""
    import baselines as bl
    import torch

    threads = args.threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    model_dir = Path(args.model)
    llama, why = bl.llama_cpp_runner(model_dir, args.llama_cpp_src, threads)
    runners: list[Any] = [llama] if llama is not None else []
    notes = [why] if why else []
    runners.append(bl.TransformersRunner(model_dir))
    rows, out = [], {"http_tokens_per_s": http_tps, "baselines": [], "notes": notes}
    for r in runners:
        res = r.run(ids, args.new_tokens, args.repeat)
        out["baselines"].append({**res.to_json(), "http_over": http_tps / res.tokens_per_s})
        rows.append([res.name, len(ids), f"{res.tokens_per_s:.1f}",
                     f"{http_tps / res.tokens_per_s:.2f}x"])
    rows.insert(0, ["mcserve over HTTP", args.clients, f"{http_tps:.1f}", "1.00x"])
    print_table(rows, ["implementation", "streams", "tokens/s", "mcserve HTTP / this"],
                title=f"Mamba2 {bl.describe_shape(shape)}, {args.prompt_len} -> "
                f"{args.new_tokens} tokens, {threads} threads")
    for n in notes:
        print(n)
    return out


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default=None, metavar="MODEL",
                    help="checkpoint directory (default: the embedded default model)")
    ap.add_argument("--url", default=None, help="a running server (default: start one)")
    ap.add_argument("--served-model-name", default=None,
                    help="model name to send (default: none, the server's only model)")
    ap.add_argument("--clients", type=int, default=16, help="concurrent clients (default 16)")
    ap.add_argument("--num-requests", type=int, default=64, help="requests in all (default 64)")
    ap.add_argument("--quick", action="store_true",
                    help="8 clients, 16 short requests: under a minute")
    ap.add_argument("--no-offline", action="store_true",
                    help="skip the offline LLM.generate baseline")
    ap.add_argument("--api-key", default=os.environ.get("MCSERVE_API_KEY"),
                    help="API key (default: $MCSERVE_API_KEY)")
    ap.add_argument("--server-arg", action="append", default=[],
                    help="extra flag for the server it starts (repeatable), e.g. "
                    "--server-arg=--num-state-blocks=256")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads for the server and the baseline alike (default: "
                    "torch's default; on a loaded machine 1 avoids OpenMP spin-waits)")
    ap.add_argument("--repeat", type=int, default=3,
                    help="offline + HTTP repeats; medians are reported (default 3, --quick 1)")
    ap.add_argument("--out", default=None, help="result file name or path")
    cmp = ap.add_argument_group("--compare")
    cmp.add_argument("--compare", action="store_true",
                     help="the 130M Mamba2 shape, against llama.cpp and transformers")
    cmp.add_argument("--prompt-len", type=int, default=16, help="prompt tokens (--compare)")
    cmp.add_argument("--new-tokens", type=int, default=64, help="tokens per request (--compare)")
    cmp.add_argument("--llama-cpp-src", default=None,
                     help="llama.cpp source folder with convert_hf_to_gguf.py "
                     "(default: $LLAMA_CPP_SRC)")
    args = ap.parse_args(argv)

    mix = MIX
    if args.quick:
        args.clients, args.num_requests, mix, args.repeat = 8, 16, QUICK_MIX, 1
        args.prompt_len, args.new_tokens = 8, 8
        if args.threads is None:
            args.threads = 1  # bounded time even on a busy machine (no OpenMP spin-waits)
    if args.clients < 1 or args.num_requests < 1 or args.repeat < 1:
        ap.error("--clients, --num-requests and --repeat must be >= 1")
    reqs = workload(args.num_requests, mix)
    shape = prompt_ids = None
    if args.compare:
        import baselines as bl

        if args.model or args.url:
            ap.error("--compare serves its own Mamba2 checkpoint: no MODEL or --url")
        shape = bl.MAMBA2_QUICK if args.quick else bl.MAMBA2_130M
        args.model = str(bl.mamba2_dir(shape))
        args.server_arg = [*args.server_arg, "--mc-variant", "none",
                           "--max-model-len", str(args.prompt_len + args.new_tokens + 1)]
        # the word-level tokenizer maps "t17" to id 17: text prompts are exact id sequences
        prompt_ids = bl.prompts(shape["vocab_size"], args.num_requests, args.prompt_len)
        reqs = [(" ".join(f"t{i}" for i in ids), args.new_tokens) for ids in prompt_ids]
    out_name = args.out or ("tmp_serving_quick.json" if args.quick else "serving.json")
    if args.compare and not args.out:
        out_name = "tmp_serving_compare_quick.json" if args.quick else "serving_compare.json"
    env = env_info()
    print(env_line(env))

    result: dict[str, Any] = {"env": env, "threads": args.threads, "clients": args.clients,
                              "num_requests": args.num_requests, "mix": mix, "quick": args.quick,
                              "repeat": args.repeat, "runs": []}
    with tempfile.TemporaryDirectory(prefix="mcserve-bench-") as tmp:
        model = None
        if args.url is None or not args.no_offline:
            model = resolve_model(args.model, Path(tmp))
        base = None if args.no_offline else Offline(model, args.clients, args.threads)
        server = None
        try:
            url = args.url
            if url is None:
                assert model is not None
                server = Server(model, args.clients, args.server_arg, args.api_key,
                                args.threads)
                url = server.url
            result["url"] = url
            for rep in range(args.repeat):
                run: dict[str, Any] = {}
                if base is not None:  # the server idles meanwhile (its engine thread sleeps)
                    run["offline"] = base.run(reqs)
                s0 = proc_cpu_s(server.proc.pid) if server is not None else None
                c0 = time.process_time()
                results, wall = asyncio.run(run_clients(url, args.served_model_name, reqs,
                                                        args.clients, args.api_key))
                run["http"] = http_summary(results, wall)
                run["http"]["client_cpu_s"] = time.process_time() - c0
                s1 = proc_cpu_s(server.proc.pid) if server is not None else None
                if s0 is not None and s1 is not None:
                    run["http"]["server_cpu_s"] = s1 - s0
                if "offline" in run:
                    run["http_over_offline"] = (run["http"]["tokens_per_s"]
                                                / run["offline"]["tokens_per_s"])
                result["runs"].append(run)
                line = (f"run {rep + 1}/{args.repeat}: HTTP {run['http']['tokens_per_s']:.1f} "
                        f"tokens/s in {wall:.2f} s (client CPU "
                        f"{run['http']['client_cpu_s']:.2f} s")
                if "server_cpu_s" in run["http"]:
                    line += f", server CPU {run['http']['server_cpu_s']:.2f} s"
                line += ")"
                if "offline" in run:
                    line += (f"; offline {run['offline']['tokens_per_s']:.1f} tokens/s: "
                             f"ratio {run['http_over_offline'] * 100:.1f}%")
                print(line, flush=True)
        finally:
            if server is not None:
                server.stop()

    # the run with the median HTTP throughput is the one reported in detail
    runs = sorted(result["runs"], key=lambda r: r["http"]["tokens_per_s"])
    http = runs[len(runs) // 2]["http"]
    result["http"] = http
    ratios = [r["http_over_offline"] for r in result["runs"] if "http_over_offline" in r]
    if ratios:
        result["http_over_offline"] = pct(ratios, 50)
        result["offline_tokens_per_s"] = pct(
            [r["offline"]["tokens_per_s"] for r in result["runs"]], 50)
    results_n = args.num_requests
    tokens, wall = http["tokens"], http["wall_s"]
    errors = [r["http"]["first_error"] for r in result["runs"] if r["http"]["errors"]]

    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x * 1000:.1f}"

    rows = [[name, ms(s["p50"]), ms(s["p90"]), ms(s["p99"]), s["count"]]
            for name, s in (("TTFT", http["ttft_s"]), ("ITL", http["itl_s"]),
                            ("E2E", http["e2e_s"]))]
    print_table(rows, ["latency (ms)", "p50", "p90", "p99", "samples"],
                title=f"{results_n} requests, {args.clients} streaming clients "
                f"(median of {args.repeat} runs)")
    print(f"HTTP throughput: {tokens} tokens in {wall:.2f} s = {http['tokens_per_s']:.1f} "
          f"tokens/s, {http['requests_per_s']:.2f} requests/s, {len(errors)} runs with errors")
    if "http_over_offline" in result:
        print(f"offline LLM.generate: {result['offline_tokens_per_s']:.1f} tokens/s; "
              f"HTTP / offline throughput: {result['http_over_offline'] * 100:.1f}% "
              f"(median over runs; target >= 85% at 16 clients)")
    if args.compare:
        result["compare"] = compare_baselines(args, shape, prompt_ids[:args.clients],
                                              http["tokens_per_s"])
    if errors:
        print(f"first error: {errors[0]}", file=sys.stderr)
    for p in write_json(result, out_name):
        print(f"wrote {p}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
