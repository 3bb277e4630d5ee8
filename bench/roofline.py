"""This machine's limits (memory bandwidth, float32 GEMM) and the decode step against them.

Measures, with ``torch`` on the CPU:

* **memory bandwidth**: ``dst.copy_(src)`` of a ``--bw-mib`` buffer (bytes = read + write,
  so 2 × the buffer; write-allocate traffic not counted) and ``src.sum()`` (bytes = the buffer);
* **float32 GEMM throughput**: ``a @ b`` of two n × n matrices (``--gemm-n``), 2n³ flops;
* **the decode step of the default model** (``mcserve/assets/default_model`` if present, else a
  random model of its shape: ``ModelConfig(vocab_size=4096, d_model=256, n_layers=4, n_heads=4,
  head_dim=64, segment_len=64)``, grm, float32) at batch 1 and 32 (``--batches``), every row at
  context ``--context`` tokens, timed three ways:

  - ``engine.step()``: the whole engine step (scheduler, gathers from the pools, model,
    write-back, sampler, detokenizer), after the prefill of every row finished;
  - ``model.forward_paged``: the model alone on the same ragged batch (``PagedLayer`` views of the
    engine's pools, built as ``ModelRunner.decode`` does);
  - ``model(ids, state)``: the model's own single-token forward from a ``ModelState``;

  next to two floors: **bytes / bandwidth** (the read bandwidth of ``sum``, usually the higher
  of the two: a step mostly reads) and **flops / GEMM throughput**; the floor is the larger.
  Bytes are what one decode step must at least touch: every weight once (the tied LM head
  once, only B rows of an untied embedding), each row's online state read and written, its
  short-conv tail, and the cached states the variant reads (grm: all N = context / 64; ssc:
  top_k; residual: the one summed state; none: nothing). Flops come from
  ``torch.utils.flop_counter`` on the ``model(ids, state)`` call (matmuls and einsums only; the
  elementwise work is left out, it is bandwidth-bound).

    python bench/roofline.py               # full (about 1-2 min on 2 cores)
    python bench/roofline.py --quick       # CI smoke (seconds)
    python bench/roofline.py --profile     # also: top ops of the batch-1 model(ids, state)

Prints tables and writes ``bench/results/roofline.json`` (``--quick``: ``tmp_roofline_quick.json``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import (  # noqa: E402
    env_info,
    env_line,
    fmt_time,
    print_table,
    set_threads,
    timeit,
    write_json,
)

from mcserve.config import EngineConfig, ModelConfig  # noqa: E402
from mcserve.engine.llm_engine import DEFAULT_MODEL_DIR, LLMEngine  # noqa: E402
from mcserve.engine.sampling import SamplingParams  # noqa: E402
from mcserve.engine.tokenizer import Tokenizer  # noqa: E402
from mcserve.kernels import cpu as cpu_ops  # noqa: E402
from mcserve.models.mc_state import PagedLayer  # noqa: E402
from mcserve.models.native import MCForCausalLM  # noqa: E402

SHAPE = dict(vocab_size=4096, d_model=256, n_layers=4, n_heads=4, head_dim=64, segment_len=64)
DECODE_MAX = 2.0  # target: decode step at batch 1 within 2x of the bandwidth floor


# --------------------------------------------------------------------------- machine limits


def bandwidth(mib: int, repeats: int) -> dict:
    n = mib * 2**20 // 4
    src = torch.rand(n)
    dst = torch.empty_like(src)
    dst.copy_(src)
    nbytes = n * 4
    t_copy = timeit(lambda: dst.copy_(src), repeats=repeats, warmup=2, min_sample_s=0.0)
    t_sum = timeit(lambda: src.sum(), repeats=repeats, warmup=2, min_sample_s=0.0)
    return {
        "buffer_bytes": nbytes,
        "copy": {"seconds": t_copy, "bytes": 2 * nbytes,
                 "gb_per_s": 2 * nbytes / t_copy["median"] / 1e9},
        "sum": {"seconds": t_sum, "bytes": nbytes, "gb_per_s": nbytes / t_sum["median"] / 1e9},
    }


def gemm(n: int, repeats: int) -> dict:
    a, b = torch.randn(n, n), torch.randn(n, n)
    c = torch.empty(n, n)
    t = timeit(lambda: torch.mm(a, b, out=c), repeats=repeats, warmup=2, min_sample_s=0.05)
    return {"n": n, "flops": 2 * n**3, "seconds": t, "gflop_per_s": 2 * n**3 / t["median"] / 1e9}


# --------------------------------------------------------------------------- model


def build_engine(max_num_seqs: int, max_len: int, blocks: int) -> LLMEngine:
    cfg = EngineConfig(max_num_seqs=max_num_seqs, max_model_len=max_len,
                       max_num_batched_tokens=8192, num_state_blocks=blocks,
                       enable_prefix_caching=False)
    if (DEFAULT_MODEL_DIR / "config.json").is_file():
        return LLMEngine(cfg)
    torch.manual_seed(0)
    model = MCForCausalLM(ModelConfig(**SHAPE, mc_variant="grm"))
    return LLMEngine(cfg, model=model, tokenizer=Tokenizer.byte_level(),
                     model_name="random-default-shape")


def paged_layers(engine: LLMEngine) -> tuple[torch.Tensor, list[PagedLayer]]:
    """The ragged batch of the running sequences, as ``ModelRunner.decode`` builds it."""
    runner, cache = engine.runner, engine.cache
    seqs = sorted(engine.scheduler.running, key=lambda s: s.arrival)
    slots = torch.tensor([s.slot for s in seqs])
    n_max = max(len(s.block_table) for s in seqs)
    table = torch.full((len(seqs), n_max), -1, dtype=torch.long)
    for r, s in enumerate(seqs):
        if s.block_table:
            table[r, :len(s.block_table)] = torch.tensor(s.block_table)
    seg_len = torch.tensor([s.segment_fill for s in seqs])
    n_seg = torch.tensor([len(s.block_table) for s in seqs])
    layers = []
    for mc, sl, bl in zip(runner.mems, cache.slot, cache.block, strict=True):
        keys = mc.family.readout_keys
        layers.append(PagedLayer(
            mem={n[4:]: t[slots] for n, t in sl.items() if n.startswith("mem.")},
            conv=sl["conv"][slots] if "conv" in sl else None,
            seg_ksum=sl["seg_ksum"][slots], seg_len=seg_len, n_seg=n_seg,
            csum={k: sl[f"csum.{k}"][slots] for k in keys} if mc.collapsed else None,
            table=table, pool={k: bl[f"mem.{k}"] for k in keys}, ksum_pool=bl["ksum"],
            inplace=True))  # gathered copies, writable: the engine's in-place decode path
    tokens = torch.tensor([[s.all_ids[-1]] for s in seqs])
    return tokens, layers


def floor_bytes(model: MCForCausalLM, B: int, context: int) -> dict:
    """Least bytes one decode step of B rows at ``context`` tokens must touch."""
    cfg = model.config
    el = next(model.parameters()).element_size()
    params = {id(p): p for p in model.parameters()}  # tied weights once
    emb = model.embed.weight
    w = sum(p.numel() for p in params.values()) * el
    if model.lm_head.weight is not emb:  # untied: only B rows of the embedding are read
        w -= emb.numel() * el - B * cfg.d_model * el
    H, K = cfg.n_heads, cfg.head_dim
    S = H * K * K * el  # one layer's memory state
    conv = (cfg.conv_size - 1) * 3 * H * K * el if cfg.conv_size else 0
    n_cached = context // cfg.segment_len
    reads = {"none": 0, "residual": 1, "post": 1, "grm": n_cached, "soup": n_cached,
             "ssc": min(cfg.mc_top_k, n_cached), "loglinear": context.bit_length()}
    n_read = reads[cfg.mc_variant]
    per_seq_layer = 2 * S + 2 * conv + n_read * (S + H * K * el)  # state r+w, blocks + key sums
    state = B * cfg.n_layers * per_seq_layer
    return {"weights": w, "state_and_blocks": state, "total": w + state,
            "blocks_read_per_layer": n_read}


@torch.inference_mode()
def count_flops(model: MCForCausalLM, tok: torch.Tensor, state) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    # the C++ decode ops are invisible to the counter: count the torch twins' flops
    with FlopCounterMode(display=False) as fc, cpu_ops.twins_only():
        model(tok, state)
    return fc.get_total_flops()


@torch.inference_mode()
def bench_decode(B: int, args, log) -> dict:
    context, n_steps = args.context, args.steps
    C = SHAPE["segment_len"]
    max_len = context + args.warmup + n_steps + 8
    engine = build_engine(B, max_len, B * (max_len // C + 2))
    model = engine.model
    g = torch.Generator().manual_seed(B)
    prompts = [torch.randint(0, model.config.vocab_size, (context,), generator=g).tolist()
               for _ in range(B)]
    params = SamplingParams(max_tokens=max_len - context - 1, temperature=0.0, ignore_eos=True)
    for r, p in enumerate(prompts):
        engine.add_request(f"r{r}", None, params, prompt_token_ids=p)
    got = {f"r{r}": 0 for r in range(B)}
    t0 = time.perf_counter()
    while min(got.values()) == 0:
        for out in engine.step():
            got[out.request_id] = len(out.outputs[0].token_ids)
    log(f"  B={B}: prefilled {B} x {context} tokens in {time.perf_counter() - t0:.1f} s "
        f"({engine.describe()})")
    for _ in range(args.warmup):
        engine.step()
    times = []
    for _ in range(n_steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    t_engine = {"median": statistics.median(times), "min": min(times), "max": max(times),
                "repeats": len(times)}
    # the model alone on the engine's ragged batch (state advances each call; shapes do not)
    tokens, layers = paged_layers(engine)
    t_paged = timeit(lambda: model.forward_paged(tokens, layers), repeats=args.repeats,
                     warmup=2, min_sample_s=0.02)
    n_cached = min(len(s.block_table) for s in engine.scheduler.running)
    for rid in list(engine.requests):
        engine.abort_request(rid)
    whole = engine.cache.is_whole()
    del engine
    # the model's own decode path from a ModelState
    ids = torch.tensor(prompts)
    logits, state = model(ids)
    tok = logits[:, -1:].argmax(-1)
    t_model = timeit(lambda: model(tok, state), repeats=args.repeats, warmup=2,
                     min_sample_s=0.02)
    flops = count_flops(model, tok, state)
    prof = None
    if args.profile and B == 1:
        prof = profile_ops(model, tok, state)
    return {"batch": B, "context": context, "cached_segments": n_cached,
            "engine_step": t_engine, "forward_paged": t_paged, "model_forward": t_model,
            "flops": flops, "bytes": floor_bytes(model, B, context),
            "variant": model.config.mc_variant, "pool_whole_after": whole, "profile": prof}


def profile_ops(model: MCForCausalLM, tok, state, top: int = 15) -> str:
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        model(tok, state)
    with profile(activities=[ProfilerActivity.CPU]) as p:
        for _ in range(20):
            model(tok, state)
    table = p.key_averages().table(sort_by="self_cpu_time_total", row_limit=top)
    events = p.events()
    top_level = [e for e in events if e.cpu_parent is None]
    n_ops = len(top_level) / 20
    per_call = sum(e.cpu_time_total for e in top_level) / 20  # µs
    head = (f"profile of model(tok, state), batch 1, 20 calls: {n_ops:.0f} top-level torch ops "
            f"per call, {per_call / 1e3:.2f} ms of op time per call "
            f"({per_call / max(n_ops, 1):.1f} µs per op)")
    print("\n" + head)
    print(table)
    return head + "\n" + table


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--context", type=int, default=None,
                    help="tokens of context per row (default 1024; --quick 128)")
    ap.add_argument("--bw-mib", type=int, default=None, help="bandwidth buffer (default 512 MiB)")
    ap.add_argument("--gemm-n", type=int, default=None, help="GEMM size (default 2048)")
    ap.add_argument("--steps", type=int, default=None, help="timed engine steps (default 32)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=None, help="samples per timing (default 9)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: all cores)")
    ap.add_argument("--profile", action="store_true", help="print the top ops at batch 1")
    ap.add_argument("--quick", action="store_true", help="small sizes (CI smoke)")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args(argv)
    q = args.quick
    args.context = args.context or (128 if q else 1024)
    args.bw_mib = args.bw_mib or (64 if q else 512)
    args.gemm_n = args.gemm_n or (512 if q else 2048)
    args.steps = args.steps or (4 if q else 32)
    args.repeats = args.repeats or (3 if q else 9)
    threads = set_threads(args.threads)
    env = env_info()
    print(env_line(env), flush=True)
    t_start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t_start:6.1f}s] {msg}", flush=True)

    bw = bandwidth(args.bw_mib, args.repeats)
    log(f"bandwidth: copy {bw['copy']['gb_per_s']:.1f} GB/s, sum {bw['sum']['gb_per_s']:.1f} GB/s")
    mm = gemm(args.gemm_n, args.repeats)
    log(f"GEMM {args.gemm_n}: {mm['gflop_per_s']:.1f} GFLOP/s")
    rows = [["copy (read + write)", f"{args.bw_mib} MiB", fmt_time(bw["copy"]["seconds"]["median"]),
             f"{bw['copy']['gb_per_s']:.1f} GB/s"],
            ["sum (read)", f"{args.bw_mib} MiB", fmt_time(bw["sum"]["seconds"]["median"]),
             f"{bw['sum']['gb_per_s']:.1f} GB/s"],
            [f"float32 GEMM {args.gemm_n}³", f"{mm['flops'] / 1e9:.1f} GFLOP",
             fmt_time(mm["seconds"]["median"]), f"{mm['gflop_per_s']:.1f} GFLOP/s"]]
    print_table(rows, ["measure", "size", "median time", "rate"],
                title=f"machine limits ({threads} threads)")
    bw_read = bw["sum"]["gb_per_s"] * 1e9
    flop_rate = mm["gflop_per_s"] * 1e9
    dec = [bench_decode(B, args, log) for B in args.batches]
    rows = []
    for d in dec:
        t_bw = d["bytes"]["total"] / bw_read
        t_fl = d["flops"] / flop_rate
        floor = max(t_bw, t_fl)
        d["floor"] = {"bandwidth_s": t_bw, "flops_s": t_fl, "floor_s": floor}
        for name, key in (("engine.step()", "engine_step"),
                          ("model.forward_paged", "forward_paged"),
                          ("model(ids, state)", "model_forward")):
            t = d[key]["median"]
            d[key + "_over_floor"] = t / floor
            rows.append([d["batch"], name, f"{d['bytes']['total'] / 2**20:.1f}",
                         f"{d['flops'] / 1e6:.1f}", fmt_time(t_bw), fmt_time(t_fl), fmt_time(t),
                         f"{t / floor:.1f}x", f"{d['batch'] / t:.0f}"])
    cfg_line = (f"{dec[0]['variant']}, context {args.context} ({dec[0]['cached_segments']} cached "
                f"segments), bandwidth {bw['sum']['gb_per_s']:.1f} GB/s (sum), "
                f"GEMM {mm['gflop_per_s']:.0f} GFLOP/s")
    print_table(rows, ["batch", "measured", "MiB touched", "MFLOP", "bytes floor",
                       "flops floor", "measured time", "/ floor", "tokens/s"],
                title=f"decode step vs floor ({cfg_line})")
    b1 = next((d for d in dec if d["batch"] == 1), None)
    tgt = None
    if b1:
        x = b1["engine_step_over_floor"]
        tgt = {"target": "decode step at batch 1 within 2x of the bandwidth floor",
               "measured": x, "limit": DECODE_MAX, "pass": x <= DECODE_MAX,
               "model_only": b1["forward_paged_over_floor"]}
        print(f"\ntarget: engine decode step at batch 1 / floor = {x:.1f}x "
              f"(limit {DECODE_MAX}x): {'PASS' if tgt['pass'] else 'FAIL'}; model alone "
              f"(forward_paged) {b1['forward_paged_over_floor']:.1f}x")
    print(f"total {time.perf_counter() - t_start:.0f} s; load {env_info()['loadavg']}")
    out = {"bench": "roofline", "env": env, "env_end_loadavg": env_info()["loadavg"],
           "config": vars(args), "bandwidth": bw, "gemm": mm, "decode": dec, "target": tgt}
    paths = write_json(out, "tmp_roofline_quick.json" if q else "roofline.json", extra=args.out)
    print("wrote " + ", ".join(str(p) for p in paths))


if __name__ == "__main__":
    main()
