"""Cost of Memory Caching in one layer versus the number of cached segments N.

One MC layer of the ``linear`` family with decay and write gates (H = 8, K = V = 64, C = 64,
float32), every variant (``none``, ``residual``, ``post``, ``grm``, ``ssc`` with top_k = 4,
``soup`` = ``grm`` on a linear memory, ``loglinear``), N ∈ {1, 8, 64, 256}:

* decode step (one token) through ``MCMemory.forward`` with T = 1 (the model's path) and through
  ``MCMemory.decode_paged`` with a ``PagedLayer`` whose pool holds the blocks (the engine's
  path), batch 1 and batch 8;
* prefill tokens/s: ``MCMemory.forward`` over 4·C tokens, batch 1, from a state with N cached
  segments;
* the memory-bandwidth floor for ``grm``: a plain ``sum`` over the N cached states it reads.

States are built directly (random cached blocks of the right shapes, as the engine's
``ModelRunner.load_state`` / ``decode`` lay them out) instead of prefilling N·C tokens. Decode
states sit mid-segment (``seg_len = C/2``); prefill starts right after the N-th push
(``seg_len = 0``), so it crosses 3 segment boundaries. ``loglinear`` decodes the token at position
N·C − 1 (binary all ones: the most segments, ⌊log2(N·C)⌋, of any position up to N·C) and
prefills from there; it has no paged path.

Samples of all variants of one (N, path, batch) cell are interleaved round-robin and the medians
reported, so ratios to ``none`` are steadier than the absolute times on a shared machine. The
targets (docs/bench-mc-layer.md) are printed as PASS/FAIL, not asserted.

    python bench/mc_layer.py              # full run, a few minutes on 2 cores
    python bench/mc_layer.py --quick      # N ∈ {1, 8}, fewer repeats, < 30 s (CI smoke);
                                          # writes bench/results/tmp_mc_layer_quick.json
    python bench/mc_layer.py --threads 1 --out /tmp/mc.json
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import (  # noqa: E402
    env_info,
    env_line,
    fmt_time,
    print_table,
    set_threads,
    timeit_many,
    write_json,
)

from mcserve.config import MCConfig  # noqa: E402
from mcserve.models.mc import MCMemory  # noqa: E402
from mcserve.models.mc_loglinear import log_boundaries  # noqa: E402
from mcserve.models.mc_state import MCLayerState, PagedLayer  # noqa: E402
from mcserve.models.memory.linear import LinearMemory  # noqa: E402

H, K, V, C = 8, 64, 64, 64
TOP_K = 4
DTYPE = torch.float32
VARIANTS = ("none", "residual", "post", "grm", "ssc", "soup", "loglinear")
PREFILL_T = 4 * C
BATCHES = (1, 8)

# targets (printed, not asserted; docs/bench-mc-layer.md)
COLLAPSE_MAX = 1.05  # residual/post ≤ 1.05× none at N = 256
SSC_MAX = 1.5  # ssc ≤ 1.5× none at N = 256
SSC_FLAT = 1.2  # ssc at N = 256 within 1.2× of N = 8
FLOOR_MAX = 1.5  # grm within 1.5× of the bandwidth floor


def make_mc(variant: str) -> MCMemory:
    # post's default mode is independent (docs/mc.md); loglinear is checkpoint only.
    mode = "independent" if variant == "post" else "checkpoint"
    return MCMemory(LinearMemory(), MCConfig(variant=variant, mode=mode, segment_len=C,
                                             top_k=TOP_K))


def tokens(B: int, T: int, g: torch.Generator) -> tuple:
    """q, k, v, u and the gates the native model makes (a = sigmoid^(1/8), b = sigmoid)."""
    r = lambda *s: torch.randn(*s, generator=g, dtype=DTYPE)
    q, k, u = (r(B, T, H, K) / math.sqrt(K) for _ in range(3))
    v = r(B, T, H, V)
    gates = {"log_a": F.logsigmoid(r(B, T, H)) / 8.0, "b": torch.sigmoid(r(B, T, H))}
    return q, k, v, u, gates


class Data:
    """Random cached blocks for N segments and the largest batch, shared by every variant."""

    def __init__(self, N: int, bmax: int, g: torch.Generator):
        self.N, self.bmax = N, bmax
        self.S = torch.randn(bmax, N, H, K, V, generator=g, dtype=DTYPE) * 0.05
        self.ksum = torch.randn(bmax, N, H, K, generator=g, dtype=DTYPE) * math.sqrt(C / K)
        self.Ssum = self.S.sum(1, keepdim=True)  # the collapsed block: Σ of the N states
        self.mem = torch.randn(bmax, H, K, V, generator=g, dtype=DTYPE) * 0.05
        self.seg_ksum = torch.randn(bmax, H, K, generator=g, dtype=DTYPE) * math.sqrt(C / 2 / K)
        # loglinear: the token at position N·C − 1 is decoded from the state at P = N·C − 2
        self.log_pos = N * C - 2
        bounds = log_boundaries(self.log_pos)
        self.log_bounds = bounds
        self.log_S = torch.randn(bmax, len(bounds), H, K, V, generator=g, dtype=DTYPE) * 0.05
        self.log_ksum = torch.randn(bmax, len(bounds), H, K, generator=g, dtype=DTYPE)

    # ---------------------------------------------------------------- MCMemory.forward states
    def state(self, mc: MCMemory, B: int, seg_len: int) -> MCLayerState:
        N, variant = self.N, mc.cfg.variant
        mem = {"S": self.mem[:B].clone()}
        seg_ksum = self.seg_ksum[:B].clone() if seg_len else torch.zeros(B, H, K, dtype=DTYPE)
        common = dict(mem=mem, seg_ksum=seg_ksum, seg_len=seg_len, v_dim=V)
        if variant == "none":
            return MCLayerState(cached={"S": self.S[:B, :0]}, cached_ksum=self.ksum[:B, :0],
                                pos=N * C + seg_len, **common)
        if variant == "loglinear":
            b = self.log_bounds
            lens = [e - s for s, e in zip([0] + b[:-1], b)]
            common.update(seg_ksum=self.seg_ksum[:B].clone(), seg_len=self.log_pos - b[-1])
            return MCLayerState(cached={"S": self.log_S[:B]}, cached_ksum=self.log_ksum[:B],
                                cached_len=lens, cached_pos=list(b), n_segments=len(b),
                                pos=self.log_pos, **common)
        if mc.collapsed:  # one summed block, as ModelRunner.load_state builds it
            return MCLayerState(cached={"S": self.Ssum[:B]},
                                cached_ksum=torch.zeros(B, 1, H, K, dtype=DTYPE),
                                cached_len=[C], cached_pos=[C], n_segments=N,
                                pos=N * C + seg_len, **common)
        return MCLayerState(cached={"S": self.S[:B]}, cached_ksum=self.ksum[:B],
                            cached_len=[C] * N, cached_pos=[(i + 1) * C for i in range(N)],
                            n_segments=N, pos=N * C + seg_len, **common)

    # ---------------------------------------------------------------- decode_paged views
    def paged(self, mc: MCMemory, B: int) -> PagedLayer:
        N = self.N
        table = torch.arange(B)[:, None] * N + torch.arange(N)[None]  # row b owns its N blocks
        return PagedLayer(
            mem={"S": self.mem[:B].clone()}, conv=None, seg_ksum=self.seg_ksum[:B].clone(),
            seg_len=torch.full((B,), C // 2, dtype=torch.long),
            n_seg=torch.full((B,), N, dtype=torch.long),
            csum={"S": self.Ssum[:B, 0].clone()} if mc.collapsed else None,
            table=table, pool={"S": self.S.view(self.bmax * N, H, K, V)},
            ksum_pool=self.ksum.view(self.bmax * N, H, K),
        )


def segments_read(variant: str, N: int, data: Data) -> int:
    """Cached states one decode step reads (besides the online one)."""
    if variant == "none":
        return 0
    if variant in ("residual", "post"):
        return 1
    if variant == "ssc":
        return min(N, TOP_K)
    if variant == "loglinear":
        return len(log_boundaries(data.log_pos + 1))
    return N


def check_paths(mcs: dict[str, MCMemory], data: Data, g: torch.Generator) -> float:
    """The forward (T = 1) and paged paths give the same y on the built states (sanity)."""
    B = data.bmax
    q, k, v, u, gates = tokens(B, 1, g)
    worst = 0.0
    for name, mc in mcs.items():
        if name == "loglinear":
            continue
        y1, _ = mc.forward(data.state(mc, B, C // 2), q, k, v, u, gates)
        y2 = mc.decode_paged(data.paged(mc, B), q, k, v, u, gates)
        err = ((y1 - y2).abs().max() / y1.abs().max().clamp_min(1e-30)).item()
        worst = max(worst, err)
        if not err < 1e-4:
            print(f"WARNING: {name} N={data.N}: forward and decode_paged differ (rel {err:.2e})")
    return worst


def bench_N(N: int, mcs: dict[str, MCMemory], args, g: torch.Generator) -> dict:
    t_start = time.perf_counter()
    data = Data(N, max(BATCHES), g)
    res: dict = {"N": N, "check_rel_err": check_paths(mcs, data, g), "decode": {}, "prefill": {},
                 "floor": {}, "segments_read": {v: segments_read(v, N, data) for v in mcs},
                 "loglinear_position": data.log_pos + 1}
    kw = dict(repeats=args.repeats, warmup=args.warmup, min_sample_s=args.min_sample,
              clock=args.clock)

    for B in BATCHES:
        inp = tokens(B, 1, g)  # q, k, v, u, gates
        # MCMemory.forward, T = 1 (states are not modified by forward: reuse them)
        fns = {}
        for name, mc in mcs.items():
            st = data.state(mc, B, C // 2)
            fns[name] = (lambda mc=mc, st=st, x=inp: mc.forward(st, *x))
        # the bandwidth floor: one plain pass over the B·N cached states grm reads
        S = data.S[:B]
        fns["floor"] = lambda S=S: S.sum()
        t = timeit_many(fns, **kw)
        res["floor"][f"B{B}"] = dict(t.pop("floor"), bytes=S.numel() * S.element_size())
        res["decode"][f"forward_B{B}"] = t
        # decode_paged (loglinear has no paged path); pl.mem / seg_ksum are updated in place
        fns = {}
        for name, mc in mcs.items():
            if name == "loglinear":
                continue
            pl = data.paged(mc, B)
            fns[name] = (lambda mc=mc, pl=pl, x=inp: mc.decode_paged(pl, *x))
        res["decode"][f"paged_B{B}"] = timeit_many(fns, **kw)

    # prefill: 4·C tokens, batch 1, starting right after the N-th push
    inp = tokens(1, PREFILL_T, g)
    fns = {}
    for name, mc in mcs.items():
        st = data.state(mc, 1, 0)  # loglinear: its own position (see Data)
        fns[name] = (lambda mc=mc, st=st, x=inp: mc.forward(st, *x))
    t = timeit_many(fns, **dict(kw, repeats=args.prefill_repeats))
    for x in t.values():
        x["tokens_per_s"] = PREFILL_T / x["median"]
    res["prefill"] = t
    res["seconds"] = time.perf_counter() - t_start
    return res


# --------------------------------------------------------------------------- report


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def fr(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}×"


def med(res: dict, path: str, variant: str) -> float | None:
    x = res["decode"].get(path, {}).get(variant)
    return None if x is None else x["median"]


def report(results: list[dict], variants: list[str]) -> dict:
    paths = [f"{p}_B{b}" for p in ("forward", "paged") for b in BATCHES]
    # decode table
    rows = []
    for res in results:
        for v in variants:
            row = [res["N"], v, res["segments_read"][v]]
            for p in paths:
                t = med(res, p, v)
                row += [fmt_time(t), fr(ratio(t, med(res, p, "none")))]
            rows.append(row)
    heads = ["N", "variant", "reads"]
    for p in paths:
        heads += [p.replace("_B", " B="), "×none"]
    print_table(rows, heads, title="Decode step, one token (median); reads = cached states read",
                align="rlr" + "r" * (len(heads) - 3))

    # prefill table
    rows = []
    for res in results:
        none = res["prefill"]["none"]["median"]
        for v in variants:
            x = res["prefill"][v]
            rows.append([res["N"], v, f"{x['tokens_per_s']:,.0f}", fmt_time(x["median"]),
                         fr(x["median"] / none)])
    print_table(rows, ["N", "variant", "tok/s", f"{PREFILL_T} tokens", "time ×none"],
                title=f"Prefill, MCMemory.forward over {PREFILL_T} tokens, batch 1 (median)",
                align="rlrrr")

    # bandwidth floor
    rows = []
    for res in results:
        for B in BATCHES:
            f = res["floor"][f"B{B}"]
            row = [res["N"], B, f"{f['bytes'] / 2**20:.1f}", fmt_time(f["median"]),
                   f"{f['bytes'] / f['median'] / 1e9:.1f}"]
            for p in ("forward", "paged"):
                t = med(res, f"{p}_B{B}", "grm")
                n = med(res, f"{p}_B{B}", "none")
                row += [fmt_time(t), fr(ratio(t, f["median"])), fr(ratio(t - n, f["median"]))]
            rows.append(row)
    print_table(rows, ["N", "B", "MiB", "floor (sum)", "GB/s", "grm fwd", "/floor",
                       "(grm−none)/floor", "grm paged", "/floor", "(grm−none)/floor"],
                title="grm decode vs the bandwidth floor (a plain sum over the same cached states)",
                align="rr" + "r" * 9)

    # targets
    targets = []
    by_n = {res["N"]: res for res in results}
    if 256 in by_n:
        r256 = by_n[256]
        for p in paths:
            for v in ("residual", "post"):
                x = ratio(med(r256, p, v), med(r256, p, "none"))
                targets.append([f"{v} ≤ {COLLAPSE_MAX}× none @N=256", p, x, COLLAPSE_MAX])
            x = ratio(med(r256, p, "ssc"), med(r256, p, "none"))
            targets.append([f"ssc ≤ {SSC_MAX}× none @N=256", p, x, SSC_MAX])
            if 8 in by_n:
                x = ratio(med(r256, p, "ssc"), med(by_n[8], p, "ssc"))
                targets.append([f"ssc N=256 ≤ {SSC_FLAT}× N=8", p, x, SSC_FLAT])
            B = int(p.split("_B")[1])
            x = ratio(med(r256, p, "grm"), r256["floor"][f"B{B}"]["median"])
            targets.append([f"grm ≤ {FLOOR_MAX}× floor @N=256", p, x, FLOOR_MAX])
    rows = [[name, p, fr(x), f"{lim}×", "-" if x is None else ("PASS" if x <= lim else "FAIL")]
            for name, p, x, lim in targets]
    if rows:
        print_table(rows, ["target", "path", "measured", "limit", ""],
                    title="Targets (printed, not asserted)", align="llrrl")
    else:
        print("\n(targets are defined at N = 256; run without --quick to evaluate them)")
    return [{"target": n, "path": p, "measured": x, "limit": lim,
             "pass": None if x is None else x <= lim} for n, p, x, lim in targets]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: all cores)")
    ap.add_argument("--quick", action="store_true", help="N ∈ {1, 8}, fewer repeats (CI smoke)")
    ap.add_argument("--ns", type=int, nargs="+", default=None, help="override the N values")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--repeats", type=int, default=None, help="samples per measurement (≥ 7)")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="what the tables show: wall time (default) or process CPU time, which "
                         "leaves out time spent descheduled on a shared machine (use with "
                         "--threads 1); the JSON keeps the medians of both")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if "none" not in args.variants:
        args.variants.insert(0, "none")
    ns = args.ns or ([1, 8] if args.quick else [1, 8, 64, 256])
    if args.repeats is None:
        args.repeats = 3 if args.quick else 9
    args.prefill_repeats = args.repeats if args.quick else max(7, args.repeats - 2)
    args.warmup = 1 if args.quick else 2
    args.min_sample = 0.002 if args.quick else 0.01

    set_threads(args.threads)
    env = env_info()
    print(env_line(env))
    print(f"one MC layer: linear memory with gates, H={H} K={K} V={V} C={C} {DTYPE}, "
          f"ssc top_k={TOP_K}; repeats={args.repeats} (prefill {args.prefill_repeats}), "
          f"N={ns}; clock={args.clock}", flush=True)
    load = env.get("loadavg")
    if load and env["threads"] > 1 and load[0] > (env["cpu_count"] or 1) - 0.5:
        print(f"WARNING: load average {load[0]:.1f} on {env['cpu_count']} cpus: with "
              f"{env['threads']} threads, wall times will be dominated by waiting for a "
              "descheduled thread (ms-scale stalls); --threads 1 --clock cpu measures the work.")
    g = torch.Generator().manual_seed(args.seed)
    mcs = {v: make_mc(v) for v in args.variants}
    results = []
    t0 = time.perf_counter()
    with torch.inference_mode():
        for N in ns:
            results.append(bench_N(N, mcs, args, g))
            print(f"  N={N}: {results[-1]['seconds']:.1f} s", flush=True)
    targets = report(results, args.variants)
    iqr = [(x["p75"] - x["p25"]) / x["median"] for res in results
           for cell in list(res["decode"].values()) + [res["prefill"]] for x in cell.values()]
    noise = {"median_rel_iqr": sorted(iqr)[len(iqr) // 2], "max_rel_iqr": max(iqr)}
    print(f"\nnoise: (p75 − p25) / median over all cells: median {noise['median_rel_iqr']:.1%}, "
          f"max {noise['max_rel_iqr']:.1%}; total {time.perf_counter() - t0:.0f} s; "
          f"load {env_info()['loadavg']}")
    out = {
        "bench": "mc_layer",
        "env": env,
        "env_end_loadavg": env_info()["loadavg"],
        "config": {"memory": "linear", "gates": ["log_a", "b"], "H": H, "K": K, "V": V, "C": C,
                   "dtype": str(DTYPE), "top_k": TOP_K, "prefill_tokens": PREFILL_T,
                   "batches": list(BATCHES), "ns": ns, "variants": args.variants,
                   "repeats": args.repeats, "prefill_repeats": args.prefill_repeats,
                   "quick": args.quick, "decode_seg_len": C // 2, "clock": args.clock,
                   "threads": torch.get_num_threads(),
                   "modes": {v: mc.cfg.mode for v, mc in mcs.items()}},
        "units": "seconds per call (median, min, p25, p75, max over repeats); prefill also "
                 "tokens_per_s",
        "results": results,
        "targets": targets,
        "noise": noise,
    }
    paths = write_json(out, "tmp_mc_layer_quick.json" if args.quick else "mc_layer.json",
                       extra=args.out)
    print("wrote " + ", ".join(str(p) for p in paths))


if __name__ == "__main__":
    main()
