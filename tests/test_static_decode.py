"""The static decode step (what CUDA graphs capture), run eagerly on the CPU: padding the batch
to a bucket size and the block table to a bucket width gives the same greedy tokens as the
ragged step and as the model's own greedy loop; the padded rows touch only the scratch slot;
the step makes no host syncs. CUDA-graph replay itself is checked in tests/test_cuda.py."""

from __future__ import annotations

import contextlib

import pytest
import torch

from mcserve.config import EngineConfig, ModelConfig
from mcserve.engine import cuda_graphs
from mcserve.engine.cuda_graphs import bucket, decode_buckets, table_buckets
from mcserve.engine.llm import LLM
from mcserve.engine.llm_engine import LLMEngine
from mcserve.engine.sampling import SamplingParams
from mcserve.kernels import cpu as cpu_ops
from mcserve.models.mamba2 import Mamba2Config, Mamba2MCForCausalLM
from mcserve.models.native import MCForCausalLM

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
# 0 to 10 cached segments of 4 tokens at the start of decode, more while it runs
PROMPT_LENS = [1, 3, 4, 5, 9, 23, 40]


@torch.no_grad()
def greedy(model, ids: list[int], n: int) -> list[int]:
    logits, state = model(torch.tensor([ids], device=model.device), last_only=True)
    out: list[int] = []
    for _ in range(n):
        out.append(int(logits[0, -1].argmax()))
        logits, state = model(torch.tensor([[out[-1]]], device=model.device), state)
    return out


def native(memory: str, variant: str, mode: str, top_k: int = 1) -> MCForCausalLM:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=256, d_model=32, n_layers=2, n_heads=2, head_dim=8,
                      memory=memory, mc_variant=variant, mc_mode=mode, segment_len=4,
                      mc_top_k=top_k, inner_chunk=2, memory_expansion=2)
    return MCForCausalLM(cfg).double()


def mamba2(variant: str, mode: str = "checkpoint") -> Mamba2MCForCausalLM:
    torch.manual_seed(0)
    model = Mamba2MCForCausalLM(Mamba2Config(
        vocab_size=256, d_model=32, n_layers=2, n_heads=4, head_dim=8, state_size=8,
        mc_variant=variant, mc_mode=mode, segment_len=4, mc_top_k=1))
    with torch.no_grad():
        for blk in model.layers:
            blk.mixer.A_log.uniform_(-1.0, 1.0)
            blk.mixer.dt_bias.uniform_(-2.0, 0.0)
    return model.double().eval()


MODELS = {
    "linear-grm": lambda: native("linear", "grm", "checkpoint"),
    "linear-grm-indep": lambda: native("linear", "grm", "independent"),
    "linear-ssc": lambda: native("linear", "ssc", "checkpoint"),
    "linear-ssc-indep": lambda: native("linear", "ssc", "independent"),
    "linear-post": lambda: native("linear", "post", "checkpoint"),
    "linear-post-indep": lambda: native("linear", "post", "independent"),
    "swla-grm": lambda: native("swla", "grm", "checkpoint"),
    "dla-grm": lambda: native("dla", "grm", "checkpoint"),
    "linear-none": lambda: native("linear", "none", "checkpoint"),
    "mamba2-none": lambda: mamba2("none"),
    "mamba2-grm": lambda: mamba2("grm"),
    "mamba2-ssc-indep": lambda: mamba2("ssc", "independent"),
}


def engine(model, static: bool, **kw) -> LLMEngine:
    args = dict(max_num_seqs=8, num_state_blocks=128, max_num_batched_tokens=64,
                dtype="float64", max_model_len=128)
    args.update(kw)
    eng = LLMEngine(EngineConfig(**args), model=model)
    eng.runner.static_decode = static
    return eng


def prompts(n: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = (PROMPT_LENS * 2)[:n]
    return [torch.randint(0, 256, (m,), generator=g).tolist() for m in lens]


def run(eng: LLMEngine, ps: list[list[int]], params=GREEDY, **kw) -> list[list[int]]:
    outs = LLM(engine=eng).generate(ps, params, use_tqdm=False, **kw)
    return [o.outputs[0].token_ids for o in outs]


def spy_static(monkeypatch, eng: LLMEngine) -> list[tuple[int, int, int]]:
    """Record (real rows, padded batch, table width) of every static step."""
    shapes: list[tuple[int, int, int]] = []
    real = eng.runner._decode_static

    def spy(seqs, B, N, offloaded):
        shapes.append((len(seqs), B, N))
        return real(seqs, B, N, offloaded)

    monkeypatch.setattr(eng.runner, "_decode_static", spy)
    return shapes


# ------------------------------------------------------------------ buckets
def test_buckets():
    assert decode_buckets(32) == [1, 2, 4, 8, 16, 24, 32]
    assert decode_buckets(8) == [1, 2, 4, 8]
    assert decode_buckets(5) == [1, 2, 4, 5]
    assert decode_buckets(1) == [1]
    assert decode_buckets(36) == [1, 2, 4, 8, 16, 24, 32, 36]
    assert table_buckets(0) == [0]
    assert table_buckets(1) == [1]
    assert table_buckets(16) == [1, 2, 4, 8, 16]
    assert table_buckets(24) == [1, 2, 4, 8, 16, 24]
    assert bucket([1, 2, 4, 8], 3) == 4 and bucket([1, 2, 4, 8], 8) == 8
    assert bucket([1, 2, 4, 8], 9) is None


def test_table_width_capped_by_max_model_len_and_pool():
    eng = engine(native("linear", "grm", "checkpoint"), True, max_model_len=128)
    assert eng.runner.width_buckets == [1, 2, 4, 8, 16, 32]  # 128 // 4 segments
    eng = engine(native("linear", "grm", "checkpoint"), True, num_state_blocks=12)
    assert eng.runner.width_buckets == [1, 2, 4, 8, 12]
    # collapsed variants and no MC read no table
    assert engine(native("linear", "post", "checkpoint"), True).runner.width_buckets == [0]
    assert engine(native("linear", "none", "checkpoint"), True).runner.width_buckets == [0]


def test_scratch_slot_outside_accounting():
    eng = engine(native("linear", "grm", "checkpoint"), True)
    c = eng.cache
    assert c.scratch_slot == c.num_slots == 8
    assert c.scratch_slot not in c.free_slots
    assert all(t.shape[0] == c.num_slots + 1 for layer in c.slot for t in layer.values())
    assert c.is_whole()


# ------------------------------------------------------------------ token identity
@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("n", [3, 5, 7])
def test_static_equals_ragged_equals_model(monkeypatch, name, n):
    model = MODELS[name]()
    ps = prompts(n)
    want = [greedy(model, p, GREEDY.max_tokens) for p in ps]
    ragged = engine(model, False)
    assert run(ragged, ps) == want
    eng = engine(model, True)
    shapes = spy_static(monkeypatch, eng)
    assert run(eng, ps) == want
    assert eng.cache.is_whole() and ragged.cache.is_whole()
    assert shapes, "the static step never ran"
    assert any(B > rows for rows, B, _ in shapes), "no step was padded"
    assert all(B == bucket(eng.runner.batch_buckets, rows) for rows, B, _ in shapes)
    if eng.runner.reads_table:
        assert len({N for *_, N in shapes}) > 1  # several table widths
    # the scratch slot is back to a fresh state after every step
    for sl, init in zip(eng.cache.slot, eng.runner.init_mem, strict=True):
        for name_, t in sl.items():
            want_row = init[name_[4:]] if name_.startswith("mem.") else torch.zeros_like(t[0])
            assert torch.equal(t[eng.cache.scratch_slot], want_row)


def test_static_with_prefix_hits_and_preemption(monkeypatch):
    model = native("linear", "grm", "checkpoint")
    ps = prompts(7)
    want = [greedy(model, p, GREEDY.max_tokens) for p in ps]
    eng = engine(model, True)
    assert run(eng, ps) == want
    assert run(eng, ps) == want  # prefix hits: rows resume from cached blocks
    small = engine(model, True, num_state_blocks=14, max_num_batched_tokens=16)
    assert run(small, ps) == want
    assert small.stats()["num_preemptions"] > 0
    assert eng.cache.is_whole() and small.cache.is_whole()


def test_static_per_request_top_k_and_host_tier(monkeypatch):
    # per-request top_k and host-tier (offloaded) ssc blocks run the static step eagerly
    model = native("linear", "ssc", "checkpoint", top_k=2)
    ps = prompts(5)
    for kw in ({}, dict(num_state_blocks=8, host_state_blocks=64)):
        ragged = engine(model, False, **kw)
        want = run(ragged, ps)
        eng = engine(model, True, **kw)
        shapes = spy_static(monkeypatch, eng)
        assert run(eng, ps) == want
        assert shapes
        if kw:
            assert eng.stats()["host_blocks_offloaded"] > 0
        assert eng.cache.is_whole()
    ragged, eng = engine(model, False), engine(model, True)
    params = [SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)] * len(ps)
    over = [{"mc_top_k": k} for k in (1, 3, None, 2, 1)]

    def go(e):
        for i, (p, o) in enumerate(zip(ps, over, strict=True)):
            e.add_request(str(i), None, params[i], prompt_token_ids=p,
                          mc_overrides=o if o["mc_top_k"] else None)
        done = {}
        while e.has_unfinished_requests():
            for out in e.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
        return [done[str(i)] for i in range(len(ps))]

    assert go(eng) == go(ragged)
    assert eng.cache.is_whole() and ragged.cache.is_whole()


# ------------------------------------------------------------------ no host syncs
class HostSync(AssertionError):
    pass


@contextlib.contextmanager
def no_host_syncs():
    """Fail on every Python-level read of a tensor's values (what stalls a GPU stream, and
    what a CUDA graph capture rejects): ``bool``/``int``/``float`` of a tensor, ``item``,
    ``tolist``, ``nonzero``, ``unique``, boolean-mask indexing."""
    T = torch.Tensor
    saved = {name: getattr(T, name) for name in
             ("__bool__", "__int__", "__float__", "__index__", "item", "tolist", "nonzero",
              "unique", "numpy", "__getitem__", "__setitem__")}
    saved_torch = {name: getattr(torch, name) for name in ("nonzero", "unique", "masked_select")}

    def refuse(name):
        def f(*a, **k):
            raise HostSync(f"host sync inside the static decode step: Tensor.{name}")
        return f

    def has_mask(index) -> bool:
        items = index if isinstance(index, tuple) else (index,)
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)

    def getitem(self, index):
        if has_mask(index):
            raise HostSync("host sync inside the static decode step: boolean-mask indexing")
        return saved["__getitem__"](self, index)

    def setitem(self, index, value):
        if has_mask(index):
            raise HostSync("host sync inside the static decode step: boolean-mask assignment")
        return saved["__setitem__"](self, index, value)

    try:
        for name in saved:
            setattr(T, name, refuse(name))
        T.__getitem__, T.__setitem__ = getitem, setitem
        for name in saved_torch:
            setattr(torch, name, refuse(name))
        yield
    finally:
        for name, f in saved.items():
            setattr(T, name, f)
        for name, f in saved_torch.items():
            setattr(torch, name, f)


def test_guard_catches_syncs():
    x = torch.ones(3)
    with no_host_syncs(), pytest.raises(HostSync):
        int(x.sum())
    with no_host_syncs(), pytest.raises(HostSync):
        x[x > 0]
    with no_host_syncs(), pytest.raises(HostSync):
        bool((x > 0).any())
    assert int(x.sum()) == 3  # restored


SYNC_FREE = ["linear-grm", "linear-grm-indep", "linear-ssc", "linear-ssc-indep", "linear-post",
             "swla-grm", "linear-none", "mamba2-none", "mamba2-grm", "mamba2-ssc-indep"]


def route_through_kernel_twins(monkeypatch) -> list[int]:
    """``MCMemory.decode_paged`` of routing linear/swla layers through ``decode_paged_kernels``
    with the torch twin of the Triton kernel: the control flow a GPU with Triton runs."""
    from mcserve.models.mc import MCMemory

    real, calls = MCMemory.decode_paged, []

    def decode_paged(mc, pl, q, k, v, u, gates):
        if mc.family.linear and mc.cfg.routes and mc.cfg.caches_blocks and not mc.collapsed:
            calls.append(1)
            return mc.decode_paged_kernels(pl, q, k, v, u, gates, backend="torch")
        return real(mc, pl, q, k, v, u, gates)

    monkeypatch.setattr(MCMemory, "decode_paged", decode_paged)
    return calls


@pytest.mark.parametrize("path", ["cpp-float32", "torch-float64", "kernel-twins"])
@pytest.mark.parametrize("name", SYNC_FREE)
def test_static_step_has_no_host_syncs(monkeypatch, name, path):
    """The captured region: ``static_forward`` for every bucket shape a run reaches. The
    ``torch-float64`` run takes the torch twins of the C++ ops (``twins_only``), i.e. the path
    a GPU runs without Triton; ``kernel-twins`` also routes through ``decode_paged_kernels``
    (the GPU path with Triton, the kernel replaced by its torch twin). The deep memories (dla,
    titans) sync on their inner-chunk fill and are not captured (their step stays eager)."""
    model = MODELS[name]()
    f32 = path == "cpp-float32"
    kernel_calls = route_through_kernel_twins(monkeypatch) if path == "kernel-twins" else None
    if f32:
        model = model.float()
    ctx = contextlib.nullcontext() if f32 else cpu_ops.twins_only()
    eng = engine(model, True, dtype="float32" if f32 else "float64")
    calls = []
    real = eng.runner.static_forward

    def guarded(B, N, **kw):
        assert not kw.get("offloaded") and kw.get("top_k_range") is None
        with no_host_syncs():
            out = real(B, N, **kw)
        calls.append((B, N))
        return out

    monkeypatch.setattr(eng.runner, "static_forward", guarded)
    ps = prompts(7)
    with ctx:
        got = run(eng, ps)
    assert len(set(calls)) > 1
    if kernel_calls is not None:
        assert got == [greedy(model, p, GREEDY.max_tokens) for p in ps]
        assert bool(kernel_calls) == (model.layers[0].mixer.memory.cfg.variant in ("grm", "ssc"))
    assert eng.cache.is_whole()


def test_deep_memory_step_syncs():
    # why dla/titans stay eager on a GPU: the inner-chunk fill is read on the host
    eng = engine(MODELS["dla-grm"](), True)
    real = eng.runner.static_forward

    def guarded(B, N, **kw):
        with no_host_syncs():
            return real(B, N, **kw)

    eng.runner.static_forward = guarded
    outs = LLM(engine=eng).generate(prompts(3), GREEDY, use_tqdm=False)
    assert all(o.outputs[0].finish_reason == "error" and "host sync" in o.error for o in outs)
    assert eng.cache.is_whole()


# ------------------------------------------------------------------ switches
def test_enforce_eager_and_cpu_never_captures():
    assert EngineConfig().enforce_eager is False
    assert EngineConfig(enforce_eager=True).enforce_eager is True
    for eager in (False, True):
        eng = engine(native("linear", "grm", "checkpoint"), False, enforce_eager=eager)
        assert eng.runner.graphs is None and not eng.runner.static_decode
        assert not eng.runner.capture_decode_graphs()  # CPU: nothing to capture


def test_llm_passes_enforce_eager(monkeypatch):
    import mcserve.engine.llm as llm_mod

    seen = []
    monkeypatch.setattr(llm_mod, "LLMEngine", lambda config: seen.append(config))
    LLM(model=None, enforce_eager=True)
    assert seen and seen[0].enforce_eager is True


def test_cli_enforce_eager_flag():
    import argparse

    from mcserve.server.cli_serve import add_engine_args

    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert p.parse_args(["--enforce-eager"]).enforce_eager is True
    assert p.parse_args(["--no-enforce-eager"]).enforce_eager is False
    assert "enforce_eager" not in vars(p.parse_args([]))
    assert "CUDA graphs" in p.format_help()


def test_decode_graphs_need_cuda():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(RuntimeError, match="CUDA"):
        cuda_graphs.DecodeGraphs(lambda b, n: torch.zeros(b), [1], [0])
