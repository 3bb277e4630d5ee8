"""Jamba specifics (tests/test_hybrid_models.py runs the shared checks on the fixture
tests/hybrid_models/jamba.py): a dense, tied variant with its own attention head dim, the
original checkpoints' one-Linear-per-expert layout, post-hoc MC on the Mamba layers, and the
errors for what is not supported."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from hybrid_models import jamba as fixture
from hybrid_models import rewrite  # noqa: E402

from mcserve.models.checkpoint import CheckpointError  # noqa: E402
from mcserve.models.registry import load_model  # noqa: E402

ATOL = 1e-4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("jamba")
    ref = fixture.save_tiny(path)
    return path, ref


def _ids(T: int, seed: int, batch: int = 2) -> torch.Tensor:
    return torch.randint(0, 97, (batch, T), generator=torch.Generator().manual_seed(seed))



@torch.no_grad()
def test_dense_tied_with_own_head_dim_matches_transformers(tmp_path):
    from transformers import JambaConfig, JambaForCausalLM

    torch.manual_seed(1)
    cfg = JambaConfig(vocab_size=97, hidden_size=64, intermediate_size=80, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=1, head_dim=8,
                      attn_layer_period=2, attn_layer_offset=0, num_experts=1,
                      mamba_d_state=4, mamba_d_conv=3, mamba_expand=1, mamba_conv_bias=False,
                      mamba_proj_bias=True, rms_norm_eps=1e-5, use_mamba_kernels=False,
                      tie_word_embeddings=True)
    ref = JambaForCausalLM(cfg).eval()
    for name, p in ref.named_parameters():
        if name.endswith("norm.weight"):
            p.uniform_(0.5, 1.5)
    ref.save_pretrained(tmp_path)
    ours = load_model(tmp_path)
    assert ours.config.attn_head_dim == 8 and ours.config.tie_embeddings
    assert [b.attn is not None for b in ours.blocks] == [True, False, True, False]
    ids = _ids(19, 0)
    torch.testing.assert_close(ours(ids)[0], ref(ids).logits, atol=ATOL, rtol=0)


@torch.no_grad()
def test_per_expert_layout_is_stacked(tiny, tmp_path):
    path, ref = tiny

    def split(sd):
        out = {}
        for name, t in sd.items():
            if name.endswith("experts.gate_up_proj"):
                base = name[:-len("gate_up_proj")]
                gate, up = t.chunk(2, dim=1)
                for e in range(t.shape[0]):
                    out[f"{base}{e}.gate_proj.weight"] = gate[e]
                    out[f"{base}{e}.up_proj.weight"] = up[e]
            elif name.endswith("experts.down_proj"):
                base = name[:-len("down_proj")]
                for e in range(t.shape[0]):
                    out[f"{base}{e}.down_proj.weight"] = t[e]
            else:
                out[name] = t
        return out

    legacy = rewrite(path, tmp_path / "legacy", tensors=split)
    ids = _ids(13, 1)
    torch.testing.assert_close(load_model(legacy)(ids)[0], ref(ids).logits, atol=ATOL, rtol=0)

    def drop_one(sd):
        sd = split(sd)
        del sd["model.layers.3.feed_forward.experts.2.up_proj.weight"]
        return sd

    broken = rewrite(path, tmp_path / "broken", tensors=drop_one)
    with pytest.raises(CheckpointError, match=r"layers\.3\.feed_forward\.experts\.2\.up_proj"):
        load_model(broken)


@pytest.mark.parametrize("change,match", [
    (lambda c: c.update(hidden_act="gelu"), "hidden_act 'gelu'"),
    (lambda c: c.update(attn_layer_offset=3, attn_layer_period=3), "attn_layer_offset 3"),
    (lambda c: c.update(expert_layer_offset=2), "expert_layer_offset 2"),
    (lambda c: c.update(attn_layer_period=1, attn_layer_offset=0), "without Mamba layers"),
    (lambda c: c.update(num_experts_per_tok=5), "num_experts_per_tok 5"),
    (lambda c: c.pop("num_attention_heads"), "num_attention_heads"),
])
def test_unsupported_configs_are_refused(tiny, tmp_path, change, match):
    path, _ = tiny
    bad = rewrite(path, tmp_path / "bad", config=change)
    with pytest.raises(CheckpointError, match=match):
        load_model(bad)


def test_missing_and_unknown_tensors_are_named(tiny, tmp_path):
    path, _ = tiny

    def drop(sd):
        del sd["model.layers.2.mamba.b_layernorm.weight"]
        return sd

    with pytest.raises(CheckpointError, match=r"model\.layers\.2\.mamba\.b_layernorm\.weight"):
        load_model(rewrite(path, tmp_path / "drop", tensors=drop))

    def extra(sd):
        sd["model.layers.1.self_attn.rotary.inv_freq"] = torch.ones(4)
        return sd

    with pytest.raises(CheckpointError, match=r"self_attn\.rotary\.inv_freq"):
        load_model(rewrite(path, tmp_path / "extra", tensors=extra))
