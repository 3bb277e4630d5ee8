"""Decode-step time: the ragged eager step, the static (padded) eager step, and CUDA graphs.

    python bench/decode_step.py                  # batches 1 8 32 on CUDA if present, else CPU
    python bench/decode_step.py --quick          # seconds (CI smoke run)
    python bench/decode_step.py --device cpu --batch 3 8 --context 200

B sequences with ``--context``-token prompts are prefilled, then every step decodes one token for
each; steps are timed per mode in interleaved rounds (the contexts grow by one token a step in
every mode alike; modes take turns step by step, so background load hits them alike; medians)
around ``ModelRunner.decode`` (synchronised on CUDA) and around the whole ``LLMEngine.step``
(scheduler and sampler included). Modes: ``ragged`` (the eager step at the
batch's own shape), ``static`` (padded to the bucket, run eagerly: what the graphs capture) and,
on CUDA, ``graph`` (replays). The model is ``--model DIR``, else the embedded default model,
else a random model of the default model's shape. Writes ``bench/results/decode_step.json``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import env_info, env_line, print_table, set_threads, write_json  # noqa: E402

from mcserve.config import EngineConfig, ModelConfig  # noqa: E402
from mcserve.engine.llm_engine import DEFAULT_MODEL_DIR, LLMEngine  # noqa: E402
from mcserve.engine.sampling import SamplingParams  # noqa: E402
from mcserve.engine.tokenizer import Tokenizer  # noqa: E402
from mcserve.models.native import MCForCausalLM  # noqa: E402


def build_engine(args, batch: int, device: str) -> LLMEngine:
    cfg = EngineConfig(model=args.model, max_num_seqs=max(batch, args.max_num_seqs),
                       device=device,
                       max_model_len=args.context + args.steps * 3 + 32,
                       max_num_batched_tokens=max(4096, batch * args.context),
                       enforce_eager=device != "cuda")
    if args.model or (DEFAULT_MODEL_DIR / "config.json").is_file():
        return LLMEngine(cfg)
    torch.manual_seed(0)
    shape = (dict(vocab_size=512, d_model=64, n_layers=2, n_heads=2, head_dim=32,
                  segment_len=16) if args.quick else
             dict(vocab_size=4096, d_model=256, n_layers=4, n_heads=4, head_dim=64,
                  segment_len=64))
    model = MCForCausalLM(ModelConfig(**shape, mc_variant=args.variant)).to(device)
    return LLMEngine(cfg, model=model, tokenizer=Tokenizer.byte_level(),
                     model_name="random-default-shape")


def measure(args, batch: int, device: str) -> dict[str, dict[str, float]]:
    eng = build_engine(args, batch, device)
    runner = eng.runner
    graphs = runner.graphs
    modes = {"ragged": (False, None), "static": (True, None)}
    if graphs is not None:
        modes["graph"] = (True, graphs)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    vocab = eng.model_config.vocab_size
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        eng.add_request(str(i), None, params,
                        prompt_token_ids=torch.randint(0, vocab, (args.context,),
                                                       generator=g).tolist())
    while any(s.is_prefill for s in eng.scheduler.running) or eng.scheduler.waiting:
        eng.step()
    times: dict[str, dict[str, list[float]]] = {m: {"decode": [], "step": []} for m in modes}
    real = runner.decode

    def timed(items):
        sync()
        t0 = time.perf_counter()
        out = real(items)
        sync()
        cur["decode"].append(time.perf_counter() - t0)
        return out

    runner.decode = timed
    names = list(modes)
    warm = 8 * len(names)  # first steps page in pools and JIT oneDNN kernels
    for i in range(warm + args.steps * len(names)):  # modes take turns step by step
        name = names[i % len(names)]
        runner.static_decode, runner.graphs = modes[name]
        cur = {"decode": [], "step": []}
        sync()
        t0 = time.perf_counter()
        eng.step()
        sync()
        cur["step"].append(time.perf_counter() - t0)
        if i >= warm:
            for k in cur:
                times[name][k] += cur[k]
    runner.decode = real
    for i in range(batch):
        eng.abort_request(str(i))
    return {m: {k: statistics.median(v) for k, v in d.items()} for m, d in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default=None, help="cuda when available, else cpu")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--max-num-seqs", type=int, default=32,
                    help="slots, hence batch buckets: a batch pads to the next bucket")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--variant", default="grm", help="MC variant of the random model")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.quick:
        args.batch, args.context, args.steps = [3], 40, 10
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    set_threads(args.threads)
    env = env_info()
    print(env_line(env))
    if device != "cuda":
        print("CUDA graphs: needs CUDA (none visible to torch); timing the eager steps only")
    rows, results = [], {}
    for B in args.batch:
        res = measure(args, B, device)
        results[B] = res
        base = res["ragged"]["decode"]
        for mode, t in res.items():
            rows.append([B, mode, f"{t['decode'] * 1e3:.2f}", f"{t['step'] * 1e3:.2f}",
                         f"{base / t['decode']:.2f}"])
    print_table(rows, ["batch", "mode", "decode ms", "engine step ms", "speed-up"],
                title=f"decode step on {device} (context {args.context})")
    write_json({"env": env, "device": device, "args": vars(args), "results": results},
               args.out or "decode_step.json")


if __name__ == "__main__":
    main()
