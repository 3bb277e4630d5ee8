"""Mamba2 decode with every layer's fused C++ block in one call (``Mamba2Stack``) against one call
per layer, in one run: generated tokens/s of ``LLM.generate`` (16-token prompts, greedy) at each
``--streams`` count and weight precision, the two modes interleaved round by round (medians;
background load hits both alike), and whether their tokens are identical.

    python bench/mamba2_stack.py                 # 130M Mamba2 shape, float32 and int8, 1 and 8
    python bench/mamba2_stack.py --quick         # 2-layer shape, seconds (CI smoke run)

Writes ``bench/results/mamba2_stack.json`` (``tmp_mamba2_stack.json`` with ``--quick``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import baselines as bl  # noqa: E402
from common import env_info, env_line, print_table, set_threads, write_json  # noqa: E402

from mcserve.engine.llm import LLM  # noqa: E402
from mcserve.engine.sampling import SamplingParams  # noqa: E402
from mcserve.models import mamba2  # noqa: E402

MODES = ("stack", "per-layer")


def measure(llm: LLM, prompts: list[list[int]], new_tokens: int, rounds: int) -> dict[str, Any]:
    """Interleaved rounds of both modes (one untimed first round); tokens/s medians."""
    real = mamba2.Mamba2MCForCausalLM._decode_stack
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    rates: dict[str, list[float]] = {m: [] for m in MODES}
    tokens: dict[str, list[list[int]]] = {}
    used: dict[str, bool] = {}
    try:
        for r in range(rounds + 1):
            for mode in MODES:
                calls: list[bool] = []

                def spy(self, x, layers, mode=mode, calls=calls):
                    st = real(self, x, layers) if mode == "stack" else None
                    calls.append(st is not None)
                    return st

                mamba2.Mamba2MCForCausalLM._decode_stack = spy
                t = time.perf_counter()
                outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                    use_tqdm=False)
                dt = time.perf_counter() - t
                if r:
                    rates[mode].append(len(prompts) * new_tokens / dt)
                tokens[mode] = [list(o.outputs[0].token_ids) for o in outs]
                used[mode] = any(calls)
    finally:
        mamba2.Mamba2MCForCausalLM._decode_stack = real
    med = {m: statistics.median(v) for m, v in rates.items()}
    return {"tokens_per_s": med, "rounds": rates, "ratio": med["stack"] / med["per-layer"],
            "same_tokens": tokens["stack"] == tokens["per-layer"],
            "stack_used": used["stack"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--weights", nargs="+", default=["float32", "int8"],
                    choices=["float32", "int8", "bf16"])
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=10, help="timed rounds of each mode")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    shape = bl.MAMBA2_QUICK if args.quick else bl.MAMBA2_130M
    if args.quick:
        args.streams, args.new_tokens, args.rounds = [1, 3], 8, 2
    threads = set_threads(args.threads)
    env = env_info()
    print(env_line(env))
    path = bl.mamba2_dir(shape)
    rows, results = [], []
    for w in args.weights:
        kw = ({"quantization": "int8"} if w == "int8" else {"dtype": "bfloat16"} if w == "bf16"
              else {})
        llm = LLM(model=str(path), max_num_seqs=max(args.streams), max_model_len=256, **kw)
        for n in args.streams:
            res = measure(llm, bl.prompts(shape["vocab_size"], n, 16, seed=n), args.new_tokens,
                          args.rounds)
            results.append({"weights": w, "streams": n, **res})
            t = res["tokens_per_s"]
            rows.append([w, n, f"{t['stack']:.1f}", f"{t['per-layer']:.1f}",
                         f"{res['ratio']:.3f}", "yes" if res["same_tokens"] else "NO",
                         "yes" if res["stack_used"] else "no"])
    print_table(rows, ["weights", "streams", "stack tok/s", "per-layer tok/s", "ratio",
                       "same tokens", "stack used"],
                title=f"Mamba2 (d {shape['hidden_size']}, {shape['num_hidden_layers']} layers) "
                      f"decode, {args.new_tokens} tokens per stream, medians of "
                      f"{args.rounds} interleaved rounds, {threads} threads")
    name = args.out or ("tmp_mamba2_stack.json" if args.quick else "mamba2_stack.json")
    for p in write_json({"env": env, "args": vars(args), "shape": shape, "results": results},
                        name):
        print(f"wrote {p}")


if __name__ == "__main__":
    main()
