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
   configuration and cache copy come from ``bench/long_context.py``.
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
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib.util
import inspect
import shlex
import signal
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import baselines as bl  # noqa: E402
import long_context as lc  # noqa: E402
from common import env_info, env_line, print_table, set_threads, write_json  # noqa: E402

from mcserve.config import EngineConfig  # noqa: E402
from mcserve.engine.llm import LLM  # noqa: E402
from mcserve.engine.llm_engine import LLMEngine  # noqa: E402
from mcserve.engine.sampling import SamplingParams  # noqa: E402

# nominal DRAM bandwidth (TB/s) by a fragment of torch.cuda.get_device_name(); the first match
# wins, so the more specific names come first (an "H100 PCIe" must not match "H100")
NOMINAL_TBS: dict[str, float] = {"GH200": 4.0, "H200": 4.8, "H100 NVL": 3.9, "H100 PCIe": 2.0,
                                 "H100": 3.35, "A100-SXM4-80GB": 2.039, "A100": 1.555,
                                 "L40S": 0.864}

# targets (printed, not asserted)
MAMBA2_B1_TOKS = 1000.0  # Mamba2-130M float32, 1 stream, decode tokens/s
MAMBA2_FLOOR_FRAC = 0.30  # 256 streams: floor step time / measured step time
PREFILL_RATIO = 2.0  # 32K prefill, mcserve grm/ssc8 seconds / SDPA Transformer seconds
SSC_DECODE_RATIO = 10.0  # 32K decode at batch 1, ssc8 tokens/s / static-cache Transformer's

# --quick: the 130M Mamba2's layout (heads of 64, one group, conv 4) at a width and depth that a
# CPU smoke run builds and runs in seconds
MAMBA2_TINY: dict[str, Any] = dict(bl.MAMBA2_130M, hidden_size=256, num_heads=8, state_size=32,
                                   num_hidden_layers=2, vocab_size=4096)


# --------------------------------------------------------------------------- run plumbing


class Budget:
    """The global ``--time-budget-s``: rows asked for after it ran out are skipped (and listed),
    so one slow card still leaves time for the script that called this one."""

    def __init__(self, seconds: float):
        self.seconds, self.t0 = seconds, time.perf_counter()
        self.skipped: list[str] = []

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def left(self) -> float:
        return self.seconds - self.elapsed()

    def ok(self, row: str) -> bool:
        if self.left() > 0:
            return True
        self.skipped.append(row)
        print(f"  skipped {row}: time budget of {self.seconds:.0f} s spent "
              f"({self.elapsed():.0f} s elapsed)", flush=True)
        return False


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def release(dev: torch.device) -> None:
    """Free what a finished section held, so the next one gets the whole card."""
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def tf_generate_kwargs() -> dict[str, Any]:
    """``disable_compile=True`` where transformers has it: on CUDA its ``generate`` compiles the
    forward by itself for a static cache, which would time the compiler (and take minutes)."""
    from transformers import GenerationConfig

    return {"disable_compile": True} if hasattr(GenerationConfig(), "disable_compile") else {}


class SyncStepTimer(lc.StepTimer):
    """``long_context.StepTimer`` that synchronises the device before each timestamp: on a GPU
    ``generate`` queues work ahead, and the gap between two ``put`` calls must be a step."""

    def __init__(self, dev: torch.device):
        super().__init__()
        self.dev = dev

    def put(self, value) -> None:
        sync(self.dev)
        super().put(value)


def param_bytes(model: torch.nn.Module) -> int:
    """Bytes of the weights a decode step reads once (``parameters()`` lists a tied weight
    once)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"torch": torch.__version__, "cuda": torch.version.cuda}
    for mod in ("triton", "transformers"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception:  # not installed, or broken: the run says so instead of failing
            out[mod] = None
    # with these, transformers' Mamba2 would use CUDA kernels instead of its torch path
    for mod in ("mamba_ssm", "causal_conv1d", "kernels"):
        out[f"{mod}_installed"] = str(importlib.util.find_spec(mod) is not None)
    return out


def card_info(dev: torch.device) -> dict[str, Any]:
    if dev.type != "cuda":
        return {"name": "cpu", "device": str(dev)}
    p = torch.cuda.get_device_properties(dev)
    return {"name": p.name, "device": str(dev), "memory_gib": p.total_memory / 2**30,
            "capability": f"{p.major}.{p.minor}", "sms": p.multi_processor_count}


def nominal_tbs(name: str, override: float | None) -> float | None:
    if override:
        return override
    return next((tbs for frag, tbs in NOMINAL_TBS.items() if frag in name), None)


def copy_bandwidth(dev: torch.device, mib: int) -> dict[str, float]:
    """``dst.copy_(src)`` of ``mib`` MiB, counted as read + write: the bandwidth a memory-bound
    step can expect on this card (usually 85-90% of the nominal figure)."""
    n = mib * 2**20 // 4
    src = torch.ones(n, device=dev)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(7):
        sync(dev)
        t0 = time.perf_counter()
        for _ in range(5):
            dst.copy_(src)
        sync(dev)
        times.append((time.perf_counter() - t0) / 5)
    t = statistics.median(times)
    del src, dst
    return {"mib": mib, "seconds": t, "tbs": 2 * n * 4 / t / 1e12}


def floor_fracs(bytes_step: float, step_s: float, bw: dict[str, float | None]) -> dict:
    """Floor time (bytes / bandwidth) over the measured step, per bandwidth figure."""
    out: dict[str, float | None] = {"bytes_per_step": bytes_step}
    for key, tbs in bw.items():
        out[f"floor_frac_{key}"] = (None if not tbs or not step_s
                                    else bytes_step / (tbs * 1e12) / step_s)
    return out


def pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def num(x: float | None, fmt: str = ".1f") -> str:
    return "-" if x is None else format(x, fmt)


# --------------------------------------------------------------------------- 1. Mamba2 130M


def engine_generate(engine: LLMEngine, ids: list[list[int]], new_tokens: int, tag: str
                    ) -> dict[str, Any]:
    """Every prompt of ``ids`` as one request, stepped to the end. Decode steps are those that
    start with every stream prefilled and none finished (one token for every stream)."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    rids = [f"{tag}-{i}" for i in range(len(ids))]
    for rid, p in zip(rids, ids):
        engine.add_request(rid, None, params, prompt_token_ids=p)
    ntok = dict.fromkeys(rids, 0)
    tokens: dict[str, list[int]] = {}
    done: set[str] = set()
    steps: list[float] = []
    t0 = time.perf_counter()
    while len(done) < len(rids):
        decoding = not done and all(n > 0 for n in ntok.values())
        ts = time.perf_counter()
        outs = engine.step()  # returns host token ids: the step's GPU work is finished
        te = time.perf_counter()
        for out in outs:
            ntok[out.request_id] = len(out.outputs[0].token_ids)
            tokens[out.request_id] = list(out.outputs[0].token_ids)
            if out.finished:
                done.add(out.request_id)
        if decoding:
            steps.append(te - ts)
    wall = time.perf_counter() - t0
    assert all(n == new_tokens for n in ntok.values()), ntok
    return {"wall_s": wall, "steps": steps, "tokens": [tokens[r] for r in rids]}


def tf_generate(model, ids: list[list[int]], new_tokens: int, dev: torch.device
                ) -> dict[str, Any]:
    x = torch.tensor(ids, device=dev)
    timer = SyncStepTimer(dev)
    sync(dev)
    t0 = time.perf_counter()
    out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                         streamer=timer, **tf_generate_kwargs())
    sync(dev)
    wall = time.perf_counter() - t0
    assert out.shape == (len(ids), x.shape[1] + new_tokens), out.shape
    # stamps: the prompt, then one per generated token; the first gap is the prefill
    steps = [b - a for a, b in zip(timer.t[1:], timer.t[2:])]
    return {"wall_s": wall, "steps": steps, "tokens": out[:, x.shape[1]:].tolist()}


def summarize_runs(runs: list[dict], streams: int, new_tokens: int) -> dict[str, Any]:
    steps = [s for r in runs for s in r["steps"]]
    med = statistics.median(steps)
    walls = [r["wall_s"] for r in runs]
    return {"streams": streams, "step_s_median": med, "step_s_min": min(steps),
            "step_s_p90": sorted(steps)[int(0.9 * (len(steps) - 1))], "decode_steps": len(steps),
            "decode_tokens_per_s": streams / med, "wall_s": walls,
            "e2e_tokens_per_s": streams * new_tokens / statistics.median(walls)}


def mcserve_engine(model_dir: Path, dtype: str, dev: torch.device, max_streams: int,
                   max_len: int, prompt_len: int, eager: bool | None = None) -> LLM:
    kw: dict[str, Any] = dict(device=str(dev), dtype=dtype, max_num_seqs=max_streams,
                              max_model_len=max_len, enable_prefix_caching=False,
                              max_num_batched_tokens=max(512, max_streams * prompt_len))
    if eager is not None:
        kw["enforce_eager"] = eager
    return LLM(str(model_dir), **kw)


def graphs_captured(engine: LLMEngine) -> int | None:
    g = getattr(engine.runner, "graphs", None)
    return None if g is None else len(getattr(g, "graphs", {}))


def run_mcserve_rows(llm: LLM, label: str, streams: list[int], prompts_of: dict, args,
                     budget: Budget, extra: dict) -> list[dict]:
    eng = llm.engine
    rows = []
    for n in streams:
        if not budget.ok(f"mamba2 {label} streams {n}"):
            continue
        ids = prompts_of[n]
        engine_generate(eng, ids, min(4, args.new_tokens), f"warm{n}")
        runs = [engine_generate(eng, ids, args.new_tokens, f"r{n}-{i}")
                for i in range(args.repeats)]
        row = dict(extra, **summarize_runs(runs, n, args.new_tokens))
        row["tokens"] = runs[-1]["tokens"]
        rows.append(row)
        print(f"  {label:<28} streams {n:>3}: {row['decode_tokens_per_s']:10.1f} tok/s "
              f"(step {row['step_s_median'] * 1e3:.3f} ms, e2e "
              f"{row['e2e_tokens_per_s']:.1f} tok/s)", flush=True)
    return rows


def mamba2_section(args, dev: torch.device, budget: Budget, bw: dict, res: dict,
                   dtypes: list[str]) -> None:
    """Section 1 for ``dtypes``; appends to ``res`` (called once per dtype group)."""
    from transformers import Mamba2ForCausalLM

    shape = res.setdefault("shape", args.m_shape)
    model_dir = bl.mamba2_dir(shape)
    prompts_of = {n: bl.prompts(shape["vocab_size"], n, args.prompt_len)
                  for n in sorted(set(args.streams) | set(args.tf_streams))}
    max_len = args.prompt_len + args.new_tokens + 1
    rows: list[dict] = res.setdefault("rows", [])
    for dtype in dtypes:
        if not budget.ok(f"mamba2 {dtype}"):
            continue
        t0 = time.perf_counter()
        llm = mcserve_engine(model_dir, dtype, dev, max(args.streams), max_len, args.prompt_len)
        eng = llm.engine
        wb, sb = param_bytes(eng.model), eng.cache.bytes_per_slot
        res.setdefault("bytes", {})[dtype] = {"weights": wb, "state_per_stream": sb}
        info = {"impl": "mcserve", "dtype": dtype, "startup_s": time.perf_counter() - t0,
                "graphs_captured": graphs_captured(eng)}
        print(f"  mcserve {dtype}: {eng.describe()}; weights {wb / 2**20:.1f} MiB, state "
              f"{sb / 2**20:.2f} MiB/stream, start-up {info['startup_s']:.1f} s, "
              f"{info['graphs_captured']} CUDA graphs", flush=True)
        ours = run_mcserve_rows(llm, f"mcserve {dtype}", args.streams, prompts_of, args,
                                budget, info)
        del llm, eng
        release(dev)
        tf_rows: list[dict] = []
        if budget.ok(f"mamba2 transformers {dtype}"):
            tdt = getattr(torch, dtype)
            try:
                tf = Mamba2ForCausalLM.from_pretrained(model_dir, dtype=tdt)
            except TypeError:  # transformers before 4.56 calls it torch_dtype
                tf = Mamba2ForCausalLM.from_pretrained(model_dir, torch_dtype=tdt)
            tf = tf.to(dev).eval()
            last: tuple[int, float] | None = None  # (streams, seconds of one run)
            for n in args.tf_streams:
                if last is not None:  # linear in streams: pessimistic on a GPU, so it is safe
                    est = last[1] * max(1.0, n / last[0]) * (args.repeats + 1)
                    if est > args.tf_row_cap_s or est > budget.left():
                        why = (f"transformers {dtype} streams {n}: skipped, estimated {est:.0f} "
                               f"s > cap {args.tf_row_cap_s:.0f} s or the budget left "
                               f"({budget.left():.0f} s)")
                        print("  " + why, flush=True)
                        budget.skipped.append(why)
                        continue
                if not budget.ok(f"mamba2 transformers {dtype} streams {n}"):
                    continue
                ids = prompts_of[n]
                with torch.inference_mode():
                    tf_generate(tf, ids, 2, dev)  # warm-up
                    runs = [tf_generate(tf, ids, args.new_tokens, dev)
                            for _ in range(args.repeats)]
                last = (n, statistics.median(r["wall_s"] for r in runs))
                row = dict(impl="transformers", dtype=dtype,
                           param_dtype=str(next(tf.parameters()).dtype),
                           **summarize_runs(runs, n, args.new_tokens))
                row["tokens"] = runs[-1]["tokens"]
                tf_rows.append(row)
                print(f"  {'transformers ' + dtype:<28} streams {n:>3}: "
                      f"{row['decode_tokens_per_s']:10.1f} tok/s (step "
                      f"{row['step_s_median'] * 1e3:.3f} ms, e2e {row['e2e_tokens_per_s']:.1f} "
                      f"tok/s)", flush=True)
            del tf
            release(dev)
        # one floor per (dtype, streams), from mcserve's weights and state: the work the step
        # must do, whoever does it
        for row in ours + tf_rows:
            row.update(floor_fracs(wb + 2 * sb * row["streams"], row["step_s_median"], bw))
        tf_by = {r["streams"]: r for r in tf_rows}
        for row in ours:
            t = tf_by.get(row["streams"])
            if t is not None:
                row["vs_transformers"] = row["decode_tokens_per_s"] / t["decode_tokens_per_s"]
                row["agreement_with_transformers"] = bl.agreement(
                    bl.Result("mcserve", 0, 0, [1.0], row["tokens"]),
                    bl.Result("transformers", 0, 0, [1.0], t["tokens"]))
        rows += ours + tf_rows


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


# --------------------------------------------------------------------------- 2. long context


def lc_engine(name: str, L: int, dev: torch.device, args) -> lc.EngineRun:
    variant, top_k, _ = lc.ENGINE_VARIANTS[name]
    C = lc.SHAPE["segment_len"]
    extra = args.lc_warmup + args.lc_steps + 2 * C
    # the warm-up request's blocks stay cached (prefix caching) after it is aborted: room for
    # two whole sequences, so the timed one never evicts
    blocks = 2 * ((L + extra) // C + 2) if variant != "none" else 2
    model = lc.make_model(variant, top_k, args.seed).to(dev)
    cfg = lc.engine_config(1, L + extra + 1, blocks).replace(device=str(dev))
    return lc.EngineRun(model, cfg)


def lc_bytes(run: lc.EngineRun, name: str, L: int) -> int:
    """Least bytes one decode step moves: every weight, the online state read and written, and
    the cached blocks the variant reads (grm: all L/C, ssc: top_k; the router's key sums are
    left out)."""
    variant, top_k, _ = lc.ENGINE_VARIANTS[name]
    n = L // lc.SHAPE["segment_len"]
    n_read = {"grm": n, "ssc": min(top_k, n)}.get(variant, 0)
    c = run.engine.cache
    return param_bytes(run.engine.model) + 2 * c.bytes_per_slot + n_read * c.bytes_per_block


def hybrid_section(args, dev: torch.device, budget: Budget, res: dict) -> None:
    """Section 5: hybrid models on the card (float32, CUDA graphs of the static step with the
    KV table): LFM2-350M-like and Granite-4.0-H-350M-like decode tokens/s at ``--streams``,
    each with its start-up (graph capture) and how many graphs were captured."""
    shapes = ({"LFM2": (bl.lfm2_dir, bl.LFM2_QUICK), "Granite-4.0-H":
               (bl.granite_hybrid_dir, bl.GRANITE_H_QUICK)} if args.quick else
              {"LFM2": (bl.lfm2_dir, bl.LFM2_350M), "Granite-4.0-H":
               (bl.granite_hybrid_dir, bl.GRANITE_H_350M)})
    max_len = args.prompt_len + args.new_tokens + 1
    rows: list[dict] = res.setdefault("rows", [])
    for name, (build, shape) in shapes.items():
        if not budget.ok(f"hybrid {name}"):
            continue
        prompts_of = {n: bl.prompts(shape["vocab_size"], n, args.prompt_len)
                      for n in args.streams}
        t0 = time.perf_counter()
        llm = mcserve_engine(build(shape), "float32", dev, max(args.streams), max_len,
                             args.prompt_len)
        info = {"model": name, "impl": "mcserve", "dtype": "float32",
                "startup_s": time.perf_counter() - t0,
                "graphs_captured": graphs_captured(llm.engine)}
        print(f"  {name}: {llm.engine.describe()}; start-up {info['startup_s']:.1f} s, "
              f"{info['graphs_captured']} CUDA graphs", flush=True)
        for row in run_mcserve_rows(llm, name, args.streams, prompts_of, args, budget, info):
            row.pop("tokens", None)
            rows.append(row)
        del llm
        release(dev)


def long_context_section(args, dev: torch.device, budget: Budget, bw: dict, res: dict) -> None:
    L = args.lc_length
    res.update({"length": L, "shape": lc.SHAPE, "dtype": "float32", "batch": 1,
                "tf_chunk": args.tf_chunk, "steps": args.lc_steps, "warmup": args.lc_warmup})
    rows: list[dict] = res.setdefault("rows", [])
    for name in ("grm", "ssc8", "none"):
        if not budget.ok(f"long_context {name}"):
            continue
        # no inference_mode around the engine: it runs under no_grad itself, and its CUDA
        # graphs are captured and replayed as the server does it
        t0 = time.perf_counter()
        run = lc_engine(name, L, dev, args)
        startup = time.perf_counter() - t0
        # untimed warm-up: a whole prompt of another seed (compiles every kernel the timed
        # prefill and decode use), then aborted
        run.add("warm", lc.prompt(L, 7))
        run.prefill(["warm"])
        for _ in range(2):
            run.step()
        run.engine.abort_request("warm")
        first = f"{name}-{L}"
        run.add(first, lc.prompt(L, 1000 + L))
        t_pre = run.prefill([first])
        d = run.decode(1, args.lc_warmup, args.lc_steps)
        d.update(floor_fracs(lc_bytes(run, name, L), d["step_s_median"], bw))
        row = {"model": name, "prefill_s": t_pre, "prefill_tokens_per_s": L / t_pre,
               "startup_s": startup, "graphs_captured": graphs_captured(run.engine), **d}
        row["pool_whole_after"] = run.finish()
        rows.append(row)
        print(f"  {name:<20} L={L}: prefill {t_pre:.3f} s, decode "
              f"{row['tokens_per_s']:.1f} tok/s (step {row['step_s_median'] * 1e3:.3f} ms)",
              flush=True)
        del run
        release(dev)
    if budget.ok("long_context transformer"):
        rows += transformer_rows(args, dev, budget, bw)
    by = {r["model"]: r for r in rows}
    tf = by.get("transformer-static")
    if tf:
        for r in rows:
            if r["model"] in lc.ENGINE_VARIANTS:
                r["prefill_vs_transformer"] = r["prefill_s"] / tf["prefill_s"]
                r["decode_vs_transformer_static"] = r["tokens_per_s"] / tf["tokens_per_s"]


@torch.inference_mode()
def transformer_rows(args, dev: torch.device, budget: Budget, bw: dict) -> list[dict]:
    import transformers
    from transformers import DynamicCache

    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    L = args.lc_length
    model, cfg = lc.make_transformer(args.seed)
    model = model.to(dev)
    kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    ids = torch.tensor([lc.prompt(L, 1000 + L)], device=dev)
    print(f"  transformer: transformers {transformers.__version__} LlamaForCausalLM "
          f"({model.config._attn_implementation}), prefill in chunks of {args.tf_chunk}",
          flush=True)

    def prefill(n: int) -> tuple[Any, float]:
        cache = DynamicCache(config=cfg)
        sync(dev)
        t0 = time.perf_counter()
        for s in range(0, n, args.tf_chunk):
            model(input_ids=ids[:, s:min(n, s + args.tf_chunk)], use_cache=True, **{kw: cache})
        sync(dev)
        return cache, time.perf_counter() - t0

    warm, _ = prefill(min(L - 1, 2 * args.tf_chunk))  # cuBLAS / SDPA kernel selection
    del warm
    prefilled, t_pre = prefill(L - 1)
    n_new = args.lc_warmup + args.lc_steps + 1
    wb = param_bytes(model)
    rows = []
    modes = [("transformer-static", tf_generate_kwargs())]
    if args.tf_compile:
        modes.append(("transformer-static-compiled", {}))
    for name, gen_kw in modes:
        if not budget.ok(f"long_context {name}"):
            continue
        for _ in ("warm", "timed"):  # the first generate selects kernels (or compiles)
            cache = lc._copy_cache(prefilled, 1, cfg, "static", L + n_new + 1)
            timer = SyncStepTimer(dev)
            out = model.generate(input_ids=ids, **{kw: cache}, streamer=timer,
                                 attention_mask=torch.ones_like(ids), max_new_tokens=n_new,
                                 min_new_tokens=n_new, do_sample=False, pad_token_id=0,
                                 **gen_kw)
            assert out.shape == (1, L + n_new), out.shape
            del cache
        stamps = timer.t
        steps = [b - a for a, b in zip(stamps[1:], stamps[2:])][args.lc_warmup:]
        d = lc.summarize(steps, 1)
        # a static cache attends over its whole preallocated length
        d.update(floor_fracs(wb + lc.kv_bytes_formula(L + n_new + 1), d["step_s_median"], bw))
        row = {"model": name, "prefill_s": t_pre + (stamps[1] - stamps[0]),
               "prefill_tokens_per_s": None, "kv_bytes": lc.kv_bytes_formula(L), **d}
        row["prefill_tokens_per_s"] = L / row["prefill_s"]
        rows.append(row)
        print(f"  {name:<20} L={L}: prefill {row['prefill_s']:.3f} s, decode "
              f"{row['tokens_per_s']:.1f} tok/s (step {row['step_s_median'] * 1e3:.3f} ms)",
              flush=True)
    return rows


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


# --------------------------------------------------------------------------- 3. CUDA graphs


def graphs_section(args, dev: torch.device, budget: Budget, res: dict, mamba2: dict) -> None:
    if "enforce_eager" not in {f.name for f in dataclasses.fields(EngineConfig)}:
        res["skipped"] = "EngineConfig has no enforce_eager field: eager vs CUDA graphs not timed"
        print("  " + res["skipped"])
        return
    if dev.type != "cuda":
        res["note"] = "not CUDA: no graphs are captured, both rows run eagerly (a code-path smoke)"
        print("  " + res["note"])
    shape = mamba2.get("shape", args.m_shape)
    model_dir = bl.mamba2_dir(shape)
    streams = args.graph_streams
    prompts_of = {n: bl.prompts(shape["vocab_size"], n, args.prompt_len) for n in streams}
    max_len = args.prompt_len + args.new_tokens + 1
    # the default (graphs) rows of section 1 where it measured them: the same engine settings
    have = {r["streams"]: r for r in mamba2.get("rows", [])
            if r["impl"] == "mcserve" and r["dtype"] == "float32" and r["streams"] in streams}
    rows = [dict(r, enforce_eager=False) for r in have.values()]
    for eager, need in ((True, streams), (False, [n for n in streams if n not in have])):
        if not need or not budget.ok(f"graphs enforce_eager={eager}"):
            continue
        llm = mcserve_engine(model_dir, "float32", dev, max(args.streams), max_len,
                             args.prompt_len, eager=eager)
        info = {"impl": "mcserve", "dtype": "float32", "enforce_eager": eager,
                "graphs_captured": graphs_captured(llm.engine)}
        rows += run_mcserve_rows(llm, f"mcserve float32 eager={eager}", need, prompts_of, args,
                                 budget, info)
        del llm
        release(dev)
    res["rows"] = [{k: v for k, v in r.items() if k != "tokens"} for r in rows]
    by = {(r["enforce_eager"], r["streams"]): r for r in rows}
    out = []
    for n in streams:
        e, g = by.get((True, n)), by.get((False, n))
        ratio = None if not (e and g) else e["step_s_median"] / g["step_s_median"]
        if e and g:
            res.setdefault("speedup", {})[str(n)] = ratio
        out.append([n, "-" if not e else f"{e['step_s_median'] * 1e3:.3f}",
                    "-" if not g else f"{g['step_s_median'] * 1e3:.3f}",
                    "-" if ratio is None else f"{ratio:.2f}x",
                    "-" if not g else str(g.get("graphs_captured"))])
    print_table(out, ["streams", "eager step ms", "graphs step ms", "eager / graphs",
                      "graphs captured"],
                title="Mamba2 float32 decode step: enforce_eager vs CUDA graphs")


def profile_section(args, dev: torch.device, budget: Budget, res: dict, mamba2: dict) -> None:
    """Section 4: what one decode step launches and how long the card works in it. One stream
    of the section-1 Mamba2 (float32), eager and with CUDA graphs: ``--profile-steps`` engine
    steps timed plainly (the wall time), then the same number under ``torch.profiler``: kernels
    run on the card per step, host-side launch calls per step (``cudaLaunchKernel`` and kin, and
    ``cudaGraphLaunch``), and the kernels' summed time over the plain step time (busy)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    shape = mamba2.get("shape", args.m_shape)
    model_dir = bl.mamba2_dir(shape)
    ids = bl.prompts(shape["vocab_size"], 1, args.prompt_len)[0]
    k = args.profile_steps
    max_len = args.prompt_len + 2 * k + 8
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    rows = []
    for eager in (True, False):
        if not budget.ok(f"profile enforce_eager={eager}"):
            continue
        llm = mcserve_engine(model_dir, "float32", dev, 1, max_len, args.prompt_len, eager=eager)
        eng = llm.engine
        engine_generate(eng, [ids], 4, f"pwarm{eager}")
        params = SamplingParams(max_tokens=2 * k + 4, temperature=0.0, ignore_eos=True)
        eng.add_request(f"prof{eager}", None, params, prompt_token_ids=ids)
        eng.step()  # the prefill
        eng.step()
        walls = []
        for _ in range(k):
            t0 = time.perf_counter()
            eng.step()  # returns host token ids: the step's work is finished
            walls.append(time.perf_counter() - t0)
        with profile(activities=acts) as p:
            for _ in range(k):
                eng.step()
            sync(dev)
        while eng.has_unfinished_requests():
            eng.step()
        events = p.events()
        kernels = [e for e in events if e.device_type == DeviceType.CUDA]
        launches = [e for e in events if e.device_type == DeviceType.CPU and (
            "LaunchKernel" in e.name or "GraphLaunch" in e.name)]
        graph_launches = sum("GraphLaunch" in e.name for e in launches)
        busy_us = sum(e.time_range.elapsed_us() for e in kernels) / k
        wall = statistics.median(walls)
        row = {"enforce_eager": eager, "steps": k, "step_s_median": wall,
               "kernels_per_step": len(kernels) / k, "launch_calls_per_step": len(launches) / k,
               "graph_launches_per_step": graph_launches / k,
               "gpu_busy_s_per_step": busy_us / 1e6,
               "gpu_busy_frac": (busy_us / 1e6 / wall) if kernels else None,
               "graphs_captured": graphs_captured(eng)}
        rows.append(row)
        print(f"  eager={eager}: step {wall * 1e3:.3f} ms, {row['kernels_per_step']:.0f} kernels "
              f"and {row['launch_calls_per_step']:.0f} launch calls per step, GPU busy "
              f"{busy_us / 1e3:.3f} ms ({pct(row['gpu_busy_frac'])})", flush=True)
        del llm, eng, p, events, kernels, launches
        release(dev)
    res["rows"] = rows
    if dev.type != "cuda":
        res["note"] = "not CUDA: no kernels to count (a code-path smoke)"
    print_table([[r["enforce_eager"], f"{r['step_s_median'] * 1e3:.3f}",
                  f"{r['kernels_per_step']:.0f}", f"{r['launch_calls_per_step']:.0f}",
                  f"{r['gpu_busy_s_per_step'] * 1e3:.3f}", pct(r["gpu_busy_frac"])]
                 for r in rows],
                ["enforce_eager", "step ms", "kernels / step", "launch calls / step",
                 "GPU busy ms / step", "GPU busy"],
                title="Mamba2 float32 decode step, 1 stream, under torch.profiler")


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
