"""The C++ decode kernels (``mcserve/kernels/cpu``) against what they replace, on this CPU.

Two measurements, each against its baseline in the same run (samples interleaved):

* **matrix-vector products** for one and two rows over every linear weight of a model shape
  (each weight a separate tensor, as in a model, so they stream from L3/DRAM rather than sit in
  L1/L2): ``F.linear`` (torch's GEMM), oneDNN's packed weights (``models/packed_linear.py``) and
  the C++ GEMV (``kernels.cpu.linear``); shapes of the default model (d 256, 4 layers, tied 4096
  vocabulary head) and of the 130M Mamba2 (hidden 768, 24 layers, 50288 vocabulary);
* **weight precisions** (``--lowp`` alone, or with the rest): every weight of the 130M Mamba2's
  decode step at 1, 2, 4, 8, 16 and 64 rows: float32 as the engine runs it (the C++ GEMV up to 2
  rows, oneDNN packed beyond), torch's weight-only int8 product ``_weight_int8pack_mm`` (with
  bfloat16 x: its float32-x path is far slower), the C++ int8 and bfloat16 kernels
  (``kernels/cpu/lowp.cpp``) at each instruction-set level this CPU runs, and oneDNN's packed
  bfloat16 product (bfloat16 in and out: the old ``--dtype bfloat16`` path);
* **a sparse MoE layer's routed experts** (with ``--lowp`` too): 64 experts of 512 (gated) on
  d 1536, top 6, at 1, 8 and 64 tokens per call, each call with new tokens (so new experts, read
  from DRAM), in float32 and with the int8 and bfloat16 copies of
  ``lowp_linear.apply_expert_precision``, each as the engine runs it (one C++ call for the layer,
  ``kernels.cpu.moe_experts``) and through the per-expert Python loop (``impl="loop"``: the C++
  GEMV for an expert's one or two float32 rows, ``F.linear`` beyond, or the copies' kernels);
  and ``F.linear`` for every expert (the twins);
* **a prefill's products** (``--prefill`` alone): the default model's projections (qkv, u, g,
  o) and its SwiGLU at 8192 rows with bfloat16 weights, as the engine runs them
  (``kernels.cpu.linear_bf16``, ``kernels.cpu.gated_mlp``) against oneDNN's packed bfloat16
  product (bfloat16 in and out, so fewer bytes than the engine's float32 activations) and, for
  the SwiGLU, the three products with ``silu_mul`` between; and the bfloat16 token embedding's
  lookup of those rows (``packed_rows`` against its torch twin); and one call of ``grm``'s
  bfloat16 cached readout (``kernels.cpu.readout_bf16_``: 4 heads, 512 tokens, 64, 128 and 256
  checkpoints of 64 × 64) against oneDNN's bfloat16 ``bmm`` of the same flops (the weights
  times the checkpoints, without the queries), in GFLOP/s;
* **the MC block readout** (``readout_paged``: Σ_n w_n · S_nᵀ q over 512 cached 64 × 64 states
  per head, 4 heads, 4 layers, as ``grm`` at 32K context), with the pools on ordinary 4 KiB pages
  (``torch.zeros``) and on transparent huge pages (``kernels.cpu.zeros``).

    python bench/cpu_kernels.py --threads 1     # about two minutes
    python bench/cpu_kernels.py --threads 1 --lowp   # the weight precisions only
    python bench/cpu_kernels.py --threads 2 --moe    # the MoE experts only: cpu_kernels_moe.json
    python bench/cpu_kernels.py --threads 2 --prefill  # a prefill's products: *_prefill.json
    python bench/cpu_kernels.py --quick         # CI smoke (seconds)

Prints tables and writes ``bench/results/cpu_kernels.json`` (``--quick``:
``tmp_cpu_kernels_quick.json``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import env_info, env_line, fmt_time, print_table, set_threads, timeit_many  # noqa: E402

from mcserve.kernels import cpu  # noqa: E402
from mcserve.models import packed_linear  # noqa: E402

SHAPES = {  # (out, in) of every linear weight of one decode step
    "default (d256, 4 layers)": [(1288, 256), (256, 256), (1536, 256), (256, 768)] * 4
    + [(4096, 256)],
    "mamba2-130m (24 layers)": [(3352, 768), (768, 1536)] * 24 + [(50288, 768)],
}


def bench_gemv(name: str, shapes: list[tuple[int, int]], rows: int, repeats: int) -> dict:
    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(o, i, generator=g) for o, i in shapes]
    packed = [packed_linear.pack_weight(w) for w in ws] if packed_linear.available() else None
    xs = {i: torch.randn(rows, i, generator=g) for _, i in shapes}
    fns = {"F.linear": lambda: [F.linear(xs[w.shape[1]], w) for w in ws]}
    if packed is not None:
        fns["oneDNN packed"] = lambda: [packed_linear.packed_linear(xs[w.shape[1]], p, None)
                                        for w, p in zip(ws, packed)]
    fns["C++ GEMV"] = lambda: [cpu.ops().gemv(xs[w.shape[1]], w, None) for w in ws]
    t = timeit_many(fns, repeats=repeats, warmup=2, min_sample_s=0.02)
    nbytes = sum(o * i * 4 for o, i in shapes)
    return {"shape": name, "rows": rows, "weight_bytes": nbytes,
            "results": {k: {**v, "gb_per_s": nbytes / v["median"] / 1e9} for k, v in t.items()}}


LOWP_ROWS = (1, 2, 4, 8, 16, 64)
LEVEL_NAMES = {0: "scalar", 1: "AVX2", 2: "AVX-512", 3: "VNNI"}


def bench_lowp(shapes: list[tuple[int, int]], rows: int, repeats: int) -> dict:
    """Every weight of ``shapes`` at ``rows`` rows in each precision and implementation."""
    from mcserve.kernels.cpu.twins import pack_pairs
    from mcserve.models.lowp_linear import quantize_int8

    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(o, i, generator=g) for o, i in shapes]
    plain = [quantize_int8(w) for w in ws]
    qs = [(pack_pairs(q), s) for q, s in plain]  # the kernels' blocked layout
    qs_b = [(q, s.bfloat16()) for q, s in plain]  # torch's: (N, K)
    bfs = [w.bfloat16() for w in ws]
    bps = [(pack_pairs(w), torch.ones(w.shape[0])) for w in bfs]
    xs = {i: torch.randn(rows, i, generator=g) for _, i in shapes}
    m = cpu.ops()
    info = cpu.lowp_info()
    if rows <= cpu.GEMV_MAX_ROWS or not packed_linear.available():
        fns = {"float32 (engine: C++ GEMV / oneDNN)":
               lambda: [cpu.linear(xs[w.shape[1]], w) for w in ws]}
    else:
        packed = [packed_linear.pack_weight(w) for w in ws]
        fns = {"float32 (engine: C++ GEMV / oneDNN)":
               lambda: [packed_linear.packed_linear(xs[w.shape[1]], p, None)
                        for w, p in zip(ws, packed)]}
    if hasattr(torch.ops.aten, "_weight_int8pack_mm"):
        fns["int8 torch _weight_int8pack_mm"] = lambda: [
            torch.ops.aten._weight_int8pack_mm(xs[q.shape[1]].bfloat16(), q, s).float()
            for q, s in qs_b]
    for lvl in range(int(info["int8_impl"]), 0, -1):  # the levels MCSERVE_CPU_ISA allows
        fns[f"int8 C++ {LEVEL_NAMES[lvl]}"] = lambda lvl=lvl: [
            m.q8_linear(xs[w.shape[1]], q, s, None, lvl) for w, (q, s) in zip(ws, qs)]
    for lvl in range(int(info["bf16_impl"]), 0, -1):
        name = {4: "AMX tiles", 3: "BF16 dot"}.get(lvl) or LEVEL_NAMES[lvl] + " FMA"
        fns[f"bf16 C++ {name}"] = lambda lvl=lvl: [
            m.bf16_linear(xs[w.shape[1]], p, s, None, lvl) for w, (p, s) in zip(bfs, bps)]
    if packed_linear.available() and packed_linear.bf16_packing_supported():
        pb = [packed_linear.pack_weight(w) for w in bfs]
        fns["bf16 oneDNN packed (bf16 in/out)"] = lambda: [
            packed_linear.packed_linear(xs[w.shape[1]].bfloat16(), p, None)
            for w, p in zip(bfs, pb)]
    t = timeit_many(fns, repeats=repeats, warmup=1, min_sample_s=0.02)
    return {"rows": rows, "weights": len(shapes),
            "results": {k: dict(v) for k, v in t.items()}}


def bench_prefill(rows: int, repeats: int) -> dict:
    """The default model's bfloat16 projections, SwiGLU and embedding lookup at ``rows``."""
    from mcserve.kernels.cpu import twins
    from mcserve.kernels.cpu.twins import pack_pairs

    g = torch.Generator().manual_seed(0)
    D, hidden, vocab = 256, 688, 4096
    proj = [torch.randn(o, D, generator=g).bfloat16() for o in (768, 256, 256, 256)]
    packed = [(pack_pairs(w), torch.ones(w.shape[0])) for w in proj]
    up = torch.randn(2 * hidden, D, generator=g).bfloat16()
    down = torch.randn(D, hidden, generator=g).bfloat16()
    (pu, su), (pd, sd) = (pack_pairs(up), torch.ones(2 * hidden)), (pack_pairs(down), torch.ones(D))
    nb = hidden // 16
    emb = (pack_pairs(torch.randn(vocab, D, generator=g).bfloat16()), torch.ones(vocab))
    x = torch.randn(rows, D, generator=g)
    ids = torch.randint(0, vocab, (rows,), generator=g)
    fns = {
        "projections: C++ bf16_linear (engine)":
            lambda: [cpu.linear_bf16(x, p, s) for p, s in packed],
        "SwiGLU: C++ gated_mlp (engine)":
            lambda: cpu.gated_mlp(x, pu[:nb], su[:hidden], pu[nb:], su[hidden:], pd, sd),
        "SwiGLU: bf16_linear + silu_mul + bf16_linear":
            lambda: cpu.linear_bf16(cpu.silu_mul(*cpu.linear_bf16(x, pu, su).chunk(2, -1)),
                                    pd, sd),
        "embedding: C++ packed_rows (engine)": lambda: cpu.packed_rows(*emb, ids, D),
        "embedding: twins.packed_rows": lambda: twins.packed_rows(*emb, ids, D),
    }
    if packed_linear.available() and packed_linear.bf16_packing_supported():
        xb = x.bfloat16()
        pp = [packed_linear.pack_weight(w, rows) for w in proj]
        pup, pdn = packed_linear.pack_weight(up, rows), packed_linear.pack_weight(down, rows)
        fns["projections: oneDNN packed (bf16 in/out)"] = lambda: [
            packed_linear.packed_linear(xb, p, None) for p in pp]
        fns["SwiGLU: oneDNN packed (bf16 in/out) + silu*up"] = lambda: (
            packed_linear.packed_linear(
                (lambda h: torch.nn.functional.silu(h[:, :hidden]) * h[:, hidden:])(
                    packed_linear.packed_linear(xb, pup, None)), pdn, None))
    flops = {}
    A, T, K, V = 4, min(rows, 512), 64, 64  # one readout call of grm's prefill: 4 heads
    for n in (64, 128, 256):  # checkpoints seen: 4K, 8K and 16K tokens into a prompt
        P = ((n + 1) // 2 + 15) // 16 * 16
        S = torch.randn(A, K * V // 16, P, 16, 2, generator=g).bfloat16()
        w, q = torch.rand(A, T, n, generator=g), torch.randn(A, T, K, generator=g)
        o = torch.zeros(A, T, V)
        wb, Sb = w.bfloat16(), torch.randn(A, n, K * V, generator=g).bfloat16()
        name = f"readout, {n} checkpoints: C++ readout_bf16_ (engine)"
        fns[name] = lambda o=o, w=w, q=q, S=S: cpu.readout_bf16_(o, w, q, S)
        flops[name] = 2 * A * T * n * K * V
        name = f"readout, {n} checkpoints: oneDNN bf16 bmm, same flops"
        fns[name] = lambda wb=wb, Sb=Sb: torch.bmm(wb, Sb)
        flops[name] = 2 * A * T * n * K * V
    t = timeit_many(fns, repeats=repeats, warmup=1, min_sample_s=0.02)
    results = {k: dict(v) for k, v in t.items()}
    for k, f in flops.items():
        results[k]["gflops"] = f / results[k]["median"] / 1e9
    return {"rows": rows, "readout_tokens": T, "results": results}


MOE_SHAPE = dict(d_model=1536, n_experts=64, top_k=6, intermediate=512)
MOE_QUICK = dict(d_model=256, n_experts=8, top_k=2, intermediate=128)


def bench_moe(shape: dict, tokens: int, repeats: int) -> dict:
    """One MoE layer's forward (router, routed experts) in float32 and with int8 / bfloat16
    expert copies; every call takes the next of 16 fresh token batches (other experts)."""
    import contextlib
    import copy
    import itertools

    from mcserve.models.lowp_linear import apply_expert_precision
    from mcserve.models.moe import SparseMoE

    torch.manual_seed(0)
    base = SparseMoE(shape["d_model"], shape["n_experts"], shape["top_k"],
                     shape["intermediate"], routing="softmax_topk").eval()
    mods = {}
    for kind in ("float32", "int8", "bf16"):
        for label, impl in (("one C++ call (engine)", "auto"), ("per-expert loop", "loop")):
            m = copy.deepcopy(base)  # the loop: C++ GEMV / F.linear, or the copies' kernels
            m.impl = impl
            if kind != "float32":
                apply_expert_precision(m, kind, min_numel=1)
            mods[f"{kind}, {label}"] = m
    g = torch.Generator().manual_seed(2)
    xs = [torch.randn(tokens, shape["d_model"], generator=g) for _ in range(16)]

    def caller(m, twins=False):
        it = itertools.cycle(xs)

        def run():
            with torch.inference_mode(), cpu.twins_only() if twins else contextlib.nullcontext():
                return m(next(it))
        return run

    fns = {k: caller(m) for k, m in mods.items()}
    fns["float32 F.linear per expert (the twins)"] = caller(base, twins=True)
    t = timeit_many(fns, repeats=repeats, warmup=2, min_sample_s=0.02)
    return {"shape": shape, "tokens": tokens, "results": {k: dict(v) for k, v in t.items()}}


def print_moe(moe: list[dict], threads: int) -> None:
    rows = []
    for r in moe:
        base = r["results"]["float32, one C++ call (engine)"]["median"]
        for k, v in r["results"].items():
            rows.append([r["tokens"], k, fmt_time(v["median"]), f"{base / v['median']:.2f}x"])
    sh = moe[0]["shape"]
    print_table(rows, ["tokens", "experts", "median", "vs float32"],
                title=f"\nMoE layer: {sh['n_experts']} experts of {sh['intermediate']} on d "
                      f"{sh['d_model']}, top {sh['top_k']} ({threads} threads)")


def bench_readout(n_blocks: int, repeats: int) -> dict:
    H, K, L = 4, 64, 4
    g = torch.Generator().manual_seed(1)
    ids = torch.randperm(n_blocks + 8, generator=g)[:n_blocks].sort().values
    ids = ids[None, :, None].expand(1, n_blocks, H).contiguous()
    q = torch.randn(1, H, K, generator=g)
    w = torch.rand(1, n_blocks, H, generator=g)
    shape = (n_blocks + 8, H, K, K)
    pools = {"4 KiB pages (torch.zeros)": [torch.zeros(shape) for _ in range(L)],
             "huge pages (kernels.cpu.zeros)": [cpu.zeros(shape, torch.float32, "cpu")
                                               for _ in range(L)]}
    for ps in pools.values():
        for p in ps:
            p.normal_(generator=g)
    fns = {name: (lambda ps=ps: [cpu.ops().readout_paged(p, ids, q, w) for p in ps])
           for name, ps in pools.items()}
    t = timeit_many(fns, repeats=repeats, warmup=2, min_sample_s=0.02)
    nbytes = L * n_blocks * H * K * K * 4
    return {"blocks_per_layer": n_blocks, "layers": L, "bytes": nbytes,
            "results": {k: {**v, "gb_per_s": nbytes / v["median"] / 1e9} for k, v in t.items()}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--quick", action="store_true", help="small sizes, few repeats (CI smoke)")
    ap.add_argument("--lowp", action="store_true",
                    help="only the weight precisions (int8, bfloat16 against float32)")
    ap.add_argument("--moe", action="store_true",
                    help="only the MoE layer's experts (float32, int8, bfloat16)")
    ap.add_argument("--prefill", action="store_true",
                    help="only a prefill's products (8192 rows of the default model, bfloat16)")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args()
    threads = set_threads(args.threads)
    if cpu.ops() is None:
        print(f"C++ CPU kernels unavailable ({cpu.status()}): nothing to compare")
        return 0
    env = env_info()
    print(env_line(env))
    repeats = 3 if args.quick else args.repeats
    pre = None
    if args.prefill or not (args.lowp or args.moe):
        pre = bench_prefill(512 if args.quick else 8192, repeats)
        print_table([[k, fmt_time(v["median"]),
                      f"{v['gflops']:.0f}" if "gflops" in v else ""]
                     for k, v in pre["results"].items()],
                    ["default model, bfloat16 weights", "median", "GFLOP/s"],
                    title=f"\na prefill's products at {pre['rows']} rows ({threads} threads)")
    if args.prefill:
        from common import write_json

        out = {"bench": "cpu_kernels_prefill", "env": env, "threads": threads,
               "quick": args.quick, "lowp_info": cpu.lowp_info(), "prefill": pre}
        paths = write_json(out, "tmp_cpu_kernels_prefill_quick.json" if args.quick
                           else "cpu_kernels_prefill.json", extra=args.out)
        print("wrote " + ", ".join(str(p) for p in paths))
        return 0
    if args.moe:
        from common import write_json

        moe = [bench_moe(MOE_QUICK if args.quick else MOE_SHAPE, t, repeats)
               for t in ((1, 8) if args.quick else (1, 8, 64))]
        print_moe(moe, threads)
        out = {"bench": "cpu_kernels_moe", "env": env, "threads": threads, "quick": args.quick,
               "lowp_info": cpu.lowp_info(), "moe": moe}
        paths = write_json(out, "tmp_cpu_kernels_moe_quick.json" if args.quick
                           else "cpu_kernels_moe.json", extra=args.out)
        print("wrote " + ", ".join(str(p) for p in paths))
        return 0
    lowp_shapes = (SHAPES["default (d256, 4 layers)"][:5] if args.quick
                   else SHAPES["mamba2-130m (24 layers)"])
    lowp = [bench_lowp(lowp_shapes, rows, repeats) for rows in LOWP_ROWS[:3 if args.quick else 6]]
    info = cpu.lowp_info()
    print(f"low-precision kernels: int8 level {info['int8_impl']}, bf16 level "
          f"{info['bf16_impl']} (AVX2 {info['avx2_fma']}, AVX-512 {info['avx512']}, VNNI "
          f"{info['avx512_vnni']}, BF16 {info['avx512_bf16']}, AMX-BF16 {info['amx_bf16']})")
    rows = []
    for r in lowp:
        base = r["results"]["float32 (engine: C++ GEMV / oneDNN)"]["median"]
        for k, v in r["results"].items():
            rows.append([r["rows"], k, fmt_time(v["median"]), f"{base / v['median']:.2f}x"])
    print_table(rows, ["rows", "implementation", "median", "vs float32"],
                title=f"\nweight precisions over every weight of a "
                      f"{'default-model' if args.quick else '130M Mamba2'} decode step "
                      f"({threads} threads)")
    moe = [bench_moe(MOE_QUICK if args.quick else MOE_SHAPE, t, repeats)
           for t in ((1, 8) if args.quick else (1, 8, 64))]
    print_moe(moe, threads)
    if args.lowp:
        from common import write_json

        out = {"bench": "cpu_kernels_lowp", "env": env, "threads": threads, "quick": args.quick,
               "lowp_info": info, "lowp": lowp, "moe": moe}
        paths = write_json(out, "tmp_cpu_kernels_lowp_quick.json" if args.quick
                           else "cpu_kernels_lowp.json", extra=args.out)
        print("wrote " + ", ".join(str(p) for p in paths))
        return 0
    shapes = ({"default (d256, 4 layers)": SHAPES["default (d256, 4 layers)"][:5]}
              if args.quick else SHAPES)
    gemv = [bench_gemv(name, s, rows, repeats) for name, s in shapes.items() for rows in (1, 2)]
    rows = []
    for r in gemv:
        base = r["results"]["F.linear"]["median"]
        for k, v in r["results"].items():
            rows.append([r["shape"], r["rows"], k, fmt_time(v["median"]),
                         f"{v['gb_per_s']:.1f}", f"{base / v['median']:.2f}x"])
    print_table(rows, ["weights", "rows", "implementation", "median", "GB/s", "vs F.linear"],
                title=f"\nmatrix-vector products over every weight of a decode step "
                      f"({threads} threads)")
    ro = bench_readout(32 if args.quick else 512, repeats)
    base = ro["results"]["4 KiB pages (torch.zeros)"]["median"]
    print_table([[k, fmt_time(v["median"]), f"{v['gb_per_s']:.1f}", f"{base / v['median']:.2f}x"]
                 for k, v in ro["results"].items()],
                ["block pool", "median", "GB/s", "vs 4 KiB pages"],
                title=f"\nMC readout of {ro['blocks_per_layer']} cached states x 4 heads x "
                      f"{ro['layers']} layers (grm at {ro['blocks_per_layer'] * 64} tokens)")
    from common import write_json

    out = {"bench": "cpu_kernels", "env": env, "threads": threads, "quick": args.quick,
           "gemv": gemv, "readout": ro, "lowp_info": info, "lowp": lowp, "moe": moe,
           "prefill": pre}
    paths = write_json(out, "tmp_cpu_kernels_quick.json" if args.quick else "cpu_kernels.json",
                       extra=args.out)
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
