"""Long-prompt prefill of the MC models against the Transformer, timed round-robin in one run.

``bench/long_context.py`` times one prefill per model and length, the models one after another,
so on a machine whose speed drifts by tens of percent over minutes its prefill ratios move with
the drift. Here every round prefills one fresh prompt of each model (the order rotated each
round, so none always runs first), and the report gives each model's median and quartiles and
two ratios to the Transformer: of the medians, and the median of the rounds' own ratios.

* mcserve engines of ``long_context_runs.SHAPE`` (``grm``, ``ssc8``, ... as
  ``ENGINE_VARIANTS`` names them; prefix caching on, a fresh random prompt each round, the
  request aborted after its first token);
* the Transformer of the same width and depth (``make_transformer``: transformers' Llama, SDPA
  attention), the prompt in chunks of ``--tf-chunk`` tokens through a ``DynamicCache`` with
  only the last position's logits, as ``long_context.py``'s prefill.

    python bench/prefill_ratio.py --length 16384 --dtype bfloat16 --threads 2   # 5 rounds
    python bench/prefill_ratio.py --quick                                       # CI smoke

Prints a table and writes ``bench/results/prefill_ratio.json`` (``--quick``:
``tmp_prefill_ratio_quick.json``).
"""

from __future__ import annotations

import argparse
import gc
import inspect
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import env_info, env_line, print_table, quantile, set_threads, write_json  # noqa: E402
from long_context_runs import (  # noqa: E402
    ENGINE_VARIANTS,
    EngineRun,
    engine_config,
    make_model,
    make_transformer,
    prompt,
)

TRANSFORMER = "transformer"


def engine_prefill(name: str, length: int, dtype: str, seed: int) -> Callable[[], float]:
    """A function that prefills one fresh prompt of ``length`` on the engine of variant
    ``name`` and returns the seconds to its first token."""
    variant, top_k, _host = ENGINE_VARIANTS[name]
    segments = length // 64 + 8  # every checkpoint of one prompt, and the warm-up's
    run = EngineRun(make_model(variant, top_k, seed),
                    engine_config(1, length + 16, 2 * segments + 16, dtype=dtype))
    run.warm_up()
    count = [0]

    def once() -> float:
        count[0] += 1
        rid = f"{name}-{count[0]}"
        run.add(rid, prompt(length, 10_000 + count[0]))
        t = run.prefill([rid])
        run.engine.abort_request(rid)
        run.ntok.pop(rid)
        return t

    return once


def transformer_prefill(length: int, dtype: str, seed: int, chunk: int) -> Callable[[], float]:
    import transformers
    from transformers import DynamicCache

    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    model, cfg = make_transformer(seed, dtype)
    kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    count = [0]

    @torch.inference_mode()
    def once() -> float:
        count[0] += 1
        ids = torch.tensor([prompt(length, 10_000 + count[0])])
        cache = DynamicCache(config=cfg)
        t0 = time.perf_counter()
        for s in range(0, length, chunk):
            model(input_ids=ids[:, s:s + chunk], use_cache=True, logits_to_keep=1,
                  **{kw: cache})
        t = time.perf_counter() - t0
        del cache
        gc.collect()
        return t

    once()  # warm-up
    return once


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--length", type=int, default=16384)
    ap.add_argument("--models", nargs="+", default=["grm", "ssc8"],
                    choices=sorted(set(ENGINE_VARIANTS) - {"ssc8-host"}))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--tf-chunk", type=int, default=4096, help="transformer prefill chunk")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: all cores)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="512 tokens, 2 rounds (CI smoke)")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args(argv)
    if args.quick:
        args.length, args.rounds = 512, 2
    threads = set_threads(args.threads)
    env = env_info()
    print(env_line(env) + f"  threads {threads}", flush=True)

    fns = {name: engine_prefill(name, args.length, args.dtype, args.seed) for name in args.models}
    fns[TRANSFORMER] = transformer_prefill(args.length, args.dtype, args.seed, args.tf_chunk)
    names = list(fns)
    samples: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for n in order:
            samples[n].append(fns[n]())
        print(f"round {r + 1}: " + ", ".join(f"{n} {samples[n][-1]:.2f} s" for n in names),
              flush=True)

    tf = samples[TRANSFORMER]
    rows, out_rows = [], []
    for n in names:
        s = samples[n]
        per_round = [a / b for a, b in zip(s, tf, strict=True)]
        d = {"model": n, "seconds": s, "median_s": statistics.median(s), "min_s": min(s),
             "p25_s": quantile(s, 0.25), "p75_s": quantile(s, 0.75),
             "ratio_of_medians": statistics.median(s) / statistics.median(tf),
             "round_ratios": per_round, "median_round_ratio": statistics.median(per_round)}
        out_rows.append(d)
        rows.append([n, f"{d['median_s']:.2f}", f"{d['p25_s']:.2f}-{d['p75_s']:.2f}",
                     f"{d['ratio_of_medians']:.3f}", f"{d['median_round_ratio']:.3f}",
                     f"{min(per_round):.3f}-{max(per_round):.3f}"])
    print_table(rows, ["model", "median s", "p25-p75 s", "/ transformer (medians)",
                       "median of round ratios", "round ratios"],
                title=f"prefill of {args.length} tokens, {args.dtype}, {args.rounds} rounds "
                      f"(one prompt each, batch 1)")
    out = {"bench": "prefill_ratio", "env": env, "threads": threads, "length": args.length,
           "dtype": args.dtype, "rounds": args.rounds, "tf_chunk": args.tf_chunk,
           "rows": out_rows}
    for p in write_json(out, "tmp_prefill_ratio_quick.json" if args.quick
                        else "prefill_ratio.json", extra=args.out):
        print(f"wrote {p}")


if __name__ == "__main__":
    main()
