"""Constrained decoding cost: decode throughput at N streams (default 16) on the CPU (or
``--device cuda``), the same requests with a JSON schema (structured outputs) and without, in
one run.

    python bench/structured.py                # 16 streams x 128 tokens, 9 rounds of each
    python bench/structured.py --quick        # smoke run (seconds): tmp_structured.json

Every request is greedy with ``ignore_eos`` and ``max_tokens = --new-tokens``; the schema is an
array of at least 1000 records (an id, a name, a tag from an enum, a score), so a constrained
request never completes before its ``max_tokens`` and both sides generate exactly the same
number of tokens, through every kind of JSON state (structure, keys, numbers, strings, enums).
A round adds the N requests, steps the engine until each has its first token (the prefill),
then times the steps that decode the rest: tokens/s = decoded tokens / that time. Rounds of
the two kinds alternate (their ratio is steadier under a drifting load) and medians are
reported: the ratio is the median over the repeats of each constrained round's rate against
the plain round just before it (a drift in the machine's speed cancels within a pair), with the
time llguidance spends filling the batch's bitmasks per step (one call per step) and the time to
compile the schema once (later requests hit the cache).

The model is ``--model DIR``, else the embedded default model (4.8M parameters, a 4,096-token
vocabulary: a 5 ms step, the hardest case for the mask); ``--model mamba2-130m`` is the 130M
Mamba2 shape with random weights and a 50,288-token byte-level BPE vocabulary trained on the
standard library's sources (``baselines.mamba2_bpe_dir``, built on first use), the size of model
and vocabulary people serve. Target (printed, not asserted): the mask costs <= 10% of decode
throughput at 16 streams. Writes ``bench/results/structured.json`` (``structured_<model>.json``
for a named model, ``tmp_structured.json`` with ``--quick``; ``--out PATH`` elsewhere).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from baselines import mamba2_bpe_dir  # noqa: E402
from common import env_info, env_line, print_table, set_threads, write_json  # noqa: E402

from mcserve.config import EngineConfig  # noqa: E402
from mcserve.engine.llm_engine import LLMEngine  # noqa: E402
from mcserve.engine.sampling import SamplingParams  # noqa: E402
from mcserve.engine.sampling_params import StructuredOutputsParams  # noqa: E402

SCHEMA: dict[str, Any] = {
    "type": "array", "minItems": 1000,
    "items": {"type": "object", "additionalProperties": False,
              "required": ["id", "name", "tag", "score"],
              "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99999},
                             "name": {"type": "string", "maxLength": 16},
                             "tag": {"enum": ["alpha", "beta", "gamma", "delta"]},
                             "score": {"type": "number", "minimum": 0, "maximum": 100,
                                       "multipleOf": 0.01}}}}
PROMPTS = ["Records as JSON:", "The inventory:", "Here is the list of users", "Data dump",
           "It is a truth universally acknowledged", "The Python documentation says",
           "Output:", "Results of the survey"]
TARGET_COST = 0.10
#: ``--model`` names: random-weight checkpoints built on first use (bench/baselines.py)
NAMED_MODELS = {"mamba2-130m": mamba2_bpe_dir}


def run_round(engine: LLMEngine, streams: int, new_tokens: int, constrained: bool,
              tag: str) -> dict[str, Any]:
    """One round of ``streams`` requests; the decode phase timed."""
    so = {"json": SCHEMA} if constrained else None
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True,
                            structured_outputs=so)
    ids = [f"{tag}-{i}" for i in range(streams)]
    for i, rid in enumerate(ids):
        engine.add_request(rid, PROMPTS[i % len(PROMPTS)] + f" #{i}", params)
    produced: dict[str, int] = dict.fromkeys(ids, 0)
    while not all(produced.values()):  # prefill: every request gets its first token
        for out in engine.step():
            assert out.error is None, out.error
            produced[out.request_id] = len(out.outputs[0].token_ids)
    before = sum(produced.values())
    fill_time = [0.0]
    fill_calls = [0]
    structured = engine.structured if constrained else None
    original = structured.fill if structured is not None else None
    if structured is not None:
        def timed_fill(matchers: list) -> Any:
            t = time.perf_counter()
            try:
                return original(matchers)  # type: ignore[misc]
            finally:
                fill_time[0] += time.perf_counter() - t
                fill_calls[0] += 1
        structured.fill = timed_fill  # type: ignore[method-assign]
    steps = 0
    t0 = time.perf_counter()
    try:
        while engine.has_unfinished_requests():
            for out in engine.step():
                assert out.error is None, out.error
                produced[out.request_id] = len(out.outputs[0].token_ids)
            steps += 1
    finally:
        if structured is not None:
            del structured.fill
    dt = time.perf_counter() - t0
    decoded = sum(produced.values()) - before
    assert sum(produced.values()) == streams * new_tokens, produced
    return {"tokens": decoded, "seconds": dt, "tokens_per_s": decoded / dt, "steps": steps,
            "fill_ms_per_step": 1e3 * fill_time[0] / fill_calls[0] if fill_calls[0] else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint directory, or mamba2-130m "
                    "(default: the embedded default model)")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=9, help="rounds of each kind")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    ap.add_argument("--device", default="cpu", help="the engine's device (default: cpu)")
    ap.add_argument("--quick", action="store_true", help="32 tokens, 2 rounds of each")
    ap.add_argument("--out", default=None, help="JSON path (default: bench/results/...)")
    args = ap.parse_args()
    if args.quick:
        args.new_tokens, args.repeats = 32, 2
    threads = set_threads(args.threads)
    env = env_info()
    print(env_line(env))
    named = args.model if args.model in NAMED_MODELS else None
    model = str(NAMED_MODELS[named]()) if named else args.model
    engine = LLMEngine(EngineConfig(model=model, max_num_seqs=args.streams,
                                    max_model_len=max(512, args.new_tokens + 64),
                                    device=args.device))
    t = time.perf_counter()
    engine.compile_structured(StructuredOutputsParams(json=SCHEMA))
    compile_s = time.perf_counter() - t
    # warm-up: kernels, caches and the allocator, both kinds
    for kind in (False, True):
        run_round(engine, args.streams, min(args.new_tokens, 16), kind, f"warm-{kind}")
    rounds: dict[str, list[dict[str, Any]]] = {"plain": [], "constrained": []}
    for r in range(args.repeats):
        for kind in ("plain", "constrained"):
            rounds[kind].append(run_round(engine, args.streams, args.new_tokens,
                                          kind == "constrained", f"{kind}-{r}"))
    med = {k: statistics.median(x["tokens_per_s"] for x in v) for k, v in rounds.items()}
    fills = [x["fill_ms_per_step"] for x in rounds["constrained"] if x["fill_ms_per_step"]]
    fill_ms = statistics.median(fills) if fills else None
    step_ms = {k: statistics.median(1e3 * x["seconds"] / x["steps"] for x in v)
               for k, v in rounds.items()}
    pairs = [c["tokens_per_s"] / p["tokens_per_s"]
             for p, c in zip(rounds["plain"], rounds["constrained"], strict=True)]
    ratio = statistics.median(pairs)
    rows = [[k, f"{med[k]:.0f}", f"{step_ms[k]:.2f}",
             f"{fill_ms:.3f}" if k == "constrained" and fill_ms is not None else "-",
             f"{min(x['tokens_per_s'] for x in rounds[k]):.0f}–"
             f"{max(x['tokens_per_s'] for x in rounds[k]):.0f}"] for k in rounds]
    print_table(rows, ["decode", "tokens/s (median)", "ms per step", "bitmask fill ms/step",
                       "range"],
                title=f"{named or args.model or 'default model'}: "
                      f"{args.streams} streams x {args.new_tokens} tokens, greedy, "
                      f"{args.repeats} rounds each, {args.device}, {threads} thread(s); "
                      f"schema compiled once in {compile_s * 1e3:.1f} ms")
    cost = 1 - ratio
    ok = cost <= TARGET_COST
    print("\nTargets (printed, not asserted):")
    print(f"  {'PASS' if ok else 'FAIL'}: constrained decode at {ratio:.1%} of plain "
          f"(median of {len(pairs)} paired rounds, {min(pairs):.1%}-{max(pairs):.1%}; mask cost "
          f"{cost:.1%}, target <= {TARGET_COST:.0%})")
    data = {
        "env": env,
        "args": vars(args),
        "model": {"name": named or args.model or "default", "dir": model,
                  "vocab_size": engine.model_config.vocab_size},
        "schema": SCHEMA,
        "compile_ms": compile_s * 1e3,
        "rounds": rounds,
        "median_tokens_per_s": med,
        "median_ms_per_step": step_ms,
        "bitmask_fill_ms_per_step": fill_ms,
        "paired_ratios": pairs,
        "ratio": ratio,
        "targets": [{"name": "mask cost <= 10% of decode throughput", "value": cost,
                     "pass": ok}],
    }
    name = args.out or ("tmp_structured.json" if args.quick else
                        f"structured_{named}.json" if named else "structured.json")
    for p in write_json(data, name):
        print(f"wrote {p}")


if __name__ == "__main__":
    main()
