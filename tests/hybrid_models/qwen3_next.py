"""A tiny Qwen3-Next: Gated DeltaNet (2 key heads, 4 value heads, K 16, V 8), gated attention
(GQA 4/2, partial rotary 0.5), MoE MLPs (4 experts, top 2, renormalised, gated shared expert)
except one dense layer, untied head; norm weights and dt_bias perturbed from their
initial values so the (1 + w) norms and the decay are exercised."""

from __future__ import annotations

import importlib
import inspect

import torch

MODEL_TYPE = "qwen3_next"


def use_torch_delta_rule(module: str) -> None:
    """Make transformers' ``module`` (e.g. ``qwen3_next.modeling_qwen3_next``) run its own torch
    delta-rule functions: with fla installed it picks fla's Triton kernels at import time,
    which need a GPU. The reference the tests compare against is the torch fallback."""
    mod = importlib.import_module(f"transformers.models.{module}")
    for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"):
        setattr(mod, name, inspect.unwrap(getattr(mod, name)))


def save_tiny(path, seed: int = 0, **overrides):
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    use_torch_delta_rule("qwen3_next.modeling_qwen3_next")
    torch.manual_seed(seed)
    kw = dict(

        vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=5,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        layer_types=["linear_attention", "full_attention", "linear_attention",
        "linear_attention", "full_attention"],
        rope_parameters={"rope_theta": 10000.0, "partial_rotary_factor": 0.5,
        "rope_type": "default"},
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=8, linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=48, mlp_only_layers=[2],
        decoder_sparse_step=1, norm_topk_prob=True, tie_word_embeddings=False,
        max_position_embeddings=4096, initializer_range=0.08)
    cfg = Qwen3NextConfig(**{**kw, **overrides})
    model = Qwen3NextForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "layernorm.weight", "dt_bias")):
                p.add_(0.3 * torch.randn_like(p))
    model.save_pretrained(path)
    return model
