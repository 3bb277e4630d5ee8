"""Bamba beyond tests/test_hybrid_models.py: post-hoc MC on its Mamba2 layers, the configuration
options the tiny fixture does not cover (the older rope keys with transformers' hard-coded half
rotary, a tied head without biases, a Δ limit), and the clear errors."""

from __future__ import annotations

import json

import pytest
import torch
from hybrid_models import bamba as fixture
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


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("bamba")
    return path, fixture.save_tiny(path)


@torch.no_grad()
def test_older_rope_keys_get_half_rotary_as_in_transformers(tmp_path):
    from transformers import BambaForCausalLM

    fixture.save_tiny(tmp_path)
    file = tmp_path / "config.json"
    cfg = json.loads(file.read_text())
    cfg.pop("rope_parameters")
    cfg["rope_theta"] = 500000.0
    file.write_text(json.dumps(cfg))
    ref = BambaForCausalLM.from_pretrained(tmp_path).eval()
    ours = load_model(tmp_path)
    rot = ours.attn_layers[0].rotary
    assert rot.rotary_dim == 8 and rot.inv_freq[1].item() == pytest.approx(500000.0 ** -0.25)
    ids = _ids(20, 2)
    torch.testing.assert_close(ours(ids)[0], ref(ids).logits, atol=ATOL, rtol=0)


@torch.no_grad()
@pytest.mark.parametrize("overrides", [
    {"tie_word_embeddings": True, "attention_bias": False, "mlp_bias": False,
     "mamba_n_groups": 1, "mamba_conv_bias": False, "mamba_proj_bias": True},
    {"time_step_limit": (0.0, 0.3), "rope_parameters": {"rope_theta": 100.0,
                                                         "rope_type": "default",
                                                         "partial_rotary_factor": 1.0}},
], ids=["tied-nobias", "dt-limit-full-rotary"])
def test_other_options_match_transformers(tmp_path, overrides):
    ref = fixture.save_tiny(tmp_path, **overrides)
    ours = load_model(tmp_path)
    ids = _ids(27, 3)
    want = ref(ids).logits
    torch.testing.assert_close(ours(ids)[0], want, atol=ATOL, rtol=0)
    if "time_step_limit" not in overrides:  # transformers' decode step does not clamp Δ
        torch.testing.assert_close(_pieces(ours, ids, [9]), want, atol=ATOL, rtol=0)


def _edit(path, **changes):
    file = path / "config.json"
    cfg = json.loads(file.read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    file.write_text(json.dumps(cfg))


@pytest.mark.parametrize("changes,match", [
    ({"attn_layer_indices": [1, 5]}, "attn_layer_indices"),
    ({"attn_layer_indices": [0, 1, 2, 3, 4]}, "Transformer"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"mamba_d_head": 12}, "mamba_d_head"),
    ({"rope_parameters": {"rope_theta": 1e4, "rope_type": "yarn", "factor": 2.0}}, "yarn"),
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
    ({"mc_variant": "nope"}, "mc_variant"),
])
def test_unsupported_configs_are_clear_errors(tmp_path, changes, match):
    fixture.save_tiny(tmp_path)
    _edit(tmp_path, **changes)
    with pytest.raises(CheckpointError, match=match):
        load_model(tmp_path)


def test_missing_and_unknown_tensors_are_named(tmp_path):
    fixture.save_tiny(tmp_path)
    file = tmp_path / "model.safetensors"
    tensors = load_file(file)
    dt = tensors.pop("model.layers.2.mamba.dt_bias")
    save_file(tensors, file)
    with pytest.raises(CheckpointError, match=r"model\.layers\.2\.mamba\.dt_bias"):
        load_model(tmp_path)
    tensors["model.layers.2.mamba.dt_bias"] = dt
    tensors["model.layers.1.mamba.dt_bias"] = dt.clone()
    save_file(tensors, file)
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mamba\.dt_bias"):
        load_model(tmp_path)
