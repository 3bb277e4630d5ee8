"""A tiny Bamba: Mamba2, attention, Mamba2, Mamba2, attention (GQA 4/2), two groups of B/C,
biases on the attention and MLP projections, a small chunk size (transformers' chunked scan over
several chunks), untied head; every parameter perturbed off its initial value."""

from __future__ import annotations

import torch

MODEL_TYPE = "bamba"


def save_tiny(path, seed: int = 0, **overrides):
    """``overrides``: other ``BambaConfig`` values (tests/test_hybrid_bamba.py)."""
    from transformers import BambaConfig, BambaForCausalLM

    torch.manual_seed(seed)
    kw = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=5,
              num_attention_heads=4, num_key_value_heads=2, attn_layer_indices=[1, 4],
              mamba_n_heads=8, mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4,
              mamba_chunk_size=8, attention_bias=True, mlp_bias=True, tie_word_embeddings=False,
              max_position_embeddings=4096, pad_token_id=0)
    cfg = BambaConfig(**{**kw, **overrides})
    model = BambaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(path)
    return model
