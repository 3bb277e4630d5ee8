"""Granite-4.0-H beyond tests/test_hybrid_models.py (whose fixture is the MoE model with rope):
the dense models without rope (the published Micro/H-1B shape), transformers 5's expert names
beside the older ones it writes, the older layer type names, post-hoc MC on the Mamba2 layers
and the clear errors."""

from __future__ import annotations

import json

import pytest
import torch
from hybrid_models import granitemoehybrid as fixture
from safetensors.torch import load_file, save_file

from mcserve.models.checkpoint import CheckpointError
from mcserve.models.registry import load_model

ATOL = 1e-4


def _ids(T: int, seed: int = 0, V: int = 97) -> torch.Tensor:
    return torch.randint(0, V, (1, T), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def _pieces(model, ids, cuts) -> torch.Tensor:
    """Logits of ``ids`` fed in pieces ending at ``cuts`` (the rest one token at a time)."""
    state, outs, a = None, [], 0
    for b in [*cuts, *range(cuts[-1] + 1, ids.shape[1] + 1)]:
        o, state = model(ids[:, a:b], state)
        outs.append(o)
        a = b
    return torch.cat(outs, 1)


def _edit(path, **changes):
    file = path / "config.json"
    cfg = json.loads(file.read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    file.write_text(json.dumps(cfg))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("granite")
    return path, fixture.save_tiny(path)


@torch.no_grad()
@pytest.mark.parametrize("pos", [None, "nope"])
def test_dense_model_without_rope_matches_transformers(tmp_path, pos):
    ref = fixture.save_tiny(tmp_path, num_local_experts=0, position_embedding_type=pos,
                            tie_word_embeddings=True, attention_bias=False)
    ours = load_model(tmp_path)
    assert all(b.mlp.moe is None for b in ours.blocks)
    assert all(a.rotary is None for a in ours.attn_layers)
    assert ours.lm_head.weight is ours.embed.weight
    ids = _ids(25, 1)
    want = ref(ids).logits
    torch.testing.assert_close(ours(ids)[0], want, atol=ATOL, rtol=0)
    torch.testing.assert_close(_pieces(ours, ids, [10]), want, atol=ATOL, rtol=0)


@torch.no_grad()
def test_transformers5_expert_names_and_older_layer_types_load(tiny, tmp_path):
    path, ref = tiny
    tensors = load_file(path / "model.safetensors")
    legacy = ((".block_sparse_moe.input_linear.weight", ".block_sparse_moe.experts.gate_up_proj"),
              (".block_sparse_moe.output_linear.weight", ".block_sparse_moe.experts.down_proj"),
              (".block_sparse_moe.router.layer.weight", ".block_sparse_moe.router.weight"))
    renamed = {}
    for name, t in tensors.items():
        for a, b in legacy:
            if name.endswith(a):
                name = name[:-len(a)] + b
        renamed[name] = t
    assert renamed.keys() != tensors.keys()
    save_file(renamed, tmp_path / "model.safetensors")
    cfg = json.loads((path / "config.json").read_text())
    cfg["layer_types"] = ["mamba", "attention", "mamba", "mamba", "attention"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    ours = load_model(tmp_path)
    assert [b.attn is not None for b in ours.blocks] == [False, True, False, False, True]
    ids = _ids(19, 2)
    torch.testing.assert_close(ours(ids)[0], ref(ids).logits, atol=ATOL, rtol=0)


@pytest.mark.parametrize("changes,match", [
    ({"position_embedding_type": "alibi"}, "position_embedding_type"),
    ({"layer_types": ["mamba", "sliding_attention", "mamba", "mamba", "attention"]},
     "sliding_attention"),
    ({"layer_types": ["mamba", "attention"]}, "layer_types"),
    ({"num_experts_per_tok": 5}, "num_experts_per_tok"),
    ({"logits_scaling": 0}, "logits_scaling"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"mamba_n_heads": 6}, "mamba_n_heads"),
])
def test_unsupported_configs_are_clear_errors(tmp_path, changes, match):
    fixture.save_tiny(tmp_path)
    _edit(tmp_path, **changes)
    with pytest.raises(CheckpointError, match=match):
        load_model(tmp_path)


def test_missing_expert_tensor_is_named_as_stored(tmp_path):
    fixture.save_tiny(tmp_path)
    file = tmp_path / "model.safetensors"
    tensors = load_file(file)
    tensors.pop("model.layers.3.block_sparse_moe.output_linear.weight")
    save_file(tensors, file)
    with pytest.raises(CheckpointError,
                       match=r"model\.layers\.3\.block_sparse_moe\.output_linear\.weight"):
        load_model(tmp_path)
