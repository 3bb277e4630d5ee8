"""Hybrid models with int8 and bf16 weights (``--quantization int8``, ``--dtype bfloat16``'s
linears): every linear of every family of tests/hybrid_models (attention, recurrent
projections, MLPs, heads) takes its low-precision copy, and the engine's greedy tokens and
logprobs agree with the float32 path on the rounded weights (the kernels' twin)."""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch
from hybrid_models import FAMILIES
from lowp_helpers import generate

from mcserve.kernels import cpu
from mcserve.models import lowp_linear as lp
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
