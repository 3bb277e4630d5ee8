"""Scale-out benchmark: the state-affinity router against Ray Serve's default router.

    python bench/scale_out.py [MODEL] [--replicas 2] [--conversations 32] [--turns 4] [--quick]

Starts a local Ray cluster, and for each router (``state``: mcserve's ``StateAffinityRouter``;
``pow2``: Ray Serve's power-of-two-choices default) deploys ``--replicas`` engine replicas
behind the OpenAI-compatible ingress (``mcserve.server.ray``), fresh caches each time, and
runs the same workload over HTTP:

* ``--conversations`` multi-turn conversations, ``--concurrency`` of them at a time; every
  conversation starts with the same ~``--system-tokens`` system prompt, then ``--turns`` turns
  of ~``--user-tokens`` new tokens each, every turn's prompt being the whole conversation so far
  (previous answers included), after a pause of ``--think-s`` on average; answers are
  ``--max-tokens`` greedy tokens, streamed.
* measured: prefix-hit rate (cached blocks / blocks looked up, summed over replicas, from the
  merged /metrics; blocks a replica imported from another count as hits, as they do in the
  responses' ``cached_tokens``; the rate without them is in the JSON), its *ceiling* (the share
  of looked-up blocks that some replica had computed, or was computing, when the request was
  sent: what no router can beat, since the rest is the turn's new content), the hit rate of
  *reusable* blocks (of the blocks some replica had computed before a request was sent, the
  share its replica reused: the router's own quality), where the misses come from (new content,
  being computed elsewhere, cached elsewhere), TTFT p50 / p99 (send to the first streamed text)
  and the engines' own TTFT and queue time, throughput (generated tokens / wall time), blocks and
  bytes migrated, routing decisions by reason, and blocks left in use on every replica after
  the run (must be 0).

Then, on the state router's deployment, ``--migrate-trials`` ~``--migrate-tokens`` conversations,
one at a time: each one's prefill on replica A (recompute, cold), then the same prompt on
replica B told that A holds it: B fetches A's blocks through Ray's object store, imports them
and prefills only the tail. Reported (medians): the recompute TTFT, the migrated TTFT, the fetch
time, and their ratio.

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
    # blocks some replica computed before a request was sent: prompts and answers of finished
    # requests (an answer's complete segments are cached as it is decoded), the most any
    # router could have reused for it; and blocks of requests in flight at the time
    seen: set[bytes] = set()
    inflight: dict[bytes, int] = {}
    records: list[dict[str, Any]] = []
    sem = asyncio.Semaphore(args.concurrency)
    timeout = httpx.Timeout(600.0)
    C = args.segment_len
    # words per user turn for --user-tokens tokens on average (the system prompt's ratio)
    user_words = max(1, round(args.user_tokens * len(system.split()) / args.system_tokens))

    def run_of(hashes: list[bytes], known: Any) -> int:
        n = 0
        while n < len(hashes) and known(hashes[n]):
            n += 1
        return n

    async def conversation(i: int, client: httpx.AsyncClient) -> None:
        nonlocal tokens, failed
        rng = random.Random(1000 + i)
        conv = system
        async with sem:
            for t in range(args.turns):
                if t and args.think_s > 0:
                    # the user reads and types: without it, the replica that just finished
                    # this conversation's turn is the least loaded when the next one comes, and
                    # a load-only router follows conversations by accident
                    await asyncio.sleep(rng.uniform(0, 2 * args.think_s))
                conv += f"\nUser {t}: " + words(rng, user_words) + "\nAssistant:"
                body = {"prompt": conv, "max_tokens": args.max_tokens, "temperature": 0,
                        "ignore_eos": True, "stream": True,
                        "stream_options": {"include_usage": True}}
                ids = (await client.post("/tokenize", json={"prompt": conv})).json()["tokens"]
                hashes = keys(ids)
                rec: dict[str, Any] = {
                    "conv": i, "turn": t, "prompt_tokens": len(ids), "queried": len(hashes),
                    "avail": run_of(hashes, seen.__contains__),
                    "avail_inflight": run_of(hashes, lambda h: h in seen or h in inflight)}
                for h in hashes:
                    inflight[h] = inflight.get(h, 0) + 1
                t0 = time.perf_counter()
                first = None
                answer = []
                try:
                    async with client.stream("POST", "/v1/completions", json=body) as r:
                        if r.status_code != 200:
                            failed += 1
                            await r.aread()
                            return
                        rec["replica"] = r.headers.get("x-mcserve-replica")
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
                                rec["hit"] = min(len(hashes), cached // C)
                finally:
                    for h in hashes:
                        inflight[h] -= 1
                        if not inflight[h]:
                            del inflight[h]
                if first is not None:
                    ttft.append(first)
                    rec["ttft_s"] = first
                conv += "".join(answer)
                # the answer's complete segments were cached as it was decoded
                done = (await client.post("/tokenize", json={"prompt": conv})).json()["tokens"]
                seen.update(hashes)
                seen.update(keys(done))
                records.append(rec)

    t0 = time.perf_counter()
    async with httpx.AsyncClient(base_url=base, timeout=timeout) as client:
        await asyncio.gather(*(conversation(i, client) for i in range(args.conversations)))
    wall = time.perf_counter() - t0
    return {"ttft": ttft, "tokens": tokens, "wall_s": wall, "failed": failed,
            "records": records}


def miss_breakdown(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Where the looked-up blocks that missed come from, summed over requests:

    * ``new``: no replica had computed them, nor was computing them, when the request was
      sent (the turn's user message, the part of the last segment that the answer left
      incomplete): no router can reuse them;
    * ``concurrent``: a request in flight on some replica was computing them (the shared
      system prompt while the first conversations start together);
    * ``lost``: some replica had them cached when the request was sent, and its replica
      neither had them nor migrated them (routed away, or evicted).
    """
    recs = [r for r in records if "hit" in r]
    q = sum(r["queried"] for r in recs)
    hit = sum(r["hit"] for r in recs)
    new = sum(r["queried"] - r["avail_inflight"] for r in recs)
    conc = sum(max(0, r["avail_inflight"] - max(r["avail"], r["hit"])) for r in recs)
    lost = sum(max(0, r["avail"] - r["hit"]) for r in recs)
    avail = sum(r["avail"] for r in recs)
    by_turn: dict[int, dict[str, int]] = {}
    for r in recs:
        d = by_turn.setdefault(r["turn"], {"requests": 0, "queried": 0, "hit": 0, "new": 0})
        d["requests"] += 1
        d["queried"] += r["queried"]
        d["hit"] += r["hit"]
        d["new"] += r["queried"] - r["avail_inflight"]
    return {"queried": q, "hit": hit, "missed": q - hit, "new": new, "concurrent": conc,
            "lost": lost, "reusable": avail,
            # the best any router could do: every block computed once in the cluster (the
            # blocks of requests in flight included), then reused or migrated
            "ceiling": (q - new) / q if q else None,
            "by_turn": by_turn}


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
    """``--migrate-trials`` prompts of ``--migrate-tokens`` tokens, each new: cold prefill on
    replica A, then on replica B with A named as the holder (B migrates, then prefills the
    tail). Medians over the trials (one sample on a shared machine is noise)."""
    import torch
    from ray import serve

    from mcserve.engine.sampling import SamplingParams
    from mcserve.server.ray import ENGINE_DEPLOYMENT, known_replicas

    handle = serve.get_deployment_handle(ENGINE_DEPLOYMENT, app_name)
    a, b = known_replicas(app_name)[:2]
    info = handle.info.remote({"to": a}).result(timeout_s=60)
    from mcserve.server.ray import RemoteEngineView

    view = RemoteEngineView(info, tokenizer=None)
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

    trials = []
    for k in range(max(1, args.migrate_trials)):
        g = torch.Generator().manual_seed(7 + k)
        ids = torch.randint(2, info["vocab_size"], (args.migrate_tokens,), generator=g).tolist()
        hashes = view.prefix_hashes(ids, None)
        base = {"prompt": None, "prompt_token_ids": ids, "params": params, "hashes": hashes}
        t_recompute, _ = ttft({**base, "request_id": f"probe-a{k}", "to": a})
        t_migrated, acc = ttft({**base, "request_id": f"probe-b{k}", "to": b,
                                "route": {"holder": a, "holder_blocks": len(hashes),
                                          "reason": "fallback"}})
        mig = acc.get("migration") or {}
        trials.append({"blocks": int(mig.get("blocks", 0)), "bytes": int(mig.get("nbytes", 0)),
                       "fetch_s": float(mig.get("seconds") or 0.0),
                       "ttft_recompute_s": t_recompute, "ttft_migrated_s": t_migrated})

    def med(key: str) -> float:
        return statistics.median(t[key] for t in trials)

    out: dict[str, Any] = {"tokens": args.migrate_tokens, "blocks": trials[-1]["blocks"],
                           "bytes": trials[-1]["bytes"], "fetch_s": med("fetch_s"),
                           "ttft_recompute_s": med("ttft_recompute_s"),
                           "ttft_migrated_s": med("ttft_migrated_s"), "trials": trials}
    out["speedup"] = (out["ttft_recompute_s"] / out["ttft_migrated_s"]
                      if out["ttft_migrated_s"] else None)
    return out


def bench_router(router: str, args: argparse.Namespace, port: int) -> dict[str, Any]:
    import httpx
    from ray import serve

    from mcserve.server.ray import RayServeOptions, deploy

    engine: dict[str, Any] = {"max_num_seqs": args.concurrency,
                              "max_model_len": max(8192, 2 * args.migrate_tokens)}
    if args.model:
        engine["model"] = str(Path(args.model).resolve())
    if args.num_state_blocks:
        engine["num_state_blocks"] = args.num_state_blocks
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

    from mcserve.server.ray import ENGINE_DEPLOYMENT, RemoteEngineView

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

    def delta_labelled(name: str, label: str, value: str) -> float:
        sel = f'{label}="{value}"'
        return sum(float(ln.rsplit(" ", 1)[1]) * sign for text, sign in ((after, 1), (before, -1))
                   for ln in text.splitlines() if ln.startswith(name + "{") and sel in ln)

    def mean_of(hist: str) -> float | None:
        n = delta(hist + "_count")
        return delta(hist + "_sum") / n if n else None

    recs = res["records"]
    miss = miss_breakdown(recs)
    hits, queries = delta("mcserve:prefix_cache_hits_total"), delta(
        "mcserve:prefix_cache_queries_total")
    out: dict[str, Any] = {
        "router": router, "deploy_s": deploy_s, "requests": len(res["ttft"]),
        "failed": res["failed"],
        "prefix_hit_rate": hits / queries if queries else None,
        # the same, not counting the blocks a replica imported from another as hits (their first
        # use after the import)
        "prefix_hit_rate_local": ((hits - delta("mcserve:state_migrated_blocks_total")) / queries
                                  if queries else None),
        "prefix_hit_ceiling": miss["ceiling"],
        "prefix_blocks_hit": hits, "prefix_blocks_queried": queries,
        # of the blocks some replica had computed before the request was sent, the share the
        # serving replica reused (from each response's cached_tokens)
        "reusable_hit_rate": (sum(min(r["hit"], r["avail"]) for r in recs) / miss["reusable"]
                              if miss["reusable"] else None),
        "reusable_blocks": miss["reusable"],
        # inside the replicas (arrival at the engine to first token; waiting for admission)
        "engine_ttft_mean_s": mean_of("mcserve:time_to_first_token_seconds"),
        "engine_queue_mean_s": mean_of("mcserve:request_queue_time_seconds"),
        "engine_itl_mean_s": mean_of("mcserve:inter_token_latency_seconds"),
        "misses": miss,
        "requests_detail": recs,
        "routed": {k: delta_labelled("mcserve:routed_requests_total", "reason", k)
                   for k in ("affinity", "fallback", "cold")},
        "migrations": {k: delta_labelled("mcserve:state_migrations_total", "outcome", k)
                       for k in ("imported", "empty", "failed")},
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
    ap.add_argument("--migrate-trials", type=int, default=3,
                    help="migration probes (each a new prompt); medians are reported")
    ap.add_argument("--imbalanced-threshold", type=int, default=1)
    ap.add_argument("--num-state-blocks", type=int, default=None,
                    help="state blocks per replica (default: the engine's automatic pool, "
                         "which holds the whole workload; fewer puts the caches under pressure)")
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
                     is not None else "-", f"{r['prefix_hit_ceiling']:.1%}",
                     f"{r['reusable_hit_rate']:.1%}" if r["reusable_hit_rate"] is not None
                     else "-", f"{r['ttft_p50_s'] * 1e3:.0f} ms",
                     f"{r['ttft_p99_s'] * 1e3:.0f} ms", f"{r['throughput_tok_s']:.1f}",
                     f"{int(r['blocks_migrated'])}", f"{r['bytes_migrated'] / 2**20:.1f} MiB",
                     r["failed"], sum(r["blocks_in_use_after"].values())])
    env = env_info()
    print(env_line(env))
    print_table(rows, ["router", "prefix hits", "ceiling", "of reusable", "TTFT p50",
                       "TTFT p99", "tok/s", "blocks moved", "bytes moved", "failed", "blocks left"],
                title=f"{args.conversations} conversations x {args.turns} turns, "
                      f"{args.system_tokens}-token shared system prompt, "
                      f"{args.replicas} replicas x {args.threads} thread(s)")
    for r in results:
        m = r["misses"]
        print(f"{r['router']}: {m['queried']} blocks looked up, {m['missed']} missed: "
              f"{m['new']} new content, {m['concurrent']} being computed elsewhere, "
              f"{m['lost']} cached elsewhere; ceiling {m['ceiling']:.1%}; routed "
              f"{ {k: int(v) for k, v in r['routed'].items()} }, migrations "
              f"{ {k: int(v) for k, v in r['migrations'].items()} }")
        if r.get("engine_ttft_mean_s") is not None:
            print(f"  TTFT mean {r['ttft_mean_s'] * 1e3:.0f} ms, in the engines "
                  f"{r['engine_ttft_mean_s'] * 1e3:.0f} ms (queued "
                  f"{r['engine_queue_mean_s'] * 1e3:.0f} ms), ITL "
                  f"{r['engine_itl_mean_s'] * 1e3:.1f} ms")
    by = {r["router"]: r for r in results}
    summary: dict[str, Any] = {}
    if "state" in by and "pow2" in by:
        s, d = by["state"], by["pow2"]
        summary["ttft_p50_ratio_default_over_state"] = d["ttft_p50_s"] / s["ttft_p50_s"]
        summary["prefix_hit_rate_state"] = s["prefix_hit_rate"]
        summary["prefix_hit_rate_default"] = d["prefix_hit_rate"]
        summary["prefix_hit_rate_state_local"] = s["prefix_hit_rate_local"]
        summary["prefix_hit_ceiling"] = s["prefix_hit_ceiling"]
        summary["reusable_hit_rate_state"] = s["reusable_hit_rate"]
        summary["reusable_hit_rate_default"] = d["reusable_hit_rate"]
        print(f"TTFT p50: default / state = {summary['ttft_p50_ratio_default_over_state']:.2f}x")
    probe = by.get("state", {}).get("migration_probe")
    if probe:
        summary["migration_speedup"] = probe["speedup"]
        print(f"migration of a {probe['tokens']}-token prefix ({probe['blocks']} blocks, "
              f"{probe['bytes'] / 2**20:.1f} MiB): TTFT {probe['ttft_migrated_s'] * 1e3:.0f} ms "
              f"(fetch {float(probe['fetch_s'] or 0) * 1e3:.0f} ms) vs recompute "
              f"{probe['ttft_recompute_s'] * 1e3:.0f} ms: {probe['speedup']:.1f}x faster "
              f"(medians of {len(probe['trials'])})")
    data = {"env": env, "args": vars(args), "results": results, "summary": summary}
    name = args.out or ("tmp_scale_out_quick.json" if args.quick else "scale_out.json")
    for p in write_json(data, name):
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
