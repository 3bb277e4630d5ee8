"""Falcon-H1 specifics (tests/test_hybrid_models.py runs the shared checks on the fixture
tests/hybrid_models/falcon_h1.py): the options the fixture leaves at their defaults (no gated
RMSNorm, the gate after the norm, biases on one Mamba2 projection only, attention and MLP biases,
a tied head, the inner size from mamba_expand, a binding time_step_limit, an own head_dim), the
µP vector stored by older checkpoints, post-hoc MC on the Mamba2 halves, and the errors for what
is not supported."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from hybrid_models import falcon_h1 as fixture
from hybrid_models import rewrite  # noqa: E402

from mcserve.models.checkpoint import CheckpointError  # noqa: E402
from mcserve.models.registry import load_model  # noqa: E402

ATOL = 1e-4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("falcon_h1")
    return path, fixture.save_tiny(path)


def _ids(T: int, seed: int, batch: int = 2) -> torch.Tensor:
    return torch.randint(0, 97, (batch, T), generator=torch.Generator().manual_seed(seed))



@torch.no_grad()
@pytest.mark.parametrize("options", [
    dict(mamba_rms_norm=False, mamba_proj_bias=True, attention_bias=True, mlp_bias=True,
         tie_word_embeddings=True, mamba_d_ssm=None, mamba_expand=1, mamba_n_heads=8,
         time_step_limit=(0.0, 0.8)),
    dict(mamba_norm_before_gate=False, projectors_bias=True, mamba_n_groups=1, head_dim=8,
         num_key_value_heads=1, mamba_conv_bias=False, time_step_limit=(0.5, 100.0)),
], ids=["no_gated_norm_in_bias_tied", "gate_before_norm_out_bias_own_head_dim"])
def test_options_match_transformers(tmp_path, options):
    ref = fixture.save_tiny(tmp_path, seed=1, **options)
    ours = load_model(tmp_path)
    c = ours.config
    assert c.mamba_bias and c.tie_embeddings == options.get("tie_word_embeddings", False)
    if "head_dim" in options:
        assert ours.blocks[0].attn.D == 8
    ids = _ids(21, 0)
    torch.testing.assert_close(ours(ids)[0], ref(ids).logits, atol=ATOL, rtol=0)
    state, outs = None, []
    for a, b in [(0, 9), (9, 10), (10, 21)]:
        o, state = ours(ids[:, a:b], state)
        outs.append(o)
    torch.testing.assert_close(torch.cat(outs, 1), ref(ids).logits, atol=ATOL, rtol=0)


@torch.no_grad()
def test_stored_mup_vector_is_ignored(tiny, tmp_path):
    path, ref = tiny

    def add(sd):
        for i in range(3):
            sd[f"model.layers.{i}.mamba.mup_vector"] = ref.model.layers[i].mamba.mup_vector
        return sd

    ours = load_model(rewrite(path, tmp_path / "mup", tensors=add))
    ids = _ids(6, 1)
    torch.testing.assert_close(ours(ids)[0], ref(ids).logits, atol=ATOL, rtol=0)


@pytest.mark.parametrize("change, needle", [
    (lambda c: c.update(hidden_act="gelu"), "hidden_act"),
    (lambda c: c.update(ssm_multipliers=[1.0, 2.0]), "ssm_multipliers"),
    (lambda c: c.update(mlp_multipliers="x"), "mlp_multipliers"),
    (lambda c: c.update(mamba_d_head=8), "mamba_d_head"),
    (lambda c: c.update(mamba_d_head="auto", mamba_n_heads=5), "mamba_n_heads"),
    (lambda c: c["rope_parameters"].update(partial_rotary_factor=0.5), "partial_rotary_factor"),
    (lambda c: c["rope_parameters"].update(rope_type="yarn"), "rope_type"),
    (lambda c: c.update(time_step_limit=[1.0, 0.5]), "time_step_limit"),
    (lambda c: c.pop("num_hidden_layers"), "num_hidden_layers"),
])
def test_unsupported_configs_are_refused(tiny, tmp_path, change, needle):
    path, _ = tiny
    with pytest.raises(CheckpointError, match=needle):
        load_model(rewrite(path, tmp_path / "bad", config=change))


def test_bad_tensors_are_refused(tiny, tmp_path):
    path, _ = tiny

    def extra(sd):
        sd["model.layers.0.mamba.extra"] = torch.zeros(3)
        return sd

    with pytest.raises(CheckpointError, match="model.layers.0.mamba.extra"):
        load_model(rewrite(path, tmp_path / "extra", tensors=extra))

    def missing(sd):
        sd.pop("model.layers.2.self_attn.k_proj.weight")
        return sd

    with pytest.raises(CheckpointError, match=r"model\.layers\.2\.self_attn\.k_proj\.weight"):
        load_model(rewrite(path, tmp_path / "missing", tensors=missing))

    def misshaped(sd):
        sd["model.layers.1.mamba.in_proj.weight"] = sd["model.layers.1.mamba.in_proj.weight"][1:]
        return sd

    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mamba\.in_proj\.weight"):
        load_model(rewrite(path, tmp_path / "shape", tensors=misshaped))
