"""mcserve.models.moe: the grouped fast path against its per-token twin, and each routing mode
against the MoE block of the transformers family that uses it."""

from __future__ import annotations

import pytest
import torch

from mcserve.models.moe import SparseMoE, naive_moe

D = 64


def _randomise(module: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in list(module.parameters()) + list(module.buffers()):
            if t.is_floating_point():
                t.copy_(torch.randn(t.shape, generator=g) * 0.2)


CONFIGS = {
    "softmax_topk": dict(n_experts=4, top_k=2, intermediate=32),
    "softmax_topk_norm_shared_gate": dict(n_experts=8, top_k=3, intermediate=24,
                                          norm_topk_prob=True, shared_intermediate=40,
                                          shared_gate=True),
    "softmax_topk_k1": dict(n_experts=5, top_k=1, intermediate=16, router_bias=True),
    "topk_softmax_shared": dict(n_experts=6, top_k=2, intermediate=32, routing="topk_softmax",
                                shared_intermediate=48),
    "topk_softmax_all": dict(n_experts=3, top_k=3, intermediate=16, routing="topk_softmax",
                             act="gelu"),
    "sigmoid_groups_latent": dict(n_experts=8, top_k=3, intermediate=32, routing="sigmoid",
                                  gated=False, act="relu2", norm_topk_prob=True,
                                  routed_scaling_factor=2.5, n_group=4, topk_group=2,
                                  shared_intermediate=48, shared_gated=False, shared_bias=True,
                                  latent_size=32, latent_bias=True),
    "sigmoid_plain": dict(n_experts=16, top_k=4, intermediate=16, routing="sigmoid",
                          gated=False, act="relu2"),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("n", [1, 7, 33])
def test_fast_matches_naive(name, n):
    moe = SparseMoE(D, **CONFIGS[name]).eval()
    _randomise(moe, seed=n)
    x = torch.randn(1, n, D, generator=torch.Generator().manual_seed(100 + n))
    with torch.no_grad():
        fast, slow = moe(x), naive_moe(moe, x)
    assert fast.shape == x.shape
    torch.testing.assert_close(fast, slow, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", ["grouped", "gathered"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_sync_free_paths_match_loop(name, impl):
    """The sync-free paths (F.grouped_mm, float32 runs on the CPU; the gathered weights of each
    pair) and the loop."""
    loop = SparseMoE(D, **CONFIGS[name], impl="loop").eval()
    fast = SparseMoE(D, **CONFIGS[name], impl=impl).eval()
    _randomise(loop, 11)
    fast.load_state_dict(loop.state_dict())
    for n in (1, 7, 33):
        x = torch.randn(n, D, generator=torch.Generator().manual_seed(n))
        with torch.no_grad():
            torch.testing.assert_close(fast(x), loop(x), atol=1e-5, rtol=1e-5)
    assert fast.max_sync_free_tokens(torch.float32, torch.device("cpu")) is None
    assert loop.max_sync_free_tokens(torch.float32, torch.device("cpu")) == 0


def test_auto_picks_a_sync_free_path_on_cuda_for_few_pairs():
    moe = SparseMoE(D, **CONFIGS[sorted(CONFIGS)[0]]).eval()
    cuda = torch.device("cuda")
    h = torch.empty(0, D, device="meta")
    assert moe._impl(h) == "loop"  # not CUDA
    limit = moe.n_experts // moe.top_k
    assert moe.max_sync_free_tokens(torch.float32, cuda) == limit
    assert moe.max_sync_free_tokens(torch.float32, torch.device("cpu")) == 0


def test_sigmoid_router_stays_fp32():
    moe = SparseMoE(D, **CONFIGS["sigmoid_groups_latent"]).eval()
    _randomise(moe, 12)
    w = moe.router.weight.detach().clone()
    x = torch.randn(7, D).bfloat16()
    with torch.no_grad():
        ref = moe(x.float())
        ref_idx, ref_w = moe.route(x.float())
        moe.to(torch.bfloat16)
        assert moe.router.weight.dtype == torch.float32
        assert moe.e_score_correction_bias.dtype == torch.float32
        assert moe.experts.up_proj.dtype == torch.bfloat16
        assert torch.equal(moe.router.weight, w)  # not rounded through bfloat16
        idx, w_route = moe.route(x)  # the same routing as in float32, to the bit
        assert torch.equal(idx, ref_idx) and torch.equal(w_route, ref_w)
        y = moe(x)
        assert y.dtype == torch.bfloat16
        assert (y.float() - ref).norm() < 0.02 * ref.norm()
        moe.float()
    assert isinstance(moe.router.weight, torch.nn.Parameter)
    other = SparseMoE(D, 4, 2, 16).to(torch.bfloat16)  # softmax routing: cast like the rest
    assert other.router.weight.dtype == torch.bfloat16


def test_shapes_batched_and_empty():
    moe = SparseMoE(D, 4, 2, 16, shared_intermediate=16).eval()
    _randomise(moe, 0)
    x = torch.randn(3, 5, D)
    with torch.no_grad():
        y = moe(x)
        torch.testing.assert_close(y[1], moe(x[1:2])[0], atol=1e-6, rtol=1e-6)
        assert moe(torch.randn(0, D)).shape == (0, D)
    assert y.shape == x.shape


def test_unused_experts_are_skipped():
    moe = SparseMoE(D, 8, 1, 16).eval()
    _randomise(moe, 1)
    with torch.no_grad():
        moe.router.weight.zero_()
        moe.router.weight[5, 0] = 10.0
        moe.experts.gate_up_proj[[0, 1, 2, 3, 4, 6, 7]] = float("nan")  # never read
        x = torch.randn(9, D).abs()
        y = moe(x)
    assert torch.isfinite(y).all()


@pytest.mark.parametrize("kw, msg", [
    (dict(routing="argmax"), "routing"),
    (dict(top_k=9), "top_k"),
    (dict(act="tanhshrink"), "activation"),
    (dict(routing="sigmoid", n_group=3), "n_group"),
    (dict(n_group=2), "sigmoid"),
    (dict(shared_gate=True), "shared"),
    (dict(impl="triton"), "impl"),
])
def test_refused(kw, msg):
    args = dict(n_experts=8, top_k=2, intermediate=16) | kw
    with pytest.raises(ValueError, match=msg):
        SparseMoE(D, **args)


# ------------------------------------------------------------------- against transformers
def _copy(ours: SparseMoE, theirs: dict[str, torch.Tensor], names: dict[str, str]) -> None:
    sd = {ours_name: theirs[their_name] for ours_name, their_name in names.items()}
    ours.load_state_dict(sd, strict=True)


def _compare(ours, ref_fn, n_tokens=(1, 7, 33)):
    for n in n_tokens:
        x = torch.randn(1, n, D, generator=torch.Generator().manual_seed(n))
        with torch.no_grad():
            torch.testing.assert_close(ours(x), ref_fn(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("norm", [True, False])
def test_qwen3_next(norm):
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextSparseMoeBlock

    cfg = Qwen3NextConfig(hidden_size=D, num_experts=8, num_experts_per_tok=3,
                          moe_intermediate_size=24, shared_expert_intermediate_size=40,
                          norm_topk_prob=norm, hidden_act="silu")
    ref = Qwen3NextSparseMoeBlock(cfg).eval()
    _randomise(ref, 3)
    ours = SparseMoE(D, 8, 3, 24, routing="softmax_topk", norm_topk_prob=norm,
                     shared_intermediate=40, shared_gate=True).eval()
    sd = ref.state_dict()
    _copy(ours, sd, {"router.weight": "gate.weight",
                     "experts.gate_up_proj": "experts.gate_up_proj",
                     "experts.down_proj": "experts.down_proj",
                     **{f"shared_expert.{p}_proj.weight": f"shared_expert.{p}_proj.weight"
                        for p in ("gate", "up", "down")},
                     "shared_expert_gate.weight": "shared_expert_gate.weight"})
    _compare(ours, ref)


def test_jamba():
    from transformers import JambaConfig
    from transformers.models.jamba.modeling_jamba import JambaSparseMoeBlock

    cfg = JambaConfig(hidden_size=D, num_experts=6, num_experts_per_tok=2, intermediate_size=32,
                      hidden_act="silu")
    ref = JambaSparseMoeBlock(cfg).eval()
    _randomise(ref, 4)
    ours = SparseMoE(D, 6, 2, 32, routing="softmax_topk").eval()
    _copy(ours, ref.state_dict(), {"router.weight": "router.weight",
                                   "experts.gate_up_proj": "experts.gate_up_proj",
                                   "experts.down_proj": "experts.down_proj"})
    _compare(ours, ref)


def test_granitemoehybrid():
    from transformers import GraniteMoeHybridConfig
    from transformers.models.granitemoehybrid.modeling_granitemoehybrid import (
        GraniteMoeHybridMLP,
        GraniteMoeHybridMoE,
    )

    cfg = GraniteMoeHybridConfig(hidden_size=D, num_local_experts=6, num_experts_per_tok=2,
                                 intermediate_size=32, shared_intermediate_size=48,
                                 hidden_act="silu")
    moe, shared = GraniteMoeHybridMoE(cfg).eval(), GraniteMoeHybridMLP(cfg).eval()
    _randomise(moe, 5)
    _randomise(shared, 6)
    ours = SparseMoE(D, 6, 2, 32, routing="topk_softmax", shared_intermediate=48).eval()
    gate, up = shared.input_linear.weight.chunk(2, dim=0)  # (2I_s, D): gate rows, then up
    _copy(ours, {**moe.state_dict(), "gate": gate, "up": up,
                 "down": shared.output_linear.weight},
          {"router.weight": "router.weight", "experts.gate_up_proj": "experts.gate_up_proj",
           "experts.down_proj": "experts.down_proj", "shared_expert.gate_proj.weight": "gate",
           "shared_expert.up_proj.weight": "up", "shared_expert.down_proj.weight": "down"})
    _compare(ours, lambda x: moe(x) + shared(x))


@pytest.mark.parametrize("latent, groups", [(None, (1, 1)), (32, (4, 2)), (None, (2, 1))])
def test_nemotron_h(latent, groups):
    from transformers import NemotronHConfig
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMoE

    n_group, topk_group = groups
    cfg = NemotronHConfig(hidden_size=D, n_routed_experts=8, num_experts_per_tok=3,
                          moe_intermediate_size=32, moe_shared_expert_intermediate_size=48,
                          n_group=n_group, topk_group=topk_group, norm_topk_prob=True,
                          routed_scaling_factor=2.5, moe_latent_size=latent,
                          mlp_bias=latent is not None, mlp_hidden_act="relu2")
    ref = NemotronHMoE(cfg).eval()
    _randomise(ref, 7)
    ours = SparseMoE(D, 8, 3, 32, routing="sigmoid", gated=False, act="relu2",
                     norm_topk_prob=True, routed_scaling_factor=2.5, n_group=n_group,
                     topk_group=topk_group, shared_intermediate=48, shared_gated=False,
                     shared_bias=cfg.mlp_bias, latent_size=latent,
                     latent_bias=cfg.mlp_bias).eval()
    sd = ref.state_dict()
    names = {"router.weight": "gate.weight",
             "e_score_correction_bias": "gate.e_score_correction_bias",
             "experts.up_proj": "experts.up_proj", "experts.down_proj": "experts.down_proj"}
    for n in sd:
        if n.startswith(("shared_experts.", "fc1_latent_proj.", "fc2_latent_proj.")):
            names[n.replace("shared_experts.", "shared_expert.")] = n
    _copy(ours, sd, names)
    _compare(ours, ref)
