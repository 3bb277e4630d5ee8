"""Offline throughput: ``LLM.generate`` on a batch of prompts versus one request at a time.

    python bench/offline.py            # 64 prompts x 128 tokens -> 128 new tokens
    python bench/offline.py --quick    # CI smoke run (seconds)
    python bench/offline.py --compare [--llama-cpp-src DIR]   # vs llama.cpp and transformers
    python bench/offline.py --compare --rwkv7   # RWKV-7 0.1B vs the rwkv package
    python bench/offline.py --compare --families   # RWKV-7, Gated DeltaNet, Mamba2 at ~0.1B
    python bench/offline.py --compare --hybrids    # LFM2 and Granite-4.0-H at ~350M, 3 engines

The model is ``--model DIR``, else the embedded default model, else a random model of the
default model's shape. Both runs use the same engine settings except ``max_num_seqs``; the
one-at-a-time baseline is timed on ``--serial-prompts`` prompts (its per-token rate does not
depend on how many prompts it runs). Greedy, ``ignore_eos``, so every request makes exactly
``--new-tokens`` tokens. Prints a table and writes ``bench/results/offline.json``.

``--compare`` measures something else: decode throughput on the 130M Mamba2 shape (random
weights, ``bench/baselines.py``) at 1, 8 and 16 concurrent streams for mcserve (as-is, no MC),
llama.cpp's batched decode and transformers ``generate``, all in one run with the same threads,
and prints the ratios against the targets (mcserve >= 1x llama.cpp at 8 and 16 streams, >= 0.7x
at 1; >= 5x transformers at 8). Writes ``bench/results/offline_compare.json``. With ``--quick``
the model has 2 layers and a 4096 vocabulary (a smoke run, no meaningful ratio).

``--isa avx2`` runs everything as on a CPU without AVX-512 (an AVX2-only AMD EPYC, say): the
script restarts itself with mcserve's C++ kernels built for x86-64-v3 (``MCSERVE_CPU_ISA=avx2``,
``docs/cpu-kernels.md``) and torch's own kernels, oneDNN and MKL capped at AVX2
(``ATEN_CPU_CAPABILITY=avx2``, ``ONEDNN_MAX_CPU_ISA=AVX2``, ``MKL_ENABLE_INSTRUCTIONS=AVX2``). The
llama.cpp column is whatever ``llama_cpp`` imports: ``--llama-cpp-path DIR`` puts a
``pip install --target DIR`` build first on the path (bench/README.md: an AVX2-only build). The
printout and JSON say which instruction set each side ran.

``--compare --precisions`` times mcserve's weight precisions on the 130M Mamba2 shape (random
weights): float32, ``dtype="bfloat16"`` (bfloat16 weights for the large linears, float32
activations and state) and ``quantization="int8"`` (weight-only int8, one scale per output
channel), at each ``--streams`` count, plus a prefill row (prompt tokens/s of one
``--prefill-len``-token prompt), all in one run with the same threads, the runners interleaved
repeat by repeat after a warm-up run at each size (median of 5 by default); llama.cpp's f32 /
f16 / Q8_0 conversions of the same weights join when llama-cpp-python and the converter are
there (else a note says why not). Prints the CPU's features and which kernels ran; writes
``bench/results/offline_compare_precisions.json``.

``--compare --families`` times mcserve's decode on three imported ~0.1B shapes with random
weights: RWKV-7 0.1B (BlinkDL ``.pth``), a 130M-class fla Gated DeltaNet and the 130M Mamba2
(``bench/baselines.py``), at each ``--streams`` count, each with the fused C++ state step and,
for RWKV-7 and Gated DeltaNet, with the generic per-row step (``baselines.generic_step``) in the
same run. Writes ``bench/results/offline_compare_families.json``.

``--compare --hybrids`` times decode on two ~350M hybrid shapes with random weights, built and
saved by transformers' own ``save_pretrained`` (nothing downloaded; ``bench/baselines.py``):

* LFM2-350M-like (``Lfm2Config``): hidden 1024, 16 layers, attention at 2, 5, 8, 10, 12, 14 and
  gated short convs (3 taps) elsewhere, 16 heads / 8 KV heads of 64, SwiGLU of 4608
  (``intermediate_size`` 6656 through ``block_auto_adjust_ff_dim``: int(2/3 · 6656) rounded up
  to a multiple of 256), vocabulary 65536, tied embeddings;
* Granite-4.0-H-350M-like (``GraniteMoeHybridConfig``, dense: ``num_local_experts`` 0, the
  shared SwiGLU MLP of 2048 alone): hidden 768, 32 layers, attention at 10, 13, 17, 27 (no
  position embedding) and Mamba2 elsewhere (48 heads of 32, state 128, 1 group, conv 4), 12
  heads / 4 KV heads of 64, Granite's multipliers (embedding 12, attention 1/64, logits 3),
  vocabulary 100352, tied embeddings;

each with mcserve (as-is, no MC), llama.cpp's batched decode (the checkpoint converted with
``convert_hf_to_gguf.py`` from ``--llama-cpp-src`` or ``$LLAMA_CPP_SRC``, float32, no
vocabulary; a shape it cannot convert or load gets a note saying why instead of its column) and
transformers ``generate`` (greedy, every stream in one batched call: the prompts have one
length, so no padding) at each ``--streams`` count (default 1, 8, 16; transformers at every
count unless ``--tf-streams`` says otherwise), 16-token prompts and 64 greedy tokens, same
threads, one run, medians of ``--repeats``. With ``--quick`` both models have 2 layers (one of
each kind) and a 4096 vocabulary, 8 tokens at 1 and 4 streams. Writes
``bench/results/offline_compare_hybrids.json``.
"""

from __future__ import annotations

import argparse
import os
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


#: what ``--isa avx2`` sets: mcserve's C++ kernels and torch's own ISA dispatch capped at AVX2
ISA_ENV = {
    "avx2": {"MCSERVE_CPU_ISA": "avx2", "ATEN_CPU_CAPABILITY": "avx2",
             "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "native": {"MCSERVE_CPU_ISA": "native"},
}


def _restart_with_isa(isa: str) -> None:
    """Re-run this script with ``ISA_ENV[isa]`` set (torch, oneDNN and MKL read these when they
    load, which has happened by now), unless they already are."""
    env = dict(os.environ)
    if isa == "native":
        for k in ISA_ENV["avx2"]:
            env.pop(k, None)
    env.update(ISA_ENV[isa])
    if all(os.environ.get(k) == env.get(k) for k in set(env) | set(os.environ)):
        return
    os.execve(sys.executable, [sys.executable, *sys.argv], env)


def isa_info() -> dict[str, str | None]:
    """Which instruction sets this run's mcserve used: its C++ kernels' build and torch's
    dispatch (and the caps set on oneDNN and MKL)."""
    from mcserve.kernels import cpu as cpu_ops

    return {"mcserve_cpu_kernels": cpu_ops.isa(),
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "ONEDNN_MAX_CPU_ISA": os.environ.get("ONEDNN_MAX_CPU_ISA"),
            "MKL_ENABLE_INSTRUCTIONS": os.environ.get("MKL_ENABLE_INSTRUCTIONS")}


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
    cmp = ap.add_argument_group("--compare")
    cmp.add_argument("--compare", action="store_true",
                     help="mcserve vs llama.cpp vs transformers on the 130M Mamba2 shape")
    cmp.add_argument("--streams", type=int, nargs="+", default=[1, 8, 16])
    cmp.add_argument("--tf-streams", type=int, nargs="+", default=None,
                     help="stream counts at which transformers runs (it is slow; default 1 8, "
                     "with --hybrids every --streams count)")
    cmp.add_argument("--repeats", type=int, default=None,
                     help="runs per cell; the median counts (default 3; 5 with --precisions)")
    cmp.add_argument("--mc", nargs="*", default=[],
                     help="also mcserve with these post-hoc MC variants (e.g. post grm)")
    cmp.add_argument("--rwkv7", action="store_true",
                     help="instead: mcserve vs the rwkv package on the 0.1B RWKV-7 shape")
    cmp.add_argument("--precisions", action="store_true",
                     help="instead: mcserve float32 / bf16 / int8 weights (and llama.cpp f32 / "
                     "f16 / Q8_0 when available) on the 130M Mamba2 shape, with a prefill row")
    cmp.add_argument("--prefill-len", type=int, default=1024,
                     help="--precisions: prompt tokens of the prefill row")
    cmp.add_argument("--families", action="store_true",
                     help="instead: mcserve's decode on RWKV-7, Gated DeltaNet and Mamba2 at "
                     "~0.1B, fused state step vs the generic one")
    cmp.add_argument("--hybrids", action="store_true",
                     help="instead: mcserve vs llama.cpp vs transformers on LFM2-350M-like and "
                     "Granite-4.0-H-350M-like shapes")
    ap.add_argument("--isa", choices=["native", "avx2"], default=None,
                    help="avx2: restart with mcserve's kernels, torch, oneDNN and MKL limited "
                    "to AVX2 (as on a CPU without AVX-512); default: as the environment says")
    cmp.add_argument("--llama-cpp-path", default=None,
                     help="a folder holding the llama_cpp package (pip install --target DIR), "
                     "put first on sys.path: e.g. an AVX2-only build")
    cmp.add_argument("--llama-cpp-src", default=None,
                     help="llama.cpp source folder with convert_hf_to_gguf.py "
                     "(default: $LLAMA_CPP_SRC)")
    args = ap.parse_args()
    if args.repeats is None:
        args.repeats = 5 if args.precisions else 3
    if args.isa is not None:
        _restart_with_isa(args.isa)
    if args.llama_cpp_path:
        sys.path.insert(0, str(Path(args.llama_cpp_path).resolve()))
    if args.compare and args.rwkv7:
        return compare_rwkv7(args)
    if args.compare and args.families:
        return compare_families(args)
    if args.compare and args.hybrids:
        return compare_hybrids(args)
    if args.compare and args.precisions:
        return compare_precisions(args)
    if args.compare:
        return compare(args)
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
    # no ratio target: the one-at-a-time path is itself fast, so the absolute rates are what
    # to compare
    print(f"batched / one-at-a-time: {tps_b / tps_s:.1f}x ({tps_b:.0f} vs {tps_s:.0f} tokens/s)")
    write_json({"env": env, "model": eng.describe(), "args": vars(args),
                "batched": {"seconds": t_b, "tokens": n_b, "tokens_per_s": tps_b},
                "serial": {"seconds": t_s, "tokens": n_s, "tokens_per_s": tps_s},
                "speedup": tps_b / tps_s},
               "tmp_offline_quick.json" if args.quick else "offline.json", extra=args.out)


def compare(args: argparse.Namespace) -> None:
    import baselines as bl

    if args.quick:
        args.prompt_len, args.new_tokens, args.repeats = 8, 8, 1
        args.streams, args.tf_streams = [1, 4], [1, 4]
        shape = bl.MAMBA2_QUICK
    else:
        args.prompt_len, args.new_tokens = 16, 64
        shape = bl.MAMBA2_130M
        if args.tf_streams is None:
            args.tf_streams = [1, 8]
    threads = set_threads(args.threads)
    model_dir = bl.mamba2_dir(shape)
    runners: list = [bl.McserveRunner(model_dir)]
    runners += [bl.McserveRunner(model_dir, mc_variant=v, segment_len=16, state_cache_mib=8192)
                for v in args.mc]
    llama, why = bl.llama_cpp_runner(model_dir, args.llama_cpp_src, threads)
    runners += [llama] if llama is not None else []
    notes = [why] if why else []
    isa = isa_info()
    isa["llama_cpp"] = llama.system_info() if llama is not None else None
    tf = bl.TransformersRunner(model_dir)
    results, agree = [], {}
    for n in args.streams:
        ids = bl.prompts(shape["vocab_size"], n, args.prompt_len)
        for r in runners + ([tf] if n in args.tf_streams else []):
            res = r.run(ids, args.new_tokens, args.repeats)
            line = f"  {res.name:<16} streams {n:>3}: {res.tokens_per_s:8.1f} tokens/s"
            if res.name == "mcserve":
                ref = res
            else:  # the same greedy tokens as mcserve on the same weights?
                agree[(res.name, n)] = bl.agreement(ref, res)
                line += f" (tokens agreeing with mcserve: {agree[(res.name, n)]:.0%})"
            print(line, flush=True)
            results.append(res)
    by = {(r.name, r.streams): r.tokens_per_s for r in results}
    targets = {"llama.cpp": {1: 0.7, 8: 1.0, 16: 1.0}, "transformers": {8: 5.0}}
    names = [r.name for r in runners] + ["transformers"]
    rows, checks = [], []
    for n in args.streams:
        row = [n] + [f"{by[(m, n)]:.1f}" if (m, n) in by else "-" for m in names]
        for base in ("llama.cpp", "transformers"):
            if (base, n) in by:
                ratio = by[("mcserve", n)] / by[(base, n)]
                want = targets[base].get(n)
                mark = "" if want is None else (" PASS" if ratio >= want else " FAIL")
                row.append(f"{ratio:.2f}x" + mark)
                if want is not None:
                    checks.append({"baseline": base, "streams": n, "ratio": ratio,
                                   "target": want, "met": ratio >= want})
            else:
                row.append("-")
        rows.append(row)
    env = env_info()
    print(env_line(env))
    print(f"model: Mamba2 {bl.describe_shape(shape)}, float32, random weights; "
          f"{args.prompt_len}-token prompts -> {args.new_tokens} greedy tokens per stream; "
          f"{threads} threads for every implementation; median of {args.repeats}")
    print(f"instruction sets: mcserve C++ kernels {isa['mcserve_cpu_kernels']}, torch "
          f"{isa['torch_cpu_capability']} (oneDNN cap {isa['ONEDNN_MAX_CPU_ISA'] or 'none'}, MKL "
          f"cap {isa['MKL_ENABLE_INSTRUCTIONS'] or 'none'}); llama.cpp: {isa['llama_cpp']}")
    print_table(rows, ["streams"] + [f"{m} tok/s" for m in names]
                + ["mcserve / llama.cpp", "mcserve / transformers"],
                title="decode throughput, same weights, same run")
    for note in notes:
        print(note)
    write_json({"env": env, "args": vars(args), "shape": shape, "threads": threads, "isa": isa,
                "results": [r.to_json() for r in results], "targets": checks, "notes": notes,
                "agreement_with_mcserve": [{"name": k[0], "streams": k[1], "fraction": v}
                                           for k, v in agree.items()]},
               "tmp_offline_compare_quick.json" if args.quick else "offline_compare.json",
               extra=args.out)



#: the /proc/cpuinfo flags that decide which low-precision kernels a CPU can run
PRECISION_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
                   "avx_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")


def compare_precisions(args: argparse.Namespace) -> None:
    """mcserve's weight precisions (and llama.cpp's, when available) on one Mamba2 checkpoint:
    decode tokens/s at each stream count and prompt tokens/s of one long prompt, one run."""
    import statistics

    import baselines as bl

    from mcserve.kernels import cpu as cpu_ops

    if args.quick:
        args.prompt_len, args.new_tokens, args.repeats = 8, 8, 1
        args.streams, args.prefill_len = [1, 4], 128
        shape = bl.MAMBA2_QUICK
    else:
        args.prompt_len, args.new_tokens = 16, 64
        shape = bl.MAMBA2_130M
    threads = set_threads(args.threads)
    model_dir = bl.mamba2_dir(shape)
    max_len = max(args.prompt_len + args.new_tokens, args.prefill_len + 1) + 1
    kinds = {"float32": {}, "bf16": {"dtype": "bfloat16"}, "int8": {"quantization": "int8"}}
    runners: list = [bl.McserveEngineRunner(model_dir, f"mcserve {k}", max(args.streams),
                                            max_len, **kw) for k, kw in kinds.items()]
    llama, why = bl.llama_cpp_precision_runners(model_dir, args.llama_cpp_src, threads)
    runners += llama
    notes = [why] if why else []
    flags = cpu_ops.cpu_flags()
    isa = isa_info()
    isa.update(cpu_flags=[f for f in PRECISION_FLAGS if f in flags], lowp=cpu_ops.lowp_info(),
               llama_cpp=llama[0].system_info() if llama else None)
    # decode: every runner once per repeat, in turn
    secs: dict[tuple[str, int], list[float]] = {}
    outputs: dict[tuple[str, int], bl.Result] = {}
    for n in args.streams:
        ids = bl.prompts(shape["vocab_size"], n, args.prompt_len)
        for r in runners:  # warm up at this batch size (first-touch of buffers, packed copies)
            r.run(ids, 4, 1)
        for _ in range(args.repeats):
            for r in runners:
                res = r.run(ids, args.new_tokens, 1)
                secs.setdefault((r.name, n), []).extend(res.seconds)
                outputs[(r.name, n)] = res
        for r in runners:
            tps = n * args.new_tokens / statistics.median(secs[(r.name, n)])
            print(f"  {r.name:<16} streams {n:>3}: {tps:8.1f} tokens/s", flush=True)
    # prefill: one prompt of prefill_len tokens, one new token
    long = bl.prompts(shape["vocab_size"], 1, args.prefill_len, seed=1)
    pre: dict[str, list[float]] = {}
    for r in runners:
        r.run(long, 1, 1)
    for _ in range(args.repeats):
        for r in runners:
            pre.setdefault(r.name, []).extend(r.run(long, 1, 1).seconds)
    names = [r.name for r in runners]
    tps = {(m, n): n * args.new_tokens / statistics.median(secs[(m, n)])
           for m in names for n in args.streams}
    ptps = {m: args.prefill_len / statistics.median(pre[m]) for m in names}
    # greedy agreement with float32 (random weights: near-ties make any rounding diverge soon)
    agree = {(m, n): bl.agreement(outputs[("mcserve float32", n)], outputs[(m, n)])
             for m in names for n in args.streams}
    # batch invariance: every stream count starts with the same prompt; its tokens must not
    # depend on how many streams ran with it
    n0 = min(args.streams)
    invariant = {m: all(outputs[(m, n)].outputs[0] == outputs[(m, n0)].outputs[0]
                        for n in args.streams) for m in names}
    ratio_cols = [("mcserve bf16", "mcserve float32"), ("mcserve int8", "mcserve float32")]
    if llama:
        ratio_cols += [("mcserve float32", "llama.cpp F32"), ("mcserve bf16", "llama.cpp F16"),
                       ("mcserve int8", "llama.cpp Q8_0")]
    rows = []
    for n in args.streams:
        rows.append([f"decode, {n} stream{'s' if n > 1 else ''}"]
                    + [f"{tps[(m, n)]:.1f}" for m in names]
                    + [f"{tps[(a, n)] / tps[(b, n)]:.2f}x" for a, b in ratio_cols])
    rows.append([f"prefill, {args.prefill_len} tokens"] + [f"{ptps[m]:.0f}" for m in names]
                + [f"{ptps[a] / ptps[b]:.2f}x" for a, b in ratio_cols])
    env = env_info()
    print(env_line(env))
    print(f"model: Mamba2 {bl.describe_shape(shape)}, random weights; decode: "
          f"{args.prompt_len}-token prompts -> {args.new_tokens} greedy tokens per stream "
          f"(generated tokens/s of wall time, prompt included); prefill: prompt tokens/s of one "
          f"{args.prefill_len}-token prompt; {threads} threads for every implementation; "
          f"median of {args.repeats}, runners interleaved")
    print(f"CPU features: {' '.join(isa['cpu_flags']) or 'none of ' + ', '.join(PRECISION_FLAGS)}")
    lw = isa["lowp"]
    print(f"instruction sets: mcserve C++ kernels {isa['mcserve_cpu_kernels']} (int8 level "
          f"{lw.get('int8_impl')}, bf16 level {lw.get('bf16_impl')}: 0 scalar, 1 AVX2, 2 AVX-512, "
          f"3 VNNI / BF16, 4 AMX-BF16), torch {isa['torch_cpu_capability']}; "
          f"llama.cpp: {isa['llama_cpp']}")
    print_table(rows, ["", *names] + [f"{a.split()[-1]} / {b}" for a, b in ratio_cols],
                title="tokens/s by weight precision, same weights, same run")
    print("greedy tokens agreeing with mcserve float32 (random weights): "
          + ", ".join(f"{m} {n}: {agree[(m, n)]:.0%}" for m in names[1:] for n in args.streams))
    print(f"the first stream's tokens the same at {', '.join(map(str, args.streams))} streams "
          "(batch invariance): " + ", ".join(f"{m} {'yes' if invariant[m] else 'NO'}"
                                             for m in names))
    for note in notes:
        print(note)
    write_json({"env": env, "args": vars(args), "shape": shape, "threads": threads, "isa": isa,
                "batch_invariant": invariant,
                "decode": [{"name": m, "streams": n, "tokens_per_s": tps[(m, n)],
                            "seconds": secs[(m, n)], "agreement_with_float32": agree[(m, n)]}
                           for m in names for n in args.streams],
                "prefill": [{"name": m, "prompt_tokens": args.prefill_len,
                             "tokens_per_s": ptps[m], "seconds": pre[m]} for m in names],
                "notes": notes},
               "tmp_offline_compare_precisions_quick.json" if args.quick
               else "offline_compare_precisions.json", extra=args.out)


def compare_rwkv7(args: argparse.Namespace) -> None:
    """Decode throughput on the 0.1B RWKV-7 shape (random weights, BlinkDL's .pth): mcserve's
    engine (as-is, and any --mc variants) against the rwkv package's own CPU inference (fp32,
    unbatched), same file, same threads, same run."""
    import baselines as bl

    if args.quick:
        args.prompt_len, args.new_tokens, args.repeats = 8, 8, 1
        args.streams = [1, 4]
        shape = bl.RWKV7_QUICK
    else:
        args.prompt_len, args.new_tokens = 16, 64
        shape = bl.RWKV7_01B
    threads = set_threads(args.threads)
    pth = bl.rwkv7_file(shape)
    runners: list = [bl.McserveRunner(pth)]
    runners += [bl.McserveRunner(pth, mc_variant=v, segment_len=16, state_cache_mib=8192)
                for v in args.mc]
    runners.append(bl.RwkvPackageRunner(pth))
    results, agree = [], {}
    for n in args.streams:
        ids = bl.prompts(shape["vocab_size"], n, args.prompt_len)
        for r in runners:
            res = r.run(ids, args.new_tokens, args.repeats)
            line = f"  {res.name:<16} streams {n:>3}: {res.tokens_per_s:8.1f} tokens/s"
            if res.name == "mcserve":
                ref = res
            else:
                agree[(res.name, n)] = bl.agreement(ref, res)
                line += f" (tokens agreeing with mcserve: {agree[(res.name, n)]:.0%})"
            print(line, flush=True)
            results.append(res)
    by = {(r.name, r.streams): r.tokens_per_s for r in results}
    names = [r.name for r in runners]
    rows = [[n] + [f"{by[(m, n)]:.1f}" for m in names]
            + [f"{by[('mcserve', n)] / by[('rwkv package', n)]:.2f}x"] for n in args.streams]
    env = env_info()
    print(env_line(env))
    print(f"model: RWKV-7 {shape}, float32, random weights; {args.prompt_len}-token prompts -> "
          f"{args.new_tokens} greedy tokens per stream; {threads} threads for both; median of "
          f"{args.repeats}")
    print_table(rows, ["streams"] + [f"{m} tok/s" for m in names] + ["mcserve / rwkv package"],
                title="RWKV-7 decode throughput, same weights, same run")
    write_json({"env": env, "args": vars(args), "shape": shape, "threads": threads,
                "results": [r.to_json() for r in results],
                "agreement_with_mcserve": [{"name": k[0], "streams": k[1], "fraction": v}
                                           for k, v in agree.items()]},
               "tmp_offline_compare_rwkv7_quick.json" if args.quick
               else "offline_compare_rwkv7.json", extra=args.out)


def compare_families(args: argparse.Namespace) -> None:
    """Decode throughput of mcserve on RWKV-7 0.1B, a 130M-class Gated DeltaNet and the 130M
    Mamba2 (random weights, float32, no MC), fused state step and generic step, same run."""
    import baselines as bl

    if args.quick:
        args.prompt_len, args.new_tokens, args.repeats = 8, 8, 1
        args.streams = [1, 4]
        shapes = {"RWKV-7": bl.RWKV7_QUICK, "Gated DeltaNet": bl.GDN_QUICK,
                  "Mamba2": bl.MAMBA2_QUICK}
    else:
        args.prompt_len, args.new_tokens = 16, 64
        shapes = {"RWKV-7": bl.RWKV7_01B, "Gated DeltaNet": bl.GDN_130M,
                  "Mamba2": bl.MAMBA2_130M}
    threads = set_threads(args.threads)
    paths = {"RWKV-7": bl.rwkv7_file(shapes["RWKV-7"]),
             "Gated DeltaNet": bl.gated_deltanet_dir(shapes["Gated DeltaNet"]),
             "Mamba2": bl.mamba2_dir(shapes["Mamba2"])}
    results, rows = [], []
    for model, path in paths.items():
        vocab = shapes[model]["vocab_size"]
        runners = [bl.McserveRunner(path)]
        if model != "Mamba2":  # Mamba2's decode has its own fused block: no generic row
            runners.append(bl.McserveRunner(path, generic=True))
        for n in args.streams:
            ids = bl.prompts(vocab, n, args.prompt_len)
            res = [r.run(ids, args.new_tokens, args.repeats) for r in runners]
            fused = res[0].tokens_per_s
            generic = res[1].tokens_per_s if len(res) > 1 else None
            same = bl.agreement(res[0], res[1]) if len(res) > 1 else None
            print(f"  {model:<15} streams {n:>3}: {fused:8.1f} tokens/s"
                  + ("" if generic is None else
                     f" (generic step {generic:.1f}; tokens agreeing {same:.0%})"), flush=True)
            rows.append([model, n, f"{fused:.1f}", "-" if generic is None else f"{generic:.1f}",
                         "-" if generic is None else f"{fused / generic:.2f}x"])
            results += [dict(r.to_json(), model=model) for r in res]
            if same is not None:
                results[-1]["agreement_with_fused"] = same
    env = env_info()
    print(env_line(env))
    print(f"models: {', '.join(f'{m} {shapes[m]}' for m in shapes)}; float32, random weights, "
          f"no MC; {args.prompt_len}-token prompts -> {args.new_tokens} greedy tokens per "
          f"stream; {threads} threads; median of {args.repeats}")
    print_table(rows, ["model", "streams", "fused step tok/s", "generic step tok/s",
                       "fused / generic"],
                title="mcserve decode throughput by imported family, same run")
    write_json({"env": env, "args": vars(args), "shapes": shapes, "threads": threads,
                "results": results},
               "tmp_offline_compare_families_quick.json" if args.quick
               else "offline_compare_families.json", extra=args.out)


def _hybrid_summary(shape: dict) -> str:
    kinds = shape["layer_types"]
    attn = [i for i, t in enumerate(kinds) if t in ("attention", "full_attention")]
    return (f"hidden {shape['hidden_size']}, {len(kinds)} layers (attention at "
            f"{', '.join(map(str, attn))}), vocabulary {shape['vocab_size']}")


def compare_hybrids(args: argparse.Namespace) -> None:
    """Decode throughput on the LFM2-350M-like and Granite-4.0-H-350M-like shapes (random
    weights, float32): mcserve, llama.cpp and transformers on the same checkpoint, same run."""
    import gc

    import baselines as bl

    if args.quick:
        args.prompt_len, args.new_tokens, args.repeats = 8, 8, 1
        args.streams, args.tf_streams = [1, 4], [1, 4]
        shapes = {"LFM2": bl.LFM2_QUICK, "Granite-4.0-H": bl.GRANITE_H_QUICK}
    else:
        args.prompt_len, args.new_tokens = 16, 64
        shapes = {"LFM2": bl.LFM2_350M, "Granite-4.0-H": bl.GRANITE_H_350M}
    if args.tf_streams is None:
        args.tf_streams = list(args.streams)
    threads = set_threads(args.threads)
    build = {"LFM2": (bl.lfm2_dir, None),
             "Granite-4.0-H": (bl.granite_hybrid_dir, bl.GRANITE_LAYER_NAMES)}
    isa = isa_info()
    isa["llama_cpp"] = None
    names = ["mcserve", "llama.cpp", "transformers"]
    results, agree, notes, rows = [], [], [], []
    for model, shape in shapes.items():
        builder, layer_names = build[model]
        path = builder(shape)
        llama, why = bl.hybrid_llama_cpp_runner(path, args.llama_cpp_src, threads, layer_names)
        if why:
            notes.append(f"{model}: {why}")
        if llama is not None and isa["llama_cpp"] is None:
            isa["llama_cpp"] = llama.system_info()
        runners: list = [bl.McserveRunner(path)] + ([llama] if llama is not None else [])
        tf = bl.TransformersRunner(path, "AutoModelForCausalLM")
        for n in args.streams:
            ids = bl.prompts(shape["vocab_size"], n, args.prompt_len)
            by: dict[str, float] = {}
            for r in runners + ([tf] if n in args.tf_streams else []):
                try:
                    res = r.run(ids, args.new_tokens, args.repeats)
                except RuntimeError as e:  # llama_decode failing on a shape: its note, not a stop
                    if r.name == "mcserve":
                        raise
                    notes.append(f"{model}: {r.name} at {n} streams failed: {e}")
                    print(f"  {model:<14} {r.name:<13} streams {n:>3}: failed ({e})", flush=True)
                    continue
                by[r.name] = res.tokens_per_s
                line = (f"  {model:<14} {res.name:<13} streams {n:>3}: "
                        f"{res.tokens_per_s:8.1f} tokens/s")
                if res.name == "mcserve":
                    ref = res
                else:  # the same greedy tokens as mcserve on the same weights?
                    frac = bl.agreement(ref, res)
                    agree.append({"model": model, "name": res.name, "streams": n,
                                  "fraction": frac})
                    line += f" (tokens agreeing with mcserve: {frac:.0%})"
                print(line, flush=True)
                results.append(dict(res.to_json(), model=model))
            rows.append([model, n] + [f"{by[m]:.1f}" if m in by else "-" for m in names]
                        + [f"{by['mcserve'] / by[b]:.2f}x" if b in by else "-"
                           for b in ("llama.cpp", "transformers")])
        del runners, llama, tf
        gc.collect()
    env = env_info()
    print(env_line(env))
    print(f"models: {'; '.join(f'{m} {_hybrid_summary(s)}' for m, s in shapes.items())}; float32, "
          f"random weights, no MC; {args.prompt_len}-token prompts -> {args.new_tokens} greedy "
          f"tokens per stream; {threads} threads for every implementation; median of "
          f"{args.repeats}")
    print(f"instruction sets: mcserve C++ kernels {isa['mcserve_cpu_kernels']}, torch "
          f"{isa['torch_cpu_capability']}; llama.cpp: {isa['llama_cpp']}")
    print_table(rows, ["model", "streams"] + [f"{m} tok/s" for m in names]
                + ["mcserve / llama.cpp", "mcserve / transformers"],
                title="hybrid decode throughput, same weights, same run")
    for note in notes:
        print(note)
    write_json({"env": env, "args": vars(args), "shapes": shapes, "threads": threads,
                "isa": isa, "results": results, "notes": notes,
                "agreement_with_mcserve": agree},
               "tmp_offline_compare_hybrids_quick.json" if args.quick
               else "offline_compare_hybrids.json", extra=args.out)


if __name__ == "__main__":
    main()
