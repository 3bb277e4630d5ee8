"""Mamba (v1) import (transformers and mamba_ssm formats) on the ``gla`` memory family:
logits and greedy generations against transformers' ``MambaForCausalLM``, post-hoc MC, the
engine's invariants (batched, preempted, prefix-cached), and errors for bad directories.

Models are built with random weights by transformers itself and saved to temporary
directories; nothing is downloaded.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import MambaConfig as HFConfig  # noqa: E402
from transformers import MambaForCausalLM as HFMamba  # noqa: E402

from mcserve.config import EngineConfig  # noqa: E402
from mcserve.engine.llm import LLM  # noqa: E402
from mcserve.engine.llm_engine import LLMEngine  # noqa: E402
from mcserve.engine.sampling import SamplingParams  # noqa: E402
from mcserve.models.checkpoint import CheckpointError  # noqa: E402
from mcserve.models.mamba1 import Mamba1MCForCausalLM  # noqa: E402
from mcserve.models.registry import detect_format, load_model  # noqa: E402

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


@torch.no_grad()
def greedy(model, ids: list[int], n: int) -> list[int]:
    """The model's own greedy continuation: a prefill, then one forward per token."""
    logits, state = model(torch.tensor([ids], device=model.device), last_only=True)
    out: list[int] = []
    for _ in range(n):
        out.append(int(logits[0, -1].argmax()))
        logits, state = model(torch.tensor([[out[-1]]], device=model.device), state)
    return out


# name: (transformers config, the tokenizer's vocab for the mamba_ssm copy)
CONFIGS = {
    # tied embeddings (Mamba's default), dt rank "auto" = ceil(24 / 16) = 2
    "tied": (dict(vocab_size=96, hidden_size=24, num_hidden_layers=2, state_size=8,
                  conv_kernel=4, expand=2), 93),
    # biases on in/out_proj, no conv bias, conv of width 3, untied head, dt rank 3
    "bias_untied": (dict(vocab_size=104, hidden_size=16, num_hidden_layers=3, state_size=12,
                         conv_kernel=3, expand=2, time_step_rank=3, use_bias=True,
                         use_conv_bias=False, tie_word_embeddings=False), 104),
}


def write_mamba_ssm(hf: HFMamba, path: Path, vocab_size: int, pad_multiple: int = 8) -> Path:
    """The same weights in the original ``mamba_ssm`` layout (config.json + pytorch_model.bin)."""
    c = hf.config
    assert vocab_size + (-vocab_size) % pad_multiple == c.vocab_size
    cfg = {
        "d_model": c.hidden_size, "d_intermediate": 0, "n_layer": c.num_hidden_layers,
        "vocab_size": vocab_size,
        "ssm_cfg": {"d_state": c.state_size, "d_conv": c.conv_kernel, "expand": c.expand,
                    "dt_rank": c.time_step_rank, "bias": c.use_bias,
                    "conv_bias": c.use_conv_bias},
        "rms_norm": True, "residual_in_fp32": True, "fused_add_norm": True,
        "pad_vocab_size_multiple": pad_multiple, "tie_embeddings": bool(c.tie_word_embeddings),
    }
    sd = {name.replace("backbone.embeddings.", "backbone.embedding."): t.detach().clone()
          for name, t in hf.state_dict().items()}
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
        torch.manual_seed(200 + i)
        hf = HFMamba(HFConfig(**kw, bos_token_id=None, eos_token_id=None,
                              pad_token_id=None)).eval()
        with torch.no_grad():  # Δ over a wider range than the init, so decays differ a lot
            for layer in hf.backbone.layers:
                layer.mixer.dt_proj.bias.add_(torch.randn_like(layer.mixer.dt_proj.bias))
                layer.mixer.A_log.add_(0.3 * torch.randn_like(layer.mixer.A_log))
        root = tmp_path_factory.mktemp(name)
        hf.save_pretrained(root / "hf")
        out[name] = (hf, {"hf": root / "hf",
                          "ssm": write_mamba_ssm(hf, root / "ssm", real_vocab)}, real_vocab)
    return out


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / a.abs().max())


@pytest.mark.parametrize("layout", ["hf", "ssm"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_transformers(zoo, name, layout):
    hf, dirs, vocab = zoo[name]
    assert detect_format(dirs[layout]) == ("mamba", "transformers" if layout == "hf"
                                           else "mamba_ssm")
    model = load_model(dirs[layout])
    assert isinstance(model, Mamba1MCForCausalLM)
    assert model.config.vocab_size == hf.config.vocab_size
    g = torch.Generator().manual_seed(0)
    for T in (1, 9, 150):  # 150: several chunks of the scan form
        ids = torch.randint(0, vocab, (2, T), generator=g)
        with torch.no_grad():
            want = hf(ids).logits
            got, _ = model(ids)
            assert rel_err(want, got) <= 1e-4, T
            # prefill + token-by-token decode
            cut = min(T, 5)
            logits, state = model(ids[:, :cut])
            outs = [logits]
            for t in range(cut, T):
                logits, state = model(ids[:, t:t + 1], state)
                outs.append(logits)
            assert rel_err(want, torch.cat(outs, 1)) <= 1e-4, T


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_generate_matches_transformers(zoo, name):
    hf, dirs, vocab = zoo[name]
    prompt = torch.randint(0, vocab, (1, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():  # no EOS or pad token: plain greedy, no masking
        ref = hf.generate(prompt, max_new_tokens=24, do_sample=False)
    ref = ref[0, prompt.shape[1]:].tolist()
    assert len(ref) == 24
    assert greedy(load_model(dirs["ssm"]), prompt[0].tolist(), 24) == ref
    # the engine, through the registry, as a user loads it
    outs = LLM(str(dirs["hf"]), dtype="float32").generate(
        [prompt[0].tolist()], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    assert outs[0].outputs[0].token_ids == ref


# ------------------------------------------------------------------ post-hoc MC
def explicit_mc(model: Mamba1MCForCausalLM, ids: torch.Tensor, C: int, mode: str,
                variant: str) -> torch.Tensor:
    """Logits with the memory of every layer read per token from explicitly kept per-segment
    states (a plain per-token recurrence with the per-dimension decay): post = mean of the
    cached states and the online one; grm = softmax over ⟨q_t, mean key of segment i⟩/√N."""
    x = model.embed(ids)
    for blk in model.layers:
        mix = blk.mixer
        st = mix.init_state(ids.shape[0], model.dtype, model.device)
        z, xs, q, k, gates, _ = mix._project(blk.norm(x), st.conv)
        a, b = gates["log_a"].exp(), gates["b"]  # (B, L, H, N), (B, L, H)
        B, L, H, N = q.shape
        S = torch.zeros(B, H, N, dtype=q.dtype)
        cached, cached_k, ksum, n_on, ys = [], [], torch.zeros(B, H, N), 0, []
        for t in range(L):
            if t and t % C == 0:
                cached.append(S)
                cached_k.append(ksum / n_on)
                ksum, n_on = torch.zeros(B, H, N), 0
                if mode == "independent":
                    S = torch.zeros_like(S)
            S = a[:, t] * S + b[:, t, :, None] * k[:, t] * xs[:, t, :, None]
            ksum, n_on = ksum + k[:, t], n_on + 1
            mems = cached + [S]
            reads = torch.stack([(q[:, t] * M).sum(-1) for M in mems], 1)  # (B, s, H)
            if variant == "post":
                w = torch.full((B, len(mems), H), 1.0 / len(mems))
            else:
                keys = torch.stack(cached_k + [ksum / n_on], 1)
                w = torch.softmax((q[:, t, None] * keys).sum(-1) / math.sqrt(N), dim=1)
            ys.append((w * reads).sum(1)[..., None])
        x = blk._residual(x, mix._output(z, xs, torch.stack(ys, 1)))
    return model._head(x)


@pytest.mark.parametrize("variant,mode", [("post", "independent"), ("post", "checkpoint"),
                                          ("grm", "checkpoint"), ("grm", "independent")])
def test_mc_short_segments_equal_explicit_per_segment_states(zoo, variant, mode):
    hf, dirs, vocab = zoo["tied"]
    C = 5
    model = load_model(dirs["hf"], mc_overrides={"mc_variant": variant, "mc_mode": mode,
                                                 "segment_len": C})
    assert (model.config.mc_variant, model.config.mc_mode) == (variant, mode)
    ids = torch.randint(0, vocab, (2, 23), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = explicit_mc(model, ids, C, mode, variant)
        got, _ = model(ids)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        assert not torch.allclose(got, load_model(dirs["hf"])(ids)[0], atol=1e-4)
        logits, state = model(ids[:, :7])
        outs = [logits]
        for t in range(7, ids.shape[1]):
            logits, state = model(ids[:, t:t + 1], state)
            outs.append(logits)
        torch.testing.assert_close(torch.cat(outs, 1), got, rtol=1e-4, atol=1e-5)


def test_mc_defaults(zoo):
    hf, dirs, vocab = zoo["tied"]
    base = load_model(dirs["hf"])
    assert (base.config.mc_variant, base.config.segment_len) == ("none", 2048)
    post = load_model(dirs["ssm"], mc_overrides={"mc_variant": "post"})
    assert (post.config.mc_mode, post.config.segment_len) == ("independent", 2048)


# ------------------------------------------------------------------ engine
ENGINE_COMBOS = [("none", "checkpoint"), ("post", "independent"), ("grm", "checkpoint"),
                 ("ssc", "independent"), ("residual", "checkpoint"), ("loglinear", "checkpoint")]


@pytest.mark.parametrize("variant,mode", ENGINE_COMBOS)
def test_engine_alone_batched_preempted_cached(zoo, variant, mode):
    hf, dirs, vocab = zoo["bias_untied"]
    model = load_model(dirs["hf"], mc_overrides={"mc_variant": variant, "mc_mode": mode,
                                                 "segment_len": 4, "mc_top_k": 1})
    model = model.double()
    g = torch.Generator().manual_seed(5)
    ps = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (1, 3, 4, 9, 17, 23)]
    alone = [greedy(model, p, GREEDY.max_tokens) for p in ps]
    engines = []

    def run(**kw):
        args = dict(max_num_seqs=8, num_state_blocks=96, max_num_batched_tokens=32,
                    dtype="float64", max_model_len=64)
        args.update(kw)
        eng = LLMEngine(EngineConfig(**args), model=model)
        engines.append(eng)
        return eng, [o.outputs[0].token_ids for o in LLM(engine=eng).generate(ps, GREEDY)]

    eng, got = run()  # all at once: a ragged decode batch
    assert got == alone
    hits0 = eng.stats()["prefix_cache_hits"]
    assert [o.outputs[0].token_ids for o in LLM(engine=eng).generate(ps, GREEDY)] == alone
    if variant not in ("none", "loglinear"):
        assert eng.stats()["prefix_cache_hits"] > hits0
    small, got = run(num_state_blocks=12, max_num_batched_tokens=8)
    assert got == alone
    if variant not in ("none", "loglinear"):
        assert small.stats()["num_preemptions"] > 0
    assert run(max_num_seqs=1)[1] == alone
    for e in engines:
        assert not e.has_unfinished_requests() and e.cache.is_whole()


# ------------------------------------------------------------------ bad directories
def _copy(src: Path, dst: Path, skip=()) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        if f.name not in skip:
            (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_bad_directories(zoo, tmp_path):
    from safetensors.torch import load_file, save_file

    hf, dirs, _ = zoo["bias_untied"]
    src = dirs["hf"]
    d = _copy(src, tmp_path / "missing", skip={"model.safetensors"})
    sd = load_file(src / "model.safetensors")
    del sd["backbone.layers.1.mixer.A_log"]
    save_file(sd, d / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*'backbone\.layers\.1\."
                                              r"mixer\.A_log'"):
        load_model(d)

    d = _copy(src, tmp_path / "shape", skip={"model.safetensors"})
    sd = load_file(src / "model.safetensors")
    sd["backbone.layers.0.mixer.x_proj.weight"] = sd["backbone.layers.0.mixer.x_proj.weight"][1:]
    save_file(sd, d / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"'backbone\.layers\.0\.mixer\.x_proj\.weight' "
                                              r"has shape \(26, 32\), expected \(27, 32\)"):
        load_model(d)

    d = _copy(src, tmp_path / "extra", skip={"model.safetensors"})
    sd = load_file(src / "model.safetensors")
    sd["backbone.layers.0.mixer.surprise"] = torch.zeros(3)
    save_file(sd, d / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"does not use: 'backbone\.layers\.0\.mixer\."
                                              r"surprise'"):
        load_model(d)

    d = _copy(dirs["ssm"], tmp_path / "ssmcfg")
    cfg = json.loads((d / "config.json").read_text())
    cfg["ssm_cfg"]["headdim"] = 64  # a Mamba2 key in a Mamba1 config
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"ssm_cfg keys \['headdim'\]"):
        load_model(d)
