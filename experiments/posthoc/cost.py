"""Speed and state memory of each training-free setting at 1x..32x the training length.

For every setting and length L: prefill time of one L-token window (tokens/s), decode time per
token right after it (greedy steps from the prefilled state: the serving cost of a token at
position L), and the recurrent state one sequence holds at L (online memories, cached segment
memories and their key sums, conv tails). Settings run interleaved and each time is the minimum
of ``--repeats`` runs, so load from other processes on a shared machine inflates it least::

    python experiments/posthoc/cost.py --json experiments/posthoc/results/T512/cost.json
    python experiments/posthoc/cost.py --model experiments/posthoc/ckpt --delta-scale 0.09
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from mcserve.eval.common import EvalModel, model_for, parse_setting  # noqa: E402
from mcserve.models.registry import load_model  # noqa: E402


def state_bytes(state) -> int:
    total = 0
    for ls in state.layers:
        mc = ls.mc
        tensors = [*mc.mem.values(), mc.seg_ksum, *mc.cached.values(), mc.cached_ksum]
        total += sum(t.numel() * t.element_size() for t in tensors)
        if ls.conv is not None:
            total += ls.conv.numel() * ls.conv.element_size()
    return total


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(ROOT / "experiments/posthoc/ckpt512"))
    ap.add_argument("--data", default=str(ROOT / "experiments/posthoc/data/eval.bin"))
    ap.add_argument("--lengths", default=None,
                    help="comma-separated lengths (default: T, 4T, 16T, 32T; T = the "
                    "model's training length)")
    ap.add_argument("--settings", default="as-is,reset:{T},post:{T}:independent,"
                    "post:{H}:independent,post:{T}:checkpoint,grm:{T}:independent,"
                    "ssc:{T}:checkpoint:2,loglinear:{T}:checkpoint",
                    help="comma-separated settings; {T} and {H} stand for T and T/2")
    ap.add_argument("--delta-scale", default=None,
                    help="also time as-is with this Δ scale (its cost is that of as-is)")
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    base = load_model(args.model)
    T = base.config.max_position_embeddings
    ids = torch.from_numpy(np.fromfile(args.data, dtype="<u2").astype(np.int64))
    lengths = ([int(x) for x in args.lengths.split(",")] if args.lengths
               else [T, 4 * T, 16 * T, 32 * T])
    settings = [parse_setting(s, T)
                for s in args.settings.format(T=T, H=T // 2).split(",")]
    models = {s.name: (model_for(base, s), s) for s in settings}
    if args.delta_scale:
        scaled = base.with_delta_scale(float(args.delta_scale))
        models[f"as-is + Δ×{args.delta_scale}"] = (scaled, parse_setting("as-is", T))
    best: dict[tuple[str, int], dict] = {}
    with torch.no_grad():
        for _ in range(args.repeats):
            for L in lengths:
                x = ids[:L][None]
                for name, (model, s) in models.items():
                    em = EvalModel(model, reset_every=s.segment_len if s.kind == "reset"
                                   else None, chunk=1024)
                    t0 = time.perf_counter()
                    last, state = em.feed(x, None, 0)
                    t1 = time.perf_counter()
                    tok = last.argmax(-1)
                    t2 = time.perf_counter()
                    for i in range(args.decode_steps):
                        last, state = em.feed(tok[:, None], state, L + i)
                        tok = last.argmax(-1)
                    t3 = time.perf_counter()
                    rec = {"prefill_tok_s": L / (t1 - t0),
                           "decode_ms": 1e3 * (t3 - t2) / args.decode_steps,
                           "state_kib": state_bytes(state) / 1024}
                    old = best.get((name, L))
                    if old is None:
                        best[(name, L)] = rec
                    else:
                        old["prefill_tok_s"] = max(old["prefill_tok_s"], rec["prefill_tok_s"])
                        old["decode_ms"] = min(old["decode_ms"], rec["decode_ms"])
    print("| setting | " + " | ".join(f"{L} ({L // T}×)" for L in lengths) + " |")
    print("|---" * (len(lengths) + 1) + "|")
    for name in models:
        cells = []
        for L in lengths:
            r = best[(name, L)]
            cells.append(f"{r['prefill_tok_s']:.0f} tok/s, {r['decode_ms']:.2f} ms, "
                         f"{r['state_kib'] / 1024:.2f} MiB")
        print(f"| {name} | " + " | ".join(cells) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps(
            [{"setting": n, "length": L, **r} for (n, L), r in best.items()], indent=2) + "\n")


if __name__ == "__main__":
    main()
