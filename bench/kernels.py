"""Timings of the Triton kernels against their torch twins and the memory-bandwidth floor.

On a CUDA machine, for each kernel (paged MC decode readout for grm/ssc, its split-N form, the
ssc router, the chunk-parallel and the sequence-walking linear prefill with segment checkpoints,
the fused per-layer decode of a native-like and a Mamba2-like mixer, the fused cached readout of
a grm prefill chunk) and a few sizes, it times
the Triton kernel, its torch twin and, where one exists, the kernel it replaces (``old_ms``)
with ``triton.testing.do_bench`` (median ms), computes the bytes the kernel must at least move
(every input read once, every output written once) and prints the achieved bandwidth as a
fraction of the card's peak (the floor time = bytes / peak bandwidth). Results go
to ``bench/results/kernels.json`` (``--out`` to change). Without a CUDA device it says so and
exits 0.

    python bench/kernels.py                  # all kernels, default sizes
    python bench/kernels.py --quick          # fewer sizes
    python bench/kernels.py --peak-gbs 3350  # peak HBM bandwidth (default: from the card name)
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import sys
from functools import partial
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# peak DRAM bandwidth (GB/s) by card name fragment; override with --peak-gbs
PEAK_GBS = {"H200": 4800.0, "H100 SXM": 3350.0, "H100 PCIe": 2000.0, "H100": 3350.0,
            "A100-SXM4-80GB": 2039.0, "A100": 1555.0, "L40S": 864.0, "A10": 600.0,
            "RTX 4090": 1008.0, "RTX 3090": 936.0, "T4": 320.0}


def decode_bytes(B: int, H: int, K: int, V: int, n_read: int, elt: int,
                 n_scored: int | None = None) -> int:
    """Least bytes one paged decode readout moves: the ``n_read`` state blocks it reads
    (K·V each), the ``n_scored`` key sums it scores (K each; default n_read), q, u, p_online
    (K each), o_online in and y out (V each), per (row, head)."""
    n_scored = n_read if n_scored is None else n_scored
    return elt * B * H * (n_read * K * V + n_scored * K + 3 * K + 2 * V)


def router_bytes(B: int, H: int, K: int, N: int, top_k: int, elt: int) -> int:
    return B * H * (elt * (N * K + K) + (8 + elt) * top_k)


def prefill_bytes(B: int, T: int, H: int, K: int, V: int, C: int, elt: int) -> int:
    """q, k, v, gates in; o out; one K×V state and K key sum written per segment boundary."""
    nb = T // C
    return elt * B * H * (T * (2 * K + 2 * V + 2) + nb * (K * V + K) + 2 * K * V)


def _peak(name: str, override: float | None) -> float | None:
    if override:
        return override
    for frag, gbs in PEAK_GBS.items():
        if frag in name:
            return gbs
    return None


def _decode_inputs(B, H, K, V, N, dtype, dev):
    nb = B * N + 16
    g = torch.Generator(device=dev).manual_seed(0)
    pool = torch.randn(nb, H, K, V, device=dev, dtype=dtype, generator=g)
    ksum = torch.randn(nb, H, K, device=dev, dtype=dtype, generator=g)
    table = torch.randperm(nb, device=dev, generator=g)[:B * N].view(B, N)
    q, u, p = (torch.randn(B, H, K, device=dev, dtype=dtype, generator=g) for _ in range(3))
    o = torch.randn(B, H, V, device=dev, dtype=dtype, generator=g)
    return q, u, o, p, table, pool, ksum


def _fused_inputs(layout, B, H, K, V, N, dtype, dev):
    """``fused_linear_decode`` arguments for one layer: ``native`` (q, k, v per head, conv,
    sigmoid gates, learned u, per-head norm, grm over N blocks) or ``mamba2`` (B/C shared by
    every head, softplus gates, D skip, one gated norm over all heads; grm over N blocks, the
    plain SSM step when N = 0)."""
    g = torch.Generator(device=dev).manual_seed(2)
    rnd = lambda *s: torch.randn(*s, device=dev, dtype=dtype, generator=g)  # noqa: E731
    if layout == "native":
        CC = 3 * H * K
        kw = dict(q_offset=0, k_offset=H * K, v_offset=2 * H * K, normalize_qk=True,
                  u=rnd(B, H, K), gate_mode="sigmoid", log_a=rnd(B, H), b=rnd(B, H),
                  decay_scale=0.125, norm_weight=rnd(V), norm_group=V, norm_before_gate=True)
    else:
        CC = H * V + 2 * K
        kw = dict(v_offset=0, k_offset=H * V, q_offset=H * V + K, qk_heads=H,
                  gate_mode="softplus", dt=rnd(B, H), dt_bias=rnd(H), A_log=rnd(H), D=rnd(H),
                  norm_weight=rnd(H * V), norm_group=H * V)
    kw.update(conv_tail=rnd(B, 3, CC), conv_weight=rnd(CC, 4), conv_bias=rnd(CC))
    if N:
        _, _, _, _, table, pool, ksum = _decode_inputs(B, H, K, V, N, dtype, dev)
        kw.update(variant="grm", segment_len=64, seg_ksum=rnd(B, H, K),
                  seg_len=torch.zeros(B, dtype=torch.long, device=dev), table=table,
                  pool_S=pool, ksum_pool=ksum)
    else:
        kw["variant"] = "none"
    return rnd(B, CC), rnd(B, H * V), rnd(B, H, K, V), kw


def run(quick: bool, peak_override: float | None, out_path: Path) -> list[dict]:
    import triton
    from triton.testing import do_bench

    from mcserve.kernels.triton.fused_decode import triton as fused
    from mcserve.kernels.triton.fused_decode.twin import fused_linear_decode_torch
    from mcserve.kernels.triton.linear_prefill import chunk, scan
    from mcserve.kernels.triton.linear_prefill.twin import chunk_linear_prefill_torch
    from mcserve.kernels.triton.mc_decode import single, split
    from mcserve.kernels.triton.mc_decode.twin import paged_mc_decode_linear_torch
    from mcserve.kernels.triton.ssc_router import triton as router
    from mcserve.kernels.triton.ssc_router.twin import ssc_router_torch

    dev = torch.device("cuda")
    name = torch.cuda.get_device_name(dev)
    peak = _peak(name, peak_override)
    dtype = torch.float32
    elt = 4
    rows: list[dict] = []

    def record(kernel, shape, fn_tri, fn_torch, nbytes, fn_old=None):
        ms_tri = do_bench(fn_tri)
        ms_torch = do_bench(fn_torch)
        ms_old = None if fn_old is None else do_bench(fn_old)
        gbs = nbytes / (ms_tri * 1e-3) / 1e9
        row = dict(kernel=kernel, shape=shape, triton_ms=ms_tri, torch_ms=ms_torch,
                   old_ms=ms_old, speedup=ms_torch / ms_tri, bytes=nbytes, triton_gbs=gbs,
                   floor_ms=None if peak is None else nbytes / (peak * 1e9) * 1e3,
                   frac_of_floor=None if peak is None else gbs / peak)
        rows.append(row)
        frac = "n/a" if peak is None else f"{row['frac_of_floor']:.2f}"
        old = "" if ms_old is None else f"  old {ms_old:8.4f} ms"
        print(f"{kernel:<16} {shape:<40} triton {ms_tri:8.4f} ms  torch {ms_torch:8.4f} ms  "
              f"x{row['speedup']:5.1f}  {gbs:7.1f} GB/s  floor-frac {frac}{old}", flush=True)

    H, K, V = 8, 64, 64
    decode_sizes = [(1, 8), (64, 64)] if quick else [(1, 8), (1, 256), (1, 1024), (64, 8),
                                                      (64, 64), (256, 64)]
    for B, N in decode_sizes:
        args = _decode_inputs(B, H, K, V, N, dtype, dev)
        for variant, top_k in (("grm", 2), ("ssc", 4)):
            kw = dict(variant=variant, segment_len=64, top_k=top_k)
            n_read = N if variant == "grm" else min(top_k, N)
            record(f"decode-{variant}", f"B={B} N={N} H={H} K={K} V={V}",
                   lambda a=args, k=kw: single.paged_mc_decode_linear(*a, **k),
                   lambda a=args, k=kw: paged_mc_decode_linear_torch(*a, **k),
                   decode_bytes(B, H, K, V, n_read, elt, n_scored=N))
        if B == 1 and N >= 64:  # the split over N against the single-launch kernel
            kw = dict(variant="grm", segment_len=64)
            record("decode-grm-split", f"B={B} N={N} H={H} K={K} V={V}",
                   lambda a=args, k=kw: split.paged_mc_decode_linear_split(*a, **k),
                   lambda a=args, k=kw: paged_mc_decode_linear_torch(*a, **k),
                   decode_bytes(B, H, K, V, N, elt),
                   fn_old=lambda a=args, k=kw: single.paged_mc_decode_linear(*a, **k))
        q, u, o, p, table, pool, ksum = args
        rkw = dict(segment_len=64, top_k=4)
        record("ssc-router", f"B={B} N={N} H={H} K={K} top_k=4",
               partial(router.ssc_router, u, ksum, table, **rkw),
               partial(ssc_router_torch, u, ksum, table, **rkw),
               router_bytes(B, H, K, N, 4, elt))
    prefill_sizes = [(1, 2048), (8, 1024)] if quick else [(1, 2048), (1, 8192), (8, 1024),
                                                          (32, 1024)]
    C = 64
    for B, T in prefill_sizes:
        g = torch.Generator(device=dev).manual_seed(1)
        q, k = (torch.randn(B, T, H, K, device=dev, dtype=dtype, generator=g) for _ in range(2))
        v = torch.randn(B, T, H, V, device=dev, dtype=dtype, generator=g)
        la = -torch.rand(B, T, H, device=dev, dtype=dtype, generator=g) * 0.1
        bw = torch.rand(B, T, H, device=dev, dtype=dtype, generator=g)
        kw = dict(segment_len=C)
        record("prefill-chunk", f"B={B} T={T} H={H} K={K} V={V} C={C}",
               partial(chunk.chunk_linear_prefill_chunked, q, k, v, la, bw, **kw),
               partial(chunk_linear_prefill_torch, q, k, v, la, bw, **kw),
               prefill_bytes(B, T, H, K, V, C, elt),
               fn_old=partial(scan.chunk_linear_prefill, q, k, v, la, bw, **kw))
    from mcserve.kernels import mc_chunk
    from mcserve.kernels.triton.readout import triton as readout

    # the cached readout of a grm prefill chunk: L tokens after n0 carried checkpoints (the
    # last 8K chunk of a 32K prompt: n0 = 384); the torch form is the GPU's tiled reads
    for L, n0 in ([(2048, 0)] if quick else [(2048, 0), (8192, 0), (8192, 384)]):
        N = n0 + L // C - 1
        g = torch.Generator(device=dev).manual_seed(2)
        S = torch.randn(1, N, H, K, V, device=dev, dtype=dtype, generator=g) * 0.1
        q = torch.randn(1, L, H, K, device=dev, dtype=dtype, generator=g)
        vis = (torch.arange(N, device=dev)[None, :]
               < (n0 + torch.arange(L, device=dev) // C)[:, None])
        w = torch.rand(1, L, H, N, device=dev, dtype=dtype, generator=g) * vis[None, :, None, :]
        record("chunk-readout", f"L={L} n0={n0} N={N} H={H} K={K} V={V}",
               partial(readout.mc_chunk_readout, S, q, w, n0, C),
               partial(mc_chunk._readout_blocks, S, q, w, n0, C),
               (S.numel() + q.numel() + w.numel() + L * H * V) * elt)
    for layout, B, N in ([("native", 1, 64), ("mamba2", 64, 64)] if quick else
                         [("native", 1, 64), ("native", 64, 64), ("native", 256, 64),
                          ("mamba2", 1, 0), ("mamba2", 64, 64), ("mamba2", 256, 0)]):
        x, z, S, kw = _fused_inputs(layout, B, H, K, V, N, dtype, dev)
        n_read = N if kw["variant"] == "grm" else 0
        record(f"fused-{layout}-{kw['variant']}", f"B={B} N={N} H={H} K={K} V={V}",
               partial(fused.fused_linear_decode, x, z, S, **kw),
               partial(fused_linear_decode_torch, x, z, S, **kw),
               decode_bytes(B, H, K, V, n_read + 2, elt, n_scored=N))  # + S in and out
    info = dict(card=name, date=_dt.datetime.now().isoformat(timespec="seconds"),
                torch=torch.__version__, triton=triton.__version__, peak_gbs=peak,
                dtype=str(dtype), rows=rows)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(info, indent=1))
    print(f"card {name}, peak {peak} GB/s; wrote {out_path}")
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--peak-gbs", type=float, default=None)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "kernels.json")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/kernels.py: no CUDA device (torch.cuda.is_available() is False); the Triton "
              "kernels only run on CUDA (tests use TRITON_INTERPRET=1). Nothing to time.")
        return 0
    try:
        import triton  # noqa: F401
    except ImportError as e:
        print(f"bench/kernels.py: triton is not importable ({e}); nothing to time.")
        return 0
    run(args.quick, args.peak_gbs, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
