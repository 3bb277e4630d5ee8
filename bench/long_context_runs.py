"""The models and runs of ``bench/long_context.py``: the shapes (the MC engine variants, the LFM2
hybrid, the transformers Llama), the prompts, and one function per kind of model that measures
its rows over the lengths and batches: ``bench_engine_variant`` (``LLMEngine``: the MC variants,
the host tier, the hybrid), ``bench_loglinear`` (the model called directly) and
``bench_transformer`` (``generate`` with a dynamic or static cache). ``bench/gpu.py`` reuses the
models, prompts, engine configuration and cache copy for its long-context section.
"""

from __future__ import annotations

import gc
import inspect
import math
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
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
WARMUP_TOKENS = 256  # an untimed prefill per model before the timed ones


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

