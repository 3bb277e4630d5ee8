"""Multi-turn chat over HTTP: how much prompt work state reuse (prefix caching / resume points)
saves, with reuse on and off in the same run.

    python bench/multi_turn.py                      # the 130M Mamba2 shape, random weights
    python bench/multi_turn.py --model DIR          # any checkpoint mcserve serves
    python bench/multi_turn.py --shape default      # the embedded default model
    python bench/multi_turn.py --quick              # 2 users x 3 turns, the default model

Two servers (``mcserve serve`` subprocesses, ``serving.Server``) are started one after the other
on the same model, device and threads: reuse **on** (default flags) and reuse **off**
(``--no-enable-prefix-caching``); ``--server-arg`` flags go to both. Each runs three workloads:

* **chat**: ``--users`` (4) users, each a ``--turns`` (10) turn chat through
  ``/v1/chat/completions`` (streamed, ``stream_options.include_usage``), all with one shared
  ~``--system-tokens`` (1024) token system prompt, each user turn ~``--user-tokens`` (200)
  tokens of synthetic text, each answer ``--answer-tokens`` (32) tokens (temperature 0,
  ``ignore_eos``); the next turn's messages carry the previous answers verbatim. Users run
  concurrently, each turn after the previous one was answered; users after the first start once
  the first user's turn 1 has been answered (so that the system prompt can be in the cache).
* **shared-system** (the shape of vLLM issue #40696): a ``--shared-system-tokens`` (480) token
  system prompt shared by ``--shared-requests`` (32) chats of one ~20-token user message and 16
  answer tokens, ``--shared-concurrency`` (8) at a time (the first alone).
* **branch** (the shape of vLLM issue #45238): three ``/v1/completions`` prompts of 3K, 5K and
  5K tokens sharing a 2K-token prefix (different suffixes), sent one after another.

Synthetic text is sized for the model's tokenizer through the server's ``POST /tokenize`` (else
approximated at 4 characters a token); for the Mamba2 shape, whose word-level tokenizer maps
``t17`` to id 17, the text is such words. Per request the client records TTFT (send to the first
non-empty content chunk), the prompt tokens and ``usage.prompt_tokens_details.cached_tokens``
(0 until the engine reports them); tokens computed = prompt - cached. The **ceiling** of a
request is what a perfect cache could have served: the previous turn's prompt tokens (turns >= 2),
the system prompt's tokens (the rendered system message: turn 1 of users after the first, every
shared-system request after the first), the 2K prefix (branch prompts 2 and 3). Hit rate =
sum(min(cached, ceiling)) / sum(ceiling), per turn and per workload.

llama-server column (chat only): when ``bench/baselines.py`` can convert the model to GGUF as
``offline.py --compare`` does (``--llama-cpp-src`` / ``$LLAMA_CPP_SRC``, never a download) and a
``llama-server`` binary is found (``--llama-server``, ``$LLAMA_SERVER``,
``<llama-cpp-src>/build/bin/llama-server``, or on PATH), the chat workload runs against it with
``--users`` slots (``-np``) and its prompt cache as its defaults set it (``cache_prompt``). The
GGUF holds no tokenizer of the served model, so llama-server gets the same token ids mcserve's
chat template and tokenizer give (rendered here), through its ``/completion`` endpoint with
``return_tokens``; its computed tokens are its ``timings.prompt_n``. Otherwise one line says
why it was skipped.

Targets (printed PASS/FAIL, never asserted): turn-10 (last turn) TTFT p50 <= 1.5x turn-2 TTFT
p50 with reuse on; hit rate = the ceiling (each workload, reuse on); with llama-server: tokens
computed and TTFT p50 per turn <= llama-server's.

Results: ``bench/results/multi_turn.json`` (``--quick``: ``tmp_multi_turn_quick.json``), with
each server's flags, start-up time and host memory (max RSS of the server process over its run).
Every HTTP request is bounded by ``--request-timeout``; the servers are stopped in a ``finally``.
``--quick``: 2 users x 3 turns, short prompts, the default model, 1 thread unless ``--threads``.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import env_info, env_line, print_table, set_threads, write_json  # noqa: E402
from multi_turn_backends import (  # noqa: E402
    LlamaBackend,
    LlamaServer,
    McserveBackend,
    RssMonitor,
    Texts,
    llama_server_setup,
)
from serving import Server, pct, resolve_model  # noqa: E402

FULL = dict(users=4, turns=10, system_tokens=1024, user_tokens=200, answer_tokens=32,
            shared_system_tokens=480, shared_requests=32, shared_user_tokens=20,
            shared_answer_tokens=16, shared_concurrency=8, branch_prefix=2048,
            branch_lengths=[3072, 5120, 5120], branch_answer_tokens=16)
QUICK = dict(users=2, turns=3, system_tokens=64, user_tokens=24, answer_tokens=8,
             shared_system_tokens=48, shared_requests=8, shared_user_tokens=8,
             shared_answer_tokens=4, shared_concurrency=4, branch_prefix=64,
             branch_lengths=[96, 160, 160], branch_answer_tokens=4)
TTFT_TARGET = 1.5  # last-turn TTFT / turn-2 TTFT, reuse on


# --------------------------------------------------------------------------- synthetic text


def build_texts(tx: Texts, a: argparse.Namespace) -> dict[str, Any]:
    """Every prompt of the three workloads (the same for every server of the run)."""
    sys_text = tx.fit(1, a.system_tokens)
    users = [[tx.fit(1000 + 100 * u + t, a.user_tokens) for t in range(a.turns)]
             for u in range(a.users)]
    shared_sys = tx.fit(2, a.shared_system_tokens)
    shared_users = [tx.fit(3000 + i, a.shared_user_tokens) for i in range(a.shared_requests)]
    prefix_len = a.branch_prefix
    prefix_text = tx.fit(4, prefix_len)
    suffix_texts = [tx.fit(5000 + i, n - prefix_len) for i, n in enumerate(a.branch_lengths)]
    prefix_ids = tx.ids(prefix_text)
    if prefix_ids is not None:  # token-id prompts: exact lengths, an exactly shared prefix
        prefix_ids = prefix_ids[:prefix_len]
        branch: list[Any] = []
        for n, s in zip(a.branch_lengths, suffix_texts):
            ids = tx.ids(s) or []
            branch.append(prefix_ids + ids[:n - prefix_len])
    else:
        branch = [prefix_text + " " + s for s in suffix_texts]
    sys_msg = [{"role": "system", "content": sys_text}]
    shared_msg = [{"role": "system", "content": shared_sys}]
    return {
        "system": sys_text, "users": users, "shared_system": shared_sys,
        "shared_users": shared_users, "branch": branch,
        "system_tokens": tx.message_tokens(sys_msg),
        "shared_system_tokens": tx.message_tokens(shared_msg),
        "branch_prefix_tokens": prefix_len if prefix_ids is not None else tx.count(prefix_text),
        "sized_by": "/tokenize" if tx.has_tokenize else "characters (no /tokenize)",
    }


# --------------------------------------------------------------------------- workloads


def _client(timeout: float, conns: int) -> Any:
    import httpx

    return httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=10.0),
                             limits=httpx.Limits(max_connections=conns + 4,
                                                 max_keepalive_connections=conns + 4))


async def run_chat(backend: Any, tx: dict[str, Any], a: argparse.Namespace
                   ) -> list[dict[str, Any]]:
    first_answered = asyncio.Event()

    async def user(client: Any, u: int) -> list[dict[str, Any]]:
        if u > 0:
            await first_answered.wait()
        msgs = [{"role": "system", "content": tx["system"]}]
        recs: list[dict[str, Any]] = []
        try:
            for t in range(a.turns):
                msgs.append({"role": "user", "content": tx["users"][u][t]})
                rec = await backend.chat(client, list(msgs), a.answer_tokens)
                prev = recs[-1]["prompt_tokens"] if recs else None
                ceiling = (prev or 0) if t > 0 else (tx["system_tokens"] if u > 0 else 0)
                rec.update(user=u, turn=t + 1, ceiling=ceiling)
                recs.append(rec)
                if rec["error"]:
                    break
                msgs.append({"role": "assistant", "content": rec["text"]})
        finally:
            if u == 0:
                first_answered.set()
        return recs

    async with _client(a.request_timeout, a.users) as client:
        per_user = await asyncio.gather(*(user(client, u) for u in range(a.users)))
    return [r for recs in per_user for r in recs]


async def run_shared(backend: Any, tx: dict[str, Any], a: argparse.Namespace
                     ) -> list[dict[str, Any]]:
    sem = asyncio.Semaphore(a.shared_concurrency)

    async def one(client: Any, i: int) -> dict[str, Any]:
        msgs = [{"role": "system", "content": tx["shared_system"]},
                {"role": "user", "content": tx["shared_users"][i]}]
        async with sem:
            rec = await backend.chat(client, msgs, a.shared_answer_tokens)
        rec.update(request=i, ceiling=tx["shared_system_tokens"] if i > 0 else 0)
        return rec

    async with _client(a.request_timeout, a.shared_concurrency) as client:
        first = await one(client, 0)
        rest = await asyncio.gather(*(one(client, i) for i in range(1, a.shared_requests)))
    return [first, *rest]


async def run_branch(backend: Any, tx: dict[str, Any], a: argparse.Namespace
                     ) -> list[dict[str, Any]]:
    out = []
    async with _client(a.request_timeout, 1) as client:
        for i, prompt in enumerate(tx["branch"]):
            rec = await backend.complete(client, prompt, a.branch_answer_tokens)
            rec.update(request=i, ceiling=tx["branch_prefix_tokens"] if i > 0 else 0)
            out.append(rec)
    return out


async def warm_up(backend: McserveBackend, timeout: float) -> None:
    """First-request costs (imports, allocations) outside the measurement, on text that shares
    nothing with the workloads."""
    async with _client(timeout, 1) as client:
        await backend.chat(client, [{"role": "user", "content": "warm up"}], 2)
        await backend.complete(client, "warm up", 2)


# --------------------------------------------------------------------------- summaries


def hit(recs: list[dict[str, Any]]) -> dict[str, Any]:
    """Token totals and hit rate of ``recs`` against their ceilings."""
    ok = [r for r in recs if r.get("prompt_tokens") is not None]
    ceil = sum(r["ceiling"] for r in ok)
    cached = sum(r["cached_tokens"] or 0 for r in ok)
    within = sum(min(r["cached_tokens"] or 0, r["ceiling"]) for r in ok)
    return {"requests": len(recs), "errors": sum(1 for r in recs if r["error"]),
            "prompt_tokens": sum(r["prompt_tokens"] for r in ok), "cached_tokens": cached,
            "computed_tokens": sum(r["computed_tokens"] or 0 for r in ok),
            "ceiling_tokens": ceil, "hit_rate": within / ceil if ceil else None,
            "cached_over_ceiling": cached / ceil if ceil else None}


def latency(recs: list[dict[str, Any]]) -> dict[str, Any]:
    ttft = [r["ttft"] for r in recs if r["ttft"] is not None]
    e2e = [r["e2e"] for r in recs if r["e2e"] is not None and not r["error"]]
    return {"ttft_p50_s": pct(ttft, 50), "ttft_p90_s": pct(ttft, 90),
            "e2e_p50_s": pct(e2e, 50)}


def chat_summary(recs: list[dict[str, Any]], turns: int) -> dict[str, Any]:
    rows = []
    for t in range(1, turns + 1):
        rs = sorted((r for r in recs if r["turn"] == t), key=lambda r: r["user"])
        rows.append({"turn": t, **latency(rs), **hit(rs),
                     "per_user": {k: [r.get(k) for r in rs] for k in
                                  ("prompt_tokens", "cached_tokens", "computed_tokens",
                                   "ceiling", "ttft")}})
    return {"turns": rows, "total": {**hit(recs), **latency(recs)}}


def plain(recs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Requests for the JSON: no texts (the answers' length in characters instead)."""
    return [{**{k: v for k, v in r.items() if k != "text"}, "answer_chars": len(r["text"])}
            for r in recs]


# --------------------------------------------------------------------------- report


def ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.1f}"


def num(x: float | None) -> str:
    if x is None:
        return "-"
    return str(int(x)) if float(x).is_integer() else f"{x:.1f}"


def pc(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:.1f}%"


def ratio(x: float | None, y: float | None) -> float | None:
    return x / y if x is not None and y else None


def mean(row: dict[str, Any], key: str) -> float | None:
    n = row["requests"] - row["errors"]
    return row[key] / n if n > 0 else None


def print_chat(res: dict[str, Any], a: argparse.Namespace, tx: dict[str, Any]) -> None:
    on, off = res["on"]["turns"], res["off"]["turns"]
    ll = res.get("llama_server", {}).get("turns")
    headers = ["turn", "prompt tok", "ceiling", "on cached", "on computed", "off computed",
               "on TTFT p50", "on p90", "off TTFT p50", "off p90", "TTFT on/off", "on hit rate"]
    if ll:
        headers += ["llama computed", "llama TTFT p50", "llama p90"]
    rows = []
    for i, (x, y) in enumerate(zip(on, off)):
        r = ratio(x["ttft_p50_s"], y["ttft_p50_s"])
        row = [x["turn"], num(mean(x, "prompt_tokens")), num(mean(x, "ceiling_tokens")),
               num(mean(x, "cached_tokens")), num(mean(x, "computed_tokens")),
               num(mean(y, "computed_tokens")), ms(x["ttft_p50_s"]), ms(x["ttft_p90_s"]),
               ms(y["ttft_p50_s"]), ms(y["ttft_p90_s"]), "-" if r is None else f"{r:.2f}x",
               pc(x["hit_rate"])]
        if ll:
            z = ll[i] if i < len(ll) else None
            row += ["-", "-", "-"] if z is None else [
                num(mean(z, "computed_tokens")), ms(z["ttft_p50_s"]), ms(z["ttft_p90_s"])]
        rows.append(row)
    print_table(rows, headers, title=(
        f"chat: {a.users} users x {a.turns} turns, system prompt {tx['system_tokens']} tokens, "
        f"user turns ~{a.user_tokens} tokens, {a.answer_tokens}-token answers (token columns: "
        f"mean per user; TTFT in ms)"))
    for name in ("on", "off", "llama_server"):
        if name not in res or "total" not in res[name]:
            continue
        t = res[name]["total"]
        print(f"chat total, {name.replace('_', '-')}: {t['cached_tokens']} of "
              f"{t['prompt_tokens']} prompt tokens cached, {t['computed_tokens']} computed; "
              f"hit rate {pc(t['hit_rate'])} of the ceiling ({t['ceiling_tokens']} tokens)")


def print_flat(title: str, res: dict[str, Any], label: str) -> None:
    """shared-system (one row per server) and branch (one row per prompt)."""
    if label == "server":
        rows = []
        for name in ("on", "off"):
            t = res[name]["total"]
            rows.append([name, t["requests"], t["prompt_tokens"], t["ceiling_tokens"],
                         t["cached_tokens"], t["computed_tokens"], pc(t["hit_rate"]),
                         ms(t["ttft_p50_s"]), ms(t["ttft_p90_s"])])
        r = ratio(res["on"]["total"]["ttft_p50_s"], res["off"]["total"]["ttft_p50_s"])
        print_table(rows, ["reuse", "requests", "prompt tok", "ceiling", "cached", "computed",
                           "hit rate", "TTFT p50", "TTFT p90"], title=title)
        print(f"shared-system TTFT p50 on/off: {'-' if r is None else f'{r:.2f}x'}")
        return
    rows = []
    on, off = res["on"]["requests"], res["off"]["requests"]
    for x, y in zip(on, off):
        r = ratio(x["ttft"], y["ttft"])
        rows.append([x["request"] + 1, num(x["prompt_tokens"]), x["ceiling"],
                     num(x["cached_tokens"]), num(x["computed_tokens"]), ms(x["ttft"]),
                     num(y["cached_tokens"]), ms(y["ttft"]),
                     "-" if r is None else f"{r:.2f}x"])
    print_table(rows, ["prompt", "tokens", "ceiling", "on cached", "on computed",
                       "on TTFT", "off cached", "off TTFT", "TTFT on/off"], title=title)
    t = res["on"]["total"]
    print(f"branch, reuse on: hit rate {pc(t['hit_rate'])} of the ceiling "
          f"({t['ceiling_tokens']} tokens)")


def targets(res: dict[str, Any], a: argparse.Namespace) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []

    def add(name: str, passed: bool | None, detail: str) -> None:
        out.append({"target": name, "pass": passed, "detail": detail})

    chat = res["chat"]
    on = chat["on"]["turns"]
    name = f"chat: turn-{a.turns} TTFT p50 <= {TTFT_TARGET}x turn-2 TTFT p50 (reuse on)"
    if a.turns >= 3 and on[1]["ttft_p50_s"] and on[-1]["ttft_p50_s"] is not None:
        r = on[-1]["ttft_p50_s"] / on[1]["ttft_p50_s"]
        add(name, r <= TTFT_TARGET, f"{ms(on[-1]['ttft_p50_s'])} ms vs "
            f"{ms(on[1]['ttft_p50_s'])} ms: {r:.2f}x")
    else:
        add(name, None, "not measured (fewer than 3 turns, or no TTFT)")
    for wl in ("chat", "shared_system", "branch"):
        t = res[wl]["on"]["total"]
        add(f"{wl.replace('_', '-')}: hit rate = the ceiling (reuse on)",
            None if t["hit_rate"] is None else t["hit_rate"] >= 1.0,
            f"{pc(t['hit_rate'])} ({t['cached_tokens']} cached, ceiling "
            f"{t['ceiling_tokens']} tokens)")
    ll = chat.get("llama_server", {}).get("turns")
    for what, key in (("tokens computed", "computed_tokens"), ("TTFT p50", "ttft_p50_s")):
        name = f"chat: {what} per turn <= llama-server's (reuse on)"
        if not ll:
            add(name, None, "not measured: " + chat.get("llama_server", {}).get(
                "skipped", "no llama-server run"))
            continue
        worse = []
        for x, z in zip(on, ll):
            xv = mean(x, key) if key == "computed_tokens" else x[key]
            zv = mean(z, key) if key == "computed_tokens" else z[key]
            if xv is None or zv is None or xv > zv:
                worse.append(x["turn"])
        add(name, not worse, "every turn" if not worse else f"not on turns {worse}")
    return out


# --------------------------------------------------------------------------- main


def resolve(a: argparse.Namespace, tmp: Path) -> tuple[str, str, int | None]:
    """(model directory, description, vocabulary of a ``t<id>`` word tokenizer or None)."""
    if a.model:
        return a.model, a.model, None
    if a.shape == "default":
        return resolve_model(None, tmp), "the embedded default model", None
    import baselines as bl

    shape = bl.MAMBA2_130M
    return (str(bl.mamba2_dir(shape)), f"Mamba2 {bl.describe_shape(shape)}, random weights",
            shape["vocab_size"])


async def mcserve_workloads(url: str, tx: dict[str, Any], a: argparse.Namespace
                            ) -> dict[str, Any]:
    be = McserveBackend(url, a.request_timeout)
    await warm_up(be, a.request_timeout)
    out: dict[str, Any] = {}
    for wl, fn in (("chat", run_chat), ("shared_system", run_shared), ("branch", run_branch)):
        t0 = time.perf_counter()
        out[wl] = {"requests": await fn(be, tx, a), "wall_s": time.perf_counter() - t0}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    m = ap.add_mutually_exclusive_group()
    m.add_argument("--model", default=None, metavar="DIR", help="any mcserve-servable checkpoint")
    m.add_argument("--shape", choices=["mamba2-130m", "default"], default=None,
                   help="mamba2-130m: the 130M Mamba2 shape with random weights "
                   "(bench/baselines.py; the default); default: the embedded default model "
                   "(the default of --quick)")
    ap.add_argument("--device", default="cpu", help="the servers' --device (default: cpu)")
    ap.add_argument("--threads", type=int, default=None,
                    help="threads of every server (default 2; --quick: 1)")
    ap.add_argument("--server-arg", action="append", default=[],
                    help="extra flag for both mcserve servers (repeatable), e.g. "
                    "--server-arg=--checkpoint-interval=128")
    ap.add_argument("--quick", action="store_true",
                    help="2 users x 3 turns, short prompts, the default model: under a minute")
    ap.add_argument("--out", default=None, help="result file name or path")
    ap.add_argument("--request-timeout", type=float, default=600.0,
                    help="seconds any one HTTP request may take (default 600)")
    w = ap.add_argument_group("workloads (defaults: full run / --quick)")
    for k, v in FULL.items():
        w.add_argument("--" + k.replace("_", "-"), type=int, default=None,
                       nargs=len(v) if isinstance(v, list) else None,
                       help=f"default {v} (--quick: {QUICK[k]})")
    ll = ap.add_argument_group("llama-server")
    ll.add_argument("--llama-server", default=None, metavar="PATH",
                    help="the llama-server binary (default: $LLAMA_SERVER, "
                    "<llama-cpp-src>/build/bin/llama-server, or on PATH)")
    ll.add_argument("--llama-cpp-src", default=None,
                    help="llama.cpp source folder with convert_hf_to_gguf.py "
                    "(default: $LLAMA_CPP_SRC)")
    ll.add_argument("--no-llama-server", action="store_true", help="skip the llama-server run")
    a = ap.parse_args(argv)
    for k, v in (QUICK if a.quick else FULL).items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    if a.quick:
        if a.threads is None:
            a.threads = 1  # bounded time on a busy machine (no OpenMP spin-waits)
        if a.shape is None and a.model is None:
            a.shape = "default"
    a.threads = a.threads or 2
    a.shape = a.shape or (None if a.model else "mamba2-130m")
    if min(a.users, a.turns, a.shared_requests, a.shared_concurrency) < 1:
        ap.error("--users, --turns, --shared-requests and --shared-concurrency must be >= 1")
    if not 0 < a.branch_prefix <= min(a.branch_lengths):
        ap.error("--branch-prefix must be > 0 and at most the shortest --branch-lengths")
    set_threads(a.threads)
    out_name = a.out or ("tmp_multi_turn_quick.json" if a.quick else "multi_turn.json")
    env = env_info()
    print(env_line(env))

    result: dict[str, Any] = {"bench": "multi_turn", "env": env, "args": vars(a),
                              "command": [sys.executable, *sys.argv], "servers": {},
                              "workloads": {}, "notes": []}
    raw: dict[str, dict[str, Any]] = {}
    errors: list[str] = []
    with tempfile.TemporaryDirectory(prefix="mcserve-multi-turn-") as tmp_s:
        tmp = Path(tmp_s)
        model_dir, desc, id_words = resolve(a, tmp)
        result["model"] = {"dir": model_dir, "description": desc}
        print(f"model: {desc} ({model_dir}); device {a.device}; {a.threads} threads per server")
        tx: dict[str, Any] | None = None
        max_seqs = max(a.users, a.shared_concurrency)
        for mode in ("on", "off"):
            flags = ["--device", a.device, *a.server_arg]
            if mode == "off":
                flags.append("--no-enable-prefix-caching")
            server = mon = None
            info: dict[str, Any] = {"flags": flags, "max_num_seqs": max_seqs}
            try:
                t0 = time.perf_counter()
                server = Server(model_dir, max_seqs, flags, None, a.threads)
                info["startup_s"] = time.perf_counter() - t0
                mon = RssMonitor(server.proc.pid)
                if tx is None:
                    texts = Texts(server.url, a.request_timeout, id_words)
                    try:
                        tx = build_texts(texts, a)
                    finally:
                        texts.close()
                    result["texts"] = {k: tx[k] for k in ("system_tokens", "shared_system_tokens",
                                                          "branch_prefix_tokens", "sized_by")}
                    print(f"prompts sized by {tx['sized_by']}: system prompt "
                          f"{tx['system_tokens']} tokens (rendered message), shared-system "
                          f"{tx['shared_system_tokens']}, branch prefix "
                          f"{tx['branch_prefix_tokens']}")
                t0 = time.perf_counter()
                raw[mode] = asyncio.run(mcserve_workloads(server.url, tx, a))
                info["wall_s"] = time.perf_counter() - t0
            finally:
                if mon is not None:
                    info["rss_max_bytes"] = mon.stop()
                if server is not None:
                    server.stop()
                result["servers"][mode] = info
            rss = info.get("rss_max_bytes")
            print(f"reuse {mode}: server up in {info['startup_s']:.1f} s, workloads "
                  f"{info['wall_s']:.1f} s, max RSS "
                  f"{'-' if rss is None else f'{rss / 2**20:.0f} MiB'}", flush=True)

        llama: dict[str, Any] = {}
        if a.no_llama_server:
            llama["skipped"] = "llama-server column skipped: --no-llama-server"
        else:
            binary, gguf, why = llama_server_setup(a, model_dir)
            if why is not None:
                llama["skipped"] = why
            else:
                assert binary is not None and gguf is not None and tx is not None
                from mcserve.engine.tokenizer import load_tokenizer

                ctx = tx["system_tokens"] + a.turns * (a.user_tokens * 2 + a.answer_tokens + 32)
                ctx = -(-(ctx + 256) // 256) * 256
                lsrv = None
                try:
                    lsrv = LlamaServer(binary, gguf, a.users, ctx, a.threads, a.device,
                                       tmp / "llama-server.log", a.request_timeout)
                    mon = RssMonitor(lsrv.proc.pid)
                    be = LlamaBackend(lsrv.url, a.request_timeout, load_tokenizer(model_dir))
                    t0 = time.perf_counter()
                    recs = asyncio.run(run_chat(be, tx, a))
                    llama.update(requests=recs, wall_s=time.perf_counter() - t0,
                                 command=lsrv.cmd, rss_max_bytes=mon.stop())
                except Exception as e:  # noqa: BLE001 - a failed baseline is reported, not fatal
                    llama["skipped"] = f"llama-server run failed: {type(e).__name__}: {e}"
                finally:
                    if lsrv is not None:
                        lsrv.stop()
        if "skipped" in llama:
            print(llama["skipped"])
            result["notes"].append(llama["skipped"])

    # ------------------------------------------------------------------ summaries and report
    res: dict[str, Any] = {"chat": {}, "shared_system": {}, "branch": {}}
    for mode in ("on", "off"):
        recs = raw[mode]["chat"]["requests"]
        res["chat"][mode] = {**chat_summary(recs, a.turns), "requests": plain(recs),
                             "wall_s": raw[mode]["chat"]["wall_s"]}
        for wl in ("shared_system", "branch"):
            recs = raw[mode][wl]["requests"]
            res[wl][mode] = {"total": {**hit(recs), **latency(recs)}, "requests": plain(recs),
                             "wall_s": raw[mode][wl]["wall_s"]}
        for wl in res:
            errors += [f"{wl} ({mode}): {r['error']}" for r in raw[mode][wl]["requests"]
                       if r["error"]]
    if "requests" in llama:
        recs = llama["requests"]
        res["chat"]["llama_server"] = {**chat_summary(recs, a.turns), "requests": plain(recs),
                                       **{k: llama[k] for k in ("wall_s", "command",
                                                                "rss_max_bytes")}}
        errors += [f"chat (llama-server): {r['error']}" for r in recs if r["error"]]
    else:
        res["chat"]["llama_server"] = {"skipped": llama["skipped"]}
    result["workloads"] = res

    print_chat(res["chat"], a, tx)
    print_flat(f"shared-system: {a.shared_requests} requests, system prompt "
               f"{tx['shared_system_tokens']} tokens, user ~{a.shared_user_tokens} tokens, "
               f"{a.shared_answer_tokens}-token answers, {a.shared_concurrency} concurrent "
               f"(TTFT in ms)", res["shared_system"], "server")
    print_flat(f"branch: /v1/completions prompts of {'/'.join(map(str, a.branch_lengths))} "
               f"tokens sharing a {tx['branch_prefix_tokens']}-token prefix, one after another "
               f"(TTFT in ms)", res["branch"], "prompt")
    off_cached = [r["cached_tokens"] for wl in res for r in res[wl]["off"]["requests"]]
    print(f"reuse off: cached_tokens 0 on every request: "
          f"{'yes' if all(not c for c in off_cached) else 'NO'}")
    result["targets"] = targets(res, a)
    print("\nTargets (printed, not asserted):")
    for t in result["targets"]:
        mark = {True: "PASS", False: "FAIL", None: "n/a "}[t["pass"]]
        print(f"  {mark}  {t['target']}: {t['detail']}")
    result["errors"] = errors
    if errors:
        print(f"{len(errors)} request(s) failed; first: {errors[0]}", file=sys.stderr)
    for p in write_json(result, out_name):
        print(f"wrote {p}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
