"""A MoE hybrid's decode in float32 and int8 against llama.cpp's F32 and Q8_0, same weights.

The model: Granite-4.0-H with routed experts (transformers' ``GraniteMoeHybridForCausalLM``,
random weights, ``GRANITE_H_MOE``: the 350M shape's width, Mamba2 and attention layers, 8 layers
with attention at 3 and 6, each with a MoE of 32 experts of 512, top 6, beside the shared MLP of
1024). mcserve runs it as loaded (float32) and with ``quantization="int8"`` (the linears and
every routed expert matrix int8, ``models/lowp_linear.py``); llama.cpp runs the same checkpoint
converted to F32 and Q8_0 GGUFs (its converter, ``--llama-cpp-src`` as in ``offline.py``). Every
engine decodes the same prompts (16 tokens, 64 greedy tokens per stream) at each stream count,
same threads; runners interleave repeat by repeat; the greedy tokens of each are compared with
mcserve float32's.

    python bench/moe.py --llama-cpp-src DIR     # about ten minutes
    python bench/moe.py --quick                 # 2 layers, small vocabulary (smoke)

Prints a table and writes ``bench/results/moe.json`` (``--quick``: ``tmp_moe_quick.json``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import baselines as bl  # noqa: E402
from common import env_info, env_line, print_table, set_threads, write_json  # noqa: E402

#: Granite-4.0-H-350M's width and layer kinds, 8 layers, with a MoE in every layer
GRANITE_H_MOE: dict[str, Any] = dict(
    bl.GRANITE_H_350M, num_hidden_layers=8, num_local_experts=32, num_experts_per_tok=6,
    intermediate_size=512, shared_intermediate_size=1024,
    layer_types=["attention" if i in (3, 6) else "mamba" for i in range(8)])
GRANITE_H_MOE_QUICK: dict[str, Any] = dict(GRANITE_H_MOE, num_hidden_layers=2, vocab_size=4096,
                                           num_local_experts=8, num_experts_per_tok=2,
                                           layer_types=["mamba", "attention"])
SEED = 1  # the dense Granite shapes of baselines use seed 0 and the same directory names


def runners(path: Path, args, threads: int, max_streams: int) -> tuple[list, list[str]]:
    notes = []
    max_len = args.prompt_len + args.new_tokens + 1
    rs: list = [bl.McserveEngineRunner(path, "mcserve float32", max_streams, max_len),
                bl.McserveEngineRunner(path, "mcserve int8", max_streams, max_len,
                                       quantization="int8")]
    try:  # a conversion or load failure is the columns' note, not the run's end
        llama, why = bl.llama_cpp_precision_runners(path, args.llama_cpp_src, threads,
                                                    ("f32", "q8_0"), no_vocab=True,
                                                    layer_names=bl.GRANITE_LAYER_NAMES)
    except RuntimeError as e:
        lines = [x for x in str(e).splitlines() if x.strip()] or ["failed"]
        llama, why = [], f"llama.cpp columns skipped: {lines[-1]}"
    if why:
        notes.append(why)
    return rs + llama, notes


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="threads (default: all cores)")
    ap.add_argument("--llama-cpp-src", default=None,
                    help="llama.cpp source folder (its convert_hf_to_gguf.py)")
    ap.add_argument("--quick", action="store_true", help="2 layers, 8 experts (smoke)")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args(argv)
    args.prompt_len, args.new_tokens = (8, 8) if args.quick else (16, 64)
    if args.quick:
        args.repeats = 1
    shape = GRANITE_H_MOE_QUICK if args.quick else GRANITE_H_MOE
    threads = set_threads(args.threads)
    path = bl.granite_hybrid_dir(shape, seed=SEED)
    rs, notes = runners(path, args, threads, max(args.streams))
    results, rows, agree = [], [], []
    for n in args.streams:
        ids = bl.prompts(shape["vocab_size"], n, args.prompt_len)
        runs: dict[str, list] = {r.name: [] for r in rs}
        for _ in range(args.repeats):  # interleaved: a shared machine's noise hits all
            for r in rs:
                runs[r.name].append(r.run(ids, args.new_tokens, 1))
        merged = {name: bl.Result(name, n, res[0].tokens, [x.seconds[0] for x in res],
                                  res[-1].outputs) for name, res in runs.items()}
        by = {name: r.tokens_per_s for name, r in merged.items()}  # the median run's rate
        results += [r.to_json() for r in merged.values()]
        ref = merged["mcserve float32"]
        for name, r in merged.items():
            if name != "mcserve float32":
                agree.append({"name": name, "streams": n, "fraction": bl.agreement(ref, r)})
        f32, q8 = by.get("llama.cpp F32"), by.get("llama.cpp Q8_0")
        rows.append([n] + [f"{by[r.name]:.1f}" for r in rs]
                    + [f"{by['mcserve float32'] / f32:.2f}x" if f32 else "-",
                       f"{by['mcserve int8'] / q8:.2f}x" if q8 else "-"])
    env = env_info()
    print(env_line(env))
    print(f"model: Granite-4.0-H with MoE, hidden {shape['hidden_size']}, "
          f"{shape['num_hidden_layers']} layers, {shape['num_local_experts']} experts of "
          f"{shape['intermediate_size']} (top {shape['num_experts_per_tok']}), vocabulary "
          f"{shape['vocab_size']}; random weights; {args.prompt_len}-token prompts -> "
          f"{args.new_tokens} greedy tokens per stream; {threads} threads; median of "
          f"{args.repeats}")
    print_table(rows, ["streams"] + [f"{r.name} tok/s" for r in rs]
                + ["float32 / F32", "int8 / Q8_0"], title="MoE hybrid decode, same weights")
    for a in agree:
        print(f"greedy tokens of {a['name']} at {a['streams']} streams agreeing with mcserve "
              f"float32: {a['fraction']:.0%}")
    for note in notes:
        print(note)
    data = {"env": env, "args": vars(args), "shape": shape, "threads": threads,
            "results": results, "agreement_with_mcserve_float32": agree, "notes": notes}
    write_json(data, "tmp_moe_quick.json" if args.quick else "moe.json", extra=args.out)
    return data


if __name__ == "__main__":
    main()
