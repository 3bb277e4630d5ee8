"""Qwen3.5 beyond tests/test_hybrid_models.py (whose fixture is the dense text model,
``qwen3_5_text``): the MoE text model (``qwen3_5_moe_text``), the language model of the
image-text checkpoints (``qwen3_5``, ``qwen3_5_moe``: ``model.language_model.*`` tensors, the
vision tower left out), post-hoc MC on the Gated DeltaNet layers, and the clear errors."""

from __future__ import annotations

import json

import pytest
import torch
from hybrid_models import qwen3_5 as fixture
from hybrid_models.qwen3_next import use_torch_delta_rule

from mcserve.models.checkpoint import CheckpointError
from mcserve.models.registry import load_model

ATOL = 1e-4
TEXT = dict(vocab_size=97, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
            linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
            initializer_range=0.08,
            rope_parameters={"rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                             "rope_type": "default", "mrope_section": [2, 1, 1],
                             "mrope_interleaved": True})
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
           shared_expert_intermediate_size=48)
VISION = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=32, out_hidden_size=64,
              patch_size=4, temporal_patch_size=2, spatial_merge_size=2)
SPECIAL = dict(image_token_id=93, video_token_id=94, vision_start_token_id=95,
               vision_end_token_id=96)


def _ids(T: int, seed: int = 0, V: int = 90) -> torch.Tensor:
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


def _perturb_and_save(model, path):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "layernorm.weight", "dt_bias")):
                p.add_(0.3 * torch.randn_like(p))
    model.save_pretrained(path)
    return model.eval()


def _moe_text(path):
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    use_torch_delta_rule("qwen3_5_moe.modeling_qwen3_5_moe")
    torch.manual_seed(0)
    cfg = Qwen3_5MoeTextConfig(**TEXT, **MOE, tie_word_embeddings=True)
    return _perturb_and_save(Qwen3_5MoeForCausalLM(cfg).eval(), path)


def _image_text(path):
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    use_torch_delta_rule("qwen3_5.modeling_qwen3_5")
    torch.manual_seed(0)
    cfg = Qwen3_5Config(text_config={**TEXT, "intermediate_size": 96}, vision_config=VISION,
                        tie_word_embeddings=True, **SPECIAL)
    return _perturb_and_save(Qwen3_5ForConditionalGeneration(cfg).eval(), path)


def _moe_image_text(path):
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    use_torch_delta_rule("qwen3_5_moe.modeling_qwen3_5_moe")
    torch.manual_seed(0)
    cfg = Qwen3_5MoeConfig(text_config={**TEXT, **MOE}, vision_config=VISION,
                           tie_word_embeddings=False, **SPECIAL)
    return _perturb_and_save(Qwen3_5MoeForConditionalGeneration(cfg).eval(), path)


@torch.no_grad()
@pytest.mark.parametrize("make, n_moe", [(_moe_text, 4), (_image_text, 0),
                                         (_moe_image_text, 4)],
                         ids=["moe-text", "image-text", "moe-image-text"])
def test_text_models_match_transformers(tmp_path, make, n_moe):
    ref = make(tmp_path)
    ours = load_model(tmp_path)
    assert sum(b.mlp.__class__.__name__ == "SparseMoE" for b in ours.blocks) == n_moe
    for T in (1, 9, 70):
        ids = torch.cat([_ids(T, T), _ids(T, T + 100)])
        torch.testing.assert_close(ours(ids)[0], ref(input_ids=ids).logits, atol=ATOL, rtol=0)
    ids = _ids(23, 5)
    torch.testing.assert_close(_pieces(ours, ids, [10]), ref(input_ids=ids).logits,
                               atol=ATOL, rtol=0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_5")
    return path, fixture.save_tiny(path)


def _copy(tiny, tmp_path, edit):
    path, _ = tiny
    cfg = json.loads((path / "config.json").read_text())
    edit(cfg)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    for f in path.glob("*.safetensors"):
        (tmp_path / f.name).write_bytes(f.read_bytes())
    return tmp_path


@pytest.mark.parametrize("edit, match", [
    (lambda c: c.update(model_type="qwen3_5", text_config=None), "needs a 'text_config'"),
    (lambda c: c.update(hidden_act="relu"), "hidden_act 'relu'"),
    (lambda c: c["rope_parameters"].update(rope_type="dynamic"), "rope_type 'dynamic'"),
])
def test_unsupported_configs_are_clear_errors(tiny, tmp_path, edit, match):
    with pytest.raises(CheckpointError, match=match):
        load_model(_copy(tiny, tmp_path, edit))


def test_a_qwen3_next_layout_is_named_when_missing(tiny, tmp_path):
    # Qwen3.5's split projections are not Qwen3-Next's fused ones: the config decides
    path = _copy(tiny, tmp_path, lambda c: c.update(model_type="qwen3_next", num_experts=0))
    with pytest.raises(CheckpointError, match=r"missing tensor 'model\.layers\.0\.linear_attn"
                                               r"\.in_proj_qkvz\.weight'"):
        load_model(path)
