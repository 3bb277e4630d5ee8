"""Hybrid models with int8 and bf16 weights (``--quantization int8``, ``--dtype bfloat16``'s
linears): every linear of every family of tests/hybrid_models (attention, recurrent
projections, MLPs, heads) and every MoE's routed experts take their low-precision copies, and
the engine's greedy tokens and logprobs agree with the float32 path on the rounded weights (the
kernels' twin)."""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch
from hybrid_models import FAMILIES
from lowp_helpers import generate

from mcserve.kernels import cpu
from mcserve.kernels.cpu import twins
from mcserve.models import lowp_linear as lp
from mcserve.models.moe import Experts, SparseMoE
from mcserve.models.registry import load_model

pytestmark = pytest.mark.skipif(cpu.ops() is None,
                                reason=f"C++ CPU kernels unavailable: {cpu.status()}")


@contextlib.contextmanager
def _exact_x():
    """The kernels at the level that keeps x in float32 (as the twin does)."""
    old = int(cpu.lowp_info()["cap"])
    cpu.ops().lowp_set_cap(min(2, old))
    try:
        yield
    finally:
        cpu.ops().lowp_set_cap(old)


#: the families of tests/hybrid_models whose tiny model has sparse MoE layers
MOE_FAMILIES = {"granitemoehybrid", "jamba", "nemotron_h", "qwen3_next"}

# The engine's sizes for these tiny models.
_generate = functools.partial(generate, max_tokens=8, max_num_seqs=4, max_num_batched_tokens=48,
                              kv_cache_mib=4, state_cache_mib=64)


@pytest.mark.parametrize("kind", ["int8", "bf16"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_hybrid_with_low_precision_weights(family, kind, tmp_path, monkeypatch):
    calls = []
    name = "linear_q8" if kind == "int8" else "linear_bf16"
    real = getattr(cpu, name)
    monkeypatch.setattr(cpu, name, lambda *a, **kw: calls.append(1) or real(*a, **kw))
    FAMILIES[family].save_tiny(tmp_path)
    model = load_model(tmp_path)
    n_linear = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert lp.apply_weight_precision(model, kind, min_numel=1) == n_linear
    n_experts = sum(isinstance(m, Experts) for m in model.modules())
    assert n_experts or family not in MOE_FAMILIES
    assert lp.apply_expert_precision(model, kind, min_numel=1) == n_experts
    V = model.embed.num_embeddings
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in (5, 23, 2)]
    with _exact_x():
        got = _generate(model, prompts)
    assert calls, "the low-precision kernels were not reached"
    with cpu.twins_only():
        want = _generate(model, prompts)
    for (ids, lps), (ids_ref, lps_ref) in zip(got, want, strict=True):
        assert ids == ids_ref
        assert max(abs(a - b) for a, b in zip(lps, lps_ref, strict=True)) < 2e-3


@pytest.mark.parametrize("kind", ["int8", "bf16"])
@pytest.mark.parametrize("gated", [True, False])
def test_moe_experts_with_low_precision_weights(kind, gated, monkeypatch):
    """A sparse MoE's routed experts (stacked parameters, not linears) with int8 / bfloat16
    copies per expert: the CPU reads them in one C++ call for the layer, and its output equals the
    float path on the rounded weights (the twin); the weights really are rounded; an in-place
    change of the float experts makes them count again."""
    torch.manual_seed(0)
    moe = SparseMoE(48, n_experts=5, top_k=2, intermediate=40, gated=gated,
                    routing="softmax_topk").eval()
    x = torch.randn(9, 48)
    with torch.inference_mode():
        before = moe(x)
    calls = []
    real = cpu.moe_experts
    monkeypatch.setattr(cpu, "moe_experts",
                        lambda *a, **kw: calls.append(a[3].dtype) or real(*a, **kw))
    assert lp.apply_expert_precision(moe, kind, min_numel=10**6) == 0  # too small: unchanged
    assert lp.apply_expert_precision(moe, kind, min_numel=1) == 1
    assert lp.apply_expert_precision(moe, kind, min_numel=1) == 0  # idempotent
    info = lp.weight_precision(moe)
    share = 0.35 if kind == "int8" else 0.6  # a quarter / a half, plus scales and padding
    assert info["experts"] == 1 and info["compact_bytes"] < share * info["float32_bytes"]
    with torch.inference_mode(), _exact_x():
        got = moe(x)
    assert calls == [torch.int8 if kind == "int8" else torch.bfloat16]  # all in one C++ call
    with torch.inference_mode(), cpu.twins_only():
        want = moe(x)
    assert not torch.equal(want, before)
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-5)
    calls.clear()
    with torch.no_grad():
        moe.experts.down_proj.mul_(2)
    with torch.inference_mode():
        doubled = moe(x)
    assert calls == [torch.float32]  # the float experts count: the copies are stale
    torch.testing.assert_close(doubled, 2 * want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("quantization, dtype, kind", [("int8", "float32", "int8"),
                                                       (None, "bfloat16", "bf16")])
def test_engine_precision_step_covers_moe_experts(quantization, dtype, kind):
    """The engine's precision step (``--quantization int8``, ``--dtype bfloat16`` on the CPU)
    gives a MoE layer's experts their copies at the default size threshold (each expert matrix
    of 2¹⁶ weights here), as it does the linears; the router (small) stays float32."""
    torch.manual_seed(1)
    moe = SparseMoE(256, n_experts=4, top_k=2, intermediate=256).eval()
    assert moe.experts.down_proj[0].numel() >= lp.MIN_NUMEL > moe.router.weight.numel()
    assert lp.prepare_cpu_weights(moe, dtype, quantization) == 1  # the experts, no linear
    info = lp.weight_precision(moe)
    assert info["experts"] == 1 and info["linears"] == {}
    assert moe.experts.lowp.w_in[0].kind == kind


@pytest.mark.parametrize("kind", ["int8", "bf16", "f32"])
@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("act", [0, 1, 2])
def test_moe_experts_kernel_matches_twin(kind, gated, act):
    """``kernels.cpu.moe_experts`` (one C++ call for a layer's routed experts, packed int8 /
    bfloat16 or float32 stacks) against its twin on fresh random odd shapes: experts with no
    token, a token's experts in any order, one and several tokens; x kept in float32 by the
    kernels (as the twin does) it agrees to rounding."""
    g = torch.Generator().manual_seed(7 + act)
    E, D, inter = 7, 37, 23
    n1 = 2 * inter if gated else inter
    f_in = torch.randn(E, n1, D, generator=g)
    f_down = torch.randn(E, D, inter, generator=g) / 5
    if kind == "f32":
        wi, si, wd, sd = f_in, None, f_down, None
    else:
        (wi, si, _), (wd, sd, _) = (lp.stack_experts([lp.make_lowp(kind, m) for m in f])
                                    for f in (f_in, f_down))
    for T, k in ((1, 3), (5, 2), (11, 4)):
        x = torch.randn(T, D, generator=g)
        idx = torch.stack([torch.randperm(E - 1, generator=g)[:k] for _ in range(T)])  # E-1 idle
        w = torch.rand(T, k, generator=g)
        want = twins.moe_experts(x, idx, w, wi, si, wd, sd, gated, act)
        with _exact_x():
            got = cpu.moe_experts(x, idx, w, wi, si, wd, sd, gated, act)
        tol = 1e-4 if kind == "int8" else 1e-5  # int8: x rounded to int16 codes
        assert float((got - want).abs().max() / want.abs().max()) < tol, (T, k)
        best = cpu.moe_experts(x, idx, w, wi, si, wd, sd, gated, act)  # the CPU's best level
        assert float((best - want).abs().max() / want.abs().max()) < 2e-2
        rows = torch.cat([cpu.moe_experts(x[t:t + 1], idx[t:t + 1], w[t:t + 1], wi, si, wd, sd,
                                          gated, act) for t in range(T)])
        if kind == "f32":  # float32: gemv at one or two rows, ATen's GEMM beyond
            torch.testing.assert_close(rows, best, rtol=1e-4, atol=1e-4)
        else:  # a token's result does not depend on the others
            assert torch.equal(rows, best)
    empty = cpu.moe_experts(x[:0], idx[:0], w[:0], wi, si, wd, sd, gated, act)
    assert empty.shape == (0, D)
    with pytest.raises(RuntimeError, match="expert index 7 out of"):
        cpu.moe_experts(x, torch.full_like(idx, E), w, wi, si, wd, sd, gated, act)
