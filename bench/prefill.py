"""One-pass prefill of an MC layer against the per-segment loop, same layer, same run.

One MC layer over the gated linear memory at the default model's head shape (H=4, K=V=64,
segments of C=64 tokens) takes a prefill chunk of ``--chunk`` tokens after N cached checkpoints
(N ∈ ``--cached``, i.e. the chunk sits at position N·C of the prompt), for ``grm``, ``ssc``
(top_k 8) and ``post``:

* **one pass**: ``MCMemory.forward`` over the whole chunk (``kernels.mc_chunk``: all segments
  of the chunk at once, one scatter of its checkpoints);
* **per segment**: the same layer with ``MCMemory.chunked = False`` called once per segment,
  the way a prefill ran when the runner cut chunks at segment boundaries (the cached set grows
  by one checkpoint per call).

* **one pass, span-wide weights** (``grm``, the dense readout): the one pass with the scores
  and softmax weights of the whole chunk built as tensors before the readout
  (``mc_chunk._readout_dense_unfused``, the GPU's and training's form) instead of tile by tile
  (``mc_chunk._readout_dense``, the CPU's).

``--bf16-readout`` gives the dense readout bfloat16 GEMM operands (``MCMemory.readout_dtype``,
what ``--dtype bfloat16`` sets on a CPU with BF16 dot products). On a CPU with AMX tiles the
readout then runs as one C++ pass per tile (``kernels.cpu.readout_bf16_``); one more form times
``grm`` the other way, **X buffer**: the weighted queries written to a buffer and multiplied by
oneDNN's bfloat16 GEMMs (what CPUs without AMX run).

All give the same outputs (``tests/test_mc_chunk.py``). Samples of the forms are interleaved
(``common.timeit_many``), so the ratio holds on a loaded machine even when the seconds drift.

    python bench/prefill.py                 # chunk 2048, N in 0 128 480 (about a minute)
    python bench/prefill.py --quick         # CI smoke
    python bench/prefill.py --chunk 8192 --cached 128 --variants grm --bf16-readout

Prints a table and writes ``bench/results/prefill.json`` (``--bf16-readout``:
``prefill_bf16_readout.json``; ``--quick``: ``tmp_prefill_quick.json``).
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import env_info, env_line, print_table, set_threads, timeit_many, write_json  # noqa: E402

from mcserve.config import MCConfig  # noqa: E402
from mcserve.kernels import cpu, mc_chunk  # noqa: E402
from mcserve.models.mc import MCMemory  # noqa: E402
from mcserve.models.memory.linear import LinearMemory  # noqa: E402

H, K, V, C = 4, 64, 64, 64
VARIANTS = {"grm": dict(variant="grm"), "ssc8": dict(variant="ssc", top_k=8),
            "post": dict(variant="post", mode="independent")}


def make_case(variant: str, n_cached: int, T: int, seed: int = 0):
    """The layer, its state after ``n_cached`` segments and the chunk's inputs."""
    g = torch.Generator().manual_seed(seed)
    mc = MCMemory(LinearMemory(), MCConfig(segment_len=C, **VARIANTS[variant]))
    st = mc.init_state(1, H, K, V, dtype=torch.float32, device="cpu")
    for i in range(n_cached):  # cached checkpoints as the engine's load_state hands them over
        st.seg_ksum = torch.randn(1, H, K, generator=g)
        st.mem = {"S": torch.randn(1, H, K, V, generator=g) * 0.1}
        st.seg_len, st.pos = C, (i + 1) * C
        mc.push(st, None)
    x = [torch.randn(1, T, H, K, generator=g) for _ in range(3)]
    q, k, u = x[0], x[1] / K ** 0.5, x[2]
    v = torch.randn(1, T, H, V, generator=g)
    gates = {"log_a": -torch.rand(1, T, H, generator=g) * 0.1,
             "b": torch.rand(1, T, H, generator=g)}
    return mc, st, (q, k, v, u, gates)


def one_pass(mc: MCMemory, st, inputs) -> None:
    mc.chunked = True
    mc.forward(st, *inputs)


def span_weights(mc: MCMemory, st, inputs) -> None:
    tiled = mc_chunk._readout_dense
    mc_chunk._readout_dense = mc_chunk._readout_dense_unfused
    try:
        one_pass(mc, st, inputs)
    finally:
        mc_chunk._readout_dense = tiled


def x_buffer(mc: MCMemory, st, inputs) -> None:
    fused = mc_chunk.cpu_ops.readout_bf16_fused
    mc_chunk.cpu_ops.readout_bf16_fused = lambda K, V: False
    try:
        one_pass(mc, st, inputs)
    finally:
        mc_chunk.cpu_ops.readout_bf16_fused = fused


def per_segment(mc: MCMemory, st, inputs) -> None:
    mc.chunked = False
    q, k, v, u, gates = inputs
    for p in range(0, q.shape[1], C):
        sl = slice(p, p + C)
        _, st = mc.forward(st, q[:, sl], k[:, sl], v[:, sl], u[:, sl],
                           {n: g[:, sl] for n, g in gates.items()})


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunk", type=int, default=2048, help="tokens of the prefill chunk")
    ap.add_argument("--cached", type=int, nargs="+", default=[0, 128, 480],
                    help="cached checkpoints before the chunk")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: all cores)")
    ap.add_argument("--quick", action="store_true", help="chunk 256, N 0 8 (CI smoke)")
    ap.add_argument("--bf16-readout", action="store_true",
                    help="bfloat16 operands for the dense cached readout's GEMMs "
                         "(writes prefill_bf16_readout.json)")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args(argv)
    if args.quick:
        args.chunk, args.cached, args.repeats = 256, [0, 8], 3
    threads = set_threads(args.threads)
    env = env_info()
    print(env_line(env), f"threads {threads}")
    rows, results = [], []
    with torch.no_grad():
        for n in args.cached:
            for variant in args.variants:
                case = make_case(variant, n, args.chunk)
                if args.bf16_readout:
                    case[0].readout_dtype = torch.bfloat16
                fns = {"one_pass": functools.partial(one_pass, *case),
                       "per_segment": functools.partial(per_segment, *case)}
                if variant == "grm":
                    fns["span_weights"] = functools.partial(span_weights, *case)
                    if args.bf16_readout and cpu.readout_bf16_fused(K, V):
                        fns["x_buffer"] = functools.partial(x_buffer, *case)
                t = timeit_many(fns, repeats=args.repeats, warmup=1, min_sample_s=0.0)
                d = t["x_buffer"]["median"] if "x_buffer" in t else None
                a, b = t["one_pass"]["median"], t["per_segment"]["median"]
                c = t["span_weights"]["median"] if "span_weights" in t else None
                rows.append([n, variant, f"{a * 1e3:.0f}", f"{b * 1e3:.0f}", f"{a / b:.2f}",
                             "-" if c is None else f"{c * 1e3:.0f}",
                             "-" if c is None else f"{a / c:.2f}",
                             "-" if d is None else f"{d * 1e3:.0f}",
                             "-" if d is None else f"{a / d:.2f}"])
                results.append({"cached": n, "variant": variant, "chunk": args.chunk,
                                "one_pass": t["one_pass"], "per_segment": t["per_segment"],
                                "ratio": a / b, "span_weights": t.get("span_weights"),
                                "ratio_to_span_weights": None if c is None else a / c,
                                "x_buffer": t.get("x_buffer"),
                                "ratio_to_x_buffer": None if d is None else a / d})
    print_table(rows, ["cached N", "variant", "one pass ms", "per segment ms", "ratio",
                       "span-wide weights ms", "ratio", "X buffer ms", "ratio"],
                title=f"MC layer prefill of {args.chunk} tokens (H={H}, K=V={K}, C={C}"
                      f"{', bf16 readout' if args.bf16_readout else ''}), median")
    data = {"env": env, "threads": threads, "args": vars(args), "results": results}
    name = ("tmp_prefill_quick.json" if args.quick
            else "prefill_bf16_readout.json" if args.bf16_readout else "prefill.json")
    write_json(data, name, extra=args.out)
    return data


if __name__ == "__main__":
    main()
