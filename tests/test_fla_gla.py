"""flash-linear-attention GLA import (model_type ``gla``) on the ``gla`` memory family.

The reference is a layer-by-layer torch transcription of fla's ``GLAForCausalLM`` /
``GatedLinearAttention`` (same parameter names, so its state dict is what fla saves) whose
recurrence is fla's own ``naive_recurrent_gla``. Random weights; nothing is downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

naive = pytest.importorskip("fla.ops.gla.naive")

from mcserve.config import EngineConfig  # noqa: E402
from mcserve.engine.llm import LLM  # noqa: E402
from mcserve.engine.llm_engine import LLMEngine  # noqa: E402
from mcserve.engine.sampling import SamplingParams  # noqa: E402
from mcserve.models.checkpoint import CheckpointError  # noqa: E402
from mcserve.models.fla_gla import FlaGLAForCausalLM  # noqa: E402
from mcserve.models.registry import detect_format, load_model  # noqa: E402

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


# ------------------------------------------------------------------ the reference (fla's layer)
def rms(x, w, eps):
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return x if w is None else x * w


class RefNorm(nn.Module):
    def __init__(self, d, eps, affine=True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(1 + 0.2 * torch.randn(d)) if affine else None

    def forward(self, x):
        return rms(x, self.weight, self.eps)


ACT = {"swish": F.silu, "relu": F.relu, "sigmoid": torch.sigmoid}


class RefGLA(nn.Module):
    """GatedLinearAttention as fla's layer computes it (mode irrelevant: same math)."""

    def __init__(self, c):
        super().__init__()
        self.c = c
        D, H = c["hidden_size"], c["num_heads"]
        self.kvh = c.get("num_kv_heads") or H
        self.g = H // self.kvh
        self.key_dim, self.value_dim = int(D * c["expand_k"]), int(D * c["expand_v"])
        self.dk, self.dv = self.key_dim // H, self.value_dim // H
        kg, vg = self.key_dim // self.g, self.value_dim // self.g
        self.q_proj = nn.Linear(D, self.key_dim, bias=False)
        self.k_proj = nn.Linear(D, kg, bias=False)
        self.v_proj = nn.Linear(D, vg, bias=False)
        if c["use_output_gate"]:
            self.g_proj = nn.Linear(D, self.value_dim, bias=False)
        if c["use_short_conv"]:
            W = c["conv_size"]
            self.q_conv1d = nn.Conv1d(self.key_dim, self.key_dim, W, groups=self.key_dim,
                                      padding=W - 1, bias=False)
            self.k_conv1d = nn.Conv1d(kg, kg, W, groups=kg, padding=W - 1, bias=False)
            self.v_conv1d = nn.Conv1d(vg, vg, W, groups=vg, padding=W - 1, bias=False)
        self.gk_proj = nn.Sequential(nn.Linear(D, 16, bias=False), nn.Linear(16, kg, bias=True))
        nn.init.normal_(self.gk_proj[1].bias, std=2.0)  # decays from ~1 to strong
        self.o_proj = nn.Linear(self.value_dim, D, bias=False)
        self.fused = c["hidden_act"] == "swish" and c["fuse_norm"] and c["use_output_gate"]
        norm = RefNorm(self.dv, c["norm_eps"], c["elementwise_affine"])
        if self.fused:
            self.g_norm_swish_gate = norm
        else:
            self.g_norm = norm

    def conv(self, m, x):
        return F.silu(m(x.transpose(1, 2))[..., :x.shape[1]].transpose(1, 2))

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.c["use_short_conv"]:
            q, k, v = self.conv(self.q_conv1d, q), self.conv(self.k_conv1d, k), \
                self.conv(self.v_conv1d, v)
        gk = self.gk_proj(x)
        q = q.view(B, T, -1, self.dk)

        def rep(t, d):  # '... (h d) -> ... (h g) d'
            t = t.view(B, T, -1, 1, d).expand(B, T, t.shape[-1] // d, self.g, d)
            return t.reshape(B, T, -1, d)

        k, gk, v = rep(k, self.dk), rep(gk, self.dk), rep(v, self.dv)
        gk = F.logsigmoid(gk) / 16
        if self.c.get("clamp_min") is not None:
            gk = torch.clamp_min(gk, self.c["clamp_min"])
        if self.c.get("feature_map"):
            q, k = ACT[self.c["feature_map"]](q), ACT[self.c["feature_map"]](k)
        o, _ = naive.naive_recurrent_gla(q, k, v, gk)
        if self.c["use_output_gate"]:
            g = self.g_proj(x)
            if self.fused:
                o = self.g_norm_swish_gate(o) * F.silu(g.view(B, T, -1, self.dv))
                o = o.reshape(B, T, -1)
            else:
                o = self.g_norm(o).reshape(B, T, -1) * ACT[self.c["hidden_act"]](g)
        else:
            o = self.g_norm(o).reshape(B, T, -1)
        return self.o_proj(o)


class RefMLP(nn.Module):
    def __init__(self, D, inter):
        super().__init__()
        self.gate_proj = nn.Linear(D, inter, bias=False)
        self.up_proj = nn.Linear(D, inter, bias=False)
        self.down_proj = nn.Linear(inter, D, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class RefBlock(nn.Module):
    def __init__(self, c, inter):
        super().__init__()
        self.attn_norm = RefNorm(c["hidden_size"], c["norm_eps"])
        self.attn = RefGLA(c)
        self.mlp_norm = RefNorm(c["hidden_size"], c["norm_eps"])
        self.mlp = RefMLP(c["hidden_size"], inter)

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class RefInner(nn.Module):
    def __init__(self, c, inter):
        super().__init__()
        self.embeddings = nn.Embedding(c["vocab_size"], c["hidden_size"])
        self.layers = nn.ModuleList(RefBlock(c, inter) for _ in range(c["num_hidden_layers"]))
        self.norm = RefNorm(c["hidden_size"], c["norm_eps"])


class RefGLAForCausalLM(nn.Module):
    def __init__(self, c):
        super().__init__()
        inter = c.get("intermediate_size")
        if inter is None:
            inter = int(c["hidden_size"] * c["hidden_ratio"] * 2 / 3)
            inter = 256 * ((inter + 255) // 256)
        self.model = RefInner(c, inter)
        self.lm_head = nn.Linear(c["hidden_size"], c["vocab_size"], bias=False)
        if c["tie_word_embeddings"]:
            self.lm_head.weight = self.model.embeddings.weight

    def forward(self, ids):
        x = self.model.embeddings(ids)
        for blk in self.model.layers:
            x = blk(x)
        return self.lm_head(self.model.norm(x))


BASE = dict(model_type="gla", architectures=["GLAForCausalLM"], vocab_size=100, hidden_size=32,
            expand_k=0.5, expand_v=1, hidden_ratio=4, intermediate_size=None,
            num_hidden_layers=2, num_heads=4, num_kv_heads=None, feature_map=None,
            attn_mode="chunk", use_short_conv=False, conv_size=4, use_output_gate=True,
            clamp_min=None, hidden_act="swish", max_position_embeddings=2048,
            elementwise_affine=True, norm_eps=1e-6, use_gk=True, use_gv=False, attn=None,
            use_cache=True, pad_token_id=None, bos_token_id=None, eos_token_id=None,
            tie_word_embeddings=False, fuse_norm=True, fuse_swiglu=True)
CONFIGS = {
    "basic": {},
    # short convs, grouped kv heads, relu feature map, clamped decay, unfused norm + gate, tied
    "conv_kv": dict(use_short_conv=True, conv_size=3, num_kv_heads=2, feature_map="relu",
                    clamp_min=-0.05, fuse_norm=False, tie_word_embeddings=True,
                    intermediate_size=48, expand_v=2, num_hidden_layers=3),
    # no output gate, norm without weights
    "no_gate": dict(use_output_gate=False, elementwise_affine=False, num_heads=2, expand_k=1),
}


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    from safetensors.torch import save_file

    out = {}
    for i, (name, over) in enumerate(CONFIGS.items()):
        torch.manual_seed(300 + i)
        c = {**BASE, **over}
        ref = RefGLAForCausalLM(c).eval()
        d = tmp_path_factory.mktemp(name)
        (d / "config.json").write_text(json.dumps(c))
        sd = {k: t.detach().contiguous() for k, t in ref.state_dict().items()}
        if c["tie_word_embeddings"]:
            sd.pop("lm_head.weight")
        save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
        out[name] = (ref, d)
    return out


def rel_err(a, b) -> float:
    return float((a - b).abs().max() / a.abs().max())


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_reference(zoo, name):
    ref, d = zoo[name]
    assert detect_format(d) == ("gla", "transformers")
    model = load_model(d)
    assert isinstance(model, FlaGLAForCausalLM)
    g = torch.Generator().manual_seed(0)
    for T in (1, 17, 70):
        ids = torch.randint(0, 100, (2, T), generator=g)
        with torch.no_grad():
            want = ref(ids)
            got, _ = model(ids)
            assert rel_err(want, got) <= 1e-4, T
            cut = min(T, 6)  # prefill + token-by-token decode
            logits, state = model(ids[:, :cut])
            outs = [logits]
            for t in range(cut, T):
                logits, state = model(ids[:, t:t + 1], state)
                outs.append(logits)
            assert rel_err(want, torch.cat(outs, 1)) <= 1e-4, T


@pytest.mark.parametrize("name", ["basic", "conv_kv"])
def test_greedy_through_engine_matches_reference(zoo, name):
    ref, d = zoo[name]
    ids = torch.randint(0, 100, (9,), generator=torch.Generator().manual_seed(1)).tolist()
    want = []
    with torch.no_grad():
        for _ in range(16):
            want.append(int(ref(torch.tensor([ids + want]))[0, -1].argmax()))
    outs = LLM(str(d), dtype="float32").generate(
        [ids], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    assert outs[0].outputs[0].token_ids == want


@torch.no_grad()
def greedy(model, ids, n):
    logits, state = model(torch.tensor([ids]), last_only=True)
    out = []
    for _ in range(n):
        out.append(int(logits[0, -1].argmax()))
        logits, state = model(torch.tensor([[out[-1]]]), state)
    return out


@pytest.mark.parametrize("variant,mode", [("none", "checkpoint"), ("grm", "checkpoint"),
                                          ("post", "independent"), ("ssc", "checkpoint")])
def test_engine_alone_batched_preempted_cached(zoo, variant, mode):
    ref, d = zoo["conv_kv"]
    model = load_model(d, dtype="float64", mc_overrides={
        "mc_variant": variant, "mc_mode": mode, "segment_len": 4, "mc_top_k": 1})
    g = torch.Generator().manual_seed(5)
    ps = [torch.randint(0, 100, (n,), generator=g).tolist() for n in (1, 4, 9, 17, 23)]
    alone = [greedy(model, p, GREEDY.max_tokens) for p in ps]
    engines = []

    def run(**kw):
        args = dict(max_num_seqs=8, num_state_blocks=96, max_num_batched_tokens=32,
                    dtype="float64", max_model_len=64)
        args.update(kw)
        eng = LLMEngine(EngineConfig(**args), model=model)
        engines.append(eng)
        return eng, [o.outputs[0].token_ids for o in LLM(engine=eng).generate(ps, GREEDY)]

    eng, got = run()
    assert got == alone
    hits0 = eng.stats()["prefix_cache_hits"]
    assert [o.outputs[0].token_ids for o in LLM(engine=eng).generate(ps, GREEDY)] == alone
    if variant != "none":
        assert eng.stats()["prefix_cache_hits"] > hits0
    small, got = run(num_state_blocks=10, max_num_batched_tokens=8)
    assert got == alone
    if variant != "none":
        assert small.stats()["num_preemptions"] > 0
    for e in engines:
        assert not e.has_unfinished_requests() and e.cache.is_whole()


def test_bad_directories(zoo, tmp_path):
    from safetensors.torch import load_file, save_file

    _, src = zoo["basic"]

    def copy(name: str) -> Path:
        d = tmp_path / name
        d.mkdir()
        for f in src.iterdir():
            (d / f.name).write_bytes(f.read_bytes())
        return d

    d = copy("missing")
    sd = load_file(d / "model.safetensors")
    del sd["model.layers.1.attn.gk_proj.1.bias"]
    save_file(sd, d / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"missing tensor 'model\.layers\.1\.attn\."
                                              r"gk_proj\.1\.bias'"):
        load_model(d)

    d = copy("hybrid")
    cfg = json.loads((d / "config.json").read_text())
    cfg["attn"] = {"layers": [1], "num_heads": 4}
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="hybrid attention"):
        load_model(d)
