"""Long-context decode: mcserve MC variants and a hybrid (LFM2) against a Transformer, one run.

For each context length L (``--lengths``, default 1K 2K 4K 8K 16K 32K) and each model:

* **decode tokens/s** at batch 1 and batch 8 (``--batches``), greedy with ``ignore_eos``: the
  median over ``--steps`` timed decode steps (after ``--warmup`` untimed ones) that start once
  every row's prompt of L tokens is prefilled; tokens/s = batch / median step time;
* **prefill time** of one prompt of L tokens (batch 1);
* **cache bytes held per sequence**, device tier and host tier separately.

Models (float32, or ``--dtype bfloat16``; random weights, the same seed for every variant):

* mcserve ``MCForCausalLM`` of the default model's shape (``ModelConfig(vocab_size=4096,
  d_model=256, n_layers=4, n_heads=4, head_dim=64, segment_len=64)``, linear memory) with
  ``mc_variant`` ``none``, ``residual``, ``grm``, ``ssc`` (top_k 2 and 8), run through
  ``LLMEngine`` (chunked prefill, paged state pool, ragged batched decode). Decode time is the
  wall time of ``engine.step()`` (scheduler + model + sampler + detokenizer). Bytes per sequence
  come from the engine's pools: ``stats()["state_blocks_used"]`` × ``cache.bytes_per_block`` /
  batch + ``cache.bytes_per_slot`` on the device tier, ``stats()["host_blocks_used"]`` ×
  ``bytes_per_block`` / batch on the host tier.
* ``ssc8-host``: ``ssc`` top_k 8 with a device pool of only ``--device-fraction`` (25%) of the
  blocks the sequence needs and the rest in the host tier (``host_state_blocks``): the engine
  offloads the oldest blocks and fetches the router's selection into a staging area per step.
  Its device bytes include its share of the staging area (``max_num_seqs·top_k``
  blocks, divided by ``max_num_seqs``). On a CPU-only host both tiers are RAM: the split shows
  what the engine *would* keep on a GPU, and the decode rate includes the copies. A fresh engine
  per (length, batch) sized for that batch; batch 8 only with ``--host-batches 1 8``.
* ``hybrid``: an LFM2 (transformers ``Lfm2Config``/``Lfm2ForCausalLM``) of the same width and
  depth: hidden 256, 4 layers (``layer_types`` conv, full_attention, conv, full_attention: gated
  short convs of 3 taps and attention with 4 heads × 64, 4 KV heads), SwiGLU 688
  (``block_auto_adjust_ff_dim`` off), vocab 4096, tied embeddings; random weights from
  ``--seed``, written once with ``save_pretrained`` into ``baselines.cache_dir()``
  (``lfm2-longctx-d256-l4-v4096-s<seed>``) and loaded by ``LLMEngine(EngineConfig(model=dir))``.
  The same engine path and prompts as the MC variants (chunked prefill, ragged batched decode),
  its attention layers on the paged KV pool (``num_kv_blocks`` sized so that every token of the
  run stays in the pool: the resume points of earlier prompts keep their KV referenced). Bytes
  per sequence: ``cache.bytes_per_slot`` (the conv tails) + the KV blocks the running
  sequences' tables hold × ``engine.kv.bytes_per_block`` / batch (the JSON also has
  ``stats()["kv_blocks_used"]``, which counts the blocks only resume points hold as well). KV
  rows are 2 attention layers × 4 heads × 64 × 2 × 4 bytes = 4 KiB per token, half the
  Transformer's.
* ``loglinear``: measured through the model directly: ``model(ids)`` for the prefill (the
  vectorised chunked form) and ``model(tok, state)`` one token at a time (no scheduler, no
  sampler: a lower bound on what the engine, which decodes loglinear sequences one by one with
  private states, would take). ``--loglinear-max-len`` caps it (default: no cap).
* ``transformer``: transformers ``LlamaForCausalLM`` of the same width and depth (hidden 256,
  4 layers, 4 heads × 64, SwiGLU 688, vocab 4096, tied embeddings), SDPA attention, with
  ``generate``'s default ``DynamicCache`` (which concatenates, i.e. copies, the whole cache
  every step); ``transformer-static``: the same with a preallocated ``StaticCache`` (written in
  place, attention over its full length), the stronger baseline. Prefill: the prompt minus its
  last token in chunks of ``--tf-chunk`` tokens into a ``DynamicCache`` (chunks bound the
  attention mask's memory), computing the last position's logits only (``logits_to_keep=1``,
  as ``generate`` does; every model is warmed up by one untimed 256-token prefill); its keys
  and values are copied into a fresh cache of each kind, and
  ``generate`` continues from it; decode steps are timed inside ``generate`` by a streamer that
  timestamps every ``put``. Batch 8: the batch-1 prefill cache is copied 8 times (attention
  cost does not depend on the token values) instead of prefilling 8 × L tokens, which is
  quadratic. KV bytes = 2 × layers × heads × head_dim × L × 4 (2 in bfloat16; the JSON also has
  the bytes of the cache tensors). Capped at ``--tf-max-len``.

The mcserve engines of one variant are reused across lengths with prefix caching: rows 2..8 of
the batch have prompts that extend their prompt of the previous length, so their prefill only
computes the new part (untimed; the hybrid resumes from a resume point, its conv tails and the KV
before it); row 1 (whose prefill is timed) is a fresh prompt each length.

    python bench/long_context.py                          # full: 1K..32K (25-30 min, 2 cores)
    python bench/long_context.py --lengths 1024 4096      # some lengths
    python bench/long_context.py --models hybrid transformer   # the hybrid and the Transformer
    python bench/long_context.py --quick                  # CI smoke (lengths 256 512, < 1 min)

Prints tables and writes ``bench/results/long_context.json`` (``--quick``:
``tmp_long_context_quick.json``).
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import math
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import env_info, env_line, print_table, set_threads, write_json  # noqa: E402

from mcserve.config import EngineConfig, ModelConfig  # noqa: E402
from mcserve.engine.llm_engine import LLMEngine  # noqa: E402
from mcserve.engine.sampling import SamplingParams  # noqa: E402
from mcserve.engine.tokenizer import Tokenizer  # noqa: E402
from mcserve.models.native import MCForCausalLM  # noqa: E402

SHAPE = dict(vocab_size=4096, d_model=256, n_layers=4, n_heads=4, head_dim=64, segment_len=64)
# name -> (mc_variant, top_k, host tier)
ENGINE_VARIANTS = {
    "none": ("none", 2, False),
    "residual": ("residual", 2, False),
    "grm": ("grm", 2, False),
    "ssc2": ("ssc", 2, False),
    "ssc8": ("ssc", 8, False),
    "ssc8-host": ("ssc", 8, True),
}
#: transformers ``Lfm2Config`` of the ``hybrid`` model: the width and depth of SHAPE, gated short
#: convs (3 taps) in layers 0 and 2, attention (4 heads of 64, 4 KV heads) in layers 1 and 3, the
#: SwiGLU width of the MC models and of the Llama (688, not auto-adjusted), tied embeddings
HYBRID_SHAPE = dict(
    vocab_size=SHAPE["vocab_size"], hidden_size=SHAPE["d_model"],
    num_hidden_layers=SHAPE["n_layers"], num_attention_heads=SHAPE["n_heads"],
    num_key_value_heads=SHAPE["n_heads"], head_dim=SHAPE["head_dim"],
    intermediate_size=ModelConfig(d_model=SHAPE["d_model"]).mlp_hidden,
    block_auto_adjust_ff_dim=False, conv_L_cache=3, norm_eps=1e-5,
    layer_types=["conv", "full_attention", "conv", "full_attention"],
    max_position_embeddings=65536, tie_word_embeddings=True,
)
HYBRID = "hybrid"
MODELS = list(ENGINE_VARIANTS) + [HYBRID, "loglinear", "transformer"]
TF_NAMES = {"dynamic": "transformer", "static": "transformer-static"}
#: ``--dtype``: the engine's ``EngineConfig(dtype=...)`` (on the CPU bfloat16 gives the large
#: linears bfloat16 weights and, where the CPU has BF16 dot products, the MC prefill's cached
#: readout bfloat16 GEMM operands; states stay float32) and the Transformer's weights,
#: activations and KV cache (``model.to(dtype)``); ``loglinear`` stays float32
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

# targets (printed, not asserted; docs/benchmarks.md)
SSC_SPEEDUP = 10.0  # ssc top_k 8 vs transformer at 32K, batch 1
SSC_DEVICE = 0.25  # ssc top_k 8 device bytes <= 25% of the cache bytes
GRM_SPEEDUP = 3.0  # grm vs transformer at 32K
WARMUP_TOKENS = 256  # an untimed prefill per model before the timed ones
# (model, length, limit): prefill time over the Transformer's, one prompt, batch 1
PREFILL_TARGETS = [(m, 32768, 0.25) for m in ("grm", "ssc8")] + [("none", 32768, 0.1)] + [
    (m, L, 1.0) for L in (2048, 4096) for m in ("none", "grm", "ssc8")]


def make_model(variant: str, top_k: int, seed: int) -> MCForCausalLM:
    torch.manual_seed(seed)
    model = MCForCausalLM(ModelConfig(**SHAPE, mc_variant=variant, mc_top_k=top_k))
    return model.eval()


def hybrid_dir(seed: int) -> Path:
    """The random-weight LFM2 checkpoint of ``HYBRID_SHAPE`` (transformers' ``Lfm2ForCausalLM``
    seeded with ``seed``, ``save_pretrained`` into ``baselines.cache_dir()``; built on first use,
    then reused)."""
    from baselines import random_checkpoint_dir

    return random_checkpoint_dir("lfm2-longctx", "Lfm2Config", "Lfm2ForCausalLM", HYBRID_SHAPE,
                                 seed)


def prompt(length: int, seed: int, vocab: int = SHAPE["vocab_size"]) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (length,), generator=g).tolist()


def summarize(times: list[float], batch: int) -> dict:
    med = statistics.median(times)
    return {"step_s_median": med, "step_s_min": min(times), "step_s_max": max(times),
            "steps": len(times), "tokens_per_s": batch / med}


# --------------------------------------------------------------------------- mcserve engine


class EngineRun:
    """One engine; requests added, prefilled and decoded step by step."""

    def __init__(self, model: MCForCausalLM | None, cfg: EngineConfig):
        # model None: the checkpoint directory cfg.model, loaded by the engine (the hybrid)
        self.engine = (LLMEngine(cfg) if model is None else
                       LLMEngine(cfg, model=model, tokenizer=Tokenizer.byte_level(),
                                 model_name="random-default-shape"))
        self.ntok: dict[str, int] = {}
        self.tokens: dict[str, list[int]] = {}

    def add(self, rid: str, ids: list[int]) -> None:
        params = SamplingParams(max_tokens=self.engine.config.max_model_len - len(ids) - 1,
                                temperature=0.0, ignore_eos=True)
        self.engine.add_request(rid, None, params, prompt_token_ids=ids)
        self.ntok[rid] = 0

    def step(self) -> None:
        for out in self.engine.step():
            self.ntok[out.request_id] = len(out.outputs[0].token_ids)
            self.tokens[out.request_id] = out.outputs[0].token_ids
            if out.finished:
                raise RuntimeError(f"request {out.request_id} finished early "
                                   f"({out.outputs[0].finish_reason}, {out.error})")

    def prefill(self, rids: list[str]) -> float:
        """Step until every request in ``rids`` has its first token; returns the seconds."""
        t0 = time.perf_counter()
        while any(self.ntok[r] == 0 for r in rids):
            self.step()
        return time.perf_counter() - t0

    def warm_up(self) -> None:
        """One untimed prefill of ``WARMUP_TOKENS`` and a decode step, so the first timed
        prefill pays no first-call costs (allocator growth, lazy kernel loads) that the
        Transformer, warmed the same way, does not pay either."""
        self.add("warm-up", prompt(WARMUP_TOKENS, 7))
        self.prefill(["warm-up"])
        self.step()
        self.engine.abort_request("warm-up")
        self.ntok.pop("warm-up")

    def decode(self, batch: int, warmup: int, steps: int) -> dict:
        running = self.engine.stats()["num_requests_running"]
        assert running == batch, f"{running} requests running, expected {batch}"
        for _ in range(warmup):
            self.step()
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            self.step()
            times.append(time.perf_counter() - t0)
        return summarize(times, batch)

    def memory(self, batch: int) -> dict:
        st, c = self.engine.stats(), self.engine.cache
        staging = c.num_staging * c.bytes_per_block / self.engine.config.max_num_seqs
        dev = st["state_blocks_used"] * c.bytes_per_block / batch + c.bytes_per_slot + staging
        host = st["host_blocks_used"] * c.bytes_per_block / batch
        # cross-check against the block tables of the running sequences
        tables = [s.block_table for s in self.engine.scheduler.running]
        n_dev = sum(b < c.host_base for t in tables for b in t)
        n_host = sum(b >= c.host_base for t in tables for b in t)
        assert (n_dev, n_host) == (st["state_blocks_used"], st["host_blocks_used"]), \
            ((n_dev, n_host), st)
        out = {"blocks_device": st["state_blocks_used"] / batch,
               "blocks_host": st["host_blocks_used"] / batch,
               "staging_bytes_share": staging, "host_bytes_moved": st["host_bytes_moved"],
               "host_blocks_fetched": st["host_blocks_fetched"],
               "host_blocks_offloaded": st["host_blocks_offloaded"]}
        kv = self.engine.kv
        if kv is not None:  # a hybrid: the KV blocks of the batch's attention layers
            # the blocks the running sequences' tables hold; stats()["kv_blocks_used"] also
            # counts the blocks that only resume points (earlier prompts) still hold
            held = len({b for s in self.engine.scheduler.running for b in s.kv_table})
            assert held <= st["kv_blocks_used"], (held, st)
            kv_bytes = held * kv.bytes_per_block / batch
            dev += kv_bytes
            out.update({"state_slot_bytes": c.bytes_per_slot, "kv_bytes": kv_bytes,
                        "kv_blocks": held / batch, "kv_block_tokens": kv.block_size,
                        "kv_bytes_per_block": kv.bytes_per_block,
                        "kv_blocks_used_pool": st["kv_blocks_used"],
                        "kv_blocks_resume_points": st["kv_blocks_resume_points"],
                        "kv_blocks_total": st["kv_blocks_total"]})
        return {"device_bytes": dev, "host_bytes": host, **out}

    def finish(self) -> bool:
        for rid in list(self.engine.requests):
            self.engine.abort_request(rid)
        eng = self.engine
        kv_whole = eng.kv is None or eng.kv.is_whole(eng.resume.kv_held if eng.resume else 0)
        return eng.cache.is_whole() and kv_whole


def engine_config(bmax: int, max_len: int, blocks: int, host_blocks: int = 0,
                  budget: int = 8192, **kw) -> EngineConfig:
    return EngineConfig(max_num_seqs=bmax, max_model_len=max_len, num_state_blocks=max(blocks, 2),
                        host_state_blocks=host_blocks, max_num_batched_tokens=budget,
                        enable_prefix_caching=True, **kw)


def _state_blocks(variant: str, args) -> int:
    """Every state block the run needs fits without evicting: the fresh row-1 prompts of every
    length, the nested rows at the longest length, and the generated tokens of every row and
    length (``none`` caches none: only the warm-up's count and a margin of 4)."""
    C = SHAPE["segment_len"]
    bmax, lmax, extra = max(args.batches), max(args.lengths), args.extra_tokens
    blocks = (sum(args.lengths) // C + (bmax - 1) * (lmax // C)
              + bmax * len(args.lengths) * (extra // C + 2)) if variant != "none" else 2
    return blocks + WARMUP_TOKENS // C + 2


def hybrid_run(args) -> EngineRun:
    """The ``hybrid`` engine: its checkpoint directory loaded by ``LLMEngine``, a KV pool that
    holds, with no eviction, every token the run writes (the fresh row-1 prompts of every
    length, the nested rows at the longest length, the generated tokens, the warm-up), which
    the resume points of the earlier prompts keep referenced, plus a quarter."""
    bmax, lmax, extra = max(args.batches), max(args.lengths), args.extra_tokens
    bs = EngineConfig().kv_block_size
    tokens = sum(args.lengths) + (bmax - 1) * lmax + bmax * len(args.lengths) * (extra + bs)
    kv_blocks = math.ceil(1.25 * (tokens // bs + WARMUP_TOKENS // bs + 2 * bmax))
    cfg = engine_config(bmax, lmax + extra + 1, 2, model=str(hybrid_dir(args.seed)),
                        dtype=args.dtype,
                        num_kv_blocks=kv_blocks)
    return EngineRun(None, cfg)


def bench_engine_variant(name: str, args, log) -> list[dict]:
    """All lengths and batches of one engine variant (prefix-nested prompts, one engine);
    ``hybrid``: the LFM2 checkpoint through the same engine path (its KV paged)."""
    if name == HYBRID:
        variant, top_k = "none", None
        model, run = None, hybrid_run(args)
    else:
        variant, top_k, host = ENGINE_VARIANTS[name]
        if host:
            return bench_host_variant(name, args, log)
        model = make_model(variant, top_k, args.seed)
        run = EngineRun(model, engine_config(max(args.batches), max(args.lengths)
                                             + args.extra_tokens + 1, _state_blocks(variant, args),
                                             dtype=args.dtype))
    lmax = max(args.lengths)
    log(f"  {name}: {run.engine.describe()}")
    run.warm_up()
    rows = []
    for L in args.lengths:
        res = {"model": name, "length": L, "mc_variant": variant, "top_k": top_k}
        first = f"{name}-{L}-0"
        run.add(first, prompt(L, 1000 + L))
        res["prefill_s"] = run.prefill([first])
        res["prefill_tokens_per_s"] = L / res["prefill_s"]
        for B in args.batches:
            if B > 1:
                rids = [f"{name}-{L}-{r}" for r in range(1, B)]
                for r, rid in enumerate(rids, start=1):
                    run.add(rid, prompt(lmax, r)[:L])  # extends the previous length's prompt
                run.prefill(rids)
            d = run.decode(B, args.warmup, args.steps)
            d.update(run.memory(B))
            res[f"b{B}"] = d
            if B == args.batches[0]:
                res["probe_tokens"] = list(run.tokens[first])
            log(f"    L={L} B={B}: {d['tokens_per_s']:.1f} tok/s, device "
                f"{d['device_bytes'] / 2**20:.1f} MiB/seq")
        res["pool_whole_after"] = run.finish()
        rows.append(res)
    del run, model
    gc.collect()
    return rows


def bench_host_variant(name: str, args, log) -> list[dict]:
    """ssc with a small device pool and a host tier: a fresh engine per (length, batch)."""
    variant, top_k, _ = ENGINE_VARIANTS[name]
    C = SHAPE["segment_len"]
    extra = args.extra_tokens
    rows = []
    for L in args.lengths:
        res = {"model": name, "length": L, "mc_variant": variant, "top_k": top_k,
               "device_fraction": args.device_fraction}
        for B in args.host_batches:
            need = B * ((L + extra) // C + 1)
            dev_blocks = max(2, math.ceil(args.device_fraction * need))
            model = make_model(variant, top_k, args.seed)
            run = EngineRun(model, engine_config(B, L + extra + 1, dev_blocks,
                                                 host_blocks=need + B, dtype=args.dtype))
            if L == args.lengths[0]:
                log(f"  {name}: {run.engine.describe()} host_blocks={need + B}")
            rids = [f"{name}-{L}-{r}" for r in range(B)]
            run.add(rids[0], prompt(L, 1000 + L))
            t = run.prefill(rids[:1])
            if B == 1:
                res["prefill_s"] = t
                res["prefill_tokens_per_s"] = L / t
            for r, rid in enumerate(rids[1:], start=1):
                run.add(rid, prompt(max(args.lengths), r)[:L])
            run.prefill(rids)
            d = run.decode(B, args.warmup, args.steps)
            d.update(run.memory(B))
            d["device_pool_blocks"] = dev_blocks
            res[f"b{B}"] = d
            if B == args.batches[0]:
                res["probe_tokens"] = list(run.tokens[rids[0]])
            log(f"    L={L} B={B}: {d['tokens_per_s']:.1f} tok/s, device "
                f"{d['device_bytes'] / 2**20:.1f} MiB/seq, host {d['host_bytes'] / 2**20:.1f}")
            res["pool_whole_after"] = run.finish() and res.get("pool_whole_after", True)
            del run, model
            gc.collect()
        for B in args.batches:
            if B not in args.host_batches:
                res[f"b{B}"] = {"skipped": f"batch {B} not in --host-batches"}
        rows.append(res)
    return rows


# --------------------------------------------------------------------------- loglinear


def state_bytes(state) -> int:
    n = 0
    for ls in state.layers:
        mc = ls.mc
        ts = list(mc.mem.values()) + list(mc.cached.values()) + [mc.seg_ksum, mc.cached_ksum]
        if ls.conv is not None:
            ts.append(ls.conv)
        n += sum(t.numel() * t.element_size() for t in ts)
    return n


@torch.inference_mode()
def bench_loglinear(args, log) -> list[dict]:
    model = make_model("loglinear", 2, args.seed)
    rows = []
    for L in args.lengths:
        res = {"model": "loglinear", "length": L, "mc_variant": "loglinear",
               "path": "model(ids, state), no engine"}
        if L > args.loglinear_max_len:
            res["capped"] = f"L > --loglinear-max-len={args.loglinear_max_len}"
            log(f"    loglinear L={L}: capped ({res['capped']})")
            rows.append(res)
            continue
        for B in args.batches:
            ids = torch.tensor([prompt(L, 1000 + L)] + [prompt(max(args.lengths), r)[:L]
                                                         for r in range(1, B)])
            t0 = time.perf_counter()
            logits, state = model(ids)
            t = time.perf_counter() - t0
            if B == 1:
                res["prefill_s"] = t
                res["prefill_tokens_per_s"] = L / t
            tok = logits[:, -1:].argmax(-1)
            times = []
            for i in range(args.warmup + args.steps):
                t0 = time.perf_counter()
                logits, state = model(tok, state)
                tok = logits[:, -1:].argmax(-1)
                if i >= args.warmup:
                    times.append(time.perf_counter() - t0)
            d = summarize(times, B)
            d.update({"device_bytes": state_bytes(state) / B, "host_bytes": 0.0,
                      "cached_segments": state.layers[0].mc.num_cached})
            res[f"b{B}"] = d
            log(f"    loglinear L={L} B={B}: {d['tokens_per_s']:.1f} tok/s, "
                f"{d['cached_segments']} cached segments")
            del state, logits
        rows.append(res)
    return rows


# --------------------------------------------------------------------------- transformer


class StepTimer:
    """A ``generate`` streamer that timestamps every ``put`` (the prompt, then each token)."""

    def __init__(self):
        self.t: list[float] = []

    def put(self, value) -> None:
        self.t.append(time.perf_counter())

    def end(self) -> None:
        pass


def make_transformer(seed: int, dtype: str = "float32"):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=SHAPE["vocab_size"], hidden_size=SHAPE["d_model"],
                      intermediate_size=ModelConfig(d_model=SHAPE["d_model"]).mlp_hidden,
                      num_hidden_layers=SHAPE["n_layers"], num_attention_heads=SHAPE["n_heads"],
                      num_key_value_heads=SHAPE["n_heads"], head_dim=SHAPE["head_dim"],
                      max_position_embeddings=65536, tie_word_embeddings=True,
                      attn_implementation="sdpa")
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval().to(DTYPES[dtype])
    return model, cfg


def kv_bytes_formula(L: int, dtype: str = "float32") -> int:
    return (2 * SHAPE["n_layers"] * SHAPE["n_heads"] * SHAPE["head_dim"] * L
            * DTYPES[dtype].itemsize)


def cache_tensor_bytes(cache) -> int:
    return sum(t.numel() * t.element_size() for layer in cache.layers
               for t in (layer.keys, layer.values) if t is not None)


@torch.inference_mode()
def bench_transformer(args, log) -> list[dict]:
    import transformers
    from transformers import DynamicCache

    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    model, cfg = make_transformer(args.seed, args.dtype)
    # transformers 5 renamed past_key_values to cache (the old name warns)
    kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    log(f"  transformer: transformers {transformers.__version__} LlamaForCausalLM, "
        f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params, "
        f"attn={model.config._attn_implementation}, caches {args.tf_caches}, chunked prefill "
        f"{args.tf_chunk}")
    n_new = args.warmup + args.steps + 1
    # warm-up, as the engines' (EngineRun.warm_up)
    model(input_ids=torch.tensor([prompt(WARMUP_TOKENS, 7)]), use_cache=True,
          **{kw: DynamicCache(config=cfg)})
    rows = []
    for L in args.lengths:
        res_of = {kind: {"model": TF_NAMES[kind], "length": L, "cache": kind,
                         "kv_bytes_formula": kv_bytes_formula(L, args.dtype)}
                  for kind in args.tf_caches}
        if L > args.tf_max_len:
            for res in res_of.values():
                res["capped"] = f"L > --tf-max-len={args.tf_max_len}"
                log(f"    {res['model']} L={L}: capped ({res['capped']})")
            rows += res_of.values()
            continue
        ids = torch.tensor([prompt(L, 1000 + L)])
        prefilled = DynamicCache(config=cfg)
        t0 = time.perf_counter()
        for s in range(0, L - 1, args.tf_chunk):
            # only the last position's logits, as generate's prefill and mcserve compute them
            model(input_ids=ids[:, s:min(L - 1, s + args.tf_chunk)], use_cache=True,
                  logits_to_keep=1, **{kw: prefilled})
        t_pre = time.perf_counter() - t0
        for kind, res in res_of.items():
            for B in args.batches:
                cache = _copy_cache(prefilled, B, cfg, kind, L + n_new + 1)
                timer = StepTimer()
                out = model.generate(input_ids=ids.expand(B, L), **{kw: cache},
                                     attention_mask=torch.ones(B, L, dtype=torch.long),
                                     max_new_tokens=n_new, min_new_tokens=n_new,
                                     do_sample=False, streamer=timer, pad_token_id=0)
                assert out.shape == (B, L + n_new), out.shape
                stamps = timer.t  # prompt put, then one per generated token
                if B == 1:
                    res["prefill_s"] = t_pre + (stamps[1] - stamps[0])
                    res["prefill_tokens_per_s"] = L / res["prefill_s"]
                steps = [b - a for a, b in zip(stamps[1:], stamps[2:])][args.warmup:]
                d = summarize(steps, B)
                d["kv_bytes_measured"] = cache_tensor_bytes(cache) / B
                d["kv_tokens_at_end"] = int(cache.get_seq_length())
                d["device_bytes"] = float(kv_bytes_formula(L, args.dtype))
                d["host_bytes"] = 0.0
                res[f"b{B}"] = d
                log(f"    {res['model']} L={L} B={B}: {d['tokens_per_s']:.1f} tok/s, "
                    f"KV {d['device_bytes'] / 2**20:.1f} MiB/seq")
                del cache, out
                gc.collect()
        del prefilled
        gc.collect()
        rows += res_of.values()
    return rows


def _copy_cache(src, B: int, cfg, kind: str, max_len: int):
    """A fresh cache of ``kind`` holding ``src``'s keys and values repeated B times."""
    from transformers import DynamicCache, StaticCache

    new = (DynamicCache(config=cfg) if kind == "dynamic"
           else StaticCache(config=cfg, max_cache_len=max_len))
    for i, layer in enumerate(src.layers):
        new.layers[i].update(layer.keys.repeat_interleave(B, dim=0),
                             layer.values.repeat_interleave(B, dim=0))
    return new


# --------------------------------------------------------------------------- report


def _cell(res: dict, B: int) -> dict | None:
    d = res.get(f"b{B}")
    return d if d and "tokens_per_s" in d else None


def report(rows: list[dict], args) -> list[dict]:
    models = list(dict.fromkeys(r["model"] for r in rows))
    by = {(r["model"], r["length"]): r for r in rows}
    Ls = args.lengths
    hdr = ["model"] + [f"{L // 1024}K" if L % 1024 == 0 else str(L) for L in Ls]

    def table(title, fn):
        out = []
        for m in models:
            out.append([m] + [fn(by.get((m, L))) for L in Ls])
        print_table(out, hdr, title=title)

    def capped(r):
        return r is None or "capped" in r

    for B in args.batches:
        table(f"decode tokens/s, batch {B} (median step)",
              lambda r, B=B: "capped" if r is not None and "capped" in r else
              (f"{_cell(r, B)['tokens_per_s']:.1f}" if r and _cell(r, B) else "-"))
    table("prefill seconds (one prompt of L tokens, batch 1)",
          lambda r: "capped" if r is not None and "capped" in r else
          (f"{r['prefill_s']:.2f}" if r and "prefill_s" in r else "-"))
    for tf in [n for n in TF_NAMES.values() if n in models]:
        table(f"prefill time / {tf}'s (batch 1; < 1: faster)",
              lambda r, tf=tf: _prefill_ratio(by, r, tf))
    B0 = args.batches[0]

    def dev_mib(r):
        if r is None:
            return "-"
        if "kv_bytes_formula" in r:  # KV bytes: arithmetic, shown even where capped
            return f"{r['kv_bytes_formula'] / 2**20:.2f}"
        if "capped" in r:
            return "capped"
        c = _cell(r, B0)
        return f"{c['device_bytes'] / 2**20:.2f}" if c else "-"

    table(f"cache MiB per sequence, device tier (batch {B0}; transformer: KV bytes)", dev_mib)
    table(f"cache MiB per sequence, host tier (batch {B0})",
          lambda r: "-" if capped(r) or not _cell(r, B0) else
          f"{_cell(r, B0)['host_bytes'] / 2**20:.2f}")
    for tf in [n for n in TF_NAMES.values() if n in models]:
        for B in args.batches:
            table(f"decode speedup over {tf}, batch {B} (its step time / ours)",
                  lambda r, B=B, tf=tf: _speedup(by, r, B, tf))
    return targets(by, args)


def _speedup(by: dict, r: dict | None, B: int, tf: str) -> str:
    if not r or not _cell(r, B):
        return "-"
    t = by.get((tf, r["length"]))
    if not t or not _cell(t, B):
        return "-"
    return f"{_cell(r, B)['tokens_per_s'] / _cell(t, B)['tokens_per_s']:.2f}x"


def _prefill_ratio(by: dict, r: dict | None, tf: str) -> str:
    t = None if r is None else by.get((tf, r["length"]))
    if not r or "prefill_s" not in r or not t or "prefill_s" not in t:
        return "-"
    return f"{r['prefill_s'] / t['prefill_s']:.3f}"


def targets(by: dict, args) -> list[dict]:
    L = 32768
    out = []

    def speed(model, B, limit, tf_name):
        r, tf = by.get((model, L)), by.get((tf_name, L))
        x = None
        if r and tf and _cell(r, B) and _cell(tf, B):
            x = _cell(r, B)["tokens_per_s"] / _cell(tf, B)["tokens_per_s"]
        out.append({"target": f"{model} decode / {tf_name} decode @32K, B={B}", "measured": x,
                    "limit": f">= {limit}", "pass": None if x is None else x >= limit})

    tfs = [n for n in TF_NAMES.values() if n in args.tf_models]
    for tf_name in tfs:
        speed("ssc8", 1, SSC_SPEEDUP, tf_name)
        speed("ssc8-host", 1, SSC_SPEEDUP, tf_name)
    for name in ("ssc8", "ssc8-host"):
        r = by.get((name, L))
        c = _cell(r, 1) if r else None
        own = None if c is None else c["device_bytes"] / (c["device_bytes"] + c["host_bytes"])
        vs_kv = None if c is None else c["device_bytes"] / kv_bytes_formula(L, args.dtype)
        out.append({"target": f"{name} device bytes / its own cache bytes @32K",
                    "measured": own, "limit": f"<= {SSC_DEVICE}",
                    "pass": None if own is None else own <= SSC_DEVICE})
        out.append({"target": f"{name} device bytes / transformer KV bytes @32K",
                    "measured": vs_kv, "limit": f"<= {SSC_DEVICE}",
                    "pass": None if vs_kv is None else vs_kv <= SSC_DEVICE})
    for tf_name in tfs:
        for B in args.batches:
            speed("grm", B, GRM_SPEEDUP, tf_name)
    for tf_name in tfs:  # prefill: this run's time over the Transformer's
        for model, length, limit in PREFILL_TARGETS:
            r, tf = by.get((model, length)), by.get((tf_name, length))
            x = (r["prefill_s"] / tf["prefill_s"] if r and tf and "prefill_s" in r
                 and "prefill_s" in tf else None)
            out.append({"target": f"{model} prefill / {tf_name} prefill @{length // 1024}K",
                        "measured": x, "limit": f"<= {limit}",
                        "pass": None if x is None else x <= limit})
    rows = [[t["target"], "-" if t["measured"] is None else f"{t['measured']:.2f}", t["limit"],
             {True: "PASS", False: "FAIL", None: "not measured"}[t["pass"]]] for t in out]
    print_table(rows, ["target", "measured", "limit", ""],
                title="Targets (printed, not asserted)", align="lrrl")
    return out


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=None,
                    help="context lengths (default 1024 ... 32768)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--models", nargs="+", default=MODELS, choices=MODELS)
    ap.add_argument("--host-batches", type=int, nargs="+", default=[1],
                    help="batches measured for ssc8-host (a fresh engine and a full prefill of "
                         "every row each; default 1)")
    ap.add_argument("--device-fraction", type=float, default=0.25,
                    help="ssc8-host: device pool as a fraction of the blocks needed")
    ap.add_argument("--steps", type=int, default=None, help="timed decode steps (default 16)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed decode steps (default 3)")
    ap.add_argument("--extra-tokens", type=int, default=256,
                    help="room for generated tokens per request")
    ap.add_argument("--tf-max-len", type=int, default=32768,
                    help="longest context for the transformer (longer: printed as capped)")
    ap.add_argument("--tf-chunk", type=int, default=4096, help="transformer prefill chunk")
    ap.add_argument("--tf-caches", nargs="+", default=["dynamic", "static"],
                    choices=["dynamic", "static"],
                    help="transformer KV caches to time: DynamicCache (generate's default, "
                         "model 'transformer') and a preallocated StaticCache "
                         "('transformer-static')")
    ap.add_argument("--loglinear-max-len", type=int, default=None,
                    help="longest context for loglinear (default: no cap)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: all cores)")
    ap.add_argument("--dtype", default="float32", choices=list(DTYPES),
                    help="the engine models' and the Transformer's precision (default float32)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="lengths 256 512, few steps (CI smoke)")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    ap.add_argument("--partial", default=None, metavar="PATH",
                    help="where partial results go after each model (default "
                         "bench/results/tmp_long_context_partial.json)")
    ap.add_argument("--no-save", action="store_true",
                    help="do not write bench/results/long_context.json (only --out)")
    ap.add_argument("--report", default=None, metavar="JSON",
                    help="only print the tables of an earlier run's JSON (also a partial one)")
    args = ap.parse_args(argv)
    if args.report:
        data = json.loads(Path(args.report).read_text(encoding="utf-8"))
        rows = data["results"]
        args.lengths = sorted({r["length"] for r in rows})
        args.batches = sorted({int(k[1:]) for r in rows for k in r if k[:1] == "b"
                               and k[1:].isdigit()})
        args.tf_models = [m for m in TF_NAMES.values() if any(r["model"] == m for r in rows)]
        if "env" in data:
            print(env_line(data["env"]))
        report(rows, args)
        return
    if args.lengths is None:
        args.lengths = [256, 512] if args.quick else [1024 * 2 ** i for i in range(6)]
    args.lengths = sorted(set(args.lengths))
    if args.steps is None:
        args.steps = 4 if args.quick else 16
    if args.warmup is None:
        args.warmup = 1 if args.quick else 3
    if args.loglinear_max_len is None:
        args.loglinear_max_len = max(args.lengths)
    if args.extra_tokens < args.warmup + args.steps + 2 * 64:
        args.extra_tokens = args.warmup + args.steps + 2 * 64
    args.batches = sorted(set(args.batches))
    args.tf_models = [TF_NAMES[k] for k in args.tf_caches] if "transformer" in args.models else []
    args.host_batches = sorted(set(args.host_batches))
    threads = set_threads(args.threads)
    env = env_info()
    print(env_line(env))
    print(f"lengths {args.lengths}, batches {args.batches}, {args.warmup} warm-up + "
          f"{args.steps} timed decode steps, {args.dtype}, {threads} threads", flush=True)
    t_start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t_start:7.1f}s] {msg}", flush=True)

    rows: list[dict] = []
    timings: dict[str, float] = {}
    for m in args.models:
        t0 = time.perf_counter()
        log(f"{m} ...")
        with torch.inference_mode():
            if m in ENGINE_VARIANTS or m == HYBRID:
                rows += bench_engine_variant(m, args, log)
            elif m == "loglinear":
                log("  loglinear: LLMEngine does not support it yet; measured through the model "
                    "directly (model(tok, state) per token, no scheduler/sampler)")
                rows += bench_loglinear(args, log)
            else:
                rows += bench_transformer(args, log)
        timings[m] = time.perf_counter() - t0
        gc.collect()
        # partial results survive an interrupted run (not the final file name)
        write_json({"bench": "long_context", "partial": True, "env": env, "results": rows,
                    "model_seconds": timings},
                   args.partial or ("tmp_long_context_quick_partial.json" if args.quick
                                    else "tmp_long_context_partial.json"))
    print()
    print(env_line(env))
    tgt = report(rows, args)
    by = {(r["model"], r["length"]): r for r in rows}
    for L in args.lengths:  # same model, same prompt, greedy: the host tier must not change it
        a, b = by.get(("ssc8", L)), by.get(("ssc8-host", L))
        if a and b and "probe_tokens" in a and "probe_tokens" in b:
            n = min(len(a["probe_tokens"]), len(b["probe_tokens"]))
            same = a["probe_tokens"][:n] == b["probe_tokens"][:n]
            b["same_tokens_as_ssc8"] = same
            print(f"L={L}: ssc8-host greedy tokens {'==' if same else '!='} ssc8's "
                  f"(first {n})" + ("" if same else "  <-- MISMATCH"))
    bad = [r for r in rows if r.get("pool_whole_after") is False]
    if bad:
        print(f"\nWARNING: pools not whole after {[(r['model'], r['length']) for r in bad]}")
    total = time.perf_counter() - t_start
    print(f"\ntotal {total:.0f} s ({', '.join(f'{k} {v:.0f}s' for k, v in timings.items())}); "
          f"load {env_info()['loadavg']}")
    out = {"bench": "long_context", "env": env, "env_end_loadavg": env_info()["loadavg"],
           "config": {"shape": SHAPE, "dtype": args.dtype, "lengths": args.lengths,
                      "batches": args.batches, "host_batches": args.host_batches,
                      "models": args.models, "steps": args.steps, "warmup": args.warmup,
                      "device_fraction": args.device_fraction, "tf_chunk": args.tf_chunk,
                      "tf_max_len": args.tf_max_len, "tf_caches": args.tf_caches,
                      "loglinear_max_len": args.loglinear_max_len,
                      "seed": args.seed, "quick": args.quick, "threads": threads,
                      "argv": sys.argv[1:] if argv is None else argv},
           "units": "tokens_per_s = batch / median step seconds; bytes per sequence",
           "results": rows, "targets": tgt, "seconds": total, "model_seconds": timings}
    name = "tmp_long_context_quick.json" if args.quick else "long_context.json"
    paths = (write_json(out, args.out) if args.no_save and args.out
             else write_json(out, name, extra=args.out))
    print("wrote " + ", ".join(str(p) for p in paths))


if __name__ == "__main__":
    main()
