"""Scale-out benchmark: the state-affinity router against Ray Serve's default router.

    python bench/scale_out.py [MODEL] [--replicas 2] [--conversations 32] [--turns 4] [--quick]

Starts a local Ray cluster, and for each router (``state``: mcserve's ``StateAffinityRouter``;
``pow2``: Ray Serve's power-of-two-choices default) deploys ``--replicas`` engine replicas
behind the OpenAI-compatible ingress (``mcserve.server.ray_app``), fresh caches each time, and
runs the same workload over HTTP:

* ``--conversations`` multi-turn conversations, ``--concurrency`` of them at a time; every
  conversation starts with the same ~``--system-tokens`` system prompt, then ``--turns`` turns
  of ``--user-tokens`` new tokens each, every turn's prompt being the whole conversation so far
  (previous answers included), after a pause of ``--think-s`` on average; answers are
  ``--max-tokens`` greedy tokens, streamed.
* measured: prefix-hit rate (cached blocks / blocks looked up, summed over replicas, from the
  merged /metrics; its ceiling is the share of looked-up blocks that are not new content),
  the hit rate of *reusable* blocks (of the blocks some replica had computed before a request
  was sent, the share its replica reused: the router's own quality), TTFT p50 / p99 (send to
  the first streamed text), throughput (generated
  tokens / wall time), blocks and bytes migrated, and blocks left in use on every replica after
  the run (must be 0).

Then, on the state router's deployment, one ~``--migrate-tokens`` conversation: its prefill on
replica A (recompute, cold), then the same prompt on replica B told that A holds it: B fetches
A's blocks through Ray's object store, imports them and prefills only the tail. Reported: the
recompute TTFT, the migrated TTFT, the fetch time, and their ratio.

Results: a table, and JSON in ``bench/results/scale_out.json`` (``--quick``: fewer, shorter
conversations, ``tmp_scale_out_quick.json``, not tracked). Without MODEL the embedded default
model is served.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import env_info, env_line, print_table, write_json  # noqa: E402

WORDS = ("memory state segment cache replica router prefix token model layer block "
         "checkpoint recurrent linear gated delta window query key value head stream "
         "request engine server cluster node object store migrate prefill decode batch "
         "budget latency throughput affinity balance queue thread device pool hash chain "
         "the a of to and in is that it for on with as by at from this be are was or").split()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def fit_text(client: Any, target_tokens: int, seed: int) -> str:
    """Text of about ``target_tokens`` tokens under the served tokenizer (``/tokenize``)."""
    n = max(1, target_tokens)
    for _ in range(6):
        text = words(random.Random(seed), n)
        got = client.post("/tokenize", json={"prompt": text}).json()["count"]
        if abs(got - target_tokens) <= max(4, target_tokens // 50):
            return text
        n = max(1, int(n * target_tokens / max(1, got)))
    return text


def quantile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    if not s:
        return float("nan")
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def metric_sum(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def run_workload(base: str, system: str, args: argparse.Namespace,
                       keys: Any) -> dict[str, Any]:
    """``keys(ids)``: the prompt's prefix-cache keys (``RemoteEngineView.prefix_hashes``)."""
    import httpx

    ttft: list[float] = []
    tokens = 0
    failed = 0
    # blocks some replica computed before a request was sent (prompts of finished requests):
    # the most any router could have reused for it
    seen: set[bytes] = set()
    reusable = 0
    reused = 0
    sem = asyncio.Semaphore(args.concurrency)
    timeout = httpx.Timeout(600.0)

    async def conversation(i: int, client: httpx.AsyncClient) -> None:
        nonlocal tokens, failed, reusable, reused
        rng = random.Random(1000 + i)
        conv = system
        async with sem:
            for t in range(args.turns):
                if t and args.think_s > 0:
                    # the user reads and types: without it, the replica that just finished
                    # this conversation's turn is the least loaded when the next one comes, and
                    # a load-only router follows conversations by accident
                    await asyncio.sleep(rng.uniform(0, 2 * args.think_s))
                conv += f"\nUser {t}: " + words(rng, args.user_tokens) + "\nAssistant:"
                body = {"prompt": conv, "max_tokens": args.max_tokens, "temperature": 0,
                        "ignore_eos": True, "stream": True,
                        "stream_options": {"include_usage": True}}
                ids = (await client.post("/tokenize", json={"prompt": conv})).json()["tokens"]
                hashes = keys(ids)
                avail = 0
                while avail < len(hashes) and hashes[avail] in seen:
                    avail += 1
                t0 = time.perf_counter()
                first = None
                answer = []
                async with client.stream("POST", "/v1/completions", json=body) as r:
                    if r.status_code != 200:
                        failed += 1
                        await r.aread()
                        return
                    async for line in r.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        ev = json.loads(line[6:])
                        if "error" in ev:
                            failed += 1
                            return
                        for ch in ev.get("choices", []):
                            if ch.get("text"):
                                if first is None:
                                    first = time.perf_counter() - t0
                                answer.append(ch["text"])
                        if ev.get("usage"):
                            tokens += ev["usage"]["completion_tokens"]
                            cached = ev["usage"]["prompt_tokens_details"]["cached_tokens"]
                            reusable += avail
                            reused += min(avail, cached // args.segment_len)
                if first is not None:
                    ttft.append(first)
                seen.update(hashes)
                conv += "".join(answer)

    t0 = time.perf_counter()
    async with httpx.AsyncClient(base_url=base, timeout=timeout) as client:
        await asyncio.gather(*(conversation(i, client) for i in range(args.conversations)))
    wall = time.perf_counter() - t0
    return {"ttft": ttft, "tokens": tokens, "wall_s": wall, "failed": failed,
            "reusable_blocks": reusable, "reused_blocks": reused}


def blocks_in_use(app_name: str) -> dict[str, int]:
    """Blocks still referenced on each replica once every request finished (0: no leak)."""
    from ray import serve

    ingress = serve.get_app_handle(app_name)
    deadline = time.monotonic() + 30
    while True:
        stats = ingress.replica_stats.remote().result(timeout_s=120)
        if all(s["pools_whole"] for s in stats.values()) or time.monotonic() > deadline:
            return {name: int(s["state_blocks_used"]) for name, s in stats.items()}
        time.sleep(0.2)


def migration_probe(app_name: str, args: argparse.Namespace) -> dict[str, Any]:
    """One ``--migrate-tokens`` prompt: cold prefill on replica A, then on replica B with A
    named as the holder (B migrates, then prefills the tail)."""
    import torch
    from ray import serve

    from mcserve.engine.sampling import SamplingParams
    from mcserve.server.ray_app import ENGINE_DEPLOYMENT, known_replicas

    handle = serve.get_deployment_handle(ENGINE_DEPLOYMENT, app_name)
    a, b = known_replicas(app_name)[:2]
    info = handle.info.remote({"to": a}).result(timeout_s=60)
    from mcserve.server.ray_app import RemoteEngineView

    view = RemoteEngineView(info, tokenizer=None)
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(2, info["vocab_size"], (args.migrate_tokens,), generator=g).tolist()
    hashes = view.prefix_hashes(ids, None)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    def ttft(req: dict[str, Any]) -> tuple[float, dict[str, Any]]:
        gen = handle.options(stream=True).generate.remote(req)
        t0 = time.perf_counter()
        accepted: dict[str, Any] = {}
        for item in gen:
            if isinstance(item, dict):
                if "error" in item:
                    raise RuntimeError(item)
                accepted = item
                continue
            if item.outputs and item.outputs[0].token_ids:
                return time.perf_counter() - t0, accepted
        raise RuntimeError("no token")

    base = {"prompt": None, "prompt_token_ids": ids, "params": params, "hashes": hashes}
    t_recompute, _ = ttft({**base, "request_id": "probe-a", "to": a})
    t_migrated, acc = ttft({**base, "request_id": "probe-b", "to": b,
                            "route": {"holder": a, "holder_blocks": len(hashes),
                                      "reason": "fallback"}})
    mig = acc.get("migration") or {}
    return {"tokens": len(ids), "blocks": int(mig.get("blocks", 0)),
            "bytes": int(mig.get("nbytes", 0)), "fetch_s": mig.get("seconds"),
            "ttft_recompute_s": t_recompute, "ttft_migrated_s": t_migrated,
            "speedup": t_recompute / t_migrated if t_migrated else None}


def bench_router(router: str, args: argparse.Namespace, port: int) -> dict[str, Any]:
    import httpx
    from ray import serve

    from mcserve.server.ray_app import RayServeOptions, deploy

    engine: dict[str, Any] = {"max_num_seqs": args.concurrency,
                              "max_model_len": max(8192, 2 * args.migrate_tokens)}
    if args.model:
        engine["model"] = str(Path(args.model).resolve())
    app_name = f"scale-out-{router}"
    opts = RayServeOptions(engine=engine, replicas=args.replicas, cpu_threads=args.threads,
                           router=router, app_name=app_name,
                           imbalanced_threshold=args.imbalanced_threshold)
    t0 = time.perf_counter()
    deploy(opts)
    deploy_s = time.perf_counter() - t0
    print(f"  deployed in {deploy_s:.0f} s; running the workload ...", flush=True)
    base = f"http://127.0.0.1:{port}"
    client = httpx.Client(base_url=base, timeout=120)
    system = fit_text(client, args.system_tokens, seed=1)
    from ray import serve as _serve

    from mcserve.server.ray_app import ENGINE_DEPLOYMENT, RemoteEngineView

    info = _serve.get_deployment_handle(ENGINE_DEPLOYMENT, app_name).info.remote().result(
        timeout_s=60)
    view = RemoteEngineView(info, tokenizer=None)
    args.segment_len = view.segment_len
    before = client.get("/metrics").text
    res = asyncio.run(run_workload(base, system, args,
                                   lambda ids: view.prefix_hashes(ids, None)))
    after = client.get("/metrics").text

    def delta(name: str) -> float:
        return metric_sum(after, name) - metric_sum(before, name)

    hits, queries = delta("mcserve:prefix_cache_hits_total"), delta(
        "mcserve:prefix_cache_queries_total")
    out: dict[str, Any] = {
        "router": router, "deploy_s": deploy_s, "requests": len(res["ttft"]),
        "failed": res["failed"],
        "prefix_hit_rate": hits / queries if queries else None,
        "prefix_blocks_hit": hits, "prefix_blocks_queried": queries,
        # of the blocks some replica had computed before the request was sent, the share the
        # serving replica reused (from each response's cached_tokens)
        "reusable_hit_rate": (res["reused_blocks"] / res["reusable_blocks"]
                              if res["reusable_blocks"] else None),
        "reusable_blocks": res["reusable_blocks"],
        "ttft_p50_s": quantile(res["ttft"], 0.5), "ttft_p99_s": quantile(res["ttft"], 0.99),
        "ttft_mean_s": statistics.fmean(res["ttft"]) if res["ttft"] else None,
        "throughput_tok_s": res["tokens"] / res["wall_s"], "wall_s": res["wall_s"],
        "generated_tokens": res["tokens"],
        "blocks_migrated": delta("mcserve:state_migrated_blocks_total"),
        "bytes_migrated": delta("mcserve:state_migrated_bytes_total"),
        "prompt_tokens_recomputed": delta("mcserve:prompt_tokens_recomputed_total"),
    }
    if router == "state" and not args.no_migration_probe:
        out["migration_probe"] = migration_probe(app_name, args)
    out["blocks_in_use_after"] = blocks_in_use(app_name)
    client.close()
    serve.delete(app_name)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per replica")
    ap.add_argument("--conversations", type=int, default=32)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--system-tokens", type=int, default=1024)
    ap.add_argument("--user-tokens", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--think-s", type=float, default=0.5,
                    help="mean pause between a conversation's turns (uniform 0..2x)")
    ap.add_argument("--migrate-tokens", type=int, default=4096)
    ap.add_argument("--imbalanced-threshold", type=int, default=1)
    ap.add_argument("--routers", default="state,pow2")
    ap.add_argument("--no-migration-probe", action="store_true")
    ap.add_argument("--quick", action="store_true",
                    help="8 conversations of 2 turns, 256-token system prompt (smoke)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.quick:
        args.conversations, args.turns, args.system_tokens = 8, 2, 256
        args.max_tokens, args.migrate_tokens, args.concurrency = 8, 1024, 4
        args.user_tokens = 64
    import ray
    from ray import serve

    ray.init(num_cpus=max(os.cpu_count() or 1, args.replicas * args.threads),
             include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": str(args.threads)}})
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    results = []
    try:
        for router in args.routers.split(","):
            print(f"router {router}: deploying {args.replicas} replicas ...", flush=True)
            results.append(bench_router(router.strip(), args, port))
    finally:
        serve.shutdown()
        ray.shutdown()
    rows = []
    for r in results:
        rows.append([r["router"], f"{r['prefix_hit_rate']:.1%}" if r["prefix_hit_rate"]
                     is not None else "-",
                     f"{r['reusable_hit_rate']:.1%}" if r["reusable_hit_rate"] is not None
                     else "-", f"{r['ttft_p50_s'] * 1e3:.0f} ms",
                     f"{r['ttft_p99_s'] * 1e3:.0f} ms", f"{r['throughput_tok_s']:.1f}",
                     f"{int(r['blocks_migrated'])}", f"{r['bytes_migrated'] / 2**20:.1f} MiB",
                     r["failed"], sum(r["blocks_in_use_after"].values())])
    env = env_info()
    print(env_line(env))
    print_table(rows, ["router", "prefix hits", "of reusable", "TTFT p50", "TTFT p99", "tok/s",
                       "blocks moved", "bytes moved", "failed", "blocks left"],
                title=f"{args.conversations} conversations x {args.turns} turns, "
                      f"{args.system_tokens}-token shared system prompt, "
                      f"{args.replicas} replicas x {args.threads} thread(s)")
    by = {r["router"]: r for r in results}
    summary: dict[str, Any] = {}
    if "state" in by and "pow2" in by:
        s, d = by["state"], by["pow2"]
        summary["ttft_p50_ratio_default_over_state"] = d["ttft_p50_s"] / s["ttft_p50_s"]
        summary["prefix_hit_rate_state"] = s["prefix_hit_rate"]
        summary["prefix_hit_rate_default"] = d["prefix_hit_rate"]
        summary["reusable_hit_rate_state"] = s["reusable_hit_rate"]
        summary["reusable_hit_rate_default"] = d["reusable_hit_rate"]
        print(f"TTFT p50: default / state = {summary['ttft_p50_ratio_default_over_state']:.2f}x")
    probe = by.get("state", {}).get("migration_probe")
    if probe:
        summary["migration_speedup"] = probe["speedup"]
        print(f"migration of a {probe['tokens']}-token prefix ({probe['blocks']} blocks, "
              f"{probe['bytes'] / 2**20:.1f} MiB): TTFT {probe['ttft_migrated_s'] * 1e3:.0f} ms "
              f"(fetch {float(probe['fetch_s'] or 0) * 1e3:.0f} ms) vs recompute "
              f"{probe['ttft_recompute_s'] * 1e3:.0f} ms: {probe['speedup']:.1f}x faster")
    data = {"env": env, "args": vars(args), "results": results, "summary": summary}
    name = args.out or ("tmp_scale_out_quick.json" if args.quick else "scale_out.json")
    for p in write_json(data, name):
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
