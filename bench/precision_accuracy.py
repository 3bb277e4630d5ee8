"""Accuracy of mcserve's weight precisions on a trained model: perplexity and greedy agreement.

    python bench/precision_accuracy.py            # the embedded default model
    python bench/precision_accuracy.py --quick    # smoke run (seconds)
    python bench/precision_accuracy.py --model DIR --data FILE.txt

For float32, ``dtype="bfloat16"`` (bfloat16 weights for the large linears, float32 elsewhere)
and ``quantization="int8"`` (weight-only int8, one scale per output channel), all on the CPU as
the engine applies them (``mcserve/models/lowp_linear.py``):

* perplexity of each held-out text in ``--length``-token windows (``mcserve eval ppl``'s
  evaluation, the model as is); the texts: the Python language reference's topics (the stdlib's
  ``pydoc_data``; in the default model's domain, which trained on the Python docs with a held-out
  split) and mcserve's own ``docs/*.md`` (never seen in training), or ``--data``;
* greedy agreement with float32 through the engine (decode kernels included): ``--prompts``
  prompts of 32 tokens cut from the texts, ``--new-tokens`` greedy tokens each, all in one batch;
  the fraction of prompts whose tokens are identical and of tokens before the first divergence;
* batch invariance: the first 8 prompts again one at a time; their tokens must equal the batch's.

Prints a table and writes ``bench/results/precision_accuracy.json``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import env_info, env_line, print_table, set_threads, write_json  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PRECISIONS = {"float32": {}, "bf16": {"dtype": "bfloat16"}, "int8": {"quantization": "int8"}}


def texts(data: str | None) -> dict[str, str]:
    if data:
        return {Path(data).name: Path(data).read_text(encoding="utf-8")}
    import pydoc_data.topics as topics

    return {"python-reference": "\n\n".join(topics.topics[k] for k in sorted(topics.topics)),
            "mcserve-docs": "\n\n".join(p.read_text(encoding="utf-8")
                                        for p in sorted((ROOT / "docs").glob("*.md")))}


def perplexities(model_dir: str | None, corpus: dict[str, str], length: int, windows: int
                 ) -> dict[str, dict[str, float]]:
    from mcserve.engine.llm_engine import DEFAULT_MODEL_DIR
    from mcserve.eval.common import load, parse_settings
    from mcserve.eval.ppl import evaluate_ppl

    out: dict[str, dict[str, float]] = {}
    for name, kw in PRECISIONS.items():
        model, tok = load(model_dir or DEFAULT_MODEL_DIR, **kw)
        for tname, text in corpus.items():
            ids = tok.encode(text)
            rep = evaluate_ppl(model, ids, [length], parse_settings("", length, with_reset=False),
                               max_windows=windows, show_progress=False)
            out.setdefault(tname, {})[name] = rep["results"][0]["ppl"]
    return out


def prefix_agreement(a: list[list[int]], b: list[list[int]]) -> tuple[float, float]:
    """(prompts with identical tokens, tokens before each prompt's first divergence / all)."""
    same = prefix = total = 0
    for x, y in zip(a, b, strict=True):
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        same += x == y
        prefix += n
        total += len(x)
    return same / max(1, len(a)), prefix / max(1, total)


def generations(model_dir: str | None, prompts: list[list[int]], new_tokens: int
                ) -> dict[str, dict[str, list[list[int]]]]:
    from mcserve.engine.llm import LLM
    from mcserve.engine.sampling import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    out = {}
    for name, kw in PRECISIONS.items():
        llm = LLM(model_dir, max_num_seqs=len(prompts), enable_prefix_caching=False, **kw)
        batch = [list(o.outputs[0].token_ids)
                 for o in llm.generate(prompts, params, use_tqdm=False)]
        alone = [list(llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids)
                 for p in prompts[:8]]
        out[name] = {"batch": batch, "alone": alone}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint (default: the embedded model)")
    ap.add_argument("--data", default=None, help="one held-out text file instead of the two")
    ap.add_argument("--length", type=int, default=512, help="perplexity window (tokens)")
    ap.add_argument("--windows", type=int, default=64, help="windows per text at most")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.quick:
        args.length, args.windows, args.prompts, args.new_tokens = 128, 2, 8, 8
    threads = set_threads(args.threads)
    corpus = texts(args.data)
    ppl = perplexities(args.model, corpus, args.length, args.windows)
    # prompts: 32-token pieces spread evenly over the texts
    from mcserve.engine.llm import LLM

    tok = LLM(args.model).engine.tokenizer
    pool = [i for t in corpus.values() for i in tok.encode(t)]
    step = max(32, (len(pool) - 32) // args.prompts)
    prompts = [pool[i:i + 32] for i in range(0, len(pool) - 32, step)][:args.prompts]
    gens = generations(args.model, prompts, args.new_tokens)
    ref = gens["float32"]["batch"]
    rows, report = [], {}
    for name in PRECISIONS:
        same, prefix = prefix_agreement(ref, gens[name]["batch"])
        invariant = gens[name]["alone"] == gens[name]["batch"][:len(gens[name]["alone"])]
        ppls = {t: ppl[t][name] for t in corpus}
        rows.append([name] + [f"{ppls[t]:.3f} ({ppls[t] / ppl[t]['float32'] - 1:+.2%})"
                              for t in corpus]
                    + [f"{same:.0%}", f"{prefix:.1%}", "yes" if invariant else "NO"])
        report[name] = {"ppl": ppls, "identical_prompts": same, "tokens_before_divergence":
                        prefix, "batch_invariant": invariant}
    env = env_info()
    print(env_line(env))
    print(f"model: {args.model or 'the embedded default model'}; perplexity in {args.length}-token "
          f"windows (at most {args.windows} per text); greedy: {len(prompts)} prompts of 32 "
          f"tokens -> {args.new_tokens} tokens, one batch; {threads} threads")
    print_table(rows, ["weights", *[f"ppl {t} (vs float32)" for t in corpus],
                       "prompts identical to float32", "tokens before divergence",
                       "batch-invariant (8 alone)"],
                title="accuracy by weight precision")
    write_json({"env": env, "args": vars(args), "texts": list(corpus), "results": report},
               "tmp_precision_accuracy_quick.json" if args.quick
               else "precision_accuracy.json", extra=args.out)


if __name__ == "__main__":
    main()
