"""The GPU comparisons of "a GPU decode step that keeps the GPU busy", all in one run on one card.

Every number is printed as a ratio against a baseline timed in the same run (same card, same
minutes) and, for decode, as a fraction of the bandwidth floor: the bytes one step must at least
move divided by the card's bandwidth, both the nominal one (``--bandwidth-tbs``, default by card
name) and a device-to-device copy measured at the start of the run.

1. **Mamba2, the 130M shape** (``bench/baselines.py``: hidden 768, 24 layers, 24 heads × 64,
   state 128, vocab 50288; random weights, seed 0): every stream a 16-token prompt then 64 greedy
   tokens. mcserve ``LLM(dir, device="cuda")`` at 1, 16, 64, 256 streams (one engine per dtype,
   sized for the most streams) in float32 and bfloat16, against transformers'
   ``Mamba2ForCausalLM.generate`` (eager, its torch path unless ``mamba_ssm``/``causal_conv1d``
   are installed: the JSON says which) at the same streams, a row skipped when its estimated time
   exceeds ``--tf-row-cap-s``. Decode tokens/s = streams / the median decode step (mcserve: one
   ``engine.step()`` once every stream is prefilled; transformers: the gap between two tokens
   of ``generate``, timed by a streamer that synchronises). Floor per step = (weight bytes + 2 ×
   state bytes per stream × streams) / bandwidth (the state is read and written once).
2. **Long context**, the default model's shape (d 256, 4 layers, 4 heads × 64, segments of 64,
   vocab 4096; float32, random weights), ``--lc-length`` (32K) tokens: prefill seconds of
   mcserve ``grm``, ``ssc`` top 8 and ``none`` (``LLMEngine``, chunked prefill) against
   transformers ``LlamaForCausalLM`` of the same width with SDPA (prefilled in chunks of
   ``--tf-chunk`` as ``bench/long_context.py`` does), then decode tokens/s at batch 1 against
   the Transformer continuing with a ``StaticCache`` (eager; ``--tf-compile`` also times
   transformers' own compiled static-cache decode). Everything is warmed up by one untimed
   prefill first (Triton and cuBLAS compile on first use). The models, prompts, engine
   configuration and cache copy come from ``bench/long_context_runs.py``.
3. **CUDA graphs**: the Mamba2 float32 decode step with ``EngineConfig.enforce_eager=True``
   against the default (graphs captured at start-up), when the field exists.
4. **Profile**: one stream of that Mamba2 under ``torch.profiler``, eager and with graphs:
   kernels and host launch calls per decode step, and the card's busy fraction of the step.
5. **Hybrids**: LFM2-350M-like and Granite-4.0-H-350M-like (``bench/baselines.py``, random
   weights) decode tokens/s at ``--streams`` in float32, with the static step's CUDA graphs
   (the KV table in them) and the start-up they cost.

Targets (printed PASS/FAIL, never asserted): Mamba2-130M float32 at 1 stream >= 1000 tokens/s;
at 256 streams >= 30% of the floor; 32K prefill of grm and ssc8 <= 2x the SDPA Transformer's;
32K ssc8 decode at batch 1 >= 10x the static-cache Transformer's.

    python bench/gpu.py                          # on a CUDA card: bench/results/gpu.json
    python bench/gpu.py --time-budget-s 200      # skip the remaining rows after 200 s
    python bench/gpu.py --quick                  # tiny sizes (tmp_gpu_quick.json)
    python bench/gpu.py --device cpu --quick     # CPU smoke of every code path (seconds)

Each section is guarded: a failure prints one line (and goes into the JSON) and the next section
runs. The JSON is rewritten after each section (``"partial": true`` until the end), so a run cut
off by a timeout keeps what it measured.

The sections are in ``bench/gpu_sections.py``, the plumbing they share (budget, bandwidth,
decode runners) in ``bench/gpu_runs.py``; this script parses the arguments, runs the sections
and prints the report and the targets.
"""

from __future__ import annotations

import argparse
import shlex
import signal
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import baselines as bl  # noqa: E402
from common import env_info, env_line, print_table, set_threads, write_json  # noqa: E402
from gpu_runs import (  # noqa: E402
    Budget,
    card_info,
    copy_bandwidth,
    nominal_tbs,
    num,
    pct,
    release,
    versions,
)
from gpu_sections import (  # noqa: E402
    graphs_section,
    hybrid_section,
    long_context_section,
    mamba2_section,
    profile_section,
)

# targets (printed, not asserted)
MAMBA2_B1_TOKS = 1000.0  # Mamba2-130M float32, 1 stream, decode tokens/s
MAMBA2_FLOOR_FRAC = 0.30  # 256 streams: floor step time / measured step time
PREFILL_RATIO = 2.0  # 32K prefill, mcserve grm/ssc8 seconds / SDPA Transformer seconds
SSC_DECODE_RATIO = 10.0  # 32K decode at batch 1, ssc8 tokens/s / static-cache Transformer's

# --quick: the 130M Mamba2's layout (heads of 64, one group, conv 4) at a width and depth that a
# CPU smoke run builds and runs in seconds
MAMBA2_TINY: dict[str, Any] = dict(bl.MAMBA2_130M, hidden_size=256, num_heads=8, state_size=32,
                                   num_hidden_layers=2, vocab_size=4096)


# --------------------------------------------------------------------------- report


def report_mamba2(res: dict, args) -> None:
    rows = res.get("rows", [])
    tf = {(r["dtype"], r["streams"]): r for r in rows if r["impl"] == "transformers"}
    out = []
    for r in rows:
        if r["impl"] != "mcserve":
            continue
        t = tf.get((r["dtype"], r["streams"]))
        out.append([r["dtype"], r["streams"], num(r["decode_tokens_per_s"]),
                    f"{r['step_s_median'] * 1e3:.3f}", pct(r.get("floor_frac_nominal")),
                    pct(r.get("floor_frac_copy")),
                    "-" if t is None else num(t["decode_tokens_per_s"]),
                    "-" if t is None else pct(t.get("floor_frac_copy")),
                    "-" if "vs_transformers" not in r else f"{r['vs_transformers']:.2f}x",
                    "-" if "agreement_with_transformers" not in r
                    else f"{r['agreement_with_transformers']:.0%}"])
    shape = res.get("shape", {})
    print_table(out, ["dtype", "streams", "mcserve tok/s", "step ms", "% floor (nominal)",
                      "% floor (copy)", "transformers tok/s", "tf % floor (copy)",
                      "mcserve / tf", "same tokens"],
                title=f"Mamba2 {bl.describe_shape(shape) if shape else ''}: decode tokens/s "
                      f"(streams / median step), {args.prompt_len}-token prompts -> "
                      f"{args.new_tokens} greedy tokens")


def report_long_context(res: dict) -> None:
    out = [[r["model"], f"{r['prefill_s']:.3f}",
            "-" if "prefill_vs_transformer" not in r else f"{r['prefill_vs_transformer']:.2f}x",
            num(r["tokens_per_s"]), f"{r['step_s_median'] * 1e3:.3f}",
            "-" if "decode_vs_transformer_static" not in r
            else f"{r['decode_vs_transformer_static']:.2f}x",
            pct(r.get("floor_frac_nominal")), pct(r.get("floor_frac_copy"))]
           for r in res.get("rows", [])]
    print_table(out, ["model", "prefill s", "prefill / tf", "decode tok/s (B=1)", "step ms",
                      "decode / tf-static", "% floor (nominal)", "% floor (copy)"],
                title=f"Long context, {res.get('length')} tokens (default-model shape, float32, "
                      f"batch 1)")


# --------------------------------------------------------------------------- targets


def targets(data: dict, args) -> list[dict]:
    out: list[dict] = []

    def add(target: str, measured: float | None, limit: str, ok: bool | None) -> None:
        out.append({"target": target, "measured": measured, "limit": limit, "pass": ok})

    m = {(r["impl"], r["dtype"], r["streams"]): r for r in data.get("mamba2", {}).get("rows", [])}
    r = m.get(("mcserve", "float32", 1))
    x = r["decode_tokens_per_s"] if r else None
    add("Mamba2-130M fp32 decode, 1 stream (tok/s)", x, f">= {MAMBA2_B1_TOKS:.0f}",
        None if x is None else x >= MAMBA2_B1_TOKS)
    big = max(args.streams)
    for dtype in ("float32", "bfloat16"):
        r = m.get(("mcserve", dtype, big))
        for key in ("nominal", "copy"):
            x = r.get(f"floor_frac_{key}") if r else None
            add(f"Mamba2-130M {dtype}, {big} streams: floor / step ({key} bandwidth)", x,
                f">= {MAMBA2_FLOOR_FRAC:.2f}", None if x is None else x >= MAMBA2_FLOOR_FRAC)
    lcr = data.get("long_context", {})
    by = {r["model"]: r for r in lcr.get("rows", [])}
    L = lcr.get("length", 32768)
    for name in ("grm", "ssc8"):
        x = by.get(name, {}).get("prefill_vs_transformer")
        add(f"{L}-token prefill, {name} / SDPA Transformer (seconds)", x,
            f"<= {PREFILL_RATIO:.1f}", None if x is None else x <= PREFILL_RATIO)
    x = by.get("ssc8", {}).get("decode_vs_transformer_static")
    add(f"{L}-token ssc8 decode B=1 / static-cache Transformer (tok/s)", x,
        f">= {SSC_DECODE_RATIO:.0f}", None if x is None else x >= SSC_DECODE_RATIO)
    rows = [[t["target"], num(t["measured"], ".2f"), t["limit"],
             {True: "PASS", False: "FAIL", None: "not measured"}[t["pass"]]] for t in out]
    print_table(rows, ["target", "measured", "limit", ""], align="lrrl",
                title="Targets (printed, not asserted)" + (
                    " -- --quick: tiny sizes, not the targets' workloads" if args.quick else ""))
    return out


# --------------------------------------------------------------------------- main


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu (with --quick)")
    ap.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run)")
    ap.add_argument("--time-budget-s", type=float, default=300.0,
                    help="skip the rows not started after this many seconds")
    ap.add_argument("--bandwidth-tbs", type=float, default=None,
                    help="nominal bandwidth in TB/s (default by card name: H100 3.35, H200 4.8)")
    ap.add_argument("--copy-mib", type=int, default=None, help="copy-bandwidth size (1024)")
    ap.add_argument("--sections", nargs="+",
                    default=["mamba2", "long_context", "graphs", "profile", "hybrid"],
                    choices=["mamba2", "long_context", "graphs", "profile", "hybrid"])
    ap.add_argument("--streams", type=int, nargs="+", default=None, help="1 16 64 256")
    ap.add_argument("--tf-streams", type=int, nargs="+", default=None, help="1 16 64 256")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"],
                    choices=["float32", "bfloat16"])
    ap.add_argument("--prompt-len", type=int, default=None, help="16")
    ap.add_argument("--new-tokens", type=int, default=None, help="64")
    ap.add_argument("--repeats", type=int, default=None, help="timed runs per row (3)")
    ap.add_argument("--tf-row-cap-s", type=float, default=60.0,
                    help="skip a transformers Mamba2 row estimated to take longer")
    ap.add_argument("--lc-length", type=int, default=None, help="long-context tokens (32768)")
    ap.add_argument("--lc-steps", type=int, default=None, help="timed decode steps (16)")
    ap.add_argument("--lc-warmup", type=int, default=None, help="untimed decode steps (3)")
    ap.add_argument("--tf-chunk", type=int, default=None, help="Transformer prefill chunk (4096)")
    ap.add_argument("--tf-compile", action="store_true",
                    help="also time transformers' compiled static-cache decode (compiles: slow)")
    ap.add_argument("--profile-steps", type=int, default=None,
                    help="decode steps profiled per mode (16)")
    ap.add_argument("--graph-streams", type=int, nargs="+", default=None, help="1 64")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args(argv)
    q = args.quick
    defaults = dict(streams=[1, 4] if q else [1, 16, 64, 256],
                    tf_streams=[1, 4] if q else [1, 16, 64, 256],
                    prompt_len=8 if q else 16, new_tokens=8 if q else 64,
                    repeats=1 if q else 3, lc_length=256 if q else 32768,
                    lc_steps=4 if q else 16, lc_warmup=1 if q else 3,
                    tf_chunk=128 if q else 4096, graph_streams=[1, 4] if q else [1, 64],
                    profile_steps=4 if q else 16,
                    copy_mib=8 if q else 1024)
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.streams = sorted(set(args.streams))
    args.tf_streams = sorted(set(args.tf_streams))
    args.m_shape = MAMBA2_TINY if q else bl.MAMBA2_130M
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("bench/gpu.py needs CUDA: no CUDA device is visible to torch; nothing to time "
              "(--device cpu --quick runs the code paths on the CPU).")
        return 0
    if dev.type != "cuda" and not args.quick:
        print(f"bench/gpu.py needs CUDA for its measurements ({args.device} given); "
              "--device cpu --quick runs the code paths at tiny sizes.")
        return 0
    # a caller's `timeout -s INT` must reach guarded() as KeyboardInterrupt even when the shell
    # started us with SIGINT ignored (non-interactive background jobs)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    threads = set_threads(args.threads)
    budget = Budget(args.time_budget_s)
    env = env_info()
    card = card_info(dev)
    command = shlex.join([Path(sys.executable).name] + sys.argv) if argv is None else \
        shlex.join(["python", "bench/gpu.py"] + argv)
    data: dict[str, Any] = {"bench": "gpu", "partial": True, "env": env, "card": card,
                            "versions": versions(), "command": command}
    print(env_line(env))
    print(f"card: {card}; {data['versions']}; {threads} threads")
    print(f"command: {command}", flush=True)
    name = "tmp_gpu_quick.json" if args.quick else "gpu.json"

    def save() -> list[Path]:
        data["skipped"], data["seconds"] = budget.skipped, budget.elapsed()
        return write_json(data, name, extra=args.out)

    errors: list[str] = data.setdefault("errors", [])
    stopped: list[str] = []  # set by an interrupt: the sections after it do not start

    def guarded(section: str, fn: Callable[[], None]) -> None:
        if stopped:
            budget.skipped.append(f"{section} (after the interrupt)")
            return
        print(f"\n== {section} [{budget.elapsed():.0f} s]", flush=True)
        try:
            fn()
        except KeyboardInterrupt:  # SIGINT, e.g. from `timeout -s INT`: report what we have
            msg = f"{section} interrupted after {budget.elapsed():.0f} s; later sections skipped"
            print(msg, flush=True)
            errors.append(msg)
            stopped.append(section)
        except Exception as e:  # one section failing must not cost the others
            tb = traceback.format_exc(limit=-3)
            msg = f"{section} failed: {type(e).__name__}: {e}"
            print(msg + "\n" + tb, flush=True)
            errors.append(msg)
            data.setdefault("tracebacks", {})[section] = tb
        release(dev)
        save()

    nominal = nominal_tbs(card["name"], args.bandwidth_tbs) if dev.type == "cuda" else None
    bw: dict[str, float | None] = {"nominal": nominal, "copy": None}
    data["bandwidth"] = {"nominal_tbs": nominal, "nominal_source": (
        "--bandwidth-tbs" if args.bandwidth_tbs else "card name" if nominal else None)}

    def bandwidth() -> None:
        m = copy_bandwidth(dev, args.copy_mib)
        bw["copy"] = m["tbs"]
        data["bandwidth"]["copy"] = m
        print(f"  nominal {num(nominal, '.2f')} TB/s ({data['bandwidth']['nominal_source']}); "
              f"device-to-device copy of {m['mib']} MiB: {m['tbs']:.2f} TB/s"
              + (f" ({m['tbs'] / nominal:.0%} of nominal)" if nominal else ""))

    guarded("bandwidth", bandwidth)
    mamba2: dict[str, Any] = data.setdefault("mamba2", {}) if "mamba2" in args.sections else {}
    # float32 first: the targets use it; bfloat16 after the long-context section, so a short
    # budget spends its time on what the targets read
    first, rest = args.dtypes[:1], args.dtypes[1:]
    if "float32" in args.dtypes:
        first, rest = ["float32"], [d for d in args.dtypes if d != "float32"]
    if "mamba2" in args.sections:
        guarded(f"1. Mamba2 ({', '.join(first)})",
                lambda: mamba2_section(args, dev, budget, bw, mamba2, first))
    if "long_context" in args.sections:
        lcres = data.setdefault("long_context", {})
        guarded("2. long context", lambda: long_context_section(args, dev, budget, bw, lcres))
    if "profile" in args.sections:
        pres = data.setdefault("profile", {})
        guarded("4. profile", lambda: profile_section(args, dev, budget, pres, mamba2))
    if "mamba2" in args.sections and rest:
        guarded(f"1. Mamba2 ({', '.join(rest)})",
                lambda: mamba2_section(args, dev, budget, bw, mamba2, rest))
    if "graphs" in args.sections:
        gres = data.setdefault("graphs", {})
        guarded("3. CUDA graphs", lambda: graphs_section(args, dev, budget, gres, mamba2))
    if "hybrid" in args.sections:
        hres = data.setdefault("hybrid", {})
        guarded("5. hybrids", lambda: hybrid_section(args, dev, budget, hres))
    # the greedy tokens were only for the agreement check: keep the JSON small
    for r in mamba2.get("rows", []):
        r.pop("tokens", None)
    print()
    print(env_line(env))
    print(f"card: {card['name']}; bandwidth nominal {num(nominal, '.2f')} TB/s, copy "
          f"{num(bw['copy'], '.2f')} TB/s")
    if mamba2.get("rows"):
        report_mamba2(mamba2, args)
    if data.get("long_context", {}).get("rows"):
        report_long_context(data["long_context"])
    if data.get("hybrid", {}).get("rows"):
        print_table([[r["model"], r["streams"], f"{r['decode_tokens_per_s']:.1f}",
                      f"{r['step_s_median'] * 1e3:.3f}", f"{r['e2e_tokens_per_s']:.1f}",
                      r["graphs_captured"], f"{r['startup_s']:.1f}"]
                     for r in data["hybrid"]["rows"]],
                    ["hybrid (float32)", "streams", "decode tok/s", "step ms", "e2e tok/s",
                     "CUDA graphs", "start-up s"], title="\nHybrids on the card")
    data["targets"] = targets(data, args)
    if budget.skipped:
        print(f"\nskipped ({len(budget.skipped)}): " + "; ".join(budget.skipped))
    for e in errors:
        print(f"ERROR {e}")
    data["partial"] = False
    paths = save()
    print(f"total {budget.elapsed():.0f} s; wrote " + ", ".join(str(p) for p in paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
