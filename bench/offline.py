"""Offline throughput: ``LLM.generate`` on a batch of prompts versus one request at a time.

    python bench/offline.py            # 64 prompts x 128 tokens -> 128 new tokens
    python bench/offline.py --quick    # CI smoke run (seconds)

The model is ``--model DIR``, else the embedded default model, else a random model of the
default model's shape. Both runs use the same engine settings except ``max_num_seqs``; the
one-at-a-time baseline is timed on ``--serial-prompts`` prompts (its per-token rate does not
depend on how many prompts it runs). Greedy, ``ignore_eos``, so every request makes exactly
``--new-tokens`` tokens. Prints a table and writes ``bench/results/offline.json``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import env_info, env_line, print_table, set_threads, write_json  # noqa: E402

from mcserve.config import EngineConfig, ModelConfig  # noqa: E402
from mcserve.engine.llm import LLM  # noqa: E402
from mcserve.engine.llm_engine import DEFAULT_MODEL_DIR, LLMEngine  # noqa: E402
from mcserve.engine.sampling import SamplingParams  # noqa: E402
from mcserve.engine.tokenizer import Tokenizer  # noqa: E402
from mcserve.models.native import MCForCausalLM  # noqa: E402


def build_engine(model_dir: str | None, max_num_seqs: int, max_len: int) -> LLMEngine:
    cfg = EngineConfig(model=model_dir, max_num_seqs=max_num_seqs, max_model_len=max_len,
                       max_num_batched_tokens=4096, num_state_blocks=4096)
    if model_dir or (DEFAULT_MODEL_DIR / "config.json").is_file():
        return LLMEngine(cfg)
    torch.manual_seed(0)
    model = MCForCausalLM(ModelConfig(vocab_size=4096, d_model=256, n_layers=4, n_heads=4,
                                      head_dim=64, segment_len=64, mc_variant="grm"))
    return LLMEngine(cfg, model=model, tokenizer=Tokenizer.byte_level(),
                     model_name="random-default-shape")


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[float, int]:
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    dt = time.perf_counter() - t0
    return dt, sum(len(o.outputs[0].token_ids) for o in outs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--serial-prompts", type=int, default=4)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.quick:
        args.prompts, args.prompt_len, args.new_tokens, args.serial_prompts = 8, 32, 16, 2
    threads = set_threads(args.threads)
    max_len = args.prompt_len + args.new_tokens + 1
    batched = LLM(engine=build_engine(args.model, args.prompts, max_len))
    vocab = batched.engine.model_config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (args.prompt_len,), generator=g).tolist()
               for _ in range(args.prompts)]
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    run(batched, prompts[:2], SamplingParams(max_tokens=2, ignore_eos=True))  # warm up
    t_b, n_b = run(batched, prompts, params)
    serial = LLM(engine=build_engine(args.model, 1, max_len))
    t_s, n_s = 0.0, 0
    for p in prompts[:args.serial_prompts]:
        dt, n = run(serial, [p], params)
        t_s, n_s = t_s + dt, n_s + n
    tps_b, tps_s = n_b / t_b, n_s / t_s
    eng = batched.engine
    rows = [
        ["LLM.generate, batched", args.prompts, n_b, f"{t_b:.2f}", f"{tps_b:.1f}", "1.00"],
        ["one request at a time", args.serial_prompts, n_s, f"{t_s:.2f}", f"{tps_s:.1f}",
         f"{tps_s / tps_b:.3f}"],
    ]
    env = env_info()
    print(env_line(env))
    print(f"model: {eng.describe()}")
    print_table(rows, ["run", "prompts", "new tokens", "seconds", "tokens/s", "ratio"],
                title=f"offline throughput ({args.prompt_len} -> {args.new_tokens} tokens, "
                      f"{threads} threads)")
    print(f"batched / one-at-a-time: {tps_b / tps_s:.1f}x (target >= 8x)")
    write_json({"env": env, "model": eng.describe(), "args": vars(args),
                "batched": {"seconds": t_b, "tokens": n_b, "tokens_per_s": tps_b},
                "serial": {"seconds": t_s, "tokens": n_s, "tokens_per_s": tps_s},
                "speedup": tps_b / tps_s},
               "tmp_offline_quick.json" if args.quick else "offline.json", extra=args.out)


if __name__ == "__main__":
    main()
