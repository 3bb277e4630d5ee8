"""Tests for ``mcserve.models.checkpoint``: round trips and every way a checkpoint can be wrong.

The real ``MCForCausalLM`` is used throughout (tied and untied embeddings); a small stand-in
module covers what the real model does not have (integer buffers, a tensor that is a slice of
another one's storage).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from mcserve.config import ModelConfig
from mcserve.models.checkpoint import (
    CheckpointError,
    load_checkpoint,
    read_config,
    save_checkpoint,
)
from mcserve.models.native import MCForCausalLM


@torch.no_grad()
def greedy(model, ids: list[int], n: int) -> list[int]:
    """The model's own greedy continuation of ``ids``: a prefill, then one forward per token
    from the returned state (no engine involved)."""
    logits, state = model(torch.tensor([ids], device=model.device), last_only=True)
    out: list[int] = []
    for _ in range(n):
        out.append(int(logits[0, -1].argmax()))
        logits, state = model(torch.tensor([[out[-1]]], device=model.device), state)
    return out


SMALL = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, head_dim=16, segment_len=8)


def make_model(config: ModelConfig = SMALL, seed: int = 0) -> MCForCausalLM:
    torch.manual_seed(seed)
    return MCForCausalLM(config).eval()


def logits_of(model: nn.Module, length: int = 21) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (2, length), generator=gen)
    with torch.no_grad():
        return model(ids)[0]


@pytest.fixture
def saved(tmp_path: Path) -> tuple[MCForCausalLM, Path]:
    model = make_model()
    path = tmp_path / "ckpt"
    save_checkpoint(model, path)
    return model, path


def edit_config(path: Path, **changes) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def expect_error(path: Path, *phrases: str, cls=MCForCausalLM, **kwargs) -> str:
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path, cls, **kwargs)
    msg = str(info.value)
    for phrase in phrases:
        assert phrase in msg, f"{phrase!r} not in {msg!r}"
    assert "\n" not in msg
    return msg


# --- round trips ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "config",
    [
        SMALL,
        SMALL.replace(tie_embeddings=False),
        SMALL.replace(mc_variant="ssc", mc_top_k=1, mc_mode="independent"),
        SMALL.replace(memory="swla", mc_variant="loglinear", conv_size=0),
    ],
    ids=["tied-grm", "untied", "ssc-independent", "swla-loglinear"],
)
def test_round_trip_identical_logits(tmp_path: Path, config: ModelConfig) -> None:
    model = make_model(config)
    save_checkpoint(model, tmp_path / "m")
    loaded = load_checkpoint(tmp_path / "m", MCForCausalLM)
    assert loaded.config == model.config
    assert not loaded.training
    assert torch.equal(logits_of(loaded), logits_of(model))
    # a model built with a different seed really differs, so the equality above means something
    assert not torch.equal(logits_of(make_model(config, seed=1)), logits_of(model))


def test_round_trip_greedy_generation(saved) -> None:
    model, path = saved
    loaded = MCForCausalLM.from_pretrained(path)
    prompt = [1, 2, 3, 4, 5]
    assert greedy(loaded, prompt, 12) == greedy(model, prompt, 12)


def test_save_pretrained_matches_save_checkpoint(tmp_path: Path) -> None:
    model = make_model()
    model.save_pretrained(tmp_path / "a")
    save_checkpoint(model, tmp_path / "b")
    a, b = tmp_path / "a", tmp_path / "b"
    assert (a / "config.json").read_text() == (b / "config.json").read_text()
    a, b = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_config_json_content(saved) -> None:
    model, path = saved
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["model_type"] == "mcserve"
    assert cfg == model.config.to_dict()
    assert read_config(path) == model.config


def test_tied_weights_stored_once_and_tie_restored(saved) -> None:
    model, path = saved
    stored = load_file(path / "model.safetensors")
    assert "embed.weight" in stored and "lm_head.weight" not in stored
    assert set(stored) | {"lm_head.weight"} == set(model.state_dict())
    loaded = load_checkpoint(path, MCForCausalLM)
    assert loaded.lm_head.weight is loaded.embed.weight  # still tied after loading
    assert torch.equal(loaded.lm_head.weight, model.embed.weight)


def test_tied_checkpoint_with_both_copies_loads(saved) -> None:
    """A checkpoint written by other tools may carry the tied LM head explicitly."""
    model, path = saved
    stored = load_file(path / "model.safetensors")
    stored["lm_head.weight"] = stored["embed.weight"].clone()
    save_file(stored, path / "model.safetensors")
    loaded = load_checkpoint(path, MCForCausalLM)
    assert torch.equal(logits_of(loaded), logits_of(model))


def test_untied_checkpoint_keeps_both(tmp_path: Path) -> None:
    model = make_model(SMALL.replace(tie_embeddings=False))
    save_checkpoint(model, tmp_path)
    stored = load_file(tmp_path / "model.safetensors")
    assert {"embed.weight", "lm_head.weight"} <= set(stored)


def test_dtype_and_device(saved) -> None:
    model, path = saved
    loaded = load_checkpoint(path, MCForCausalLM, dtype=torch.float64, device="cpu")
    assert all(p.dtype == torch.float64 for p in loaded.parameters())
    assert loaded.lm_head.weight is loaded.embed.weight
    torch.testing.assert_close(logits_of(loaded).float(), logits_of(model), rtol=1e-4, atol=1e-5)


def test_bf16_weights_load_into_float32(tmp_path: Path) -> None:
    model = make_model().to(torch.bfloat16)
    save_checkpoint(model, tmp_path)
    assert load_file(tmp_path / "model.safetensors")["embed.weight"].dtype == torch.bfloat16
    loaded = load_checkpoint(tmp_path, MCForCausalLM)
    assert loaded.embed.weight.dtype == torch.float32
    assert torch.equal(loaded.embed.weight, model.embed.weight.float())


def test_tokenizer_files_written(tmp_path: Path) -> None:
    files = {"tokenizer.json": '{"a": 1}', "tokenizer.model": b"\x00\x01binary"}
    save_checkpoint(make_model(), tmp_path, tokenizer_files=files)
    assert (tmp_path / "tokenizer.json").read_text() == '{"a": 1}'
    assert (tmp_path / "tokenizer.model").read_bytes() == b"\x00\x01binary"
    load_checkpoint(tmp_path, MCForCausalLM)


@pytest.mark.parametrize("name", ["../evil.json", "sub/tok.json", "config.json", "", ".."])
def test_tokenizer_file_names_must_be_plain(tmp_path: Path, name: str) -> None:
    with pytest.raises(ValueError, match="plain file name"):
        save_checkpoint(make_model(), tmp_path / "m", tokenizer_files={name: "x"})


def test_harmless_transformers_keys_are_dropped(saved) -> None:
    model, path = saved
    edit_config(path, architectures=["MCForCausalLM"], torch_dtype="float32",
                transformers_version="4.99.0")
    loaded = load_checkpoint(path, MCForCausalLM)
    assert loaded.config == model.config


def test_save_overwrites_existing_directory(saved) -> None:
    _, path = saved
    other = make_model(seed=3)
    save_checkpoint(other, path)
    assert torch.equal(logits_of(load_checkpoint(path, MCForCausalLM)), logits_of(other))


# --- corruptions -------------------------------------------------------------------------------


def test_missing_directory(tmp_path: Path) -> None:
    expect_error(tmp_path / "nope", "does not exist", "nope")


def test_path_is_a_file(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    expect_error(tmp_path / "f", "is not a directory")


def test_missing_config(saved) -> None:
    _, path = saved
    (path / "config.json").unlink()
    expect_error(path, "config.json is missing")


def test_invalid_json(saved) -> None:
    _, path = saved
    (path / "config.json").write_text('{"vocab_size": 64,')
    expect_error(path, "config.json is not valid JSON")


def test_config_not_an_object(saved) -> None:
    _, path = saved
    (path / "config.json").write_text("[1, 2]")
    expect_error(path, "config.json must hold a JSON object")


def test_unknown_config_key(saved) -> None:
    _, path = saved
    edit_config(path, hidden_size=768)
    expect_error(path, "config.json", "unknown config keys", "hidden_size")


def test_other_model_type(saved) -> None:
    _, path = saved
    edit_config(path, model_type="mamba2")
    expect_error(path, "config.json", "model_type 'mamba2'")


@pytest.mark.parametrize(
    "changes, phrase",
    [
        ({"memory": "lstm"}, "memory='lstm'"),
        ({"mc_variant": "magic"}, "mc_variant='magic'"),
        ({"memory": "dla", "segment_len": 24, "inner_chunk": 16}, "multiple of inner_chunk"),
        ({"d_model": 0}, "d_model must be a positive integer"),
        ({"vocab_size": "64"}, "vocab_size must be a positive integer"),
        ({"conv_size": "4"}, "invalid config"),
    ],
)
def test_bad_config_values(saved, changes, phrase) -> None:
    _, path = saved
    edit_config(path, **changes)
    expect_error(path, "config.json", "invalid config", phrase)


def test_missing_weights(saved) -> None:
    _, path = saved
    (path / "model.safetensors").unlink()
    expect_error(path, "model.safetensors is missing")


@pytest.mark.parametrize("content", [b"", b"not a safetensors file at all", b"\xff" * 64])
def test_unreadable_weights(saved, content: bytes) -> None:
    _, path = saved
    (path / "model.safetensors").write_bytes(content)
    expect_error(path, "model.safetensors is not a readable safetensors file")


def test_truncated_weights(saved) -> None:
    _, path = saved
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])
    expect_error(path, "model.safetensors is not a readable safetensors file")


def test_missing_tensor(saved) -> None:
    _, path = saved
    stored = load_file(path / "model.safetensors")
    name = next(n for n in stored if n.startswith("layers.1."))
    del stored[name]
    save_file(stored, path / "model.safetensors")
    expect_error(path, "model.safetensors is missing tensors", repr(name))


def test_missing_untied_lm_head(tmp_path: Path) -> None:
    save_checkpoint(make_model(SMALL.replace(tie_embeddings=False)), tmp_path)
    stored = load_file(tmp_path / "model.safetensors")
    del stored["lm_head.weight"]
    save_file(stored, tmp_path / "model.safetensors")
    expect_error(tmp_path, "missing tensors", "'lm_head.weight'")


def test_untied_head_in_tied_config_must_match(tmp_path: Path) -> None:
    """A checkpoint of an untied model whose config was edited to tie_embeddings=true."""
    save_checkpoint(make_model(SMALL.replace(tie_embeddings=False)), tmp_path)
    edit_config(tmp_path, tie_embeddings=True)
    expect_error(tmp_path, "'embed.weight' and 'lm_head.weight' are tied", "different values")


def test_unexpected_tensor(saved) -> None:
    _, path = saved
    stored = load_file(path / "model.safetensors")
    stored["layers.9.extra.weight"] = torch.zeros(3)
    save_file(stored, path / "model.safetensors")
    expect_error(path, "unexpected tensors", "'layers.9.extra.weight'")


def test_wrong_shape_from_config(saved) -> None:
    """config.json says vocab 128 but the weights were saved for vocab 64."""
    _, path = saved
    edit_config(path, vocab_size=128)
    expect_error(path, "tensor 'embed.weight' has shape (64, 32), expected (128, 32)")


def test_wrong_shape_of_one_tensor(saved) -> None:
    _, path = saved
    stored = load_file(path / "model.safetensors")
    name = "norm.weight"
    stored[name] = torch.ones(stored[name].numel() + 1)
    save_file(stored, path / "model.safetensors")
    expect_error(path, f"tensor {name!r} has shape (33,), expected (32,)")


def test_wrong_dtype_kind(saved) -> None:
    _, path = saved
    stored = load_file(path / "model.safetensors")
    stored["norm.weight"] = torch.ones_like(stored["norm.weight"], dtype=torch.int32)
    save_file(stored, path / "model.safetensors")
    expect_error(path, "tensor 'norm.weight' has dtype torch.int32")


# --- a stand-in module for what the real model does not have ----------------------------------


class StandIn(nn.Module):
    """Tied embeddings, an integer buffer, and a parameter viewing part of another's storage."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.lm_head.weight = self.embed.weight
        self.register_buffer("steps", torch.arange(5, dtype=torch.int64))
        self.base = nn.Parameter(torch.randn(4, config.d_model))
        self.register_buffer("row", self.base.data[1])  # a view into base's storage

    def forward(self, ids: torch.Tensor):
        return self.lm_head(self.embed(ids) + self.row), None


def test_stand_in_round_trip(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = StandIn(SMALL)
    model.steps += 7
    save_checkpoint(model, tmp_path)  # would raise on shared storage without the dedup/clone
    stored = load_file(tmp_path / "model.safetensors")
    assert set(stored) == {"embed.weight", "steps", "base", "row"}
    torch.manual_seed(1)
    loaded = load_checkpoint(tmp_path, StandIn)
    assert torch.equal(loaded.steps, torch.arange(5) + 7)
    assert torch.equal(loaded.base, model.base) and torch.equal(loaded.row, model.row)
    assert loaded.lm_head.weight is loaded.embed.weight
    ids = torch.tensor([[1, 2, 3]])
    assert torch.equal(loaded(ids)[0], model(ids)[0])


def test_model_without_config_cannot_be_saved(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="config"):
        save_checkpoint(nn.Linear(2, 2), tmp_path)
