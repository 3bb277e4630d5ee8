"""The run plumbing of ``bench/gpu.py``: the time budget, device synchronisation and release,
the card's name, versions and copy bandwidth, the bandwidth floor, and the decode runners its
sections share (an mcserve engine stepped to the end, transformers' ``generate`` timed by a
streamer that synchronises, their median steps).
"""

from __future__ import annotations

import gc
import importlib.util
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import long_context_runs as lc  # noqa: E402

from mcserve.engine.llm import LLM  # noqa: E402
from mcserve.engine.llm_engine import LLMEngine  # noqa: E402
from mcserve.engine.sampling import SamplingParams  # noqa: E402

# nominal DRAM bandwidth (TB/s) by a fragment of torch.cuda.get_device_name(); the first match
# wins, so the more specific names come first (an "H100 PCIe" must not match "H100")
NOMINAL_TBS: dict[str, float] = {"GH200": 4.0, "H200": 4.8, "H100 NVL": 3.9, "H100 PCIe": 2.0,
                                 "H100": 3.35, "A100-SXM4-80GB": 2.039, "A100": 1.555,
                                 "L40S": 0.864}


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
    """``long_context_runs.StepTimer`` that synchronises the device before each timestamp: on
    a GPU ``generate`` queues work ahead, and the gap between two ``put`` calls must be a
    step."""

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


# --------------------------------------------------------------------------- decode runners


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
