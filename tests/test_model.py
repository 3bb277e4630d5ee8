"""MCForCausalLM invariants: full forward == prefill + token-by-token decode ==
prefill split at random points, for every memory family × MC variant × mode."""

import random

import pytest
import torch

from mcserve.config import MEMORIES, VARIANTS, MCConfig, ModelConfig, default_mode
from mcserve.models.native import MCForCausalLM

COMBOS = [
    pytest.param(mem, var, mode, id=f"{mem}-{var}-{mode}")
    for mem in MEMORIES
    for var in VARIANTS
    for mode in ("checkpoint", "independent")
    if not (var == "loglinear" and mode == "independent")
]


def tiny(memory: str, variant: str, mode: str, **kw) -> ModelConfig:
    base = dict(vocab_size=40, d_model=32, n_layers=2, n_heads=2, head_dim=8, memory=memory,
                mc_variant=variant, mc_mode=mode, segment_len=4, mc_top_k=1, inner_chunk=2,
                memory_expansion=2)
    base.update(kw)
    return ModelConfig(**base)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)],
                         ids=["f64", "f32"])
@pytest.mark.parametrize("memory,variant,mode", COMBOS)
def test_forward_decode_split_agree(memory, variant, mode, dtype, tol):
    torch.manual_seed(0)
    model = MCForCausalLM(tiny(memory, variant, mode)).to(dtype)
    T = 19  # 4 full segments of 4 and a partial one
    ids = torch.randint(0, 40, (2, T))
    with torch.no_grad():
        full, _ = model(ids)
        # prefill 6 then decode one token at a time
        logits, state = model(ids[:, :6])
        outs = [logits]
        for t in range(6, T):
            logits, state = model(ids[:, t:t + 1], state)
            outs.append(logits)
        assert _rel(torch.cat(outs, 1), full) < tol
        # random split points
        rng = random.Random(hash((memory, variant, mode)) % 1000)
        cuts = sorted(rng.sample(range(1, T), 3))
        state, outs, prev = None, [], 0
        for c in cuts + [T]:
            logits, state = model(ids[:, prev:c], state)
            outs.append(logits)
            prev = c
        assert _rel(torch.cat(outs, 1), full) < tol
        assert state.pos == T


def test_last_only_logits():
    # the engine's prefill asks for the last position only: same logits, same state
    torch.manual_seed(0)
    model = MCForCausalLM(tiny("linear", "grm", "checkpoint")).double()
    ids = torch.randint(0, 40, (2, 11))
    with torch.no_grad():
        full, s_full = model(ids)
        last, s_last = model(ids, last_only=True)
        assert last.shape == (2, 1, full.shape[-1])
        assert torch.allclose(last, full[:, -1:], rtol=1e-12, atol=1e-12)  # GEMM rounding
        nxt = torch.randint(0, 40, (2, 1))
        assert torch.equal(model(nxt, s_full)[0], model(nxt, s_last)[0])


def test_state_not_mutated():
    torch.manual_seed(0)
    model = MCForCausalLM(tiny("linear", "grm", "checkpoint")).double()
    ids = torch.randint(0, 40, (1, 10))
    with torch.no_grad():
        _, state = model(ids[:, :5])
        a, _ = model(ids[:, 5:], state)
        b, _ = model(ids[:, 5:], state)  # same state reused: same answer
    assert torch.equal(a, b)


def test_mc_changes_output_after_first_segment():
    # the cached memories must actually be read: grm differs from none once a segment is cached
    torch.manual_seed(0)
    ids = torch.randint(0, 40, (1, 12))
    outs = {}
    grm = MCForCausalLM(tiny("linear", "grm", "checkpoint")).double()
    none = MCForCausalLM(tiny("linear", "none", "checkpoint")).double()
    missing = none.load_state_dict(grm.state_dict(), strict=False)
    assert all("u_proj" in k for k in missing.unexpected_keys) and not missing.missing_keys
    with torch.no_grad():
        outs = {"none": none(ids)[0], "grm": grm(ids)[0]}
    assert torch.allclose(outs["none"][:, :4], outs["grm"][:, :4], atol=1e-12)
    assert not torch.allclose(outs["none"][:, 4:], outs["grm"][:, 4:], atol=1e-6)


def test_bad_input_shape():
    model = MCForCausalLM(tiny("linear", "grm", "checkpoint"))
    with pytest.raises(ValueError, match="input_ids"):
        model(torch.zeros(5, dtype=torch.long))


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="memory"):
        tiny("lstm", "grm", "checkpoint")
    with pytest.raises(ValueError, match="mc_variant"):
        tiny("linear", "sparse", "checkpoint")
    with pytest.raises(ValueError, match="mc_mode"):
        tiny("linear", "loglinear", "independent")
    with pytest.raises(ValueError, match="inner_chunk"):
        tiny("dla", "grm", "checkpoint", segment_len=6, inner_chunk=4)


@pytest.mark.parametrize("variant", ["grm", "loglinear"])
def test_two_continuations_of_one_state(variant):
    # cached blocks are stored append-only and shared between states: a second continuation of
    # the same prefix must not see (or overwrite) the first continuation's blocks
    torch.manual_seed(0)
    model = MCForCausalLM(tiny("linear", variant, "checkpoint")).double()
    prefix, a, b = (torch.randint(0, 40, (1, n)) for n in (6, 9, 9))
    with torch.no_grad():
        _, state = model(prefix)
        out_a, _ = model(a, state)
        out_b, _ = model(b, state)
        again_a, _ = model(a, state)
        fresh_b = model(torch.cat([prefix, b], 1))[0][:, 6:]
    assert torch.allclose(out_b, fresh_b, atol=1e-12)
    assert torch.allclose(out_a, again_a, atol=1e-12)


@pytest.mark.parametrize("memory,variant", [("linear", "grm"), ("linear", "loglinear"),
                                            ("dla", "ssc")])
@pytest.mark.parametrize("batch", [1, 2])
def test_training_backward_through_cached_segments(memory, variant, batch):
    # the cached stack is written in place at inference; with autograd on it must not be
    torch.manual_seed(0)
    model = MCForCausalLM(tiny(memory, variant, "checkpoint"))
    logits, _ = model(torch.randint(0, 40, (batch, 13)))
    logits.square().mean().backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("momentum_bias", [-10.0, 0.0, 2.0, 10.0], ids=lambda b: f"m{b:+g}")
def test_titans_inner_loop_stays_bounded_at_any_gate(momentum_bias):
    """Titans' memory is gradient descent with momentum: with the learning-rate gate saturated
    and any momentum, a fresh model's memory must not blow up over a long sequence (it did, to
    NaN, before the step was scaled by (1 - m)/(4 inner_chunk); MQAR training then died within
    tens of steps). Trained weights can still raise the curvature past the bound (see
    docs/deep-memory.md)."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=64, d_model=64, n_layers=2, n_heads=2, head_dim=32,
                      memory="titans", mc_variant="none", segment_len=16, inner_chunk=16)
    model = MCForCausalLM(cfg)
    for layer in model.layers:
        mixer = layer.mixer
        bias = mixer.gate_proj.bias.data.view(len(mixer.gate_names), mixer.H)
        bias[mixer.gate_names.index("eta")] = 10.0  # eta gate ~ 1: the largest step allowed
        bias[mixer.gate_names.index("m")] = momentum_bias
    with torch.no_grad():
        w1_init = max(float(layer.mixer.w1_init.abs().max()) for layer in model.layers)
        logits, state = model(torch.randint(0, 64, (2, 512)))
    assert torch.isfinite(logits).all()
    for layer_state in state.layers:
        w1 = layer_state.mc.mem["W1"]
        assert float(w1.abs().max()) < 4 * w1_init, "titans memory grew without bound"


# the one table of what each variant does; code elsewhere asks these properties
CAPABILITIES = {
    #            segmented log    blocks routes selects mixes  fixed  averages
    "none":      (False, False, False, False, False, False, False, False),
    "residual":  (True,  False, True,  False, False, False, True,  False),
    "post":      (True,  False, True,  False, False, False, True,  True),
    "grm":       (True,  False, True,  True,  False, False, False, False),
    "soup":      (True,  False, True,  True,  False, True,  False, False),
    "ssc":       (True,  False, True,  True,  True,  False, False, False),
    "loglinear": (True,  True,  False, True,  False, False, False, False),
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_mc_capabilities(variant):
    mc = MCConfig(variant=variant)
    got = (mc.segmented, mc.log_segmented, mc.caches_blocks, mc.routes, mc.selects,
           mc.mixes_parameters, mc.fixed_weights, mc.averages)
    assert got == CAPABILITIES[variant]
    assert mc.collapses(True) == mc.fixed_weights and not mc.collapses(False)
    assert not mc.independent
    if not mc.log_segmented:  # loglinear exists in checkpoint mode only
        assert MCConfig(variant=variant, mode="independent").independent
    # a model routes over segments only through u: a learned u_proj unless share_uq
    model = MCForCausalLM(ModelConfig(vocab_size=16, d_model=16, n_layers=1, n_heads=1,
                                      head_dim=8, mc_variant=variant, segment_len=4))
    assert (model.layers[0].mixer.u_proj is not None) == mc.routes
    assert default_mode(variant) in (None, "checkpoint", "independent")
