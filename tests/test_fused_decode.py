"""The one-call C++ decode block (``Block._fused_decode`` → ``native_block_decode_``) against
the Python path it replaces (the same engine under ``kernels.cpu.twins_only()``): the same
greedy tokens and log-probabilities, with ragged batches of 1, 2 and more rows (the GEMV and
the GEMM paths), cached blocks, per-request ssc top_k, and every gate/conv/u combination."""

from __future__ import annotations

import pytest
import torch

from mcserve.config import EngineConfig, ModelConfig
from mcserve.engine.llm_engine import LLMEngine
from mcserve.engine.sampling import SamplingParams
from mcserve.kernels import cpu
from mcserve.models import native
from mcserve.models.native import MCForCausalLM

pytestmark = pytest.mark.skipif(
    cpu.ops() is None, reason=f"C++ CPU kernels unavailable: {cpu.status()}")

PARAMS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0)


def generate(model, prompts, overrides=None, **engine_kw):
    kw = dict(max_num_seqs=8, num_state_blocks=256, dtype="float32", max_model_len=128,
              max_num_batched_tokens=64)
    kw.update(engine_kw)
    eng = LLMEngine(EngineConfig(**kw), model=model)
    for i, p in enumerate(prompts):
        eng.add_request(str(i), None, PARAMS, prompt_token_ids=p,
                        mc_overrides=(overrides or {}).get(i))
    out = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                c = o.outputs[0]
                out[int(o.request_id)] = (c.token_ids, [d[t].logprob for d, t in
                                                        zip(c.logprobs, c.token_ids)])
    assert eng.cache.is_whole()
    generate.last_engine = eng
    return [out[i] for i in range(len(prompts))]


@pytest.mark.parametrize("variant,kw,n_prompts", [
    ("grm", {}, 1), ("grm", {}, 2), ("grm", {}, 5),
    ("ssc", {"mc_top_k": 2}, 5), ("none", {}, 3),
    ("grm", {"conv_size": 0, "share_uq": True}, 3),
    ("ssc", {"use_decay_gate": False, "mc_mode": "independent"}, 4),
    ("soup", {"use_write_gate": False}, 2)],
    ids=["grm-1row", "grm-2rows", "grm-5rows", "ssc-top2", "none", "grm-noconv-uq",
         "ssc-nodecay-indep", "soup-nowrite"])
def test_fused_block_same_as_python_path(monkeypatch, variant, kw, n_prompts):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=200, d_model=48, n_layers=2, n_heads=3, head_dim=16,
                      mc_variant=variant, segment_len=4, **kw)
    model = MCForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 200, (n,), generator=g).tolist()
               for n in (9, 1, 22, 5, 14)[:n_prompts]]
    overrides = {0: {"mc_top_k": 1}} if variant == "ssc" else None  # per-row top_k
    fused = []
    real = native.Block._fused_decode
    monkeypatch.setattr(native.Block, "_fused_decode",
                        lambda self, x, pl: fused.append(1) or real(self, x, pl))
    got = generate(model, prompts, overrides)
    n_fused = len(fused)
    real_ops = cpu.ops()
    assert real_ops is not None and n_fused > 0
    with cpu.twins_only():
        want = generate(model, prompts, overrides)
    for (ids, lps), (ids_ref, lps_ref) in zip(got, want):
        assert ids == ids_ref
        assert max(abs(a - b) for a, b in zip(lps, lps_ref)) < 5e-4  # float32 sums, 12 steps


def test_fused_block_not_used_when_it_cannot_apply():
    torch.manual_seed(0)
    model = MCForCausalLM(ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2,
                                      head_dim=8, mc_variant="residual", segment_len=4))
    blk = model.layers[0]
    assert blk._fused_variant(blk.mixer.memory.cfg) is None  # collapsed sums: the Python path
    swla = MCForCausalLM(ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2,
                                     head_dim=8, memory="swla", segment_len=4))
    x = torch.randn(1, 1, 32)
    assert swla.layers[0]._fused_decode(x, None) is None  # other memory families


@pytest.mark.parametrize("groups,kw,n_prompts", [
    (1, {}, 1), (2, {"d_has_hdim": True}, 3), (1, {"rmsnorm": False}, 2),
    (1, {"norm_before_gate": True, "time_step_limit": (0.01, 0.5)}, 2), (4, {}, 3)],
    ids=["1group-1row", "2groups-Dhdim-3rows", "no-gated-norm", "norm-first-clamped",
         "group-per-head-3rows"])
def test_fused_mamba2_block_same_as_python_path(monkeypatch, groups, kw, n_prompts):
    from mcserve.models import mamba2

    torch.manual_seed(0)
    cfg = mamba2.Mamba2Config(vocab_size=120, d_model=32, n_layers=2, n_heads=4, head_dim=8,
                              state_size=16, n_groups=groups, **kw)
    model = mamba2.Mamba2MCForCausalLM(cfg).eval()
    with torch.no_grad():  # non-trivial biases, decays and skips
        for blk in model.layers:
            blk.mixer.dt_bias.normal_()
            blk.mixer.A_log.uniform_(-1, 1)
            blk.mixer.D.normal_()
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 120, (n,), generator=g).tolist() for n in (7, 1, 12)[:n_prompts]]
    # every layer in one C++ call (Mamba2Stack), as the engine decodes
    stacked = []
    real_stack = mamba2.Mamba2MCForCausalLM._decode_stack
    monkeypatch.setattr(mamba2.Mamba2MCForCausalLM, "_decode_stack",
                        lambda self, x, layers: (lambda st: stacked.append(st is not None) or st)(
                            real_stack(self, x, layers)))
    got = generate(model, prompts)
    assert stacked and all(stacked)
    # each layer's block as its own C++ call
    fused = []
    real = mamba2.Mamba2Block._fused_decode
    monkeypatch.setattr(mamba2.Mamba2MCForCausalLM, "_decode_stack", lambda *a: None)
    monkeypatch.setattr(mamba2.Mamba2Block, "_fused_decode",
                        lambda self, x, pl: (lambda y: fused.append(y is not None) or y)(
                            real(self, x, pl)))
    per_layer = generate(model, prompts)
    assert fused and all(fused)
    assert per_layer == got  # the same blocks in the same order: bit for bit
    with cpu.twins_only():
        want = generate(model, prompts)
    for (ids, lps), (ids_ref, lps_ref) in zip(got, want):
        assert ids == ids_ref
        assert max(abs(a - b) for a, b in zip(lps, lps_ref)) < 5e-4


def test_fused_block_reads_host_tier_in_place(monkeypatch):
    # more segments than the device pool holds: the fused block reads the host tier's blocks
    # where they are; the Python path (twin) fetches its picks into staging rows
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=200, d_model=48, n_layers=2, n_heads=3, head_dim=16,
                      mc_variant="ssc", mc_top_k=2, segment_len=4)
    model = MCForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 200, (n,), generator=g).tolist() for n in (60, 45, 7)]
    small = dict(num_state_blocks=6, host_state_blocks=64, max_num_batched_tokens=16)
    fused = []
    real = native.Block._fused_decode
    monkeypatch.setattr(native.Block, "_fused_decode",
                        lambda self, x, pl: (lambda y: fused.append(
                            (y is not None, pl.fetch is not None)) or y)(real(self, x, pl)))
    got = generate(model, prompts, **small)
    assert generate.last_engine.stats()["host_blocks_offloaded"] > 0
    assert (True, True) in fused and all(ok for ok, _ in fused)  # host tier, fused
    with cpu.twins_only():
        want = generate(model, prompts, **small)
        assert generate.last_engine.stats()["host_blocks_fetched"] > 0
    full = generate(model, prompts)  # everything on the device
    for (ids, lps), (ids_ref, lps_ref), (ids_full, _) in zip(got, want, full):
        assert ids == ids_ref == ids_full
        assert max(abs(a - b) for a, b in zip(lps, lps_ref)) < 5e-4


def test_fused_block_sees_weights_changed_after_first_decode():
    # the fused block caches its argument tuple; an in-place update, a reassigned parameter
    # and a round trip through .to() must all reach the next decode
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=200, d_model=48, n_layers=2, n_heads=3, head_dim=16,
                      mc_variant="grm", segment_len=4)
    model = MCForCausalLM(cfg).eval()
    prompts = [[5, 7, 11, 13, 17, 19]]
    generate(model, prompts)  # builds the caches

    def same_as_python_path():
        got = generate(model, prompts)
        with cpu.twins_only():
            want = generate(model, prompts)
        assert got[0][0] == want[0][0]
        assert max(abs(a - b) for a, b in zip(got[0][1], want[0][1])) < 5e-4

    with torch.no_grad():  # a reassigned parameter (the projections untouched)
        model.layers[1].norm2.weight = torch.nn.Parameter(torch.randn(48) * 3)
    same_as_python_path()
    model.double().float()  # new storage for every weight, then an in-place update of it
    with torch.no_grad():
        model.layers[0].mlp.down.weight.mul_(5.0)
        model.layers[1].mixer.out_norm.weight.mul_(-2.0)
    same_as_python_path()
    with torch.no_grad():  # the gates' bias, stacked into the decode projection's bias
        model.layers[0].mixer.gate_proj.bias.add_(3.0)
    # both paths read the stacked projection: compare with a model built from the weights
    fresh = MCForCausalLM(cfg).eval()
    fresh.load_state_dict(model.state_dict())
    got, want = generate(model, prompts), generate(fresh, prompts)
    assert got[0][0] == want[0][0]
    assert max(abs(a - b) for a, b in zip(got[0][1], want[0][1])) < 1e-5


def test_fused_mamba2_block_sees_weights_changed_after_first_decode():
    # the Mamba2 block caches its argument tuple too: an in-place update of a matrix, of a
    # per-head vector and a reassigned bias must reach the next decode (compared with a model
    # built from the same weights, whose caches are fresh)
    from mcserve.models import mamba2

    torch.manual_seed(1)
    cfg = mamba2.Mamba2Config(vocab_size=120, d_model=32, n_layers=2, n_heads=4, head_dim=8,
                              state_size=8, use_bias=True)
    model = mamba2.Mamba2MCForCausalLM(cfg).eval()
    prompts = [[5, 7, 11, 13, 17, 19]]
    generate(model, prompts)  # builds the caches
    with torch.no_grad():
        model.layers[0].mixer.out_proj.weight.mul_(3.0)
        model.layers[1].mixer.A_log.add_(1.0)
        model.layers[1].mixer.in_proj.bias = torch.nn.Parameter(
            torch.randn_like(model.layers[1].mixer.in_proj.bias))
    fresh = mamba2.Mamba2MCForCausalLM(cfg).eval()
    fresh.load_state_dict(model.state_dict())
    got, want = generate(model, prompts), generate(fresh, prompts)
    assert got[0][0] == want[0][0]
    assert max(abs(a - b) for a, b in zip(got[0][1], want[0][1])) < 1e-5


@pytest.mark.parametrize("change", ["data", "module", "conv-inplace", "wrapper"])
def test_mamba2_stack_sees_any_change_to_what_it_reads(change):
    # the one-call stack is rebuilt (or reads the change in place) after a parameter's storage
    # is swapped (``.data =``, as ``Module.to`` does), a projection module is replaced, the conv
    # weight is updated in place, or a projection's forward is wrapped (int8 weights): decode
    # then equals a model built fresh from the same weights
    from mcserve.models import mamba2
    from mcserve.models.lowp_linear import apply_weight_precision

    torch.manual_seed(3)
    cfg = mamba2.Mamba2Config(vocab_size=120, d_model=32, n_layers=2, n_heads=4, head_dim=8,
                              state_size=8)
    model = mamba2.Mamba2MCForCausalLM(cfg).eval()
    prompts = [[5, 7, 11, 13, 17, 19]]
    generate(model, prompts)  # builds the stack
    fresh = mamba2.Mamba2MCForCausalLM(cfg).eval()
    with torch.no_grad():
        mixer = model.layers[1].mixer
        if change == "data":
            mixer.out_proj.weight.data = torch.randn_like(mixer.out_proj.weight)
        elif change == "module":
            new = torch.nn.Linear(mixer.in_proj.in_features, mixer.in_proj.out_features,
                                  bias=False)
            mixer.in_proj = new
        elif change == "conv-inplace":
            mixer.conv1d.weight.mul_(-2.0)
    fresh.load_state_dict(model.state_dict())
    if change == "wrapper":
        assert apply_weight_precision(model, "int8", min_numel=1) > 0
        apply_weight_precision(fresh, "int8", min_numel=1)
    got, want = generate(model, prompts), generate(fresh, prompts)
    assert got[0][0] == want[0][0]
    assert max(abs(a - b) for a, b in zip(got[0][1], want[0][1])) < 1e-5


def test_mamba2_stack_only_where_every_block_fuses():
    # MC layers (segment checkpoints) and Δ-scaled layers keep their own decode path; so does
    # autograd; a plain model takes the one-call stack
    from mcserve.models import mamba2

    torch.manual_seed(0)
    kw = dict(vocab_size=120, d_model=32, n_layers=2, n_heads=4, head_dim=8, state_size=8)
    plain = mamba2.Mamba2MCForCausalLM(mamba2.Mamba2Config(**kw)).eval()
    grm = mamba2.Mamba2MCForCausalLM(mamba2.Mamba2Config(**kw, mc_variant="grm",
                                                         segment_len=4)).eval()
    calls = {}
    real = mamba2.Mamba2MCForCausalLM._decode_stack

    def spy(self, x, layers):
        st = real(self, x, layers)
        calls.setdefault(id(self), []).append(st is not None)
        return st

    mamba2.Mamba2MCForCausalLM._decode_stack = spy
    try:
        generate(plain, [[5, 7, 11]])
        generate(grm, [[5, 7, 11]])
    finally:
        mamba2.Mamba2MCForCausalLM._decode_stack = real
    assert calls[id(plain)] and all(calls[id(plain)])
    assert calls[id(grm)] and not any(calls[id(grm)])
