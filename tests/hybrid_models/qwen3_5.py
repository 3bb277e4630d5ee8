"""A tiny Qwen3.5 language model (``Qwen3_5ForCausalLM``, model_type ``qwen3_5_text``): Gated
DeltaNet with Qwen3.5's four input projections (2 key heads, 4 value heads, K 16, V 8), gated
attention (GQA 4/2, partial rotary 0.5), dense MLPs, untied head; norm weights and dt_bias
perturbed from their initial values."""

from __future__ import annotations

import torch

from .qwen3_next import use_torch_delta_rule

MODEL_TYPE = "qwen3_5_text"


def save_tiny(path, seed: int = 0, **overrides):
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    use_torch_delta_rule("qwen3_5.modeling_qwen3_5")
    torch.manual_seed(seed)
    kw = dict(

        vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=5,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        layer_types=["linear_attention", "full_attention", "linear_attention",
        "linear_attention", "full_attention"],
        rope_parameters={"rope_theta": 10000.0, "partial_rotary_factor": 0.5,
        "rope_type": "default", "mrope_section": [2, 1, 1],
        "mrope_interleaved": True},
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=8, linear_conv_kernel_dim=4, tie_word_embeddings=False,
        max_position_embeddings=4096, initializer_range=0.08)
    cfg = Qwen3_5TextConfig(**{**kw, **overrides})
    model = Qwen3_5ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "layernorm.weight", "dt_bias")):
                p.add_(0.3 * torch.randn_like(p))
    model.save_pretrained(path)
    return model
