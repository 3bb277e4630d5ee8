"""The sections of ``bench/gpu.py`` (see its docstring): 1. Mamba2 of the 130M shape against
transformers, 2. long context against the SDPA Transformer (``bench/long_context_runs.py``'s
models), 3. CUDA graphs against ``enforce_eager``, 4. the profile of one decode step, 5. the
hybrids. Each fills its part of the JSON in place and prints its rows as it goes.
"""

from __future__ import annotations

import dataclasses
import inspect
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import baselines as bl  # noqa: E402
import long_context_runs as lc  # noqa: E402
from common import print_table  # noqa: E402
from gpu_runs import (  # noqa: E402
    Budget,
    SyncStepTimer,
    engine_generate,
    floor_fracs,
    graphs_captured,
    mcserve_engine,
    param_bytes,
    pct,
    release,
    run_mcserve_rows,
    summarize_runs,
    sync,
    tf_generate,
    tf_generate_kwargs,
)

from mcserve.config import EngineConfig  # noqa: E402
from mcserve.engine.sampling import SamplingParams  # noqa: E402

# --------------------------------------------------------------------------- 1. Mamba2 130M


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


# --------------------------------------------------------------------------- 4. profile


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


# --------------------------------------------------------------------------- 5. hybrids


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
