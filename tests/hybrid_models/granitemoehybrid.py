"""A tiny Granite-4.0-H MoE: Mamba2, attention, Mamba2, Mamba2, attention (GQA 4/2), two groups
of B/C, rotary attention with biases, 4 experts (2 per token) beside the shared MLP, every
multiplier off 1, a small chunk size, untied head; every parameter perturbed off its initial
value. tests/test_hybrid_granitemoehybrid.py covers the dense and no-rope configurations."""

from __future__ import annotations

import torch

MODEL_TYPE = "granitemoehybrid"


def save_tiny(path, seed: int = 0, **overrides):
    """``overrides``: other ``GraniteMoeHybridConfig`` values."""
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    torch.manual_seed(seed)
    kw = dict(vocab_size=97, hidden_size=64, intermediate_size=48, shared_intermediate_size=80,
              num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2,
              layer_types=["mamba", "attention", "mamba", "mamba", "attention"],
              mamba_n_heads=8, mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4,
              mamba_chunk_size=8, num_local_experts=4, num_experts_per_tok=2,
              attention_bias=True, position_embedding_type="rope",
              embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.2,
              logits_scaling=2.5, tie_word_embeddings=False, max_position_embeddings=4096,
              pad_token_id=0)
    cfg = GraniteMoeHybridConfig(**{**kw, **overrides})
    model = GraniteMoeHybridForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(path)
    return model
