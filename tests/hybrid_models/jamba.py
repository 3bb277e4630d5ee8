"""A tiny Jamba: mamba, attention, mamba, mamba, attention, mamba (GQA 4/2, no rope), MoE of 4
experts (top 2) on layers 1, 3, 5 and dense MLPs on 0, 2, 4; Δ rank 6, state 8; untied head;
every RMSNorm (the mixers' dt/B/C norms included) with random weights."""

from __future__ import annotations

import torch

MODEL_TYPE = "jamba"


def save_tiny(path, seed: int = 0, **overrides):
    from transformers import JambaConfig, JambaForCausalLM

    torch.manual_seed(seed)
    kw = dict(
        vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, attn_layer_period=3,
        attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
        num_experts=4, num_experts_per_tok=2, mamba_d_state=8, mamba_d_conv=4,
        mamba_expand=2, mamba_dt_rank=6, use_mamba_kernels=False,
        tie_word_embeddings=False, max_position_embeddings=4096)
    cfg = JambaConfig(**{**kw, **overrides})
    model = JambaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith("dt_proj.bias"):
                p.uniform_(-4.0, -1.0)  # Δ of a trained model: softplus(bias) ~ 0.02 .. 0.3
    model.save_pretrained(path)
    return model
