"""A tiny Falcon-H1: 3 layers of Mamba2 beside attention (GQA 4/2, rope), every µP multiplier
other than 1 (embedding, attention in/out, key, SSM in/out and the five parts of the µP vector,
MLP gate/down, LM head), the gated RMSNorm in the Mamba2 mixers, 2 B/C groups, untied head; the
norms and D perturbed, and the Δ biases, decays and convolutions set so that the SSM's read
weighs against the D skip."""

from __future__ import annotations

import torch

MODEL_TYPE = "falcon_h1"


def save_tiny(path, seed: int = 0, **overrides):
    from transformers import FalconH1Config, FalconH1ForCausalLM

    torch.manual_seed(seed)
    kw = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, mamba_d_ssm=64, mamba_n_heads=4,
              mamba_d_state=16, mamba_n_groups=2, mamba_d_conv=4, mamba_chunk_size=8,
              mamba_rms_norm=True, embedding_multiplier=1.7, lm_head_multiplier=0.6,
              attention_in_multiplier=1.3, attention_out_multiplier=0.8, key_multiplier=1.5,
              ssm_in_multiplier=0.9, ssm_out_multiplier=1.4,
              ssm_multipliers=[0.7, 1.2, 0.8, 1.25, 0.5], mlp_multipliers=[1.5, 0.75],
              rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
              max_position_embeddings=4096, tie_word_embeddings=False)
    kw.update(overrides)
    model = FalconH1ForCausalLM(FalconH1Config(**kw)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".D"):
                p.add_(0.1 * torch.randn_like(p))
            elif name.endswith(".dt_bias"):
                p.uniform_(-1.0, 1.0)
            elif name.endswith(".A_log"):
                p.copy_(torch.empty_like(p).uniform_(0.03, 1.0).log())
            elif name.endswith("mamba.in_proj.weight"):
                p.mul_(4.0)
            elif name.endswith("mamba.conv1d.weight"):
                p.uniform_(-0.5, 0.5)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
    model.save_pretrained(path)
    return model
