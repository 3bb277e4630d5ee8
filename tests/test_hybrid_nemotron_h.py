"""Nemotron-H specifics (tests/test_hybrid_models.py runs the shared checks on the fixture
tests/hybrid_models/nemotron_h.py): the options the fixture leaves at their defaults (MoE latent
projections, biases, another MLP activation), the older config keys, a tied checkpoint, the
``mtp.*`` tensors transformers ignores, post-hoc MC on the Mamba2 layers, and the errors for
what is not supported."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from hybrid_models import nemotron_h as fixture
from hybrid_models import rewrite  # noqa: E402

from mcserve.models.checkpoint import CheckpointError  # noqa: E402
from mcserve.models.registry import load_model  # noqa: E402

ATOL = 1e-4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("nemotron_h")
    return path, fixture.save_tiny(path)


def _ids(T: int, seed: int, batch: int = 2) -> torch.Tensor:
    return torch.randint(0, 97, (batch, T), generator=torch.Generator().manual_seed(seed))



@torch.no_grad()
def test_latent_moe_biases_and_relu_match_transformers(tmp_path):
    ref = fixture.save_tiny(tmp_path, seed=1, moe_latent_size=24, mlp_bias=True, use_bias=True,
                            use_conv_bias=False, mlp_hidden_act="relu", n_group=1,
                            num_experts_per_tok=3, norm_topk_prob=False, layer_norm_epsilon=1e-6)
    with torch.no_grad():  # the biases start at zero
        for name, p in ref.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)
    ref.save_pretrained(tmp_path)
    ours = load_model(tmp_path)
    c = ours.config
    assert (c.moe_latent_size, c.mlp_bias, c.use_bias, c.mlp_act) == (24, True, True, "relu")
    assert ours.blocks[0].mixer.in_proj.bias is not None and ours.blocks[0].mixer.conv1d.bias \
        is None
    ids = _ids(21, 0)
    torch.testing.assert_close(ours(ids)[0], ref(ids).logits, atol=ATOL, rtol=0)


@torch.no_grad()
def test_older_config_keys(tiny, tmp_path):
    path, ref = tiny

    def old(cfg):
        cfg["hybrid_override_pattern"] = "".join(
            {"linear_attention": "M", "full_attention": "*", "mlp": "-", "moe": "E"}[t]
            for t in cfg.pop("layers_block_type"))
        for new, key in (("n_groups", "mamba_n_groups"), ("conv_kernel", "mamba_d_conv"),
                         ("use_conv_bias", "mamba_conv_bias"), ("time_step_min", "mamba_dt_min")):
            cfg[key] = cfg.pop(new)

    ours = load_model(rewrite(path, tmp_path / "old", config=old))
    assert ours.config.pattern == "M*E-M*E" and ours.config.n_groups == 2
    ids = _ids(13, 1)
    torch.testing.assert_close(ours(ids)[0], ref(ids).logits, atol=ATOL, rtol=0)

    def legacy_names(cfg):
        cfg["layers_block_type"] = [{"linear_attention": "mamba", "full_attention": "attention"}
                                    .get(t, t) for t in cfg["layers_block_type"]]

    ours = load_model(rewrite(path, tmp_path / "legacy", config=legacy_names))
    assert ours.config.pattern == "M*E-M*E"


@torch.no_grad()
def test_tied_checkpoint_and_mtp_tensors(tiny, tmp_path):
    path, ref = tiny

    def tie(cfg):
        cfg["tie_word_embeddings"] = True

    def no_head_and_mtp(sd):
        sd.pop("lm_head.weight")
        sd["mtp.layers.0.norm.weight"] = torch.ones(64)
        return sd

    ours = load_model(rewrite(path, tmp_path / "t", config=tie, tensors=no_head_and_mtp))
    assert ours.lm_head.weight is ours.embed.weight
    # a head stored beside tie_word_embeddings is used as is (transformers ties nothing here)
    ours = load_model(rewrite(path, tmp_path / "t2", config=tie))
    assert ours.lm_head.weight is not ours.embed.weight
    ids = _ids(5, 2)
    torch.testing.assert_close(ours(ids)[0], ref(ids).logits, atol=ATOL, rtol=0)


@pytest.mark.parametrize("change, needle", [
    (lambda c: c.update(layers_block_type=["linear_attention", "sliding_attention"]),
     "layers_block_type"),
    (lambda c: (c.pop("layers_block_type"), c.update(hybrid_override_pattern="M*X")),
     "hybrid_override_pattern"),
    (lambda c: c.pop("layers_block_type"), "layers_block_type"),
    (lambda c: c.update(mamba_hidden_act="gelu"), "mamba_hidden_act"),
    (lambda c: c.update(mlp_hidden_act="tanh"), "mlp_hidden_act"),
    (lambda c: c.update(layers_block_type=["full_attention", "mlp"] * 3 + ["moe"]),
     "without Mamba2 layers"),
    (lambda c: c.update(num_experts_per_tok=4), "top_k"),
])
def test_unsupported_configs_are_refused(tiny, tmp_path, change, needle):
    path, _ = tiny
    with pytest.raises(CheckpointError, match=needle):
        load_model(rewrite(path, tmp_path / "bad", config=change))


def test_bad_tensors_are_refused(tiny, tmp_path):
    path, _ = tiny

    def extra(sd):
        sd["backbone.layers.0.mixer.extra"] = torch.zeros(3)
        return sd

    with pytest.raises(CheckpointError, match="backbone.layers.0.mixer.extra"):
        load_model(rewrite(path, tmp_path / "extra", tensors=extra))

    def gap(sd):
        sd.pop("backbone.layers.2.mixer.experts.3.up_proj.weight")
        return sd

    with pytest.raises(CheckpointError, match="expert 3"):
        load_model(rewrite(path, tmp_path / "gap", tensors=gap))

    def missing(sd):
        sd.pop("backbone.layers.1.mixer.k_proj.weight")
        return sd

    with pytest.raises(CheckpointError, match="backbone.layers.1.mixer.k_proj.weight"):
        load_model(rewrite(path, tmp_path / "missing", tensors=missing))
