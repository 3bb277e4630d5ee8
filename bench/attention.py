"""The decode attention of hybrid models on the CPU: the paged C++ pass (blocks read in place,
online softmax, each KV row read once for the query heads that share it) against the gathered
path (every row's blocks copied out, then SDPA), same inputs, samples interleaved, one run.

    python bench/attention.py                 # LFM2-350M's attention shape, 1 to 32K tokens
    python bench/attention.py --quick         # smoke run: tmp_attention.json

Shape: 16 query heads, 8 KV heads, head dim 64, 16-token blocks, float32 (an LFM2-350M
attention layer); rows of a batch each hold their own blocks. Reports the median time per call
of one layer and the ratio; writes ``bench/results/attention.json``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import env_info, env_line, print_table, set_threads, timeit_many, write_json  # noqa: E402

from mcserve.kernels import attention as ops  # noqa: E402
from mcserve.kernels import cpu as cpu_ops  # noqa: E402

CASES = [(1, 64), (1, 1024), (1, 8192), (1, 32768), (8, 1024), (8, 8192), (16, 512)]
QUICK = [(1, 64), (4, 256)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    threads = set_threads(args.threads)
    if cpu_ops.ops() is None:
        print(f"the C++ ops are unavailable ({cpu_ops.status()}): nothing to compare")
        return
    H, Hkv, D, bs = 16, 8, 64, 16
    rows, results = [], []
    for B, L in (QUICK if args.quick else CASES):
        g = torch.Generator().manual_seed(B * L)
        nb = -(-L // bs)
        k_pool = torch.randn(B * nb, bs, Hkv, D, generator=g)
        v_pool = torch.randn(B * nb, bs, Hkv, D, generator=g)
        tables = torch.arange(B * nb).view(B, nb)
        lengths = torch.full((B,), L)
        q = torch.randn(B, 1, H, D, generator=g)

        inputs = (q, k_pool, v_pool, tables, lengths, D ** -0.5)

        def paged(inputs=inputs):
            return ops.paged_decode(*inputs)

        def gathered(inputs=inputs):
            with cpu_ops.twins_only():
                return ops.paged_decode(*inputs)

        torch.testing.assert_close(paged(), gathered(), atol=1e-4, rtol=1e-4)
        t = timeit_many({"paged": paged, "gathered": gathered}, repeats=args.repeats)
        p, gg = t["paged"]["median"], t["gathered"]["median"]
        rows.append([B, L, f"{p * 1e3:.3f}", f"{gg * 1e3:.3f}", f"{gg / p:.2f}x"])
        results.append({"batch": B, "tokens": L, "paged_s": t["paged"], "gathered_s":
                        t["gathered"]})
    env = env_info()
    print(env_line(env))
    print(f"one attention layer: {H} heads, {Hkv} KV heads, head dim {D}, blocks of {bs}, "
          f"float32; {threads} threads; median of {args.repeats}")
    print_table(rows, ["rows", "tokens each", "paged C++ ms", "gathered + SDPA ms",
                       "gathered / paged"], title="decode attention over the paged KV cache")
    write_json({"env": env, "args": vars(args), "threads": threads, "results": results},
               "tmp_attention.json" if args.quick else "attention.json", extra=args.out)


if __name__ == "__main__":
    main()
