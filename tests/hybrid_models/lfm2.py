"""A tiny LFM2: conv, attention, conv, conv, attention (GQA 4/2), untied head."""

from __future__ import annotations

import torch

MODEL_TYPE = "lfm2"


def save_tiny(path, seed: int = 0, **overrides):
    from transformers import Lfm2Config, Lfm2ForCausalLM

    torch.manual_seed(seed)
    kw = dict(
        vocab_size=97, hidden_size=64, intermediate_size=192, num_hidden_layers=5,
        num_attention_heads=4, num_key_value_heads=2, block_multiple_of=16,
        layer_types=["conv", "full_attention", "conv", "conv", "full_attention"],
        tie_word_embeddings=False, max_position_embeddings=4096)
    cfg = Lfm2Config(**{**kw, **overrides})
    model = Lfm2ForCausalLM(cfg).eval()
    model.save_pretrained(path)
    return model
