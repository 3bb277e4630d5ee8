"""RWKV-7: the generalised delta rule (chunked kernel, its per-token twin, the package-layout
oracle, flash-linear-attention's DPLR recurrence), Memory Caching over the ``rwkv7`` family
against a per-token MC oracle, the importers (BlinkDL ``.pth``, fla-hub directory) against the
``rwkv`` package's own float32 CPU inference, the World tokenizer, and serving through the engine.

Models are random BlinkDL-format state dicts written to temporary files; nothing is downloaded.
"""

from __future__ import annotations

import json
import math
import os
import random
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from mcserve.config import EngineConfig, MCConfig
from mcserve.engine.llm import LLM
from mcserve.engine.llm_engine import LLMEngine
from mcserve.engine.sampling import SamplingParams
from mcserve.engine.tokenizer import IncrementalDetokenizer, RWKVWorldTokenizer, load_tokenizer
from mcserve.kernels import reference
from mcserve.kernels.rwkv7 import chunk_rwkv7, naive_rwkv7
from mcserve.models.checkpoint import CheckpointError
from mcserve.models.mc import MCMemory
from mcserve.models.memory.rwkv7 import RWKV7Memory
from mcserve.models.registry import detect_format, load_model
from mcserve.models.rwkv7 import RWKV7ForCausalLM

DTYPES = [pytest.param(torch.float64, 1e-10, id="f64"), pytest.param(torch.float32, 1e-4, id="f32")]
C = 4  # segment length of the MC tests


def _rel(a: Tensor, b: Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _inputs(B, T, H, K, V, dtype, seed):
    """RWKV-7-like inputs: a = −κ̂ (unit removal key), b = κ̂·rate, rate ∈ (0, 1), and
    log w ∈ (−e^{−0.5}, 0)."""
    g = torch.Generator().manual_seed(seed)
    r = torch.randn(B, T, H, K, generator=g, dtype=dtype)
    k = torch.randn(B, T, H, K, generator=g, dtype=dtype)
    v = torch.randn(B, T, H, V, generator=g, dtype=dtype)
    kk = F.normalize(torch.randn(B, T, H, K, generator=g, dtype=dtype), dim=-1)
    rate = torch.rand(B, T, H, K, generator=g, dtype=dtype)
    log_w = -math.exp(-0.5) * torch.rand(B, T, H, K, generator=g, dtype=dtype)
    S0 = torch.randn(B, H, K, V, generator=g, dtype=dtype)
    return r, k, v, -kk, kk * rate, log_w, S0


# ------------------------------------------------------------------ kernels
@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("T,chunk", [(1, 32), (2, 32), (7, 4), (33, 32), (70, 16), (45, 64)])
def test_chunk_equals_naive(dtype, tol, T, chunk):
    r, k, v, a, b, log_w, S0 = _inputs(2, T, 3, 8, 5, dtype, T)
    o1, S1 = naive_rwkv7(r, k, v, a, b, log_w, S0)
    o2, S2 = chunk_rwkv7(r, k, v, a, b, log_w, S0, chunk_size=chunk)
    assert _rel(o2, o1) <= tol and _rel(S2, S1) <= tol


def test_chunk_splits_and_strong_decay():
    # any split of the span gives the same outputs and state; the strongest decay RWKV-7 can
    # produce (log w = −e^{−0.5} everywhere) stays exact in float32 over long chunks
    r, k, v, a, b, log_w, S0 = _inputs(1, 150, 2, 64, 64, torch.float32, 1)
    log_w = torch.full_like(log_w, -0.606531)
    want, S_want = naive_rwkv7(*(x.double() for x in (r, k, v, a, b, log_w, S0)))
    o, S = chunk_rwkv7(r, k, v, a, b, log_w, S0, chunk_size=64)
    assert _rel(o.double(), want) <= 1e-5 and _rel(S.double(), S_want) <= 1e-5
    o1, S1 = chunk_rwkv7(r[:, :61], k[:, :61], v[:, :61], a[:, :61], b[:, :61],
                         log_w[:, :61], S0)
    o2, S2 = chunk_rwkv7(r[:, 61:], k[:, 61:], v[:, 61:], a[:, 61:], b[:, 61:],
                         log_w[:, 61:], S1)
    assert _rel(torch.cat([o1, o2], 1).double(), want) <= 1e-5
    assert _rel(S2.double(), S_want) <= 1e-5


def test_naive_matches_package_layout_oracle():
    # reference.rwkv7_recurrent keeps the rwkv package's layout (values on the rows):
    # its state is the transpose of ours
    r, k, v, a, b, log_w, S0 = _inputs(1, 9, 2, 4, 4, torch.float64, 2)
    o, S = naive_rwkv7(r, k, v, a, b, log_w, S0)
    y, S_pkg = reference.rwkv7_recurrent(r[0], log_w[0].exp(), k[0], v[0], a[0], b[0],
                                         S0[0].transpose(-1, -2))
    assert _rel(o[0], y) <= 1e-12
    assert _rel(S[0], S_pkg.transpose(-1, -2)) <= 1e-12


def test_naive_matches_fla_dplr_recurrence():
    pytest.importorskip("einops")
    naive = pytest.importorskip("fla.ops.generalized_delta_rule.dplr.naive")
    r, k, v, a, b, log_w, S0 = _inputs(1, 11, 2, 8, 6, torch.float32, 3)
    o, S = naive_rwkv7(r, k, v, a, b, log_w, S0)
    hf = lambda x: x.transpose(1, 2).contiguous()  # noqa: E731 (B, H, T, ·)
    # fla scales q by K^-1/2 inside; RWKV-7 reads with scale 1
    o_fla, S_fla = naive.dplr_recurrence(hf(r) * math.sqrt(8), hf(k), hf(v), hf(a), hf(b),
                                         hf(log_w), initial_state=S0.clone())
    assert _rel(o, o_fla.transpose(1, 2)) <= 1e-5 and _rel(S, S_fla) <= 1e-5


# ------------------------------------------------------------------ MC over the family
def _oracle_weights(variant: str, r: Tensor, top_k: int) -> Tensor:
    """Mixing weights [H, s] of one token over its s memories (the last one online)."""
    H, s = r.shape
    if variant == "residual":
        return torch.ones_like(r)
    if variant == "post":
        return torch.full_like(r, 1.0 / s)
    if variant in ("grm", "soup", "loglinear"):
        return torch.softmax(r, -1)
    w = torch.zeros_like(r)  # ssc: top_k cached (ties → the more recent) and the online one
    for h in range(H):
        order = sorted(range(s - 1), key=lambda i: (r[h, i].item(), i), reverse=True)
        keep = sorted(order[:top_k]) + [s - 1]
        w[h, keep] = torch.softmax(r[h, keep], -1)
    return w


def mc_rwkv7_oracle(r, k, v, u, a, b, log_w, *, variant, segment_len, top_k=2,
                    mode="checkpoint"):
    """Per-token Memory Caching over the rwkv7 recurrence, one unbatched sequence (the structure
    of ``reference.mc_linear``): every state is kept, each token reads its segments' states."""
    T, H, K = r.shape
    independent = mode == "independent" and variant != "none"
    S = torch.zeros(H, K, v.shape[-1], dtype=r.dtype)
    states = [S]
    for t in range(T):
        if independent and t % segment_len == 0:
            S = torch.zeros_like(S)
        S = (S * log_w[t].exp()[..., None] + b[t][..., None] * torch.einsum("hk,hkv->hv", a[t], S)
             [:, None] + k[t][..., None] * v[t][:, None])
        states.append(S)
    y = torch.zeros(T, H, v.shape[-1], dtype=r.dtype)
    for t in range(T):
        segs = reference.segments(t + 1, segment_len, variant)
        reads = torch.stack([torch.einsum("hkv,hk->hv", states[e], r[t]) for _, e in segs], 1)
        if variant == "none":
            y[t] = reads[:, 0]
            continue
        means = torch.stack([k[s:e].mean(0) for s, e in segs], 1)  # [H, s, K]
        scores = torch.einsum("hk,hsk->hs", u[t], means) / math.sqrt(K)
        y[t] = torch.einsum("hs,hsv->hv", _oracle_weights(variant, scores, top_k), reads)
    return y


COMBOS = [(var, mode) for var in ("none", "residual", "grm", "soup", "ssc", "loglinear", "post")
          for mode in ("checkpoint", "independent")
          if not (var == "loglinear" and mode == "independent")]


def _gates(a, b, log_w):
    return {"log_w": log_w, "a": a, "b": b}


@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("variant,mode", COMBOS)
def test_mc_memory_matches_oracle(variant, mode, dtype, tol):
    H, K, V, T = 3, 4, 5, 5 * C + 3
    r, k, v, a, b, log_w, _ = _inputs(2, T, H, K, V, dtype, 7)
    u = torch.randn(2, T, H, K, dtype=dtype, generator=torch.Generator().manual_seed(8))
    mc = MCMemory(RWKV7Memory(), MCConfig(variant=variant, mode=mode, segment_len=C, top_k=2))
    state = mc.init_state(2, H, K, V, dtype=dtype, device="cpu")
    y, _ = mc.forward(state, r, k, v, u, _gates(a, b, log_w))
    for i in range(2):
        want = mc_rwkv7_oracle(r[i], k[i], v[i], u[i], a[i], b[i], log_w[i], variant=variant,
                               segment_len=C, top_k=2, mode=mode)
        assert _rel(y[i], want) <= tol, i


@pytest.mark.parametrize("variant,mode", COMBOS)
def test_mc_memory_full_equals_split(variant, mode):
    H, K, V, T = 2, 4, 3, 4 * C + 2
    r, k, v, a, b, log_w, _ = _inputs(2, T, H, K, V, torch.float64, 9)
    u = torch.randn(2, T, H, K, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    mc = MCMemory(RWKV7Memory(), MCConfig(variant=variant, mode=mode, segment_len=C, top_k=1))
    gates = _gates(a, b, log_w)
    state = mc.init_state(2, H, K, V, dtype=torch.float64, device="cpu")
    full, _ = mc.forward(state, r, k, v, u, gates)
    cuts = sorted(random.Random(variant + mode).sample(range(1, T), 4))
    for bounds in ([0, *cuts, T], list(range(T + 1))):  # random pieces; one token at a time
        st, ys = state, []
        for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
            sl = slice(lo, hi)
            y, st = mc.forward(st, r[:, sl], k[:, sl], v[:, sl], u[:, sl],
                               {n: g[:, sl] for n, g in gates.items()})
            ys.append(y)
        assert _rel(torch.cat(ys, 1), full) <= 1e-10, bounds


def test_family_needs_its_gates():
    r, k, v, a, b, log_w, _ = _inputs(1, 3, 1, 4, 4, torch.float64, 1)
    fam = RWKV7Memory()
    with pytest.raises(ValueError, match="log_w"):
        fam.scan(fam.init_state(1, 1, 4, 4, dtype=torch.float64, device="cpu"), r, k, v,
                 {"a": a, "b": b})


# ------------------------------------------------------------------ BlinkDL checkpoints
def blinkdl_state_dict(n_layer=2, C=128, N=64, vocab=256, ffn=256, dw=16, da=16, dv=8, dg=32,
                       seed=0) -> dict[str, Tensor]:
    """A random RWKV-7 state dict in BlinkDL's layout (1-D mixes stored (1, 1, C), layer 0 with
    the unused v0/v1/v2 as the trainer writes them), scaled so that every path matters."""
    g = torch.Generator().manual_seed(seed)
    H = C // N

    def rn(*s, std=1.0, mean=0.0):
        return torch.randn(*s, generator=g) * std + mean

    def ru(*s, lo=0.0, hi=1.0):
        return torch.rand(*s, generator=g) * (hi - lo) + lo

    sd = {"emb.weight": rn(vocab, C)}
    for i in range(n_layer):
        p = f"blocks.{i}."
        lns = ("ln0", "ln1", "ln2") if i == 0 else ("ln1", "ln2")
        for ln in lns:
            sd[p + ln + ".weight"], sd[p + ln + ".bias"] = rn(C, std=0.1, mean=1), rn(C, std=0.1)
        a = p + "att."
        for x in ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g"):
            sd[a + x] = ru(1, 1, C)
        sd[a + "w0"] = rn(1, 1, C, mean=-1.0)
        sd[a + "w1"], sd[a + "w2"] = rn(C, dw, std=0.1), rn(dw, C, std=0.1)
        sd[a + "a0"], sd[a + "a1"], sd[a + "a2"] = (rn(1, 1, C, std=0.5), rn(C, da, std=0.1),
                                                    rn(da, C, std=0.1))
        sd[a + "v0"], sd[a + "v1"], sd[a + "v2"] = (rn(1, 1, C, std=0.5, mean=1.0),
                                                    rn(C, dv, std=0.1), rn(dv, C, std=0.1))
        sd[a + "g1"], sd[a + "g2"] = rn(C, dg, std=0.1), rn(dg, C, std=0.1)
        sd[a + "k_k"], sd[a + "k_a"] = ru(1, 1, C, lo=0.5), ru(1, 1, C, lo=0.5, hi=1.5)
        sd[a + "r_k"] = rn(H, N, std=0.3)
        for lin in ("receptance", "key", "value", "output"):
            sd[a + lin + ".weight"] = rn(C, C, std=C ** -0.5)
        sd[a + "ln_x.weight"], sd[a + "ln_x.bias"] = rn(C, std=0.1, mean=1), rn(C, std=0.1)
        sd[p + "ffn.x_k"] = ru(1, 1, C)
        sd[p + "ffn.key.weight"] = rn(ffn, C, std=C ** -0.5)
        sd[p + "ffn.value.weight"] = rn(C, ffn, std=ffn ** -0.5)
    sd["ln_out.weight"], sd["ln_out.bias"] = rn(C, std=0.1, mean=1), rn(C, std=0.1)
    sd["head.weight"] = rn(vocab, C, std=C ** -0.5)
    return sd


@pytest.fixture(scope="module")
def pth(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("rwkv7") / "tiny.pth"
    torch.save(blinkdl_state_dict(), path)
    return path


@pytest.fixture(scope="module")
def rwkv_ref(pth):
    """The rwkv package's RWKV-7 (``cpu fp32``) on the same file."""
    pytest.importorskip("rwkv")
    if "rwkv.model" in sys.modules and os.environ.get("RWKV_V7_ON") != "1":
        pytest.skip("rwkv.model was imported without RWKV_V7_ON=1")
    os.environ.update(RWKV_V7_ON="1", RWKV_JIT_ON="0", RWKV_CUDA_ON="0")
    from rwkv.model import RWKV

    return RWKV(model=str(pth)[:-len(".pth")], strategy="cpu fp32")


@torch.no_grad()
@pytest.mark.parametrize("T", [1, 2, 17, 40])
def test_logits_match_rwkv_package(pth, rwkv_ref, T):
    model = load_model(pth)
    ids = torch.randint(0, 256, (T,), generator=torch.Generator().manual_seed(T)).tolist()
    logits, st = model(torch.tensor([ids]))
    want, ref_state = rwkv_ref.forward(list(ids), None, full_output=True)
    assert _rel(logits[0], want.view(T, -1)) <= 1e-4
    # the states agree too: our S is the package's transposed, the shifts are its x_prev
    for i, ls in enumerate(st.layers):
        assert _rel(ls.mc.mem["S"][0], ref_state[3 * i + 1].transpose(-1, -2)) <= 1e-4
        assert _rel(ls.conv[0, 0], ref_state[3 * i]) <= 1e-4
        assert _rel(ls.conv[0, 1], ref_state[3 * i + 2]) <= 1e-4
    # token by token, ours and the package's, from their own states
    ours, theirs = None, None
    for t in ids[:6]:
        lo, ours = model(torch.tensor([[t]]), ours)
        ref, theirs = rwkv_ref.forward([t], theirs)
        assert _rel(lo[0, 0], ref) <= 1e-4


@torch.no_grad()
def greedy(model, ids: list[int], n: int) -> list[int]:
    logits, state = model(torch.tensor([ids], device=model.device), last_only=True)
    out: list[int] = []
    for _ in range(n):
        out.append(int(logits[0, -1].argmax()))
        logits, state = model(torch.tensor([[out[-1]]], device=model.device), state)
    return out


@torch.no_grad()
def test_greedy_matches_rwkv_package(pth, rwkv_ref):
    model = load_model(pth)
    ids = [5, 77, 3, 200, 14, 9]
    want, state = [], None
    logits, state = rwkv_ref.forward(ids, None)
    for _ in range(8):
        want.append(int(logits.argmax()))
        logits, state = rwkv_ref.forward([want[-1]], state)
    assert greedy(model, ids, 8) == want
    outs = LLM(engine=LLMEngine(EngineConfig(max_num_seqs=2), model=model)).generate(
        [ids], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert outs[0].outputs[0].token_ids == want


ENGINE_COMBOS = [("none", "checkpoint"), ("grm", "checkpoint"), ("post", "independent"),
                 ("ssc", "independent"), ("residual", "checkpoint"), ("loglinear", "checkpoint")]


@pytest.mark.parametrize("variant,mode", ENGINE_COMBOS)
def test_engine_alone_batched_preempted_cached(pth, variant, mode):
    model = load_model(pth, dtype="float64", mc_overrides={
        "mc_variant": variant, "mc_mode": mode, "segment_len": 4, "mc_top_k": 1})
    g = torch.Generator().manual_seed(5)
    base = torch.randint(0, 256, (21,), generator=g).tolist()
    prompts = [base, base[:13], torch.randint(0, 256, (4,), generator=g).tolist(), base[:9]]
    want = [greedy(model, p, 8) for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    engines = []
    for kw in (dict(), dict(num_state_blocks=10, max_num_batched_tokens=8), dict(max_num_seqs=1)):
        args = dict(max_num_seqs=4, num_state_blocks=64, dtype="float64", max_model_len=64)
        eng = LLMEngine(EngineConfig(**{**args, **kw}), model=model)
        engines.append(eng)
        for _ in range(2):  # the second round resumes from prefix-cached checkpoints
            outs = LLM(engine=eng).generate(prompts, params)
            assert [o.outputs[0].token_ids for o in outs] == want, kw
    if variant not in ("none", "loglinear"):  # loglinear keeps private per-sequence states
        assert engines[0].stats()["prefix_cache_hits"] > 0
        assert engines[1].stats()["num_preemptions"] > 0
    for eng in engines:
        assert eng.cache.is_whole()


def test_post_hoc_mc_flags(pth):
    model = load_model(pth)
    assert detect_format(pth) == ("rwkv7", "blinkdl")
    assert model.config.mc_variant == "none"
    post = load_model(pth, mc_overrides={"mc_variant": "post"})
    assert (post.config.mc_mode, post.config.segment_len) == ("independent", 4096)
    # one segment: post and grm read only the online memory, so they equal the model as trained
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        plain = model(ids)[0]
        for variant in ("post", "grm"):
            m = load_model(pth, mc_overrides={"mc_variant": variant, "segment_len": 12})
            assert _rel(m(ids)[0], plain) <= 1e-6
        # several segments change the output
        m = load_model(pth, mc_overrides={"mc_variant": "post", "segment_len": 4})
        assert _rel(m(ids)[0], plain) > 1e-3


def test_bad_pth_files(tmp_path):
    sd = blinkdl_state_dict(n_layer=1, C=64, vocab=32, ffn=64)

    def write(d: dict, name: str) -> Path:
        path = tmp_path / name
        torch.save(d, path)
        return path

    cases = {
        "unknown.pth": ({**sd, "blocks.0.ffn.s_emb.weight": torch.zeros(32, 1024)},
                        "blocks.0.ffn.s_emb.weight"),
        "shape.pth": ({**sd, "blocks.0.att.k_k": torch.zeros(1, 1, 63)}, "blocks.0.att.k_k"),
        "missing.pth": ({k: t for k, t in sd.items() if k != "blocks.0.att.g2"},
                        "blocks.0.att.g2"),
        "no_rk.pth": ({k: t for k, t in sd.items() if k != "blocks.0.att.r_k"},
                      "blocks.0.att.r_k"),
    }
    for name, (d, key) in cases.items():
        with pytest.raises(CheckpointError, match=key.replace(".", r"\.")):
            load_model(write(d, name))
    bad = tmp_path / "junk.pth"
    bad.write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="junk.pth"):
        load_model(bad)


# ------------------------------------------------------------------ fla-hub directories
def _to_fla(sd: dict[str, Tensor]) -> dict[str, Tensor]:
    """BlinkDL names → flash-linear-attention's ``RWKV7ForCausalLM`` names and layouts."""
    out = {"model.embeddings.weight": sd["emb.weight"], "lm_head.weight": sd["head.weight"],
           "model.norm.weight": sd["ln_out.weight"], "model.norm.bias": sd["ln_out.bias"]}
    lora = {"w": "w_lora", "a": "a_lora", "v": "v_lora", "g": "g_lora"}
    lin = {"receptance": "r_proj", "key": "k_proj", "value": "v_proj", "output": "o_proj"}
    for name, t in sd.items():
        parts = name.split(".")
        if parts[0] != "blocks":
            continue
        i, part, rest = parts[1], parts[2], ".".join(parts[3:])
        p = f"model.layers.{i}."
        norms = {"ln0": "pre_norm", "ln1": "attn_norm", "ln2": "ffn_norm"}
        if part in norms:
            out[p + norms[part] + "." + rest] = t
        elif part == "ffn":
            out[p + "ffn." + rest] = t.reshape(-1) if rest == "x_k" else t
        elif rest[0] in lora and rest[1:] in ("0", "1", "2") and len(rest) == 2:
            if i == "0" and rest[0] == "v":
                continue  # fla's layer 0 has no v_lora
            key = p + "attn." + lora[rest[0]] + ".lora."
            if rest[1] == "0":
                out[key + "2.bias"] = t.reshape(-1)
            else:
                out[key + ("0.weight" if rest[1] == "1" else "2.weight")] = t.t().contiguous()
        elif rest.split(".")[0] in lin:
            out[p + "attn." + lin[rest.split(".")[0]] + ".weight"] = t
        elif rest.startswith("ln_x."):
            out[p + "attn.g_norm." + rest[5:]] = t
        else:
            out[p + "attn." + rest] = t.reshape(-1) if rest in ("k_k", "k_a") else t
    return out


def test_fla_directory_equals_pth(tmp_path, pth):
    from safetensors.torch import save_file

    sd = torch.load(pth, weights_only=True)
    d = tmp_path / "fla"
    d.mkdir()
    cfg = {"model_type": "rwkv7", "hidden_size": 128, "num_hidden_layers": 2, "head_dim": 64,
           "vocab_size": 256, "norm_eps": 1e-5, "max_position_embeddings": 512,
           "eos_token_id": 0, "bos_token_id": 0}
    (d / "config.json").write_text(json.dumps(cfg))
    save_file({k: t.contiguous() for k, t in _to_fla(sd).items()}, str(d / "model.safetensors"))
    assert detect_format(d) == ("rwkv7", "transformers")
    fla, ref = load_model(d), load_model(pth)
    assert fla.config.segment_len == 512 and fla.config.max_position_embeddings == 512
    ids = torch.randint(0, 256, (1, 19), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert _rel(fla(ids)[0], ref(ids)[0]) <= 1e-5  # e^{-0.5} vs the package's 0.606531
    assert isinstance(load_tokenizer(d), RWKVWorldTokenizer)
    # an unknown tensor is named
    save_file({**_to_fla(sd), "model.layers.0.attn.x_x": torch.zeros(6, 128)},
              str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.attn\.x_x"):
        load_model(d)


# ------------------------------------------------------------------ World tokenizer, LLM(path)
def test_world_tokenizer():
    pytest.importorskip("rwkv")
    from rwkv.rwkv_tokenizer import TRIE_TOKENIZER

    tok = RWKVWorldTokenizer()
    text = "Hello, world! Ünïcødé 你好 🙂\n\nUser: hi"
    ids = tok.encode(text)
    assert ids == TRIE_TOKENIZER(str(_vocab())).encode(text)
    assert tok.decode(ids) == text and tok.eos_token_id == 0 and tok.bos_token_id is None
    assert tok.decode([0, *ids, 0]) == text  # the end of a document stands for no text
    # a character split across byte tokens is held back until it completes
    emoji = [tok.token_to_id(chr(b)) if b < 128 else tok._backend.token2idx[bytes([b])]
             for b in "🙂".encode()]
    detok = IncrementalDetokenizer(tok, tok.encode("A"))
    deltas = [detok.add(t) for t in emoji]
    assert deltas == ["", "", "", "🙂"]
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert chat == "User: hi\n\nAssistant:"


def _vocab() -> Path:
    from mcserve.engine.tokenizer import world_vocab_file

    return world_vocab_file()


def test_world_tokenizer_needs_rwkv(monkeypatch):
    monkeypatch.setitem(sys.modules, "rwkv.rwkv_tokenizer", None)
    with pytest.raises(ImportError, match="'rwkv' package"):
        RWKVWorldTokenizer()


def test_llm_on_a_pth_file(tmp_path):
    pytest.importorskip("rwkv")
    path = tmp_path / "world.pth"
    torch.save(blinkdl_state_dict(n_layer=1, C=64, vocab=65536, ffn=64, seed=4), path)
    llm = LLM(str(path), max_num_seqs=2)
    assert isinstance(llm.get_tokenizer(), RWKVWorldTokenizer)
    out = llm.generate(["The capital of France is"],
                       SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0]
    model = llm.engine.model
    assert isinstance(model, RWKV7ForCausalLM)
    ids = llm.get_tokenizer().encode("The capital of France is")
    assert out.outputs[0].token_ids == greedy(model, ids, 5)
    assert out.outputs[0].text == llm.get_tokenizer().decode(out.outputs[0].token_ids)


def test_chunk_half_precision_runs_in_float32():
    r, k, v, a, b, log_w, S0 = _inputs(1, 40, 2, 16, 16, torch.float32, 4)
    want, S_want = chunk_rwkv7(r, k, v, a, b, log_w, S0)
    half = [x.bfloat16() for x in (r, k, v, a, b, log_w, S0)]
    o, S = chunk_rwkv7(*half)
    assert o.dtype == S.dtype == torch.bfloat16
    got, _ = chunk_rwkv7(*(x.float() for x in half))
    assert _rel(o.float(), got) <= 1e-2 and _rel(o.float(), want) <= 0.1


def test_offline_compare_rwkv7_quick(tmp_path):
    # bench/offline.py --compare --rwkv7: mcserve and the rwkv package decode the same random
    # .pth in one run and produce the same greedy tokens
    import subprocess

    pytest.importorskip("rwkv")
    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "cmp.json"
    env = {**os.environ, "MCSERVE_BENCH_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, str(root / "bench" / "offline.py"), "--compare",
                        "--rwkv7", "--quick", "--threads", "1", "--out", str(out)],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    data = json.loads(out.read_text())
    agree = {(a["name"], a["streams"]): a["fraction"] for a in data["agreement_with_mcserve"]}
    assert agree == {("rwkv package", 1): 1.0, ("rwkv package", 4): 1.0}
    assert "mcserve / rwkv package" in r.stdout
