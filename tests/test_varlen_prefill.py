"""Variable-length prefill: the prefills of one step go through the model in one call
(``RecurrentLM.forward_varlen``, ``ModelRunner.prefill_varlen``), with the same logits, states,
checkpoints and greedy tokens as running the sequences one at a time."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

from mcserve.config import EngineConfig, ModelConfig
from mcserve.engine.llm import LLM
from mcserve.engine.llm_engine import LLMEngine
from mcserve.engine.sampling import SamplingParams
from mcserve.kernels import dispatch
from mcserve.models import varlen as varlen_mod
from mcserve.models.importing import ConvInput
from mcserve.models.mamba1 import Mamba1Config, Mamba1MCForCausalLM
from mcserve.models.mamba2 import Mamba2Config, Mamba2MCForCausalLM
from mcserve.models.mc import MCMemory
from mcserve.models.native import MCForCausalLM
from mcserve.models.state import LayerState, ModelState

V = 64
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
TOL = dict(rtol=1e-10, atol=1e-12)


def native(memory: str = "linear", variant: str = "grm", mode: str = "checkpoint",
           seed: int = 0) -> MCForCausalLM:
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=V, d_model=24, n_layers=2, n_heads=3, head_dim=8,
                      memory=memory, mc_variant=variant, mc_mode=mode, segment_len=4,
                      mc_top_k=1, inner_chunk=2, memory_expansion=2)
    return MCForCausalLM(cfg).double().eval()


def mamba2(variant: str = "grm", seed: int = 0) -> Mamba2MCForCausalLM:
    torch.manual_seed(seed)
    cfg = Mamba2Config(vocab_size=V, d_model=16, n_layers=2, n_heads=4, head_dim=8,
                       state_size=8, n_groups=2, conv_size=4, mc_variant=variant, segment_len=4,
                       mc_top_k=1)
    model = Mamba2MCForCausalLM(cfg)
    with torch.no_grad():  # decays and steps that differ per head
        for blk in model.layers:
            blk.mixer.A_log.uniform_(-1.0, 1.0)
            blk.mixer.dt_bias.uniform_(-1.0, 1.0)
    return model.double().eval()


def mamba1(variant: str = "grm", seed: int = 0) -> Mamba1MCForCausalLM:
    torch.manual_seed(seed)
    cfg = Mamba1Config(vocab_size=V, d_model=16, n_layers=2, d_inner=24, state_size=8,
                       dt_rank=2, conv_size=3, mc_variant=variant, segment_len=4, mc_top_k=1)
    model = Mamba1MCForCausalLM(cfg)
    with torch.no_grad():
        for blk in model.layers:
            blk.mixer.A_log.uniform_(-1.0, 1.0)
    return model.double().eval()


MODELS = {
    "linear-none": lambda: native("linear", "none"),
    "linear-residual": lambda: native("linear", "residual"),
    "linear-grm": lambda: native("linear", "grm"),
    "linear-soup": lambda: native("linear", "soup"),
    "linear-ssc": lambda: native("linear", "ssc"),
    "linear-post-indep": lambda: native("linear", "post", "independent"),
    "linear-grm-indep": lambda: native("linear", "grm", "independent"),
    "linear-loglinear": lambda: native("linear", "loglinear"),
    "swla-grm": lambda: native("swla", "grm"),
    "swla-residual": lambda: native("swla", "residual"),
    "dla-grm": lambda: native("dla", "grm"),
    "dla-soup": lambda: native("dla", "soup"),
    "titans-ssc-indep": lambda: native("titans", "ssc", "independent"),
    "mamba2-none": lambda: mamba2("none"),
    "mamba2-grm": lambda: mamba2("grm"),
    "mamba2-residual": lambda: mamba2("residual"),
    "mamba1-none": lambda: mamba1("none"),
    "mamba1-grm": lambda: mamba1("grm"),
}

# (tokens already consumed, chunk length) of each packed sequence, segment_len = 4: fresh; mid
# segment with 1 cached; two at the same phase with the same length (one batch inside the
# call); a completed segment not yet pushed; 3 cached and 1 token; mid segment without a cache
PHASES = [(0, 7), (6, 3), (6, 3), (8, 9), (13, 1), (2, 5)]


def close(a, b, what: str) -> None:
    if a is None or b is None:
        assert a is None and b is None, what
        return
    assert a.shape == b.shape, f"{what}: {tuple(a.shape)} != {tuple(b.shape)}"
    torch.testing.assert_close(a, b, **TOL, msg=lambda m: f"{what}: {m}")


def assert_same_state(got: ModelState, want: ModelState, what: str) -> None:
    for li, (a, b) in enumerate(zip(got.layers, want.layers, strict=True)):
        w = f"{what} layer {li}"
        close(a.conv, b.conv, f"{w} conv")
        ma, mb = a.mc, b.mc
        assert (ma.pos, ma.seg_len, ma.n_segments, ma.cached_len, ma.cached_pos, ma.top_k) == \
            (mb.pos, mb.seg_len, mb.n_segments, mb.cached_len, mb.cached_pos, mb.top_k), w
        assert ma.mem.keys() == mb.mem.keys() and ma.cached.keys() == mb.cached.keys(), w
        for k in ma.mem:
            close(ma.mem[k], mb.mem[k], f"{w} mem.{k}")
        for k in ma.cached:
            close(ma.cached[k], mb.cached[k], f"{w} cached.{k}")
        close(ma.seg_ksum, mb.seg_ksum, f"{w} seg_ksum")
        close(ma.cached_ksum, mb.cached_ksum, f"{w} cached_ksum")
        assert (ma.record is None) == (mb.record is None), w
        for i, (ra, rb) in enumerate(zip(ma.record or [], mb.record or [], strict=True)):
            r = f"{w} record {i}"
            assert ra["pos"] == rb["pos"], r
            for k in ra["mem"]:
                close(ra["mem"][k], rb["mem"][k], f"{r} mem.{k}")
            close(ra["ksum"], rb["ksum"], f"{r} ksum")
            close(ra["conv"], rb["conv"], f"{r} conv")
            assert (ra["csum"] is None) == (rb["csum"] is None), r
            for k in ra["csum"] or {}:
                close(ra["csum"][k], rb["csum"][k], f"{r} csum.{k}")


def recording(state: ModelState) -> ModelState:
    """``state`` with a fresh checkpoint list in every layer (as the runner sets it)."""
    return replace(state, layers=[replace(ls, mc=replace(ls.mc, record=[]))
                                  for ls in state.layers])


@torch.no_grad()
def phased(model, g: torch.Generator) -> tuple[list[ModelState], list[torch.Tensor]]:
    """A batch-of-one state at each phase of ``PHASES`` and its chunk's tokens ``(1, T)``."""
    states, chunks = [], []
    for p0, n in PHASES:
        ids = torch.randint(0, V, (1, p0 + n), generator=g)
        states.append(model(ids[:, :p0])[1] if p0 else model.init_state(1))
        chunks.append(ids[:, p0:])
    return states, chunks


@pytest.mark.parametrize("record", [False, True], ids=["plain", "record"])
@pytest.mark.parametrize("name", list(MODELS))
def test_forward_varlen_equals_forward_per_sequence(name, record):
    model = MODELS[name]()
    assert model.packs_varlen
    g = torch.Generator().manual_seed(3)
    states, chunks = phased(model, g)
    if record:
        ref_in = [recording(st) for st in states]
        var_in = [recording(st) for st in states]
    else:
        ref_in = var_in = states
    with torch.no_grad():
        want = [model(x, st, last_only=True) for x, st in zip(chunks, ref_in, strict=True)]
        logits, got = model.forward_varlen(torch.cat(chunks, 1), var_in,
                                           [x.shape[1] for x in chunks])
    assert logits.shape == (len(PHASES), model.config.vocab_size)
    for i, ((lw, sw), sg) in enumerate(zip(want, got, strict=True)):
        close(logits[i], lw[0, -1], f"logits of sequence {i}")
        assert_same_state(sg, sw, f"sequence {i}")
    if record and model.config.mc.caches_blocks:
        n_rec = [len(st.layers[0].mc.record) for st in got]
        assert n_rec == [len(st.layers[0].mc.record) for _, st in want]
        assert len(set(n_rec)) > 1  # the sequences crossed different numbers of boundaries


def test_forward_varlen_without_packed_blocks_runs_forward_per_sequence(monkeypatch):
    # a model whose blocks have no forward_varlen: one forward per sequence, same results
    model = native("linear", "grm")
    monkeypatch.setattr(MCForCausalLM, "packs_varlen", False)
    calls = []
    real = model.forward
    monkeypatch.setattr(model, "forward", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    states, chunks = phased(model, torch.Generator().manual_seed(4))
    calls.clear()
    with torch.no_grad():
        logits, got = model.forward_varlen(torch.cat(chunks, 1), states,
                                           [x.shape[1] for x in chunks])
        assert len(calls) == len(PHASES)
        for i, (x, st) in enumerate(zip(chunks, states, strict=True)):
            lw, sw = model(x, st, last_only=True)
            close(logits[i], lw[0, -1], f"logits of sequence {i}")
            assert_same_state(got[i], sw, f"sequence {i}")


def test_forward_varlen_rejects_bad_lengths():
    model = native()
    st = [model.init_state(1), model.init_state(1)]
    ids = torch.zeros(1, 5, dtype=torch.long)
    for lens in ([2, 2], [5, 0], [5]):
        with pytest.raises(ValueError, match="lens"):
            model.forward_varlen(ids, st, lens)
    with pytest.raises(ValueError, match="input_ids"):
        model.forward_varlen(ids.view(5, 1), st, [3, 2])


def test_equal_phases_mix_as_one_batch(monkeypatch):
    # four equal prompts and two others: per layer, one memory call for the four (one batch)
    model = native("linear", "grm")
    sizes = []
    real = MCMemory.forward
    monkeypatch.setattr(MCMemory, "forward", lambda self, st, q, *a, **kw:
                        sizes.append(q.shape[0]) or real(self, st, q, *a, **kw))
    g = torch.Generator().manual_seed(6)
    ps = [torch.randint(0, V, (n,), generator=g).tolist() for n in (9, 5, 9, 9, 3, 9)]
    eng = make_engine(model)
    for i, p in enumerate(ps):
        eng.add_request(str(i), None, GREEDY, prompt_token_ids=p)
    eng.step()
    assert sorted(sizes) == sorted([1, 1, 4] * model.config.n_layers)
    drain(eng)


# ------------------------------------------------------------------ packed sequence mixing
# lengths against a window of 4 (3 tail rows): 1 and 2 read only (or mostly) the tail, 3 and 3
# at one phase are one run, then longer ones
CONV_LENS = [1, 2, 7, 3, 3, 1, 5, 4]


def conv_mixers() -> dict:
    return {
        "native-w4": native().layers[0].mixer,
        "native-w2": MCForCausalLM(ModelConfig(
            vocab_size=V, d_model=24, n_layers=1, n_heads=3, head_dim=8, conv_size=2,
            mc_variant="none")).double().layers[0].mixer,
        "mamba2": mamba2().layers[1].mixer,  # a conv bias; the T = 1 window sum per sequence
        "mamba1": mamba1().layers[0].mixer,  # window 3
    }


@pytest.mark.parametrize("name", ["native-w4", "native-w2", "mamba2", "mamba1"])
@torch.no_grad()
def test_packed_conv_equals_conv_per_sequence(name):
    # one packed conv over all sequences = each mixer's own conv of each sequence from its own
    # tail: outputs, new tails, and the tail fill_conv_tails cuts at every offset of the span
    mixer = conv_mixers()[name]
    w = mixer.conv.weight if hasattr(mixer, "conv") else mixer.conv1d.weight
    C, W = w.shape[0], w.shape[-1]
    g = torch.Generator().manual_seed(13)
    states = [LayerState(mixer.memory.init_state(1, 1, 1, 1, dtype=torch.float64,
                                                 device="cpu"),
                         torch.randn(1, W - 1, C, generator=g, dtype=torch.float64))
              for _ in CONV_LENS]
    xc = torch.randn(1, sum(CONV_LENS), C, generator=g, dtype=torch.float64)
    runs = varlen_mod.phase_runs(states, CONV_LENS)
    assert len(runs) == len(CONV_LENS) - 1  # the two 3s are one run
    bias = None if hasattr(mixer, "conv") else mixer.conv1d.bias
    out, convs, inputs = varlen_mod.conv_varlen(xc, states, CONV_LENS, runs, w[:, 0], bias)
    assert out.shape == xc.shape
    for r, (i, j, s, _) in enumerate(runs):
        for b, n in enumerate(range(i, j)):
            T = CONV_LENS[n]
            lo = s + b * T
            want, tail, full = mixer._conv(xc[:, lo:lo + T], states[n].conv)
            close(out[:, lo:lo + T], want, f"output of sequence {n}")
            close(convs[r][b:b + 1], tail, f"new tail of sequence {n}")
            got_in = ConvInput(inputs[r].tail[b:b + 1], inputs[r].x[b:b + 1])
            for off in range(T + 1):
                close(got_in.rows(off, W - 1), full.rows(off, W - 1), f"tail at {off} of {n}")


def _triton_on_cpu() -> str | None:
    """Why Triton's kernels cannot run here on CPU tensors under its interpreter (None: they
    can; tests/conftest.py sets TRITON_INTERPRET=1 before triton is imported)."""
    try:
        import triton
        from triton.runtime.interpreter import InterpretedFunction
    except Exception as e:  # not installed / broken
        return f"triton unavailable: {type(e).__name__}: {e}"
    if os.environ.get("TRITON_INTERPRET") != "1" or not isinstance(
            triton.language.standard.zeros, InterpretedFunction):
        return "triton was not imported under TRITON_INTERPRET=1 (CUDA test mode?)"
    return None


def none_plain() -> MCForCausalLM:
    """The native ``none`` model with no gates and no conv (the kernel's None gates)."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=V, d_model=24, n_layers=2, n_heads=3, head_dim=8,
                      mc_variant="none", conv_size=0, use_decay_gate=False,
                      use_write_gate=False)
    return MCForCausalLM(cfg).double().eval()


NONE_MODELS = {"linear-none": MODELS["linear-none"], "linear-none-plain": none_plain,
               "mamba2-none": MODELS["mamba2-none"]}
BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(
    _triton_on_cpu() is not None, reason=str(_triton_on_cpu())))]


class KernelSpy:
    """Counts ``dispatch.chunk_linear_prefill`` calls (with their ``cu_seqlens``) and
    ``MCMemory.forward`` calls."""

    def __init__(self, monkeypatch):
        self.prefill: list[list[int] | None] = []
        self.forward = 0
        real, fwd = dispatch.chunk_linear_prefill, MCMemory.forward

        def prefill(*a, **kw):
            cu = kw.get("cu_seqlens")
            self.prefill.append(None if cu is None else cu.tolist())
            return real(*a, **kw)

        def forward(*a, **kw):
            self.forward += 1
            return fwd(*a, **kw)

        monkeypatch.setattr(dispatch, "chunk_linear_prefill", prefill)
        monkeypatch.setattr(MCMemory, "forward", forward)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("record", [False, True], ids=["plain", "record"])
@pytest.mark.parametrize("name", list(NONE_MODELS))
def test_none_linear_varlen_one_memory_call(monkeypatch, name, record, backend):
    # MC none on the gated linear memory: on the kernel backend every sequence's scan is one
    # chunk_linear_prefill over the packed tokens (cu_seqlens) per layer, with the same logits
    # and states as forward per sequence; the torch backend keeps one memory call per run
    # (faster on the CPU than the torch twin's varlen loop)
    model = NONE_MODELS[name]()
    if backend == "triton":
        monkeypatch.setenv("MCSERVE_KERNELS", "triton")
    states, chunks = phased(model, torch.Generator().manual_seed(3))
    ref_in = [recording(st) for st in states] if record else states
    var_in = [recording(st) for st in states] if record else states
    lens = [x.shape[1] for x in chunks]
    with torch.no_grad():
        want = [model(x, st, last_only=True) for x, st in zip(chunks, ref_in, strict=True)]
        spy = KernelSpy(monkeypatch)
        logits, got = model.forward_varlen(torch.cat(chunks, 1), var_in, lens)
    n_layers = model.config.n_layers
    if backend == "triton":
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        assert (spy.prefill, spy.forward) == ([cu] * n_layers, 0)
    else:
        assert spy.prefill == [] and spy.forward == n_layers * len(
            varlen_mod.phase_runs([st.layers[0] for st in states], lens))
    for i, ((lw, sw), sg) in enumerate(zip(want, got, strict=True)):
        close(logits[i], lw[0, -1], f"logits of sequence {i}")
        assert_same_state(sg, sw, f"sequence {i}")
        for li, ls in enumerate(sg.layers):  # the caller's checkpoint list, still empty
            assert ls.mc.record is var_in[i].layers[li].mc.record, (i, li)


@pytest.mark.skipif(_triton_on_cpu() is not None, reason=str(_triton_on_cpu()))
@pytest.mark.parametrize("name", ["linear-none", "mamba2-none"])
def test_none_linear_varlen_kernel_once_per_layer(monkeypatch, name):
    # N fresh prompts of distinct lengths (1 and a few longer than a 64-token chunk): one
    # memory kernel call per layer on the kernel backend, not one per sequence
    model = NONE_MODELS[name]()
    monkeypatch.setenv("MCSERVE_KERNELS", "triton")
    g = torch.Generator().manual_seed(14)
    lens = [5, 1, 70, 12, 3, 66]
    chunks = [torch.randint(0, V, (1, n), generator=g) for n in lens]
    with torch.no_grad():
        want = [model(x, last_only=True) for x in chunks]
        spy = KernelSpy(monkeypatch)
        logits, got = model.forward_varlen(torch.cat(chunks, 1),
                                           [model.init_state(1) for _ in lens], lens)
    assert len(spy.prefill) == model.config.n_layers and spy.forward == 0
    assert all(cu is not None and len(cu) == len(lens) + 1 for cu in spy.prefill)
    for i, ((lw, sw), sg) in enumerate(zip(want, got, strict=True)):
        close(logits[i], lw[0, -1], f"logits of sequence {i}")
        assert_same_state(sg, sw, f"sequence {i}")


# ------------------------------------------------------------------ engine
ENGINES: list[LLMEngine] = []


@pytest.fixture(autouse=True)
def pools_whole_after():
    ENGINES.clear()
    yield
    for eng in ENGINES:
        assert not eng.has_unfinished_requests()
        assert eng.cache.is_whole(), "a block or slot leaked"


def make_engine(model, **kw) -> LLMEngine:
    args = dict(max_num_seqs=8, num_state_blocks=96, max_num_batched_tokens=128,
                dtype="float64", max_model_len=64)
    args.update(kw)
    eng = LLMEngine(EngineConfig(**args), model=model)
    ENGINES.append(eng)
    return eng


def drain(eng: LLMEngine) -> dict:
    done = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
    return done


class Spy:
    """Counts the model's ``forward`` and ``forward_varlen`` calls."""

    def __init__(self, monkeypatch, model):
        self.forward = self.varlen = 0
        fwd, var = model.forward, model.forward_varlen

        def forward(*a, **kw):
            self.forward += 1
            return fwd(*a, **kw)

        def forward_varlen(*a, **kw):
            self.varlen += 1
            return var(*a, **kw)

        monkeypatch.setattr(model, "forward", forward)
        monkeypatch.setattr(model, "forward_varlen", forward_varlen)

    def reset(self) -> None:
        self.forward = self.varlen = 0


def rounds(seed: int = 8) -> tuple[list[list[int]], list[list[int]]]:
    """Round one: fresh prompts of different, mostly odd lengths. Round two: extensions and
    repeats of them (prefix-cache hits of 3, 2 and 2 segments, then 7, 3 and 1 tokens to
    compute) beside a fresh prompt: different lengths and phases in one step."""
    g = torch.Generator().manual_seed(seed)

    def ids(n: int) -> list[int]:
        return torch.randint(0, V, (n,), generator=g).tolist()

    one = [ids(n) for n in (3, 9, 14, 6, 1, 11)]
    two = [one[2] + ids(5), one[1] + ids(2), ids(7), list(one[5]), one[3] + ids(13)]
    return one, two


ENGINE_MODELS = ["linear-grm", "linear-residual", "linear-ssc", "linear-none", "dla-soup",
                 "mamba2-grm", "mamba1-grm"]


@pytest.mark.parametrize("name", ENGINE_MODELS)
def test_engine_one_varlen_call_same_greedy_as_one_at_a_time(monkeypatch, name):
    model = MODELS[name]()
    one, two = rounds()
    alone_eng = make_engine(model)
    alone = {tuple(p): LLM(engine=alone_eng).generate([p], GREEDY)[0].outputs[0].token_ids
             for p in one + two}
    eng = make_engine(model)
    spy = Spy(monkeypatch, model)
    for r, prompts in enumerate((one, two)):
        for i, p in enumerate(prompts):
            eng.add_request(f"{r}-{i}", None, GREEDY, prompt_token_ids=p)
        spy.reset()
        eng.step()  # every prompt's prefill: one call of the model
        assert (spy.varlen, spy.forward) == (1, 0), (spy.varlen, spy.forward)
        done = drain(eng)
        for i, p in enumerate(prompts):
            assert done[f"{r}-{i}"].outputs[0].token_ids == alone[tuple(p)], (r, i)
    if model.config.mc.caches_blocks:
        assert eng.stats()["prefix_cache_hits"] == alone_eng.stats()["prefix_cache_hits"] > 0


def test_engine_chunked_prefill_continues_beside_new_prompts(monkeypatch):
    # a long prompt cut into chunks (segment boundaries) shares later steps with prompts that
    # start fresh: each step's prefills are one call, same tokens as alone
    model = native("linear", "grm")
    g = torch.Generator().manual_seed(9)
    long = torch.randint(0, V, (22,), generator=g).tolist()
    short = [torch.randint(0, V, (n,), generator=g).tolist() for n in (5, 3)]
    want = [LLM(engine=make_engine(model)).generate([p], GREEDY)[0].outputs[0].token_ids
            for p in [long] + short]
    eng = make_engine(model, max_num_batched_tokens=16)
    spy = Spy(monkeypatch, model)
    eng.add_request("long", None, GREEDY, prompt_token_ids=long)
    eng.step()  # 16 of its 22 tokens
    for i, p in enumerate(short):
        eng.add_request(str(i), None, GREEDY, prompt_token_ids=p)
    spy.reset()
    eng.step()  # the long one's last 6 tokens (4 cached segments) and both short ones
    assert (spy.varlen, spy.forward) == (1, 0)
    done = drain(eng)
    assert [done[k].outputs[0].token_ids for k in ("long", "0", "1")] == want


def block_entries(eng: LLMEngine) -> dict[bytes, list[dict[str, torch.Tensor]]]:
    """Every registered block's entries (all layers), by prefix hash."""
    return {h: [{n: t[bid] for n, t in layer.items()} for layer in eng.cache.block]
            for h, bid in eng.cache.by_hash.items()}


@pytest.mark.parametrize("name", ["linear-grm", "linear-residual", "linear-post-indep",
                                  "swla-grm", "mamba2-grm", "mamba1-grm"])
def test_varlen_checkpoints_equal_sequential(name):
    # the blocks a varlen prefill writes (several sequences, each crossing its own number of
    # boundaries) are the blocks of prefilling one at a time: same hashes, same contents, and
    # the same prefix-cache hits and tokens afterwards
    model = MODELS[name]()
    one, two = rounds(11)
    seq_eng, var_eng = make_engine(model), make_engine(model)
    for p in one:
        LLM(engine=seq_eng).generate([p], GREEDY)
    LLM(engine=var_eng).generate(one, GREEDY)
    want, got = block_entries(seq_eng), block_entries(var_eng)
    assert got.keys() == want.keys() and len(got) >= 5
    for h in want:
        for li, (a, b) in enumerate(zip(got[h], want[h], strict=True)):
            for n in b:
                close(a[n], b[n], f"block entry {n} of layer {li}")
    hits = [e.stats()["prefix_cache_hits"] for e in (seq_eng, var_eng)]
    outs = [[o.outputs[0].token_ids for o in LLM(engine=e).generate(two, GREEDY)]
            for e in (seq_eng, var_eng)]
    assert outs[0] == outs[1]
    assert (seq_eng.stats()["prefix_cache_hits"] - hits[0]
            == var_eng.stats()["prefix_cache_hits"] - hits[1] > 0)


def test_prompt_logprobs_alone_and_failure_fails_only_the_varlen_call(monkeypatch):
    # a request that wants prompt logprobs prefills alone (all positions' logits); the others
    # share the varlen call, and an error in that call fails only its requests
    model = native("linear", "grm")
    g = torch.Generator().manual_seed(12)
    ps = [torch.randint(0, V, (n,), generator=g).tolist() for n in (7, 10, 5)]
    want = LLM(engine=make_engine(model)).generate(
        [ps[0]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True,
                                prompt_logprobs=1))[0]
    eng = make_engine(model)

    def broken(items):
        raise RuntimeError("varlen boom")

    monkeypatch.setattr(eng.runner, "prefill_varlen", broken)
    eng.add_request("lp", None, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True,
                                               prompt_logprobs=1), prompt_token_ids=ps[0])
    for i, p in enumerate(ps[1:]):
        eng.add_request(str(i), None, GREEDY, prompt_token_ids=p)
    done = drain(eng)
    assert done["lp"].error is None
    assert done["lp"].outputs[0].token_ids == want.outputs[0].token_ids
    assert len(done["lp"].prompt_logprobs) == len(ps[0])
    for i in range(2):
        assert done[str(i)].outputs[0].finish_reason == "error"
        assert "varlen boom" in done[str(i)].error
