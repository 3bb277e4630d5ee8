"""Long-context decode: mcserve MC variants and a hybrid (LFM2) against a Transformer, one run.

For each context length L (``--lengths``, default 1K 2K 4K 8K 16K 32K) and each model:

* **decode tokens/s** at batch 1 and batch 8 (``--batches``), greedy with ``ignore_eos``: the
  median over ``--steps`` timed decode steps (after ``--warmup`` untimed ones) that start once
  every row's prompt of L tokens is prefilled; tokens/s = batch / median step time;
* **prefill time** of one prompt of L tokens (batch 1);
* **cache bytes held per sequence**, device tier and host tier separately.

Models (float32, or ``--dtype bfloat16``; random weights, the same seed for every variant):

* mcserve ``MCForCausalLM`` of the default model's shape (``ModelConfig(vocab_size=4096,
  d_model=256, n_layers=4, n_heads=4, head_dim=64, segment_len=64)``, linear memory) with
  ``mc_variant`` ``none``, ``residual``, ``grm``, ``ssc`` (top_k 2 and 8), run through
  ``LLMEngine`` (chunked prefill, paged state pool, ragged batched decode). Decode time is the
  wall time of ``engine.step()`` (scheduler + model + sampler + detokenizer). Bytes per sequence
  come from the engine's pools: ``stats()["state_blocks_used"]`` × ``cache.bytes_per_block`` /
  batch + ``cache.bytes_per_slot`` on the device tier, ``stats()["host_blocks_used"]`` ×
  ``bytes_per_block`` / batch on the host tier.
* ``ssc8-host``: ``ssc`` top_k 8 with a device pool of only ``--device-fraction`` (25%) of the
  blocks the sequence needs and the rest in the host tier (``host_state_blocks``): the engine
  offloads the oldest blocks and fetches the router's selection into a staging area per step.
  Its device bytes include its share of the staging area (``max_num_seqs·top_k``
  blocks, divided by ``max_num_seqs``). On a CPU-only host both tiers are RAM: the split shows
  what the engine *would* keep on a GPU, and the decode rate includes the copies. A fresh engine
  per (length, batch) sized for that batch; batch 8 only with ``--host-batches 1 8``.
* ``hybrid``: an LFM2 (transformers ``Lfm2Config``/``Lfm2ForCausalLM``) of the same width and
  depth: hidden 256, 4 layers (``layer_types`` conv, full_attention, conv, full_attention: gated
  short convs of 3 taps and attention with 4 heads × 64, 4 KV heads), SwiGLU 688
  (``block_auto_adjust_ff_dim`` off), vocab 4096, tied embeddings; random weights from
  ``--seed``, written once with ``save_pretrained`` into ``baselines.cache_dir()``
  (``lfm2-longctx-d256-l4-v4096-s<seed>``) and loaded by ``LLMEngine(EngineConfig(model=dir))``.
  The same engine path and prompts as the MC variants (chunked prefill, ragged batched decode),
  its attention layers on the paged KV pool (``num_kv_blocks`` sized so that every token of the
  run stays in the pool: the resume points of earlier prompts keep their KV referenced). Bytes
  per sequence: ``cache.bytes_per_slot`` (the conv tails) + the KV blocks the running
  sequences' tables hold × ``engine.kv.bytes_per_block`` / batch (the JSON also has
  ``stats()["kv_blocks_used"]``, which counts the blocks only resume points hold as well). KV
  rows are 2 attention layers × 4 heads × 64 × 2 × 4 bytes = 4 KiB per token, half the
  Transformer's.
* ``loglinear``: measured through the model directly: ``model(ids)`` for the prefill (the
  vectorised chunked form) and ``model(tok, state)`` one token at a time (no scheduler, no
  sampler: a lower bound on what the engine, which decodes loglinear sequences one by one with
  private states, would take). ``--loglinear-max-len`` caps it (default: no cap).
* ``transformer``: transformers ``LlamaForCausalLM`` of the same width and depth (hidden 256,
  4 layers, 4 heads × 64, SwiGLU 688, vocab 4096, tied embeddings), SDPA attention, with
  ``generate``'s default ``DynamicCache`` (which concatenates, i.e. copies, the whole cache
  every step); ``transformer-static``: the same with a preallocated ``StaticCache`` (written in
  place, attention over its full length), the stronger baseline. Prefill: the prompt minus its
  last token in chunks of ``--tf-chunk`` tokens into a ``DynamicCache`` (chunks bound the
  attention mask's memory), computing the last position's logits only (``logits_to_keep=1``,
  as ``generate`` does; every model is warmed up by one untimed 256-token prefill); its keys
  and values are copied into a fresh cache of each kind, and
  ``generate`` continues from it; decode steps are timed inside ``generate`` by a streamer that
  timestamps every ``put``. Batch 8: the batch-1 prefill cache is copied 8 times (attention
  cost does not depend on the token values) instead of prefilling 8 × L tokens, which is
  quadratic. KV bytes = 2 × layers × heads × head_dim × L × 4 (2 in bfloat16; the JSON also has
  the bytes of the cache tensors). Capped at ``--tf-max-len``.

The mcserve engines of one variant are reused across lengths with prefix caching: rows 2..8 of
the batch have prompts that extend their prompt of the previous length, so their prefill only
computes the new part (untimed; the hybrid resumes from a resume point, its conv tails and the KV
before it); row 1 (whose prefill is timed) is a fresh prompt each length.

    python bench/long_context.py                          # full: 1K..32K (25-30 min, 2 cores)
    python bench/long_context.py --lengths 1024 4096      # some lengths
    python bench/long_context.py --models hybrid transformer   # the hybrid and the Transformer
    python bench/long_context.py --quick                  # CI smoke (lengths 256 512, < 1 min)

Prints tables and writes ``bench/results/long_context.json`` (``--quick``:
``tmp_long_context_quick.json``). The models and their runs are in
``bench/long_context_runs.py``; this script parses the arguments, runs them, prints the report
and the targets and writes the JSON.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import env_info, env_line, print_table, set_threads, write_json  # noqa: E402
from long_context_runs import (  # noqa: E402
    DTYPES,
    ENGINE_VARIANTS,
    HYBRID,
    MODELS,
    SHAPE,
    TF_NAMES,
    bench_engine_variant,
    bench_loglinear,
    bench_transformer,
    kv_bytes_formula,
)

# targets (printed, not asserted; docs/benchmarks.md)
SSC_SPEEDUP = 10.0  # ssc top_k 8 vs transformer at 32K, batch 1
SSC_DEVICE = 0.25  # ssc top_k 8 device bytes <= 25% of the cache bytes
GRM_SPEEDUP = 3.0  # grm vs transformer at 32K
# (model, length, limit): prefill time over the Transformer's, one prompt, batch 1
PREFILL_TARGETS = [(m, 32768, 0.25) for m in ("grm", "ssc8")] + [("none", 32768, 0.1)] + [
    (m, L, 1.0) for L in (2048, 4096) for m in ("none", "grm", "ssc8")]


# --------------------------------------------------------------------------- report


def _cell(res: dict, B: int) -> dict | None:
    d = res.get(f"b{B}")
    return d if d and "tokens_per_s" in d else None


def report(rows: list[dict], args) -> list[dict]:
    models = list(dict.fromkeys(r["model"] for r in rows))
    by = {(r["model"], r["length"]): r for r in rows}
    Ls = args.lengths
    hdr = ["model"] + [f"{L // 1024}K" if L % 1024 == 0 else str(L) for L in Ls]

    def table(title, fn):
        out = []
        for m in models:
            out.append([m] + [fn(by.get((m, L))) for L in Ls])
        print_table(out, hdr, title=title)

    def capped(r):
        return r is None or "capped" in r

    for B in args.batches:
        table(f"decode tokens/s, batch {B} (median step)",
              lambda r, B=B: "capped" if r is not None and "capped" in r else
              (f"{_cell(r, B)['tokens_per_s']:.1f}" if r and _cell(r, B) else "-"))
    table("prefill seconds (one prompt of L tokens, batch 1)",
          lambda r: "capped" if r is not None and "capped" in r else
          (f"{r['prefill_s']:.2f}" if r and "prefill_s" in r else "-"))
    for tf in [n for n in TF_NAMES.values() if n in models]:
        table(f"prefill time / {tf}'s (batch 1; < 1: faster)",
              lambda r, tf=tf: _prefill_ratio(by, r, tf))
    B0 = args.batches[0]

    def dev_mib(r):
        if r is None:
            return "-"
        if "kv_bytes_formula" in r:  # KV bytes: arithmetic, shown even where capped
            return f"{r['kv_bytes_formula'] / 2**20:.2f}"
        if "capped" in r:
            return "capped"
        c = _cell(r, B0)
        return f"{c['device_bytes'] / 2**20:.2f}" if c else "-"

    table(f"cache MiB per sequence, device tier (batch {B0}; transformer: KV bytes)", dev_mib)
    table(f"cache MiB per sequence, host tier (batch {B0})",
          lambda r: "-" if capped(r) or not _cell(r, B0) else
          f"{_cell(r, B0)['host_bytes'] / 2**20:.2f}")
    for tf in [n for n in TF_NAMES.values() if n in models]:
        for B in args.batches:
            table(f"decode speedup over {tf}, batch {B} (its step time / ours)",
                  lambda r, B=B, tf=tf: _speedup(by, r, B, tf))
    return targets(by, args)


def _speedup(by: dict, r: dict | None, B: int, tf: str) -> str:
    if not r or not _cell(r, B):
        return "-"
    t = by.get((tf, r["length"]))
    if not t or not _cell(t, B):
        return "-"
    return f"{_cell(r, B)['tokens_per_s'] / _cell(t, B)['tokens_per_s']:.2f}x"


def _prefill_ratio(by: dict, r: dict | None, tf: str) -> str:
    t = None if r is None else by.get((tf, r["length"]))
    if not r or "prefill_s" not in r or not t or "prefill_s" not in t:
        return "-"
    return f"{r['prefill_s'] / t['prefill_s']:.3f}"


def targets(by: dict, args) -> list[dict]:
    L = 32768
    out = []

    def speed(model, B, limit, tf_name):
        r, tf = by.get((model, L)), by.get((tf_name, L))
        x = None
        if r and tf and _cell(r, B) and _cell(tf, B):
            x = _cell(r, B)["tokens_per_s"] / _cell(tf, B)["tokens_per_s"]
        out.append({"target": f"{model} decode / {tf_name} decode @32K, B={B}", "measured": x,
                    "limit": f">= {limit}", "pass": None if x is None else x >= limit})

    tfs = [n for n in TF_NAMES.values() if n in args.tf_models]
    for tf_name in tfs:
        speed("ssc8", 1, SSC_SPEEDUP, tf_name)
        speed("ssc8-host", 1, SSC_SPEEDUP, tf_name)
    for name in ("ssc8", "ssc8-host"):
        r = by.get((name, L))
        c = _cell(r, 1) if r else None
        own = None if c is None else c["device_bytes"] / (c["device_bytes"] + c["host_bytes"])
        vs_kv = None if c is None else c["device_bytes"] / kv_bytes_formula(L, args.dtype)
        out.append({"target": f"{name} device bytes / its own cache bytes @32K",
                    "measured": own, "limit": f"<= {SSC_DEVICE}",
                    "pass": None if own is None else own <= SSC_DEVICE})
        out.append({"target": f"{name} device bytes / transformer KV bytes @32K",
                    "measured": vs_kv, "limit": f"<= {SSC_DEVICE}",
                    "pass": None if vs_kv is None else vs_kv <= SSC_DEVICE})
    for tf_name in tfs:
        for B in args.batches:
            speed("grm", B, GRM_SPEEDUP, tf_name)
    for tf_name in tfs:  # prefill: this run's time over the Transformer's
        for model, length, limit in PREFILL_TARGETS:
            r, tf = by.get((model, length)), by.get((tf_name, length))
            x = (r["prefill_s"] / tf["prefill_s"] if r and tf and "prefill_s" in r
                 and "prefill_s" in tf else None)
            out.append({"target": f"{model} prefill / {tf_name} prefill @{length // 1024}K",
                        "measured": x, "limit": f"<= {limit}",
                        "pass": None if x is None else x <= limit})
    rows = [[t["target"], "-" if t["measured"] is None else f"{t['measured']:.2f}", t["limit"],
             {True: "PASS", False: "FAIL", None: "not measured"}[t["pass"]]] for t in out]
    print_table(rows, ["target", "measured", "limit", ""],
                title="Targets (printed, not asserted)", align="lrrl")
    return out


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=None,
                    help="context lengths (default 1024 ... 32768)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--models", nargs="+", default=MODELS, choices=MODELS)
    ap.add_argument("--host-batches", type=int, nargs="+", default=[1],
                    help="batches measured for ssc8-host (a fresh engine and a full prefill of "
                         "every row each; default 1)")
    ap.add_argument("--device-fraction", type=float, default=0.25,
                    help="ssc8-host: device pool as a fraction of the blocks needed")
    ap.add_argument("--steps", type=int, default=None, help="timed decode steps (default 16)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed decode steps (default 3)")
    ap.add_argument("--extra-tokens", type=int, default=256,
                    help="room for generated tokens per request")
    ap.add_argument("--tf-max-len", type=int, default=32768,
                    help="longest context for the transformer (longer: printed as capped)")
    ap.add_argument("--tf-chunk", type=int, default=4096, help="transformer prefill chunk")
    ap.add_argument("--tf-caches", nargs="+", default=["dynamic", "static"],
                    choices=["dynamic", "static"],
                    help="transformer KV caches to time: DynamicCache (generate's default, "
                         "model 'transformer') and a preallocated StaticCache "
                         "('transformer-static')")
    ap.add_argument("--loglinear-max-len", type=int, default=None,
                    help="longest context for loglinear (default: no cap)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: all cores)")
    ap.add_argument("--dtype", default="float32", choices=list(DTYPES),
                    help="the engine models' and the Transformer's precision (default float32)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="lengths 256 512, few steps (CI smoke)")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    ap.add_argument("--partial", default=None, metavar="PATH",
                    help="where partial results go after each model (default "
                         "bench/results/tmp_long_context_partial.json)")
    ap.add_argument("--no-save", action="store_true",
                    help="do not write bench/results/long_context.json (only --out)")
    ap.add_argument("--report", default=None, metavar="JSON",
                    help="only print the tables of an earlier run's JSON (also a partial one)")
    args = ap.parse_args(argv)
    if args.report:
        data = json.loads(Path(args.report).read_text(encoding="utf-8"))
        rows = data["results"]
        args.lengths = sorted({r["length"] for r in rows})
        args.batches = sorted({int(k[1:]) for r in rows for k in r if k[:1] == "b"
                               and k[1:].isdigit()})
        args.tf_models = [m for m in TF_NAMES.values() if any(r["model"] == m for r in rows)]
        if "env" in data:
            print(env_line(data["env"]))
        report(rows, args)
        return
    if args.lengths is None:
        args.lengths = [256, 512] if args.quick else [1024 * 2 ** i for i in range(6)]
    args.lengths = sorted(set(args.lengths))
    if args.steps is None:
        args.steps = 4 if args.quick else 16
    if args.warmup is None:
        args.warmup = 1 if args.quick else 3
    if args.loglinear_max_len is None:
        args.loglinear_max_len = max(args.lengths)
    if args.extra_tokens < args.warmup + args.steps + 2 * 64:
        args.extra_tokens = args.warmup + args.steps + 2 * 64
    args.batches = sorted(set(args.batches))
    args.tf_models = [TF_NAMES[k] for k in args.tf_caches] if "transformer" in args.models else []
    args.host_batches = sorted(set(args.host_batches))
    threads = set_threads(args.threads)
    env = env_info()
    print(env_line(env))
    print(f"lengths {args.lengths}, batches {args.batches}, {args.warmup} warm-up + "
          f"{args.steps} timed decode steps, {args.dtype}, {threads} threads", flush=True)
    t_start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t_start:7.1f}s] {msg}", flush=True)

    rows: list[dict] = []
    timings: dict[str, float] = {}
    for m in args.models:
        t0 = time.perf_counter()
        log(f"{m} ...")
        with torch.inference_mode():
            if m in ENGINE_VARIANTS or m == HYBRID:
                rows += bench_engine_variant(m, args, log)
            elif m == "loglinear":
                log("  loglinear: LLMEngine does not support it yet; measured through the model "
                    "directly (model(tok, state) per token, no scheduler/sampler)")
                rows += bench_loglinear(args, log)
            else:
                rows += bench_transformer(args, log)
        timings[m] = time.perf_counter() - t0
        gc.collect()
        # partial results survive an interrupted run (not the final file name)
        write_json({"bench": "long_context", "partial": True, "env": env, "results": rows,
                    "model_seconds": timings},
                   args.partial or ("tmp_long_context_quick_partial.json" if args.quick
                                    else "tmp_long_context_partial.json"))
    print()
    print(env_line(env))
    tgt = report(rows, args)
    by = {(r["model"], r["length"]): r for r in rows}
    for L in args.lengths:  # same model, same prompt, greedy: the host tier must not change it
        a, b = by.get(("ssc8", L)), by.get(("ssc8-host", L))
        if a and b and "probe_tokens" in a and "probe_tokens" in b:
            n = min(len(a["probe_tokens"]), len(b["probe_tokens"]))
            same = a["probe_tokens"][:n] == b["probe_tokens"][:n]
            b["same_tokens_as_ssc8"] = same
            print(f"L={L}: ssc8-host greedy tokens {'==' if same else '!='} ssc8's "
                  f"(first {n})" + ("" if same else "  <-- MISMATCH"))
    bad = [r for r in rows if r.get("pool_whole_after") is False]
    if bad:
        print(f"\nWARNING: pools not whole after {[(r['model'], r['length']) for r in bad]}")
    total = time.perf_counter() - t_start
    print(f"\ntotal {total:.0f} s ({', '.join(f'{k} {v:.0f}s' for k, v in timings.items())}); "
          f"load {env_info()['loadavg']}")
    out = {"bench": "long_context", "env": env, "env_end_loadavg": env_info()["loadavg"],
           "config": {"shape": SHAPE, "dtype": args.dtype, "lengths": args.lengths,
                      "batches": args.batches, "host_batches": args.host_batches,
                      "models": args.models, "steps": args.steps, "warmup": args.warmup,
                      "device_fraction": args.device_fraction, "tf_chunk": args.tf_chunk,
                      "tf_max_len": args.tf_max_len, "tf_caches": args.tf_caches,
                      "loglinear_max_len": args.loglinear_max_len,
                      "seed": args.seed, "quick": args.quick, "threads": threads,
                      "argv": sys.argv[1:] if argv is None else argv},
           "units": "tokens_per_s = batch / median step seconds; bytes per sequence",
           "results": rows, "targets": tgt, "seconds": total, "model_seconds": timings}
    name = "tmp_long_context_quick.json" if args.quick else "long_context.json"
    if args.no_save and not args.out:
        return  # nothing asked to be written
    paths = (write_json(out, args.out) if args.no_save
             else write_json(out, name, extra=args.out))
    print("wrote " + ", ".join(str(p) for p in paths))


if __name__ == "__main__":
    main()
