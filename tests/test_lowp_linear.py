"""int8 and bfloat16 weights on the CPU: the C++ kernels (``kernels/cpu/lowp.cpp``) against
their twins on random odd shapes, every instruction-set level this CPU runs against the others,
batch invariance, the model-level swap (``models/lowp_linear.py``), the fused decode blocks with
such weights, the engine flag, and the accuracy users rely on (perplexity close to float32)."""

from __future__ import annotations

import contextlib
import functools
import math

import pytest
import torch
import torch.nn.functional as F
from lowp_helpers import generate
from torch import nn

from mcserve.config import EngineConfig
from mcserve.kernels import cpu
from mcserve.kernels.cpu import twins
from mcserve.models import lowp_linear as lp

needs_ops = pytest.mark.skipif(cpu.ops() is None,
                               reason=f"C++ CPU kernels unavailable: {cpu.status()}")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def levels(kind: str) -> list[int]:
    """The implementation levels of ``kind`` this CPU runs under this build's cap
    (``MCSERVE_CPU_ISA``): 0 scalar .. 3 VNNI / BF16, 4 AMX-BF16 (bf16 only)."""
    return list(range(int(cpu.lowp_info()[f"{kind}_impl"]) + 1))


@contextlib.contextmanager
def cap(level: int):
    """The low-precision kernels limited to ``level`` (as ``MCSERVE_CPU_ISA`` does; never above
    the cap already set)."""
    old = int(cpu.lowp_info()["cap"])
    cpu.ops().lowp_set_cap(min(level, old))
    try:
        yield
    finally:
        cpu.ops().lowp_set_cap(old)


SHAPES = [(1, 37, 77), (2, 5, 33), (3, 130, 1000), (5, 64, 64), (8, 17, 31), (13, 11, 95),
          (16, 40, 129), (40, 9, 200)]  # (rows, N, K): odd K and N, 1..16 rows and beyond


def quantized(N: int, K: int, seed: int):
    """A random weight (rows of mixed scale), its int8 quantization packed for the kernels, and
    the scales."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g) * torch.rand(N, 1, generator=g)
    q, s = lp.quantize_int8(w)
    return w, twins.pack_pairs(q), s


def test_pack_pairs_round_trip():
    g = torch.Generator().manual_seed(3)
    for N, K in ((1, 1), (16, 2), (17, 3), (75, 77)):
        w = torch.randn(N, K, generator=g)
        p = twins.pack_pairs(w)
        assert p.shape == (-(-N // 16), -(-K // 2), 16, 2)
        assert torch.equal(twins.unpack_pairs(p, N, K), w)
        # every weight once, zeros elsewhere (exact: a float sum would depend on its order)
        assert torch.count_nonzero(p) == torch.count_nonzero(w) == N * K
        assert p[0, 0, 0, 0] == w[0, 0]


# ------------------------------------------------------------------------------ kernels
@needs_ops
@pytest.mark.parametrize("B,N,K", SHAPES, ids=lambda v: str(v))
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_q8_kernel_matches_twin_at_every_level(B, N, K, bias):
    w, q, s = quantized(N, K, B * N + K)
    g = torch.Generator().manual_seed(K)
    x = torch.randn(B, K, generator=g) * 3
    b = torch.randn(N, generator=g) if bias else None
    want = twins.linear_q8(x, q, s, b)
    ys = [cpu.ops().q8_linear(x, q, s, b, impl) for impl in levels("int8")]
    for y in ys:  # exact integer sums: every instruction set gives the same bits
        assert torch.equal(y, ys[0])
    # the only difference from the twin: x rounded to int16 per row (< 1e-4 of its largest value)
    assert rel(ys[-1], want) < 1e-3
    assert torch.equal(cpu.linear_q8(x, q, s, b), ys[-1])  # the public op takes the best
    # torch's own weight-only int8 product (the other candidate, slower here: docs/cpu-kernels.md)
    if hasattr(torch.ops.aten, "_weight_int8pack_mm"):
        plain = twins.unpack_pairs(q, N, K).contiguous()
        ref = torch.ops.aten._weight_int8pack_mm(x, plain, s) + (0 if b is None else b)
        assert rel(ys[-1], ref) < 1e-3


@needs_ops
@pytest.mark.parametrize("B,N,K", SHAPES, ids=lambda v: str(v))
def test_bf16_kernel_matches_twin_at_every_level(B, N, K):
    g = torch.Generator().manual_seed(B + N * K)
    wb = twins.pack_pairs(torch.randn(N, K, generator=g).bfloat16())
    s = torch.rand(N, generator=g) + 0.5
    x = torch.randn(B, K, generator=g)
    b = torch.randn(N, generator=g)
    want = twins.linear_bf16(x, wb, s, b)
    for impl in levels("bf16"):
        y = cpu.ops().bf16_linear(x, wb, s, b, impl)
        # levels 0-2 multiply by the exact float32 x; levels 3 (vdpbf16ps) and 4 (AMX tiles)
        # round x to bfloat16
        assert rel(y, want) < (1e-5 if impl < 3 else 1e-2), impl
        if impl >= 3:
            assert rel(y, twins.linear_bf16(x.bfloat16().float(), wb, s, b)) < 1e-5
    assert torch.equal(cpu.linear_bf16(x, wb, s, b), cpu.ops().bf16_linear(x, wb, s, b, -1))


@needs_ops
@pytest.mark.parametrize("kind", ["int8", "bf16"])
def test_kernels_are_batch_invariant(kind):
    """A row gives the same bits alone and inside any batch (1..40 rows), at every level."""
    w, q, s = quantized(67, 301, 3)
    wb = twins.pack_pairs(w.bfloat16())
    x = torch.randn(40, 301, generator=torch.Generator().manual_seed(4))
    op = ((lambda xs, i: cpu.ops().q8_linear(xs, q, s, None, i)) if kind == "int8"
          else (lambda xs, i: cpu.ops().bf16_linear(xs, wb, s, None, i)))
    for impl in levels(kind):
        full = op(x, impl)
        for n in (1, 2, 3, 5, 8, 13, 16, 17):
            assert torch.equal(op(x[:n], impl), full[:n]), (impl, n)
        assert torch.equal(op(x[7:8], impl), full[7:8])


@needs_ops
@pytest.mark.parametrize("B,N,K", [(70, 1000, 777), (33, 48, 64), (16, 17, 1)],
                         ids=["tails", "whole-tiles", "k1"])
def test_bf16_amx_tiles_match_twin_on_any_rows_and_threads(B, N, K):
    """AMX-BF16 (level 4): two row tiles and one, an odd last block, a partial last pair-step;
    every row the twin's on bfloat16-rounded x, the same bits alone, in any batch and however
    many threads split the blocks."""
    info = cpu.lowp_info()
    if int(info["bf16_impl"]) < 4:
        pytest.skip(f"needs a CPU with AMX-BF16 (here: {info['amx_note'] or 'capped'})")
    g = torch.Generator().manual_seed(B + N + K)
    wb = twins.pack_pairs(torch.randn(N, K, generator=g).bfloat16())
    s = torch.rand(N, generator=g) + 0.5
    x = torch.randn(B, K, generator=g)
    b = torch.randn(N, generator=g)
    full = cpu.ops().bf16_linear(x, wb, s, b, 4)
    assert rel(full, twins.linear_bf16(x.bfloat16().float(), wb, s, b)) < 1e-5
    for n in (1, 5, 16, 17, 32):
        assert torch.equal(cpu.ops().bf16_linear(x[B - n:], wb, s, b, 4), full[B - n:]), n
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(cpu.ops().bf16_linear(x, wb, s, b, 4), full)
    finally:
        torch.set_num_threads(threads)


@needs_ops
def test_kernels_edge_rows():
    w, q, s = quantized(9, 20, 5)
    b = torch.randn(9)
    x = torch.randn(3, 20)
    x[1] = 0  # an all-zero row: exactly the bias
    x[2, 3] = float("nan")  # a non-finite row: NaN out, never garbage
    y = cpu.linear_q8(x, q, s, b)
    assert torch.equal(y[1], b) and torch.isnan(y[2]).all()
    assert rel(y[0], twins.linear_q8(x[:1], q, s, b)[0]) < 1e-3
    assert cpu.linear_q8(torch.randn(0, 20), q, s).shape == (0, 9)
    wb = twins.pack_pairs(w.bfloat16())
    assert cpu.linear_bf16(torch.randn(2, 4, 20), wb, torch.ones(9)).shape == (2, 4, 9)
    with pytest.raises(RuntimeError, match="q8_linear: a contiguous packed weight"):
        cpu.ops().q8_linear(torch.randn(2, 23), q, s, None, -1)  # K 23: 12 pairs, not 10
    with pytest.raises(RuntimeError, match="not available"):
        cpu.ops().q8_linear(x, q, s, None, 4)


@needs_ops
def test_cap_limits_the_level():
    info = cpu.lowp_info()
    with cap(0):
        assert cpu.lowp_info()["int8_impl"] == 0 and cpu.lowp_info()["bf16_impl"] == 0
    assert cpu.lowp_info()["int8_impl"] == min(info["int8_max"], info["cap"])


def test_quantize_int8_per_channel():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(33, 70, generator=g) * torch.logspace(-3, 2, 33)[:, None]
    w[5] = 0
    q, s = lp.quantize_int8(w)
    assert q.dtype == torch.int8 and s.shape == (33,) and s[5] == 0 and (q[5] == 0).all()
    assert int(q.abs().max()) == 127 and int(q.min()) >= -127
    err = (w - q.float() * s[:, None]).abs()
    assert (err <= s[:, None] / 2 + 1e-6 * w.abs()).all()  # per-row half a step at most


# ------------------------------------------------------------------------------ the swap
def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(48, 96), nn.GELU(), nn.Linear(96, 40, bias=False),
                         nn.Linear(40, 4))


@pytest.mark.parametrize("kind", ["int8", "bf16"])
def test_apply_weight_precision_routes_and_keeps_a_float_twin(kind):
    model = _mlp()
    f32 = [m.weight.detach().clone() for m in model if isinstance(m, nn.Linear)]
    assert lp.apply_weight_precision(model, kind, min_numel=1000) == 2  # the 40x4 head stays
    assert lp.apply_weight_precision(model, kind, min_numel=1000) == 0  # idempotent
    assert lp.lowp_of(model[3]) is None and torch.equal(model[3].weight, f32[2])
    for m, w in zip((model[0], model[2]), f32):
        got = lp.lowp_of(m)
        assert got is not None and got.kind == kind
        assert torch.equal(m.weight, got.dequantized())  # the float weight holds those values
        assert rel(m.weight, w) < (1e-2 if kind == "int8" else 5e-3)
    x = torch.randn(5, 3, 48)
    with torch.no_grad():
        fast = model(x)
    with cpu.twins_only():  # F.linear on the rounded float weights
        slow = model(x).detach()
    assert rel(fast, slow) < (1e-3 if kind == "int8" else 1e-2)
    y = model(x.requires_grad_())  # autograd on: the plain path, gradients flow
    y.sum().backward()
    assert x.grad is not None and model[0].weight.grad is not None
    assert set(model.state_dict()) == {"0.weight", "0.bias", "2.weight", "3.weight", "3.bias"}


def test_weight_changed_in_place_falls_back_to_it():
    model = _mlp()
    lp.apply_weight_precision(model, "int8", min_numel=1000)
    with torch.no_grad():
        model[0].weight.mul_(2)
        assert lp.lowp_of(model[0]) is None  # stale: the float weight counts now
        x = torch.randn(2, 48)
        assert rel(model[0](x), F.linear(x, model[0].weight, model[0].bias)) < 1e-6


def test_tied_weight_converted_once():
    emb = nn.Embedding(300, 256)
    head = nn.Linear(256, 300, bias=False)
    head.weight = emb.weight
    model = nn.ModuleDict({"embed": emb, "head": head})
    assert lp.apply_weight_precision(model, "int8") == 1
    # the embedding reads the same rounded rows the head multiplies by
    assert torch.equal(emb.weight, lp.lowp_of(head).dequantized())
    info = lp.weight_precision(model)
    assert info["linears"] == {"int8": 1} and info["float32_bytes"] == 300 * 256 * 4
    assert info["compact_bytes"] == 304 * 256 + 300 * 4  # rows padded to blocks of 16


def test_engine_config_validates_quantization():
    assert EngineConfig(quantization="int8").quantization == "int8"
    with pytest.raises(ValueError, match="quantization must be None or one of"):
        EngineConfig(quantization="int4")
    with pytest.raises(ValueError, match="needs dtype='float32'"):
        EngineConfig(quantization="int8", dtype="bfloat16")
    with pytest.raises(ValueError, match="CPU path"):
        EngineConfig(quantization="int8", device="cuda")
    assert lp.load_dtype("bfloat16", "cpu") == "float32"
    assert lp.load_dtype("bfloat16", "cuda:0") == "bfloat16"


def test_serve_flag():
    import argparse

    from mcserve.server.cli_serve import add_engine_args

    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert p.parse_args(["--quantization", "int8"]).quantization == "int8"
    assert "--quantization" in p.format_help()


# ------------------------------------------------------------------------------ models
# The engine's sizes for these tiny models (a test may add more EngineConfig fields).
_generate = functools.partial(generate, max_tokens=12, max_num_seqs=8, max_model_len=128,
                              max_num_batched_tokens=64)


def _mamba2(seed: int = 0):
    from mcserve.models import mamba2

    torch.manual_seed(seed)
    cfg = mamba2.Mamba2Config(vocab_size=120, d_model=32, n_layers=2, n_heads=4, head_dim=8,
                              state_size=16, n_groups=1)
    model = mamba2.Mamba2MCForCausalLM(cfg).eval()
    with torch.no_grad():
        for blk in model.layers:
            blk.mixer.dt_bias.normal_()
            blk.mixer.A_log.uniform_(-1, 1)
            blk.mixer.D.normal_()
    return model


PROMPTS = [[5, 17, 99, 3, 42, 8, 61], [1], [7, 7, 7, 30, 2, 90, 11, 4, 66, 13, 50, 19],
           [101, 3, 3], [44, 12, 8, 9, 119]]


@needs_ops
@pytest.mark.parametrize("kind", ["int8", "bf16"])
def test_mamba2_fused_block_with_lowp_weights(monkeypatch, kind):
    """The one-call C++ Mamba2 block reads the int8 / bfloat16 copies (at every batch size) and
    agrees with the Python path on the rounded float weights; greedy tokens do not depend on how
    many streams run together."""
    from mcserve.models import mamba2

    model = _mamba2()
    assert lp.apply_weight_precision(model, kind, min_numel=1) == 5  # in/out x2, head
    fused = []  # the model's blocks in one C++ call (Mamba2Stack), as the engine decodes
    real = mamba2.Mamba2MCForCausalLM._decode_stack
    monkeypatch.setattr(mamba2.Mamba2MCForCausalLM, "_decode_stack",
                        lambda self, x, layers: (lambda st: fused.append(
                            (x.shape[0], st is not None)) or st)(real(self, x, layers)))
    with cap(2):  # bf16: the exact-x level, comparable with the twin at float32 tolerance
        got = _generate(model, PROMPTS)
    assert fused and all(ok for _, ok in fused) and max(b for b, _ in fused) == 5
    with cpu.twins_only():
        want = _generate(model, PROMPTS)
    for (ids, lps), (ids_ref, lps_ref) in zip(got, want):
        assert ids == ids_ref
        assert max(abs(a - b) for a, b in zip(lps, lps_ref)) < 2e-3
    # batch invariance at the best level: each prompt alone gives the tokens of the batch; the
    # log-probabilities agree to about 1e-5 (the prefill's float32 elementwise ops round a token
    # by a unit in the last place differently with its place in the packed batch, and the
    # state's recurrence carries that along)
    batch = _generate(model, PROMPTS)
    for i, p in enumerate(PROMPTS):
        ids, lps = _generate(model, [p])[0]
        assert ids == batch[i][0]
        assert max(abs(a - b) for a, b in zip(lps, batch[i][1])) < 1e-4


@needs_ops
def test_native_block_with_lowp_weights():
    """The native fused block with int8 o_proj / MLP weights (and the stacked projections when
    every one of them is int8) agrees with the Python path."""
    from mcserve.config import ModelConfig
    from mcserve.models.native import MCForCausalLM

    for gates in (True, False):
        torch.manual_seed(0)
        model = MCForCausalLM(ModelConfig(
            vocab_size=200, d_model=48, n_layers=2, n_heads=3, head_dim=16, mc_variant="grm",
            segment_len=4, use_decay_gate=gates, use_write_gate=gates)).eval()
        lp.apply_weight_precision(model, "int8", min_numel=1000)  # the gates (6x48) stay float
        stacked = model.layers[0].mixer._decode_lowp()
        assert stacked is None if gates else stacked.kind == "int8"
        got = _generate(model, PROMPTS[:3], num_state_blocks=64)
        with cpu.twins_only():
            want = _generate(model, PROMPTS[:3], num_state_blocks=64)
        for (ids, lps), (ids_ref, lps_ref) in zip(got, want):
            assert ids == ids_ref
            assert max(abs(a - b) for a, b in zip(lps, lps_ref)) < 2e-3


# ------------------------------------------------------------------------------ accuracy
def _heldout_ids(tok, n: int) -> list[int]:
    """Natural text the default model was not scored on: the Python reference's topics (stdlib
    ``pydoc_data``), tokenized; the first n tokens."""
    import pydoc_data.topics as topics

    text = "\n\n".join(topics.topics[k] for k in sorted(topics.topics))[:20000]
    return tok.encode(text)[:n]


def _ppl(model, ids: list[int], window: int = 512) -> float:
    nll, count = 0.0, 0
    with torch.inference_mode():
        for i in range(0, len(ids) - window + 1, window):
            x = torch.tensor(ids[i:i + window])[None]
            logits, _ = model(x, None)
            nll += float(F.cross_entropy(logits[0, :-1].float(), x[0, 1:], reduction="sum"))
            count += window - 1
    return math.exp(nll / count)


def test_default_model_perplexity_close_to_float32():
    """int8 and bfloat16 weights keep the embedded model's perplexity within 2% of float32 on
    held-out text (measured: +0.07% and +0.03%, docs/benchmarks.md)."""
    from mcserve.engine.llm import LLM

    base = LLM()
    ids = _heldout_ids(base.engine.tokenizer, 2048)
    assert len(ids) == 2048
    ref = _ppl(base.engine.model, ids)
    for kw in ({"quantization": "int8"}, {"dtype": "bfloat16"}):
        model = LLM(**kw).engine.model
        assert lp.weight_precision(model)["linears"], kw  # the large linears did change
        if kw.get("dtype"):  # and the prefill's cached readout in bfloat16, on any CPU
            assert lp.bf16_readouts(model, enable=True) == len(model.layers)
        assert abs(_ppl(model, ids) / ref - 1) < 0.02, kw


def test_bf16_readout_follows_the_precision_and_the_cpu():
    """``dtype="bfloat16"`` gives the MC memories' chunked readout bfloat16 GEMM operands where
    the CPU has BF16 dot products (``bf16_dot``), float32 elsewhere; int8 and float32 never."""
    from mcserve.config import ModelConfig
    from mcserve.models.mc import MCMemory
    from mcserve.models.native import MCForCausalLM

    def readouts(model):
        mems = [m.memory for m in model.modules() if isinstance(getattr(m, "memory", None),
                                                                  MCMemory)]
        assert len(mems) == 2
        return {m.readout_dtype for m in mems}

    for dtype, quant, want in (("bfloat16", None, torch.bfloat16 if lp.bf16_dot() else None),
                               ("float32", "int8", None), ("float32", None, None)):
        model = MCForCausalLM(ModelConfig(vocab_size=200, d_model=48, n_layers=2, n_heads=3,
                                          head_dim=16, mc_variant="grm", segment_len=4)).eval()
        lp.prepare_cpu_weights(model, dtype, quant)
        assert readouts(model) == {want}, (dtype, quant)
    assert lp.bf16_readouts(model, enable=False) == 0 and readouts(model) == {None}


def test_eval_ppl_quantization_flag(tmp_path):
    """``mcserve eval ppl --quantization int8`` scores the int8 weights the engine would serve."""
    import json

    from mcserve.engine.llm_engine import DEFAULT_MODEL_DIR
    from mcserve.eval.cli import main

    data = tmp_path / "t.txt"
    data.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    out = {}
    for q in (None, "int8"):
        path = tmp_path / f"{q}.json"
        rc = main(["ppl", str(DEFAULT_MODEL_DIR), "--data", str(data), "--mc", "", "--lengths",
                   "64", "--max-windows", "2", "--no-reset", "--no-progress", "--json",
                   str(path)] + (["--quantization", q] if q else []))
        assert rc == 0
        out[q] = json.loads(path.read_text())
    assert out["int8"]["quantization"] == "int8" and out[None]["quantization"] is None
    a, b = (out[q]["results"][0]["ppl"] for q in (None, "int8"))
    assert a != b and abs(b / a - 1) < 0.05


@needs_ops
@pytest.mark.parametrize("kind", ["int8", "bf16"])
def test_packed_rows_match_twin_and_the_dequantized_weight(kind):
    """A token embedding's lookup from the packed table: rows in any order and repeated, odd K
    (a half-used last pair), the last partial block; a row past the table is an error."""
    w, q, s = quantized(37, 77, 11)
    P, scales = (q, s) if kind == "int8" else (twins.pack_pairs(w.bfloat16()), torch.ones(37))
    idx = torch.tensor([36, 0, 5, 5, 17, 32, 1])
    got = cpu.packed_rows(P, scales, idx, 77)
    assert torch.equal(got, twins.packed_rows(P, scales, idx, 77))
    lw = lp.LowpWeight(kind, P, scales, 77)
    assert torch.equal(got, lw.dequantized()[idx]) and torch.equal(lw.rows(idx), got)
    assert cpu.packed_rows(P, scales, idx[:0], 77).shape == (0, 77)
    with pytest.raises(RuntimeError, match="outside"):
        cpu.ops().packed_rows(P, scales, torch.tensor([37]), 77)


@needs_ops
@pytest.mark.parametrize("kind", ["int8", "bf16"])
def test_kernels_split_many_rows_over_threads_without_changing_a_row(kind):
    """700 rows of a 1000-output product go through in chunks of rows, one thread each: every
    row the bits it has alone or under one thread, and the twin's values."""
    w, q, s = quantized(1000, 77, 13)
    wb = twins.pack_pairs(w.bfloat16())
    x = torch.randn(700, 77, generator=torch.Generator().manual_seed(14))
    b = torch.randn(1000, generator=torch.Generator().manual_seed(15))
    op = ((lambda xs, i: cpu.ops().q8_linear(xs, q, s, b, i)) if kind == "int8"
          else (lambda xs, i: cpu.ops().bf16_linear(xs, wb, s, b, i)))
    want = (twins.linear_q8(x, q, s, b) if kind == "int8"
            else twins.linear_bf16(x, wb, s, b))
    for impl in levels(kind):
        full = op(x, impl)
        assert rel(full, want) < (1e-2 if kind == "bf16" and impl >= 3 else 1e-3), impl
        for a, e in ((0, 1), (63, 65), (200, 456), (699, 700)):
            assert torch.equal(op(x[a:e], impl), full[a:e]), (impl, a, e)
        threads = torch.get_num_threads()
        try:
            torch.set_num_threads(1)
            assert torch.equal(op(x, impl), full), impl
        finally:
            torch.set_num_threads(threads)
