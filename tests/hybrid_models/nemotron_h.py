"""A tiny Nemotron-H: Mamba2, attention (GQA 4/2, no rope), MoE, MLP (relu²), Mamba2, attention,
MoE. Mamba2 with 2 B/C groups; MoE with 6 experts in 2 groups (top 2 of the best group), a
shared expert and routed_scaling_factor 2.5; the norms, D and the router's score correction
perturbed from their initial values, the Δ biases, decays and Mamba2 input projections set so
that the SSM's read weighs against the D skip."""

from __future__ import annotations

import torch

MODEL_TYPE = "nemotron_h"
PATTERN = ["linear_attention", "full_attention", "moe", "mlp", "linear_attention",
           "full_attention", "moe"]


def save_tiny(path, seed: int = 0, layers: list[str] | None = None, **overrides):
    from transformers import NemotronHConfig, NemotronHForCausalLM

    torch.manual_seed(seed)
    kw = dict(vocab_size=97, hidden_size=64, layers_block_type=layers or PATTERN,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96,
              ssm_state_size=16, mamba_num_heads=8, mamba_head_dim=16, n_groups=2,
              chunk_size=8, n_routed_experts=6, num_experts_per_tok=2, moe_intermediate_size=32,
              moe_shared_expert_intermediate_size=48, n_group=2, topk_group=1,
              routed_scaling_factor=2.5, max_position_embeddings=4096, tie_word_embeddings=False)
    kw.update(overrides)
    model = NemotronHForCausalLM(NemotronHConfig(**kw)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".D"):
                p.add_(0.1 * torch.randn_like(p))
            elif name.endswith(".dt_bias"):  # Δ ~ 0.3 .. 1.3: the SSM weighs in
                p.uniform_(-1.0, 1.0)
            elif name.endswith(".A_log"):  # decays exp(-Δ·A) of 0.3 .. 0.97 per token
                p.copy_(torch.empty_like(p).uniform_(0.03, 1.0).log())
            elif name.endswith("mixer.in_proj.weight"):
                p.mul_(4.0)
            elif name.endswith("mixer.conv1d.weight"):
                p.uniform_(-0.5, 0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn_like(b))
    model.save_pretrained(path)
    return model
