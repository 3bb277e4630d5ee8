"""fla-hub DeltaNet / Gated DeltaNet import (model_types ``delta_net``, ``gated_deltanet``) on the
MC delta-rule memories, post-hoc MC, serving through the engine, and errors for bad directories.

The reference is a layer-by-layer torch model written from flash-linear-attention's layer and
model definitions (``fla/layers/delta_net.py``, ``fla/layers/gated_deltanet.py``,
``fla/models/*/modeling_*.py``), with fla's parameter names, whose recurrence is fla's own
naive ops (``delta_rule_recurrence``, ``naive_recurrent_gated_delta_rule``). Random weights are
saved in fla's format (config.json + model.safetensors); nothing is downloaded.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

fla_delta = pytest.importorskip("fla.ops.delta_rule.naive")
fla_gated = pytest.importorskip("fla.ops.gated_delta_rule.naive")

from mcserve.config import EngineConfig  # noqa: E402
from mcserve.engine.llm import LLM  # noqa: E402
from mcserve.engine.llm_engine import LLMEngine  # noqa: E402
from mcserve.engine.sampling import SamplingParams  # noqa: E402
from mcserve.models.checkpoint import CheckpointError  # noqa: E402
from mcserve.models.fla_delta import FlaDeltaForCausalLM  # noqa: E402
from mcserve.models.registry import detect_format, load_model  # noqa: E402


# ------------------------------------------------------------------ the reference (fla's layers)
class RefRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class RefGatedNorm(RefRMSNorm):
    """FusedRMSNormGated with activation swish: norm(x) · w · g · sigmoid(g)."""

    def forward(self, x: Tensor, g: Tensor) -> Tensor:  # type: ignore[override]
        return super().forward(x) * g * torch.sigmoid(g)


def short_conv(dim: int, size: int, bias: bool) -> nn.Conv1d:
    """fla's ShortConvolution is an nn.Conv1d (depthwise, padding size - 1, cut to T)."""
    return nn.Conv1d(dim, dim, size, groups=dim, padding=size - 1, bias=bias)


def run_conv(conv: nn.Conv1d, x: Tensor, silu: bool) -> Tensor:
    y = conv(x.transpose(1, 2))[..., :x.shape[1]].transpose(1, 2)
    return F.silu(y) if silu else y


def l2norm(x: Tensor) -> Tensor:  # fla's l2norm: x / sqrt(sum(x^2) + 1e-6)
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


class RefDeltaNet(nn.Module):
    """fla.layers.DeltaNet (chunk/fused_recurrent replaced by fla's naive recurrence)."""

    def __init__(self, c: dict):
        super().__init__()
        D, H = c["hidden_size"], c["num_heads"]
        self.c = c
        self.key_dim = int(D * c.get("expand_k", 1.0))
        self.value_dim = int(D * c.get("expand_v", 1.0))
        self.dk, self.dv = self.key_dim // H, self.value_dim // H
        self.q_proj = nn.Linear(D, self.key_dim, bias=False)
        self.k_proj = nn.Linear(D, self.key_dim, bias=False)
        self.v_proj = nn.Linear(D, self.value_dim, bias=False)
        if c.get("use_beta", True):
            self.b_proj = nn.Linear(D, H, bias=False)
        if c.get("use_short_conv", True):
            w, bias = c.get("conv_size", 4), c.get("conv_bias", False)
            self.q_conv1d = short_conv(self.key_dim, w, bias)
            self.k_conv1d = short_conv(self.key_dim, w, bias)
            self.v_conv1d = short_conv(self.value_dim, w, bias)
        if c.get("use_gate", False):
            self.g_proj = nn.Linear(D, self.value_dim, bias=False)
            self.o_norm = RefGatedNorm(self.dv, c.get("norm_eps", 1e-6))
        else:
            self.o_norm = RefRMSNorm(self.dv, c.get("norm_eps", 1e-6))
        self.o_proj = nn.Linear(self.value_dim, D, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        c = self.c
        act = c.get("qk_activation", "silu")
        if c.get("use_short_conv", True):
            q = run_conv(self.q_conv1d, self.q_proj(x), act == "silu")
            k = run_conv(self.k_conv1d, self.k_proj(x), act == "silu")
            v = run_conv(self.v_conv1d, self.v_proj(x), True)
        else:
            q, k = self.q_proj(x), self.k_proj(x)
            if act == "silu":
                q, k = F.silu(q), F.silu(k)
            v = F.silu(self.v_proj(x))
        B, T, _ = x.shape
        q, k = q.view(B, T, -1, self.dk), k.view(B, T, -1, self.dk)
        v = v.view(B, T, -1, self.dv)
        if act == "relu":
            q, k = q.relu(), k.relu()
        elif act == "elu":
            q, k = F.elu(q, 1.0, False) + 1.0, F.elu(k, 1.0, False) + 1.0
        if c.get("qk_norm", "l2") == "sum":
            q, k = q / q.sum(-1, keepdim=True), k / k.sum(-1, keepdim=True)
        else:  # use_qk_l2norm_in_kernel
            q, k = l2norm(q), l2norm(k)
        beta = (self.b_proj(x).sigmoid() if c.get("use_beta", True)
                else torch.ones_like(q[..., 0]))
        if c.get("allow_neg_eigval", False):
            beta = beta * 2.0
        o, _ = fla_delta.delta_rule_recurrence(  # (B, H, T, K); q scaled by K^-0.5 inside
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), beta.transpose(1, 2))
        o = o.transpose(1, 2)
        if c.get("use_gate", False):
            o = self.o_norm(o, self.g_proj(x).view(B, T, -1, self.dv))
        else:
            o = self.o_norm(o)
        return self.o_proj(o.reshape(B, T, -1))


class RefGatedDeltaNet(nn.Module):
    """fla.layers.GatedDeltaNet (kernels replaced by fla's naive recurrence)."""

    def __init__(self, c: dict):
        super().__init__()
        D = c["hidden_size"]
        self.c = c
        self.H = c.get("num_heads", 6)
        self.HV = c.get("num_v_heads") or self.H
        self.dk = c.get("head_dim", 256)
        self.dv = int(self.dk * c.get("expand_v", 2.0))
        self.key_dim, self.value_dim = self.H * self.dk, self.HV * self.dv
        self.q_proj = nn.Linear(D, self.key_dim, bias=False)
        self.k_proj = nn.Linear(D, self.key_dim, bias=False)
        self.v_proj = nn.Linear(D, self.value_dim, bias=False)
        self.a_proj = nn.Linear(D, self.HV, bias=False)
        self.b_proj = nn.Linear(D, self.HV, bias=False)
        self.A_log = nn.Parameter(torch.empty(self.HV).uniform_(1, 16).log())
        dt = torch.exp(torch.rand(self.HV) * (math.log(0.1) - math.log(0.001)) + math.log(0.001))
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))
        if c.get("use_short_conv", True):
            w = c.get("conv_size", 4)
            self.q_conv1d = short_conv(self.key_dim, w, False)
            self.k_conv1d = short_conv(self.key_dim, w, False)
            self.v_conv1d = short_conv(self.value_dim, w, False)
        if c.get("use_gate", True):
            self.g_proj = nn.Linear(D, self.value_dim, bias=False)
            self.o_norm = RefGatedNorm(self.dv, c.get("norm_eps", 1e-6))
        else:
            self.o_norm = RefRMSNorm(self.dv, c.get("norm_eps", 1e-6))
        self.o_proj = nn.Linear(self.value_dim, D, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        c = self.c
        if c.get("use_short_conv", True):
            q = run_conv(self.q_conv1d, self.q_proj(x), True)
            k = run_conv(self.k_conv1d, self.k_proj(x), True)
            v = run_conv(self.v_conv1d, self.v_proj(x), True)
        else:
            q, k, v = F.silu(self.q_proj(x)), F.silu(self.k_proj(x)), F.silu(self.v_proj(x))
        B, T, _ = x.shape
        q, k = q.view(B, T, self.H, self.dk), k.view(B, T, self.H, self.dk)
        v = v.view(B, T, self.HV, self.dv)
        q, k = l2norm(q), l2norm(k)
        # grouped value heads: the kernels map value head j to q/k head j // (HV / H)
        q = q.repeat_interleave(self.HV // self.H, dim=2)
        k = k.repeat_interleave(self.HV // self.H, dim=2)
        beta = self.b_proj(x).sigmoid()
        if c.get("allow_neg_eigval", False):
            beta = beta * 2.0
        # use_gate_in_kernel: g = -exp(A_log) * softplus(a_proj(x) + dt_bias), float32
        g = -self.A_log.float().exp() * F.softplus(self.a_proj(x).float() + self.dt_bias.float())
        o, _ = fla_gated.naive_recurrent_gated_delta_rule(q, k, v, beta, g)
        if c.get("use_gate", True):
            o = self.o_norm(o, self.g_proj(x).view(B, T, self.HV, self.dv))
        else:
            o = self.o_norm(o)
        return self.o_proj(o.reshape(B, T, -1))


class RefMLP(nn.Module):
    def __init__(self, D: int, c: dict):
        super().__init__()
        inter = c.get("intermediate_size")
        if inter is None:
            inter = int(D * c.get("hidden_ratio", 4) * 2 / 3)
            inter = 256 * ((inter + 256 - 1) // 256)
        self.gate_proj = nn.Linear(D, inter, bias=False)
        self.up_proj = nn.Linear(D, inter, bias=False)
        self.down_proj = nn.Linear(inter, D, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class RefBlock(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        D, eps = c["hidden_size"], c.get("norm_eps", 1e-6)
        self.attn_norm = RefRMSNorm(D, eps)
        gated = c["model_type"] == "gated_deltanet"
        self.attn = RefGatedDeltaNet(c) if gated else RefDeltaNet(c)
        self.mlp_norm = RefRMSNorm(D, eps)
        self.mlp = RefMLP(D, c)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class RefBackbone(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        self.embeddings = nn.Embedding(c["vocab_size"], c["hidden_size"])
        self.layers = nn.ModuleList(RefBlock(c) for _ in range(c["num_hidden_layers"]))
        self.norm = RefRMSNorm(c["hidden_size"], c.get("norm_eps", 1e-6))


class RefLM(nn.Module):
    """``{Gated}DeltaNetForCausalLM``: ``model.*`` and ``lm_head``, fla's state-dict names."""

    def __init__(self, c: dict):
        super().__init__()
        self.c = c
        self.model = RefBackbone(c)
        self.lm_head = nn.Linear(c["hidden_size"], c["vocab_size"], bias=False)
        if c.get("tie_word_embeddings", False):
            self.lm_head.weight = self.model.embeddings.weight

    def forward(self, ids: Tensor) -> Tensor:
        x = self.model.embeddings(ids)
        for blk in self.model.layers:
            x = blk(x)
        return self.lm_head(self.model.norm(x))

    @torch.no_grad()
    def greedy(self, ids: list[int], n: int) -> list[int]:
        seq = list(ids)
        for _ in range(n):  # the whole sequence again each step: no state to get wrong
            seq.append(int(self(torch.tensor([seq]))[0, -1].argmax()))
        return seq[len(ids):]

    def save(self, path: Path) -> Path:
        from safetensors.torch import save_file

        path.mkdir(parents=True)
        (path / "config.json").write_text(json.dumps(self.c, indent=2))
        sd = {k: t.detach().contiguous().clone() for k, t in self.state_dict().items()}
        if self.c.get("tie_word_embeddings", False):
            sd.pop("lm_head.weight")  # as transformers saves tied weights
        save_file(sd, str(path / "model.safetensors"), metadata={"format": "pt"})
        return path


def build_ref(c: dict, seed: int) -> RefLM:
    torch.manual_seed(seed)
    ref = RefLM(c)
    with torch.no_grad():  # norms away from 1 and larger embeddings: spread-out logits
        for name, p in ref.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
        ref.model.embeddings.weight.normal_(0, 1.0)
    return ref.eval()


def fla_config(model_type: str, **kw) -> dict:
    """What fla's config classes save (defaults of fields not given left out, as fla keeps
    them in its own defaults), plus the usual transformers bookkeeping keys."""
    c = {"model_type": model_type, "architectures": [
        "GatedDeltaNetForCausalLM" if model_type == "gated_deltanet" else "DeltaNetForCausalLM"],
        "attn_mode": "chunk", "attn": None, "fuse_norm": True, "fuse_swiglu": True,
        "fuse_cross_entropy": True, "use_cache": True, "initializer_range": 0.02,
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": None, "hidden_act": "swish",
        "norm_eps": 1e-6, "max_position_embeddings": 2048, "transformers_version": "4.53.0"}
    c.update(kw)
    return c


CONFIGS = {
    # DeltaNet defaults: silu + l2, β, no output gate, MLP size from hidden_ratio
    "delta": fla_config("delta_net", vocab_size=96, hidden_size=32, num_hidden_layers=2,
                        num_heads=2, expand_k=1.0, expand_v=1.0, use_gate=False,
                        use_short_conv=True, conv_size=4, use_beta=True, qk_norm="l2",
                        qk_activation="silu", hidden_ratio=2, intermediate_size=None),
    # elu + sum norm, output gate, V = 2K, conv bias, β ∈ (0, 2), tied embeddings
    "delta_elu_sum": fla_config("delta_net", vocab_size=80, hidden_size=24, num_hidden_layers=2,
                                num_heads=3, expand_k=1.0, expand_v=2.0, use_gate=True,
                                conv_size=3, conv_bias=True, allow_neg_eigval=True,
                                qk_norm="sum", qk_activation="elu", intermediate_size=40,
                                tie_word_embeddings=True),
    # relu + l2, no short conv, no β
    "delta_relu_noconv": fla_config("delta_net", vocab_size=64, hidden_size=16,
                                    num_hidden_layers=2, num_heads=2, use_short_conv=False,
                                    use_beta=False, qk_activation="relu", intermediate_size=32),
    # Gated DeltaNet: output gate, V = 2K; byte vocabulary (for `mcserve eval ppl`)
    "gated": fla_config("gated_deltanet", vocab_size=256, hidden_size=32, num_hidden_layers=2,
                        num_heads=2, head_dim=8, expand_v=2.0, use_gate=True, conv_size=4,
                        intermediate_size=48),
    # grouped value heads (4 value heads on 2 q/k heads), no gate, β ∈ (0, 2), conv of 3, tied
    "gated_gva": fla_config("gated_deltanet", vocab_size=72, hidden_size=24, num_hidden_layers=2,
                            num_heads=2, num_v_heads=4, head_dim=8, expand_v=1.0,
                            use_gate=False, allow_neg_eigval=True, conv_size=3,
                            intermediate_size=32, tie_word_embeddings=True),
}
T = 37


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    torch.set_num_threads(1)
    out = {}
    for i, (name, c) in enumerate(CONFIGS.items()):
        ref = build_ref(c, seed=i)
        out[name] = (ref, ref.save(tmp_path_factory.mktemp("fla") / name))
    return out


def rel_err(a: Tensor, b: Tensor) -> float:
    return float((a - b).abs().max() / a.abs().max())


@torch.no_grad()
def greedy(model, ids: list[int], n: int) -> list[int]:
    """The model's own greedy continuation: a prefill, then one forward per token."""
    logits, state = model(torch.tensor([ids]), last_only=True)
    out: list[int] = []
    for _ in range(n):
        out.append(int(logits[0, -1].argmax()))
        logits, state = model(torch.tensor([[out[-1]]]), state)
    return out


# ------------------------------------------------------------------ exactness
@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_reference(zoo, name):
    ref, d = zoo[name]
    c = CONFIGS[name]
    assert detect_format(d) == (c["model_type"], "transformers")
    model = load_model(d)
    assert isinstance(model, FlaDeltaForCausalLM)
    assert (model.config.mc_variant, model.config.segment_len) == ("none", 2048)
    ids = torch.randint(0, c["vocab_size"], (2, T), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = ref(ids)
        got, _ = model(ids)
        assert rel_err(want, got) <= 1e-4
        # prefill + token-by-token decode, and a split prefill
        logits, state = model(ids[:, :11])
        outs = [logits]
        for t in range(11, 15):
            logits, state = model(ids[:, t:t + 1], state)
            outs.append(logits)
        logits, state = model(ids[:, 15:], state)
        outs.append(logits)
        assert rel_err(want, torch.cat(outs, 1)) <= 1e-4


@pytest.mark.parametrize("name", ["delta", "delta_elu_sum", "gated", "gated_gva"])
def test_greedy_through_engine_matches_reference(zoo, name):
    ref, d = zoo[name]
    vocab = CONFIGS[name]["vocab_size"]
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (9, 3, 14)]
    want = [ref.greedy(p, 12) for p in prompts]
    llm = LLM(str(d), dtype="float32")
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == want
    assert greedy(load_model(d), prompts[0], 12) == want[0]  # the model's own state loop


# ------------------------------------------------------------------ post-hoc MC
@pytest.mark.parametrize("variant,mode", [("post", "independent"), ("grm", "checkpoint"),
                                          ("ssc", "independent"), ("residual", "checkpoint")])
def test_mc_with_one_segment_equals_no_mc(zoo, variant, mode):
    _, d = zoo["gated"]
    base = load_model(d)
    mc = load_model(d, mc_overrides={"mc_variant": variant, "mc_mode": mode, "segment_len": T})
    ids = torch.randint(0, 256, (1, T), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(mc(ids)[0], base(ids)[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["delta", "gated_gva"])
@pytest.mark.parametrize("variant,mode", [("post", "independent"), ("grm", "checkpoint"),
                                          ("loglinear", "checkpoint")])
def test_mc_explicit_layer_and_splits(zoo, name, variant, mode):
    """Every layer's MC output equals ``reference.mc_delta`` run on that layer's q, k, v, β, α
    (u = q); the full forward equals prefill + decode; MC changes the logits."""
    from mcserve.kernels.reference import mc_delta

    _, d = zoo[name]
    C = 5
    model = load_model(d, mc_overrides={"mc_variant": variant, "mc_mode": mode,
                                        "segment_len": C})
    assert model.config.mc_mode == mode
    ids = torch.randint(0, CONFIGS[name]["vocab_size"], (2, 23),
                        generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        x = model.embed(ids)
        for blk in model.layers:
            mix = blk.mixer
            h = blk.attn_norm(x)
            st = mix.init_state(2, model.dtype, model.device)
            q, k, v, gates, _, _ = mix._project(h, st.conv)
            y = torch.stack([mc_delta(
                q[b], k[b], v[b], q[b], gates.get("beta", torch.ones_like(q[..., 0]))[b],
                gates["log_a"][b] if "log_a" in gates else None, variant=variant,
                segment_len=C, mode=mode) for b in range(2)])
            got, _ = mix(h, st)
            torch.testing.assert_close(got, mix._output(h, y), rtol=1e-4, atol=1e-5)
            x = x + got
            x = x + blk.mlp(blk.mlp_norm(x))
        full, _ = model(ids)
        assert not torch.allclose(full, load_model(d)(ids)[0], atol=1e-4)
        logits, state = model(ids[:, :7])
        outs = [logits]
        for t in range(7, ids.shape[1]):
            logits, state = model(ids[:, t:t + 1], state)
            outs.append(logits)
        torch.testing.assert_close(torch.cat(outs, 1), full, rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------ engine invariants
@pytest.mark.parametrize("name,variant,mode", [
    ("gated", "none", "checkpoint"), ("gated", "grm", "checkpoint"),
    ("delta_elu_sum", "post", "independent"), ("gated_gva", "ssc", "checkpoint"),
])
def test_engine_batched_preempted_prefix_cached(zoo, name, variant, mode):
    _, d = zoo[name]
    vocab = CONFIGS[name]["vocab_size"]
    model = load_model(d, mc_overrides={"mc_variant": variant, "mc_mode": mode,
                                        "segment_len": 4, "mc_top_k": 1})
    g = torch.Generator().manual_seed(5)
    base = torch.randint(0, vocab, (21,), generator=g).tolist()
    prompts = [base, base[:13], torch.randint(0, vocab, (4,), generator=g).tolist(),
               torch.randint(0, vocab, (9,), generator=g).tolist()]
    want = [greedy(model, p, 10) for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)

    def run(**kw):
        args = dict(max_num_seqs=4, num_state_blocks=64, max_num_batched_tokens=32,
                    max_model_len=128)
        args.update(kw)
        eng = LLMEngine(EngineConfig(**args), model=model)
        got = [o.outputs[0].token_ids for o in LLM(engine=eng).generate(prompts, params)]
        assert got == want
        return eng

    eng = run()  # batched (ragged decode)
    hits0 = eng.stats()["prefix_cache_hits"]
    assert [o.outputs[0].token_ids
            for o in LLM(engine=eng).generate(prompts, params)] == want  # prefix reuse
    if variant != "none":
        assert eng.stats()["prefix_cache_hits"] > hits0
    assert eng.cache.is_whole()
    small = run(num_state_blocks=10, max_num_batched_tokens=8)  # preemption + recompute
    if variant != "none":
        assert small.stats()["num_preemptions"] > 0
    assert small.cache.is_whole()
    serial = run(max_num_seqs=1)
    assert serial.cache.is_whole()


def test_eval_ppl_runs(zoo, tmp_path):
    _, d = zoo["gated"]
    data = tmp_path / "text.txt"
    data.write_text("The grass is green. The sky is blue. " * 12)
    out = subprocess.run(
        [sys.executable, "-m", "mcserve.cli", "eval", "ppl", str(d), "--data", str(data),
         "--lengths", "64", "--mc", "post:16", "--no-progress", "--json", "-"],
        capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "post" in out.stdout


# ------------------------------------------------------------------ bad directories
def _copy(src: Path, dst: Path, skip=()) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        if f.name not in skip:
            (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_bad_directories(zoo, tmp_path):
    from safetensors.torch import load_file, save_file

    _, src = zoo["gated"]
    key = "model.layers.1.attn.A_log"

    d = _copy(src, tmp_path / "missing", skip={"model.safetensors"})
    sd = load_file(src / "model.safetensors")
    del sd[key]
    save_file(sd, d / "model.safetensors")
    with pytest.raises(CheckpointError, match=f"model.safetensors is missing tensor '{key}'"):
        load_model(d)

    d = _copy(src, tmp_path / "shape", skip={"model.safetensors"})
    sd = load_file(src / "model.safetensors")
    sd["model.layers.0.attn.q_conv1d.weight"] = sd["model.layers.0.attn.q_conv1d.weight"][1:]
    save_file(sd, d / "model.safetensors")
    with pytest.raises(CheckpointError) as e:
        load_model(d)
    msg = str(e.value)
    assert "'model.layers.0.attn.q_conv1d.weight'" in msg and "(15, 1, 4)" in msg
    assert "(16, 1, 4)" in msg

    d = _copy(src, tmp_path / "extra", skip={"model.safetensors"})
    sd = load_file(src / "model.safetensors")
    sd["model.layers.0.attn.q_norm.weight"] = torch.ones(8)
    save_file(sd, d / "model.safetensors")
    with pytest.raises(CheckpointError, match="does not use: 'model.layers.0.attn.q_norm"):
        load_model(d)

    for change, pattern in [({"attn": {"layers": [1], "num_heads": 2}}, "hybrid attention"),
                            ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
                            ({"num_v_heads": 3}, "num_v_heads=3"),
                            ({"hidden_size": None}, "'hidden_size' is missing")]:
        d = _copy(src, tmp_path / f"cfg{len(list(tmp_path.iterdir()))}")
        cfg = json.loads((d / "config.json").read_text())
        cfg.update(change)
        (d / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(CheckpointError, match=pattern):
            load_model(d)
