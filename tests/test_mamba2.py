"""Mamba2 import (transformers and mamba_ssm formats) on the MC linear memory, post-hoc MC,
serving through the engine, and errors for bad checkpoint directories.

Models are built with random weights by transformers' own ``Mamba2ForCausalLM`` and saved to
temporary directories; nothing is downloaded.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import Mamba2Config as HFConfig  # noqa: E402
from transformers import Mamba2ForCausalLM as HFMamba2  # noqa: E402

from mcserve.config import EngineConfig  # noqa: E402
from mcserve.engine.llm import LLM  # noqa: E402
from mcserve.engine.llm_engine import LLMEngine  # noqa: E402
from mcserve.engine.sampling import SamplingParams  # noqa: E402
from mcserve.models.checkpoint import CheckpointError  # noqa: E402
from mcserve.models.mamba2 import Mamba2MCForCausalLM  # noqa: E402
from mcserve.models.registry import detect_format, load_model  # noqa: E402


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


# name: (transformers config, the tokenizer's vocab for the mamba_ssm copy)
CONFIGS = {
    # n_groups > 1, 6 heads (not a power of two), K = 16 != V = 8
    "groups": (dict(vocab_size=104, hidden_size=24, num_hidden_layers=2, num_heads=6,
                    head_dim=8, state_size=16, n_groups=2, conv_kernel=4, chunk_size=16), 104),
    # biases on the projections, tied embeddings, conv of width 3
    "bias_tied": (dict(vocab_size=96, hidden_size=16, num_hidden_layers=2, num_heads=4,
                       head_dim=8, state_size=8, n_groups=1, conv_kernel=3, use_bias=True,
                       tie_word_embeddings=True, chunk_size=8), 96),
    # 3 heads = 3 groups, no conv bias; the mamba_ssm copy records vocab 101 padded to 104
    "padded_vocab": (dict(vocab_size=104, hidden_size=12, num_hidden_layers=2, num_heads=3,
                          head_dim=8, state_size=12, n_groups=3, conv_kernel=4,
                          use_conv_bias=False, chunk_size=16), 101),
}
T = 37


def write_mamba_ssm(hf: HFMamba2, path: Path, vocab_size: int, pad_multiple: int = 8) -> Path:
    """The same weights in the original ``mamba_ssm`` layout (config.json + pytorch_model.bin),
    as ``MambaLMHeadModel.save_pretrained`` writes them."""
    c = hf.config
    assert vocab_size + (-vocab_size) % pad_multiple == c.vocab_size
    cfg = {
        "d_model": c.hidden_size, "d_intermediate": 0, "n_layer": c.num_hidden_layers,
        "vocab_size": vocab_size,
        "ssm_cfg": {"layer": "Mamba2", "d_state": c.state_size, "d_conv": c.conv_kernel,
                    "expand": c.expand, "headdim": c.head_dim, "ngroups": c.n_groups,
                    "bias": c.use_bias, "conv_bias": c.use_conv_bias, "rmsnorm": True,
                    "norm_before_gate": False, "chunk_size": c.chunk_size},
        "attn_layer_idx": [], "attn_cfg": {}, "rms_norm": True, "residual_in_fp32": True,
        "fused_add_norm": True, "pad_vocab_size_multiple": pad_multiple,
        "tie_embeddings": bool(c.tie_word_embeddings),
    }
    sd = {}
    for name, t in hf.state_dict().items():
        sd[name.replace("backbone.embeddings.", "backbone.embedding.")] = t.detach().clone()
    if c.tie_word_embeddings:  # mamba_ssm stores the tied head as the same tensor
        sd["lm_head.weight"] = sd["backbone.embedding.weight"]
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(cfg))
    torch.save(sd, path / "pytorch_model.bin")
    return path


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    """name -> (hf model, {layout: directory}, real vocab)."""
    out = {}
    for i, (name, (kw, real_vocab)) in enumerate(CONFIGS.items()):
        torch.manual_seed(100 + i)
        # no special tokens: transformers' generate would stop at EOS and mask pad ids
        hf = HFMamba2(HFConfig(**kw, bos_token_id=None, eos_token_id=None,
                               pad_token_id=None)).eval()
        root = tmp_path_factory.mktemp(name)
        hf.save_pretrained(root / "hf")
        dirs = {"hf": root / "hf", "ssm": write_mamba_ssm(hf, root / "ssm", real_vocab)}
        out[name] = (hf, dirs, real_vocab)
    return out


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / a.abs().max())


@pytest.mark.parametrize("layout", ["hf", "ssm"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_transformers(zoo, name, layout):
    hf, dirs, vocab = zoo[name]
    assert detect_format(dirs[layout]) == ("mamba2", "transformers" if layout == "hf"
                                           else "mamba_ssm")
    model = load_model(dirs[layout])
    assert isinstance(model, Mamba2MCForCausalLM)
    assert model.config.vocab_size == hf.config.vocab_size
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (2, T), generator=g)
    with torch.no_grad():
        want = hf(ids).logits
        got, _ = model(ids)
        assert rel_err(want, got) <= 1e-4
        # prefill + token-by-token decode
        logits, state = model(ids[:, :11])
        outs = [logits]
        for t in range(11, T):
            logits, state = model(ids[:, t:t + 1], state)
            outs.append(logits)
        assert rel_err(want, torch.cat(outs, 1)) <= 1e-4


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_generate_matches_transformers(zoo, name):
    hf, dirs, vocab = zoo[name]
    prompt = torch.randint(0, vocab, (1, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():  # the configs have no EOS or pad token: plain greedy, no masking
        ref = hf.generate(prompt, max_new_tokens=32, do_sample=False)
    ref = ref[0, prompt.shape[1]:].tolist()
    assert len(ref) == 32
    for layout in ("hf", "ssm"):
        assert greedy(load_model(dirs[layout]), prompt[0].tolist(), 32) == ref, layout


def test_sharded_and_bin_layouts(zoo, tmp_path):
    hf, dirs, vocab = zoo["groups"]
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    binary = tmp_path / "bin"
    binary.mkdir()
    (binary / "config.json").write_text((dirs["hf"] / "config.json").read_text())
    torch.save(hf.state_dict(), binary / "pytorch_model.bin")
    ids = torch.randint(0, vocab, (1, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = hf(ids).logits
        for d in (tmp_path / "sharded", binary):
            assert rel_err(want, load_model(d)(ids)[0]) <= 1e-4


# ------------------------------------------------------------------ post-hoc MC
@pytest.mark.parametrize("variant,mode", [("post", "independent"), ("post", "checkpoint"),
                                          ("grm", "checkpoint"), ("ssc", "independent"),
                                          ("residual", "checkpoint")])
def test_mc_with_one_segment_equals_no_mc(zoo, variant, mode):
    hf, dirs, vocab = zoo["groups"]
    base = load_model(dirs["hf"])
    mc = load_model(dirs["hf"], mc_overrides={"mc_variant": variant, "mc_mode": mode,
                                              "segment_len": T})
    ids = torch.randint(0, vocab, (1, T), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(mc(ids)[0], base(ids)[0], rtol=1e-5, atol=1e-5)


def explicit_mc(model: Mamba2MCForCausalLM, ids: torch.Tensor, C: int, mode: str,
                variant: str) -> torch.Tensor:
    """Logits with the memory of every layer read per token from explicitly kept per-segment
    states (a plain per-token recurrence): post = mean of the cached states and the online one;
    grm = softmax over ⟨q_t, mean key of segment i⟩/√K (u = q)."""
    x = model.embed(ids)
    for blk in model.layers:
        mix = blk.mixer
        st = mix.init_state(ids.shape[0], model.dtype, model.device)
        z, xs, q, k, gates, _ = mix._project(blk.norm(x), st.conv)
        a, b = gates["log_a"].exp(), gates["b"]
        B, L, H, N = q.shape
        S = torch.zeros(B, H, N, xs.shape[-1], dtype=q.dtype)
        cached, cached_k, ksum, n_on, ys = [], [], torch.zeros(B, H, N), 0, []
        for t in range(L):
            if t and t % C == 0:  # segment complete: cache its state (and its mean key)
                cached.append(S)
                cached_k.append(ksum / n_on)
                ksum, n_on = torch.zeros(B, H, N), 0
                if mode == "independent":
                    S = torch.zeros_like(S)
            S = a[:, t, :, None, None] * S + b[:, t, :, None, None] * (
                k[:, t, :, :, None] * xs[:, t, :, None, :])
            ksum, n_on = ksum + k[:, t], n_on + 1
            mems = cached + [S]
            reads = torch.stack([torch.einsum("bhn,bhnp->bhp", q[:, t], M) for M in mems], 1)
            if variant == "post":
                w = torch.full((B, len(mems), H), 1.0 / len(mems))
            else:
                keys = torch.stack(cached_k + [ksum / n_on], 1)  # (B, s, H, N)
                w = torch.softmax((q[:, t, None] * keys).sum(-1) / math.sqrt(N), dim=1)
            ys.append((w[..., None] * reads).sum(1))
        x = blk._residual(x, mix._output(z, xs, torch.stack(ys, 1)))
    return model._head(x)


@pytest.mark.parametrize("variant,mode", [("post", "independent"), ("post", "checkpoint"),
                                          ("grm", "checkpoint"), ("grm", "independent")])
def test_mc_short_segments_equal_explicit_per_segment_states(zoo, variant, mode):
    hf, dirs, vocab = zoo["groups"]
    C = 5
    model = load_model(dirs["hf"], mc_overrides={"mc_variant": variant, "mc_mode": mode,
                                                 "segment_len": C})
    ids = torch.randint(0, vocab, (2, 23), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = explicit_mc(model, ids, C, mode, variant)
        got, _ = model(ids)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        # not the same as no MC: the cached memories are read
        assert not torch.allclose(got, load_model(dirs["hf"])(ids)[0], atol=1e-4)
        # prefill + decode agree with the full forward under MC too
        logits, state = model(ids[:, :7])
        outs = [logits]
        for t in range(7, ids.shape[1]):
            logits, state = model(ids[:, t:t + 1], state)
            outs.append(logits)
        torch.testing.assert_close(torch.cat(outs, 1), got, rtol=1e-4, atol=1e-5)


def test_mc_defaults(zoo, tmp_path):
    hf, dirs, vocab = zoo["groups"]
    base = load_model(dirs["hf"])
    assert (base.config.mc_variant, base.config.segment_len) == ("none", 2048)
    post = load_model(dirs["hf"], mc_overrides={"mc_variant": "post"})
    assert (post.config.mc_mode, post.config.segment_len) == ("independent", 2048)
    grm = load_model(dirs["hf"], mc_overrides={"mc_variant": "grm", "segment_len": 64})
    assert (grm.config.mc_mode, grm.config.segment_len) == ("checkpoint", 64)
    # a recorded training length is the default segment length
    d = tmp_path / "trained"
    d.mkdir()
    cfg = json.loads((dirs["hf"] / "config.json").read_text())
    cfg["max_position_embeddings"] = 512
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "model.safetensors").write_bytes((dirs["hf"] / "model.safetensors").read_bytes())
    assert load_model(d, mc_overrides={"mc_variant": "post"}).config.segment_len == 512


# ------------------------------------------------------------------ engine
@pytest.mark.parametrize("variant", ["none", "post", "grm"])
def test_engine_serves_mamba2(zoo, variant):
    hf, dirs, vocab = zoo["groups"]
    model = load_model(dirs["ssm"], mc_overrides={"mc_variant": variant, "segment_len": 8})
    g = torch.Generator().manual_seed(5)
    base = torch.randint(0, vocab, (21,), generator=g).tolist()
    prompts = [base, base[:13], torch.randint(0, vocab, (4,), generator=g).tolist()]
    want = [greedy(model, p, 12) for p in prompts]
    engine = LLMEngine(EngineConfig(max_num_seqs=4, num_state_blocks=32), model=model)
    outs = LLM(engine=engine).generate(
        prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == want
    assert engine.cache.is_whole()


# ------------------------------------------------------------------ bad directories
def _copy(src: Path, dst: Path, skip=()) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        if f.name not in skip:
            (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_bad_directories(zoo, tmp_path):
    from safetensors.torch import load_file, save_file

    hf, dirs, _ = zoo["groups"]
    src = dirs["hf"]

    d = _copy(src, tmp_path / "noweights", skip={"model.safetensors"})
    with pytest.raises(CheckpointError, match="has no weights.*model.safetensors"):
        load_model(d)

    d = _copy(src, tmp_path / "missing", skip={"model.safetensors"})
    sd = load_file(src / "model.safetensors")
    del sd["backbone.layers.1.mixer.A_log"]
    save_file(sd, d / "model.safetensors")
    with pytest.raises(CheckpointError) as e:
        load_model(d)
    assert "model.safetensors" in str(e.value) and "backbone.layers.1.mixer.A_log" in str(e.value)

    d = _copy(src, tmp_path / "shape", skip={"model.safetensors"})
    sd = load_file(src / "model.safetensors")
    sd["backbone.layers.0.mixer.in_proj.weight"] = sd["backbone.layers.0.mixer.in_proj.weight"][1:]
    save_file(sd, d / "model.safetensors")
    with pytest.raises(CheckpointError) as e:
        load_model(d)
    msg = str(e.value)
    assert "model.safetensors" in msg and "backbone.layers.0.mixer.in_proj.weight" in msg
    assert "(165, 24)" in msg and "(166, 24)" in msg

    d = _copy(dirs["ssm"], tmp_path / "ssmshape", skip={"pytorch_model.bin"})
    sd = torch.load(dirs["ssm"] / "pytorch_model.bin", weights_only=True)
    sd["backbone.layers.1.mixer.conv1d.weight"] = torch.zeros(3, 1, 4)
    torch.save(sd, d / "pytorch_model.bin")
    with pytest.raises(CheckpointError) as e:
        load_model(d)
    assert "pytorch_model.bin" in str(e.value)
    assert "backbone.layers.1.mixer.conv1d.weight" in str(e.value)

    d = _copy(src, tmp_path / "llama")
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "llama"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"'llama' is not supported.*'mamba2', 'mcserve'"):
        load_model(d)

    d = tmp_path / "shards"
    hf.save_pretrained(d, max_shard_size="20KB")
    index = json.loads((d / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[-1]
    (d / shard).unlink()
    with pytest.raises(CheckpointError, match=f"{shard}.*missing"):
        load_model(d)

    import datetime

    d = _copy(src, tmp_path / "pickle", skip={"model.safetensors"})
    torch.save({"x": datetime.datetime(2024, 1, 1)}, d / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="pytorch_model.bin.*weights_only=True"):
        load_model(d)

    d = _copy(dirs["ssm"], tmp_path / "mamba1")
    cfg = json.loads((d / "config.json").read_text())
    cfg["ssm_cfg"]["layer"] = "Mamba3"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="only 'Mamba1' and 'Mamba2'"):
        load_model(d)


def test_registry_loads_native_checkpoints(tmp_path):
    from mcserve.config import ModelConfig
    from mcserve.models.native import MCForCausalLM

    torch.manual_seed(0)
    native = MCForCausalLM(ModelConfig(vocab_size=64, d_model=16, n_heads=2, head_dim=8,
                                       n_layers=1, segment_len=8))
    native.save_pretrained(tmp_path / "n")
    assert detect_format(tmp_path / "n") == ("mcserve", "mcserve")
    m = load_model(tmp_path / "n", mc_overrides={"mc_variant": "post"})
    assert (m.config.mc_variant, m.config.mc_mode, m.config.segment_len) == (
        "post", "independent", 8)
    ids = torch.randint(0, 64, (1, 12))
    with torch.no_grad():
        torch.testing.assert_close(load_model(tmp_path / "n")(ids)[0], native(ids)[0])
