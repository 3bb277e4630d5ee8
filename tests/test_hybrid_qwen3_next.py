"""Qwen3-Next beyond tests/test_hybrid_models.py: post-hoc MC on its Gated DeltaNet layers, the
configuration options the tiny fixture does not cover (dense MLPs, a sparse step, attention
biases, a tied head, the default layer pattern, as many value heads as key heads, no top-k
renormalisation), checkpoint quirks (multi-token-prediction tensors, stacked experts) and the
clear errors."""

from __future__ import annotations

import json

import pytest
import torch
from hybrid_models import qwen3_next as fixture
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
    path = tmp_path_factory.mktemp("qwen3_next")
    return path, fixture.save_tiny(path)


def _weights(path):
    files = sorted(path.glob("*.safetensors"))
    assert len(files) == 1
    return files[0], load_file(str(files[0]))


def _save(path, **overrides):
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    fixture.use_torch_delta_rule("qwen3_next.modeling_qwen3_next")
    torch.manual_seed(0)
    kw = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=16,
              linear_value_head_dim=16, num_experts=0, initializer_range=0.08)
    kw.update(overrides)
    model = Qwen3NextForCausalLM(Qwen3NextConfig(**kw)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "layernorm.weight", "dt_bias", "bias")):
                p.add_(0.3 * torch.randn_like(p))
    model.save_pretrained(path)
    return model


@torch.no_grad()
@pytest.mark.parametrize("overrides", [
    # dense MLPs everywhere, the default layer pattern (every 4th layer attention), biases on the
    # attention projections, a tied head, one value head per key head, full rotary
    dict(attention_bias=True, tie_word_embeddings=True,
         rope_parameters={"rope_theta": 1000.0, "partial_rotary_factor": 1.0,
                          "rope_type": "default"}),
    # MoE on every second layer, top-k weights not renormalised, no shared expert renorm
    dict(num_experts=3, num_experts_per_tok=2, moe_intermediate_size=24,
         shared_expert_intermediate_size=16, decoder_sparse_step=2, norm_topk_prob=False,
         linear_num_value_heads=6, linear_value_head_dim=8),
], ids=["dense-tied-bias", "sparse-step"])
def test_options_match_transformers(tmp_path, overrides):
    ref = _save(tmp_path, **overrides)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert "full_attention_interval" not in cfg
    ours = load_model(tmp_path)
    for T in (1, 9, 70):
        ids = _ids(T, T).repeat(2, 1)
        ids[1] = _ids(T, T + 100)[0]
        torch.testing.assert_close(ours(ids)[0], ref(ids).logits, atol=ATOL, rtol=0)
    ids = _ids(23, 5)
    torch.testing.assert_close(_pieces(ours, ids, [10]), ref(ids).logits, atol=ATOL, rtol=0)
    if overrides.get("tie_word_embeddings"):
        assert ours.lm_head.weight is ours.embed.weight
        assert [b.attn is not None for b in ours.blocks] == [False, False, False, True]
    else:
        assert [b.mlp.__class__.__name__ for b in ours.blocks] == ["GatedMLP", "SparseMoE"] * 2


@torch.no_grad()
def test_layer_pattern_without_layer_types(tmp_path):
    ref = _save(tmp_path, num_hidden_layers=6, full_attention_interval=3)
    file = tmp_path / "config.json"
    cfg = json.loads(file.read_text())
    cfg.pop("layer_types")
    cfg["full_attention_interval"] = 3
    file.write_text(json.dumps(cfg))
    ours = load_model(tmp_path)
    assert [b.attn is not None for b in ours.blocks] == [False, False, True] * 2
    ids = _ids(15, 4)
    torch.testing.assert_close(ours(ids)[0], ref(ids).logits, atol=ATOL, rtol=0)


@torch.no_grad()
def test_mtp_tensors_are_ignored_and_stacked_experts_load(tiny, tmp_path):
    path, ref = tiny
    file, sd = _weights(path)
    for name in ("config.json",):
        (tmp_path / name).write_text((path / name).read_text())
    sd["mtp.fc.weight"] = torch.zeros(64, 128)
    sd["mtp.layers.0.input_layernorm.weight"] = torch.zeros(64)
    # transformers 5's in-memory layout: the experts of layer 0 stacked
    p = "model.layers.0.mlp.experts"
    gate = torch.stack([sd.pop(f"{p}.{e}.gate_proj.weight") for e in range(4)])
    up = torch.stack([sd.pop(f"{p}.{e}.up_proj.weight") for e in range(4)])
    sd[f"{p}.gate_up_proj"] = torch.cat([gate, up], 1)
    sd[f"{p}.down_proj"] = torch.stack([sd.pop(f"{p}.{e}.down_proj.weight") for e in range(4)])
    save_file(sd, str(tmp_path / "model.safetensors"))
    ours = load_model(tmp_path)
    ids = _ids(12, 3)
    torch.testing.assert_close(ours(ids)[0], ref(ids).logits, atol=ATOL, rtol=0)


def _broken(tiny, tmp_path, edit_cfg=None, edit_sd=None):
    path, _ = tiny
    tmp_path.mkdir(exist_ok=True)
    cfg = json.loads((path / "config.json").read_text())
    if edit_cfg:
        edit_cfg(cfg)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    _, sd = _weights(path)
    if edit_sd:
        edit_sd(sd)
    save_file(sd, str(tmp_path / "model.safetensors"))
    return tmp_path


@pytest.mark.parametrize("edit, match", [
    (lambda c: c.update(hidden_act="gelu"), "hidden_act 'gelu'"),
    (lambda c: c["layer_types"].__setitem__(1, "sliding_attention"),
     r"layer_types \['sliding_attention'\]"),
    (lambda c: c.update(layer_types=["full_attention"] * 5), "without linear_attention"),
    (lambda c: c["rope_parameters"].update(rope_type="yarn"), "rope_type 'yarn'"),
    (lambda c: c.update(linear_num_value_heads=3), "linear_num_value_heads"),
    (lambda c: c.pop("hidden_size"), "'hidden_size' is missing"),
])
def test_unsupported_configs_are_clear_errors(tiny, tmp_path, edit, match):
    path = _broken(tiny, tmp_path, edit_cfg=edit)
    with pytest.raises(CheckpointError, match=match):
        load_model(path)


def test_weight_mismatches_name_the_tensor(tiny, tmp_path):
    def drop_expert(sd):
        sd.pop("model.layers.3.mlp.experts.2.up_proj.weight")

    with pytest.raises(CheckpointError, match=r"model\.layers\.3\.mlp\.experts\.2\.up_proj"):
        load_model(_broken(tiny, tmp_path / "a", edit_sd=drop_expert))

    def drop_ba(sd):
        sd.pop("model.layers.2.linear_attn.in_proj_ba.weight")

    with pytest.raises(CheckpointError, match=r"missing tensor 'model\.layers\.2\.linear_attn"
                                               r"\.in_proj_ba\.weight'"):
        load_model(_broken(tiny, tmp_path / "b", edit_sd=drop_ba))

    def bad_gate(sd):
        sd["model.layers.1.self_attn.q_proj.weight"] = torch.zeros(64, 64)

    with pytest.raises(CheckpointError, match=r"'model\.layers\.1\.self_attn\.q_proj\.weight' "
                                               r"has shape \(64, 64\), expected \(128, 64\)"):
        load_model(_broken(tiny, tmp_path / "c", edit_sd=bad_gate))
