"""The engine on the CPU with and without ``keep_freed_memory`` (``engine/host_malloc.py``: glibc
keeps freed large blocks for reuse instead of unmapping them): the time of a 16-token prefill
(``LLM.generate`` of one token) and of 64 generated tokens, one stream, 130M Mamba2 shape. The
setting is per process, so the two sides run in alternating child processes
(``MCSERVE_HOST_MALLOC=0`` for the baseline); medians over ``--pairs`` pairs.

    python bench/host_malloc.py --threads 2  # int8, 5 pairs: bench/results/host_malloc.json
    python bench/host_malloc.py --quick          # 2-layer shape, 2 pairs (tmp_host_malloc.json)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import env_info, env_line, print_table, write_json  # noqa: E402

CHILD = """
import json, statistics, sys, time, torch
sys.path.insert(0, {bench!r})
import baselines as bl
from mcserve.engine.host_malloc import keep_freed_memory
from mcserve.engine.llm import LLM
from mcserve.engine.sampling import SamplingParams
torch.set_num_threads({threads})
shape = bl.MAMBA2_QUICK if {quick} else bl.MAMBA2_130M
kw = {{"quantization": "int8"}} if {weights!r} == "int8" else {{}}
llm = LLM(model=str(bl.mamba2_dir(shape)), max_num_seqs=4, max_model_len=256, **kw)
prompt = [{{"prompt_token_ids": bl.prompts(shape["vocab_size"], 1, 16)[0]}}]
one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
many = SamplingParams(max_tokens={new_tokens}, temperature=0, ignore_eos=True)
for _ in range(3):
    llm.generate(prompt, one, use_tqdm=False)
pre, gen = [], []
for _ in range({repeats}):
    t = time.perf_counter(); llm.generate(prompt, one, use_tqdm=False)
    pre.append(time.perf_counter() - t)
    t = time.perf_counter(); llm.generate(prompt, many, use_tqdm=False)
    gen.append(time.perf_counter() - t)
print(json.dumps({{"applied": keep_freed_memory(), "prefill_s": statistics.median(pre),
                  "generate_s": statistics.median(gen)}}))
"""


def child(args, on: bool) -> dict:
    code = CHILD.format(bench=str(Path(__file__).resolve().parent), threads=args.threads,
                        quick=args.quick, weights=args.weights, new_tokens=args.new_tokens,
                        repeats=args.repeats)
    env = {k: v for k, v in os.environ.items() if k != "MCSERVE_HOST_MALLOC"}
    if not on:
        env["MCSERVE_HOST_MALLOC"] = "0"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=900)
    if r.returncode:
        raise SystemExit(f"child failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--weights", default="int8", choices=["float32", "int8"])
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=7, help="timed runs per child (median)")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.quick:
        args.pairs, args.repeats, args.new_tokens = 2, 2, 8
    env = env_info()
    print(env_line(env))
    runs: dict[str, list[dict]] = {"on": [], "off": []}
    for _ in range(args.pairs):
        for side in ("on", "off"):
            runs[side].append(child(args, side == "on"))
    med = {s: {k: statistics.median(r[k] for r in v) for k in ("prefill_s", "generate_s")}
           for s, v in runs.items()}
    rows = [[s, f"{1e3 * med[s]['prefill_s']:.1f}", f"{1e3 * med[s]['generate_s']:.1f}",
             "yes" if all(r["applied"] for r in runs[s]) else "no"] for s in ("on", "off")]
    rows.append(["off / on", f"{med['off']['prefill_s'] / med['on']['prefill_s']:.2f}x",
                 f"{med['off']['generate_s'] / med['on']['generate_s']:.2f}x", ""])
    print_table(rows, ["keep_freed_memory", "16-token prefill ms", f"{args.new_tokens} tokens ms",
                       "applied"],
                title=f"one stream, {args.weights} weights, {args.threads} threads, medians of "
                      f"{args.pairs} alternating process pairs x {args.repeats} runs")
    name = args.out or ("tmp_host_malloc.json" if args.quick else "host_malloc.json")
    for p in write_json({"env": env, "args": vars(args), "runs": runs, "median": med}, name):
        print(f"wrote {p}")


if __name__ == "__main__":
    main()
