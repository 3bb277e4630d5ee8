"""RWKV-7 ("Goose") on mcserve's ``rwkv7`` memory family, so Memory Caching and the engine apply.

A block is pre-LayerNorm residual: x += TimeMix(ln1(x)); x += ChannelMix(ln2(x)); layer 0 also
LayerNorms the embedding (``ln0``). Per token, TimeMix mixes its input with the previous token's
(the token shift, learned per channel: x + (x_prev − x)·μ) into six streams and computes

    r = W_r x_r,  k = W_k x_k,  v = W_v x_v          (receptance = query, key, value)
    log w = −e^{−0.5}·sigmoid(w0 + tanh(x_w W1) W2)  (per-channel decay)
    a = sigmoid(a0 + x_a A1 A2)                       (in-context learning rate)
    g = sigmoid(x_g G1) G2                            (output gate)
    κ̂ = normalize(k ⊙ k_k) per head;  k ← k ⊙ (1 + (a − 1) ⊙ k_a)
    v ← v + (v_first − v) ⊙ sigmoid(v0 + x_v V1 V2)  (layers > 0; v_first = layer 0's v)

then the state update S_t = diag(w)·S + (κ̂⊙a)·(−κ̂ᵀS) + k vᵀ with readout Sᵀr (the memory,
``RWKV7Memory``: removal key −κ̂, write κ̂⊙a), a GroupNorm per head (eps 64e-5), the bonus
(Σ_head r⊙k⊙r_k)·v outside the state, the gate g and W_o. ChannelMix is W_v relu(W_k x_k)².
The decay constant is the rwkv package's 0.606531 (≈ e^{−0.5}), so that the model equals the
package's float32 CPU inference to rounding.

Per layer the state is the MC memory plus the two token shifts, kept in ``LayerState.conv``
``(B, 2, C)``: [:, 0] the last TimeMix input, [:, 1] the last ChannelMix input.

Post-hoc MC (docs/mc.md): gated variants score with u_t = q_t = r_t (``share_uq``); the keys
averaged per segment are the written keys k. ``mc_variant="none"`` is the model as trained.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mcserve.config import validate_mc
from mcserve.models.base import RecurrentLM
from mcserve.models.importing import ImportedConfig, RebuildsUnderMC, check_positive_ints
from mcserve.models.mc import MCMemory
from mcserve.models.mc_state import PagedLayer
from mcserve.models.memory.rwkv7 import RWKV7Memory
from mcserve.models.state import LayerState, ModelState

#: used for ``segment_len`` when the checkpoint records no training length
DEFAULT_SEGMENT_LEN = 4096
#: −log w = DECAY_SCALE · sigmoid(·); the rwkv package's rounding of e^{−0.5}
DECAY_SCALE = 0.606531


@dataclass(frozen=True)
class RWKV7Config(ImportedConfig):
    """Architecture of an RWKV-7 LM plus the post-hoc MC settings applied to it.

    Field names follow mcserve's ``ModelConfig`` where the engine reads them (``vocab_size``,
    ``d_model``, ``n_layers``, ``n_heads``, ``head_dim`` (K = V = the head size), ``memory``,
    ``mc_*``, ``segment_len``). The LoRA ranks are those of the decay (w), in-context rate (a),
    value residual (v) and gate (g) projections.
    """

    vocab_size: int = 256
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 2
    head_dim: int = 64
    d_decay_lora: int = 16
    d_aaa_lora: int = 16
    d_mv_lora: int = 8
    d_gate_lora: int = 32
    d_ffn: int = 512
    norm_eps: float = 1e-5  # ln0 / ln1 / ln2 / ln_out
    gn_eps: float = 64e-5  # ln_x, the GroupNorm per head
    decay_scale: float = DECAY_SCALE  # −log w = decay_scale·sigmoid(·); fla writes e^{−0.5}
    max_position_embeddings: int | None = None  # the training length, when the source records it
    bos_token_id: int | None = None
    eos_token_id: int | None = 0  # RWKV World: 0 ends a document
    pad_token_id: int | None = None
    # post-hoc Memory Caching (u = q = r, no learned weights)
    mc_variant: str = "none"
    mc_mode: str = "checkpoint"
    segment_len: int = DEFAULT_SEGMENT_LEN
    mc_top_k: int = 2
    memory: str = "rwkv7"
    share_uq: bool = True
    model_type: str = "rwkv7"

    def __post_init__(self) -> None:
        check_positive_ints(self, ("vocab_size", "d_model", "n_layers", "n_heads", "head_dim",
                                   "d_decay_lora", "d_aaa_lora", "d_mv_lora", "d_gate_lora",
                                   "d_ffn"))
        if self.n_heads * self.head_dim != self.d_model:
            raise ValueError(f"n_heads * head_dim ({self.n_heads} * {self.head_dim}) must equal "
                             f"d_model ({self.d_model})")
        if self.memory != "rwkv7":
            raise ValueError(f"RWKV-7 runs on the 'rwkv7' memory family, got {self.memory!r}")
        if self.model_type != "rwkv7":
            raise ValueError(f"model_type must be 'rwkv7', got {self.model_type!r}")
        if not self.share_uq:
            raise ValueError("RWKV-7 has no gate connectors: share_uq must be True (u = r)")
        validate_mc(self.mc_variant, self.mc_mode, self.segment_len, self.mc_top_k)


def _shifted(x: Tensor, prev: Tensor) -> Tensor:
    """x_prev − x: each token's predecessor (``prev`` ``(B, C)`` for the first) minus itself."""
    return torch.cat([prev[:, None].to(x.dtype), x[:, :-1]], dim=1) - x


class RWKV7TimeMix(nn.Module):
    """RWKV-7 attention ("time mixing") with its state as an MC memory. Parameter names are
    BlinkDL's (``blocks.{i}.att.*``); the token-shift mixes and biases are stored 1-D."""

    def __init__(self, cfg: RWKV7Config, layer_idx: int):
        super().__init__()
        self.cfg = cfg
        self.layer_idx = layer_idx
        C, H, N = cfg.d_model, cfg.n_heads, cfg.head_dim
        self.H, self.N = H, N
        for name in ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g", "w0", "a0", "k_k", "k_a"):
            setattr(self, name, nn.Parameter(torch.zeros(C)))
        self.w1 = nn.Parameter(torch.zeros(C, cfg.d_decay_lora))
        self.w2 = nn.Parameter(torch.zeros(cfg.d_decay_lora, C))
        self.a1 = nn.Parameter(torch.zeros(C, cfg.d_aaa_lora))
        self.a2 = nn.Parameter(torch.zeros(cfg.d_aaa_lora, C))
        if layer_idx > 0:  # layer 0's v is v_first itself: no residual mix
            self.v0 = nn.Parameter(torch.zeros(C))
            self.v1 = nn.Parameter(torch.zeros(C, cfg.d_mv_lora))
            self.v2 = nn.Parameter(torch.zeros(cfg.d_mv_lora, C))
        self.g1 = nn.Parameter(torch.zeros(C, cfg.d_gate_lora))
        self.g2 = nn.Parameter(torch.zeros(cfg.d_gate_lora, C))
        self.r_k = nn.Parameter(torch.zeros(H, N))
        self.receptance = nn.Linear(C, C, bias=False)
        self.key = nn.Linear(C, C, bias=False)
        self.value = nn.Linear(C, C, bias=False)
        self.output = nn.Linear(C, C, bias=False)
        self.ln_x = nn.GroupNorm(H, C, eps=cfg.gn_eps)
        self.family = RWKV7Memory()
        self.memory = MCMemory(self.family, cfg.mc)

    # ------------------------------------------------------------------ engine interface
    def init_memory(self) -> None:
        return None  # the state starts from zero

    def init_state(self, batch: int, dtype: torch.dtype, device) -> LayerState:
        mc = self.memory.init_state(batch, self.H, self.N, self.N, dtype=dtype, device=device)
        shift = torch.zeros(batch, 2, self.cfg.d_model, dtype=dtype, device=device)
        return LayerState(mc, shift)

    # ------------------------------------------------------------------ pieces
    def project(self, x: Tensor, prev: Tensor, v_first: Tensor | None):
        """x ``(B, T, C)`` (ln1's output), prev ``(B, C)`` → r, k, v ``(B, T, H, N)``, the
        memory's gates, g ``(B, T, C)`` and v_first ``(B, T, C)``."""
        B, T, C = x.shape
        H, N = self.H, self.N
        xx = _shifted(x, prev)
        xr, xw, xk, xv, xa, xg = (x + xx * mu for mu in (self.x_r, self.x_w, self.x_k, self.x_v,
                                                         self.x_a, self.x_g))
        r = self.receptance(xr)
        w = torch.tanh(xw @ self.w1) @ self.w2
        k = self.key(xk)
        v = self.value(xv)
        a = torch.sigmoid(self.a0 + (xa @ self.a1) @ self.a2)
        g = torch.sigmoid(xg @ self.g1) @ self.g2
        kk = F.normalize((k * self.k_k).view(B, T, H, N), dim=-1, p=2.0)
        k = k * (1 + (a - 1) * self.k_a)
        if self.layer_idx == 0:
            v_first = v
        else:
            v = v + (v_first - v) * torch.sigmoid(self.v0 + (xv @ self.v1) @ self.v2)
        log_w = -self.cfg.decay_scale * torch.sigmoid(self.w0 + w)
        a = a.view(B, T, H, N)
        gates = {"log_w": log_w.view(B, T, H, N), "a": -kk, "b": kk * a}
        return (r.view(B, T, H, N), k.view(B, T, H, N), v.view(B, T, H, N), gates, g, v_first)

    def finish(self, y: Tensor, r: Tensor, k: Tensor, v: Tensor, g: Tensor) -> Tensor:
        """The memory's readout y ``(B, T, H, N)`` → the layer's output ``(B, T, C)``."""
        B, T, H, N = y.shape
        y = F.group_norm(y.reshape(B * T, H * N), H, self.ln_x.weight, self.ln_x.bias,
                         self.ln_x.eps).view(B, T, H, N)
        y = y + (r * k * self.r_k).sum(-1, keepdim=True) * v  # the bonus, outside the state
        return self.output(y.reshape(B, T, H * N) * g)

    def forward(self, x: Tensor, mc, prev: Tensor, v_first: Tensor | None):
        r, k, v, gates, g, v_first = self.project(x, prev, v_first)
        y, mc = self.memory.forward(mc, r, k, v, r, gates)
        return self.finish(y, r, k, v, g), mc, v_first

    def forward_paged(self, x: Tensor, pl: PagedLayer, v_first: Tensor | None):
        r, k, v, gates, g, v_first = self.project(x, pl.conv[:, 0], v_first)
        y = self.memory.decode_paged(pl, r, k, v, r, gates)
        return self.finish(y, r, k, v, g), v_first


class RWKV7ChannelMix(nn.Module):
    """RWKV-7 feed-forward ("channel mixing"): W_v relu(W_k (x + (x_prev − x)·x_k))²."""

    def __init__(self, cfg: RWKV7Config):
        super().__init__()
        self.x_k = nn.Parameter(torch.zeros(cfg.d_model))
        self.key = nn.Linear(cfg.d_model, cfg.d_ffn, bias=False)
        self.value = nn.Linear(cfg.d_ffn, cfg.d_model, bias=False)

    def forward(self, x: Tensor, prev: Tensor) -> Tensor:
        k = x + _shifted(x, prev) * self.x_k
        return self.value(torch.relu(self.key(k)) ** 2)


class RWKV7Block(nn.Module):
    def __init__(self, cfg: RWKV7Config, layer_idx: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps)
        self.ln2 = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps)
        self.mixer = RWKV7TimeMix(cfg, layer_idx)
        self.ffn = RWKV7ChannelMix(cfg)

    def forward(self, x: Tensor, state: LayerState, v_first: Tensor | None
                ) -> tuple[Tensor, LayerState, Tensor]:
        shift = state.conv  # (B, 2, C)
        pos0, record = state.mc.pos, state.mc.record
        h = self.ln1(x)
        out, mc, v_first = self.mixer(h, state.mc, shift[:, 0], v_first)
        x = x + out
        f = self.ln2(x)
        x = x + self.ffn(f, shift[:, 1])
        if record is not None:  # each recorded checkpoint resumes from the shifts at its end
            for rec in record:
                if "conv" not in rec:
                    i = rec["pos"] - pos0 - 1  # the token at that position
                    rec["conv"] = (torch.stack([h[:, i], f[:, i]], 1) if i >= 0
                                   else shift)
        new_shift = torch.stack([h[:, -1], f[:, -1]], 1).to(shift.dtype)
        return x, LayerState(mc, new_shift), v_first

    def forward_paged(self, x: Tensor, pl: PagedLayer, v_first: Tensor | None
                      ) -> tuple[Tensor, Tensor]:
        """One token per row of a ragged batch; updates ``pl`` (memory and shifts)."""
        if not pl.inplace:
            pl.conv = pl.conv.clone()
        h = self.ln1(x)
        out, v_first = self.mixer.forward_paged(h, pl, v_first)
        pl.conv[:, 0] = h[:, 0]
        x = x + out
        f = self.ln2(x)
        x = x + self.ffn(f, pl.conv[:, 1])
        pl.conv[:, 1] = f[:, 0]
        return x, v_first


class RWKV7ForCausalLM(RebuildsUnderMC, RecurrentLM):
    """RWKV-7 language model with post-hoc Memory Caching (model_type ``rwkv7``).

    State-dict names: ``embed.weight``, ``ln0.*``, ``layers.{i}.ln1/ln2.*``,
    ``layers.{i}.mixer.*`` (BlinkDL's ``att.*``), ``layers.{i}.ffn.*``, ``norm_f.*``,
    ``lm_head.weight``. ``mcserve.models.registry.load_model`` reads BlinkDL's ``.pth``.
    """

    def __init__(self, config: RWKV7Config):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.ln0 = nn.LayerNorm(config.d_model, eps=config.norm_eps)
        self.layers = nn.ModuleList(RWKV7Block(config, i) for i in range(config.n_layers))
        self.norm_f = nn.LayerNorm(config.d_model, eps=config.norm_eps)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)

    def _head(self, x: Tensor) -> Tensor:
        return self.lm_head(self.norm_f(x))

    def forward(self, input_ids: Tensor, state: ModelState | None = None, *,
                last_only: bool = False) -> tuple[Tensor, ModelState]:
        """input_ids ``(B, T)`` → logits ``(B, T, vocab)`` (``(B, 1, vocab)`` with
        ``last_only``) and the state after the last token. ``state`` is not modified."""
        if input_ids.dim() != 2:
            shape = tuple(input_ids.shape)
            raise ValueError(f"input_ids must be (batch, tokens), got shape {shape}")
        if state is None:
            state = self.init_state(input_ids.shape[0])
        x = self.ln0(self.embed(input_ids))
        v_first = None  # layer 0's values, mixed into every later layer's
        new_layers = []
        for blk, ls in zip(self.layers, state.layers, strict=True):
            x, ls, v_first = blk(x, ls, v_first)
            new_layers.append(ls)
        if last_only:
            x = x[:, -1:]
        return self._head(x), replace(state, layers=new_layers)

    def forward_paged(self, input_ids: Tensor, layers: list[PagedLayer]) -> Tensor:
        """Decode one token for each row of a ragged batch: ``(B, 1)`` → ``(B, 1, vocab)``."""
        x = self.ln0(self.embed(input_ids))
        v_first = None
        for blk, pl in zip(self.layers, layers, strict=True):
            x, v_first = blk.forward_paged(x, pl, v_first)
        return self._head(x)


# ---------------------------------------------------------------------------- BlinkDL's format
_FLAT = ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g", "w0", "a0", "v0", "k_k", "k_a")


def _blinkdl_name(src: str) -> str | None:
    """BlinkDL tensor name (``emb.weight``, ``blocks.{i}.att.*``, ...) → ours (None: unknown)."""
    top = {"emb.weight": "embed.weight", "head.weight": "lm_head.weight",
           "ln_out.weight": "norm_f.weight", "ln_out.bias": "norm_f.bias",
           "blocks.0.ln0.weight": "ln0.weight", "blocks.0.ln0.bias": "ln0.bias"}
    if src in top:
        return top[src]
    parts = src.split(".")
    if len(parts) < 4 or parts[0] != "blocks" or not parts[1].isdigit():
        return None
    i, part, rest = parts[1], parts[2], ".".join(parts[3:])
    if part in ("ln1", "ln2") and rest in ("weight", "bias"):
        return f"layers.{i}.{part}.{rest}"
    if part == "att":
        return f"layers.{i}.mixer.{rest}"
    if part == "ffn":
        return f"layers.{i}.ffn.{rest}"
    return None


def _dim(sd: dict[str, Tensor], key: str, axis: int, where: str) -> int:
    if key not in sd:
        raise ValueError(f"{where} is missing tensor {key!r}")
    t = sd[key]
    if t.dim() <= axis:
        raise ValueError(f"{where}: tensor {key!r} has shape {tuple(t.shape)}, expected at least "
                         f"{axis + 1} dimensions")
    return int(t.shape[axis])


def config_from_blinkdl(sd: dict[str, Tensor], where: str, **extra: Any) -> RWKV7Config:
    """The architecture of a BlinkDL RWKV-7 state dict, read off the shapes as the rwkv package
    does: (n_head, head_size) = ``blocks.0.att.r_k``, (vocab, n_embd) = ``emb.weight``,
    n_layer = 1 + the largest block index; the LoRA ranks and the FFN width likewise.
    ``extra`` sets other fields (MC settings, token ids)."""
    H, N = (_dim(sd, "blocks.0.att.r_k", a, where) for a in (0, 1))
    vocab, C = (_dim(sd, "emb.weight", a, where) for a in (0, 1))
    n_layer = 1 + max((int(k.split(".")[1]) for k in sd
                       if k.startswith("blocks.") and k.split(".")[1].isdigit()), default=-1)
    if n_layer < 1:
        raise ValueError(f"{where} has no 'blocks.*' tensors: not an RWKV-7 checkpoint")
    mv = (_dim(sd, "blocks.1.att.v1", 1, where) if n_layer > 1
          else int(sd["blocks.0.att.v1"].shape[-1]) if "blocks.0.att.v1" in sd else 1)
    try:
        return RWKV7Config(
            vocab_size=vocab, d_model=C, n_layers=n_layer, n_heads=H, head_dim=N,
            d_decay_lora=_dim(sd, "blocks.0.att.w1", 1, where),
            d_aaa_lora=_dim(sd, "blocks.0.att.a1", 1, where), d_mv_lora=mv,
            d_gate_lora=_dim(sd, "blocks.0.att.g1", 1, where),
            d_ffn=_dim(sd, "blocks.0.ffn.key.weight", 0, where), **extra)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: invalid RWKV-7 shapes: {e}") from None


def from_blinkdl(sd: dict[str, Tensor], where: str, **extra: Any) -> RWKV7ForCausalLM:
    """An ``RWKV7ForCausalLM`` (float32, eval) holding a BlinkDL RWKV-7 state dict.

    Every tensor must be known and of the derived shape (the 1-D mixes are stored ``(1, 1, C)``
    there); a missing, unknown or misshapen tensor is a ``ValueError`` naming it. Layer 0's
    ``v0``/``v1``/``v2`` are ignored (its values are v_first itself), as in the rwkv package.
    """
    cfg = config_from_blinkdl(sd, where, **extra)
    model = RWKV7ForCausalLM(cfg)
    expected = model.state_dict()
    ours: dict[str, Tensor] = {}
    src_of: dict[str, str] = {}
    for src, t in sd.items():
        if src.startswith("blocks.0.att.v") and src[len("blocks.0.att."):] in ("v0", "v1", "v2"):
            continue
        name = _blinkdl_name(src)
        if name is None or name not in expected:
            raise ValueError(f"{where}: tensor {src!r} is not part of an RWKV-7 model "
                             f"(DeepEmbed and other variants are not supported)")
        if not isinstance(t, Tensor) or not t.dtype.is_floating_point:
            raise ValueError(f"{where}: tensor {src!r} must be a floating point tensor")
        want = expected[name].shape
        if name.rsplit(".", 1)[-1] in _FLAT or name.endswith("ffn.x_k"):
            ok = t.numel() == want.numel() and all(d == 1 for d in t.shape[:-1])
            t = t.reshape(want) if ok else t
        if tuple(t.shape) != tuple(want):
            raise ValueError(f"{where}: tensor {src!r} has shape {tuple(t.shape)}, expected "
                             f"{tuple(want)} (from blocks.0.att.r_k and emb.weight)")
        ours[name] = t.to(torch.float32)
        src_of[name] = src
    missing = [n for n in expected if n not in ours]
    if missing:
        inverse = {v: k for k, v in _inverse_names(cfg).items()}
        raise ValueError(f"{where} is missing tensor {inverse.get(missing[0], missing[0])!r}"
                         + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    model.load_state_dict(ours)
    return model.eval()


def _inverse_names(cfg: RWKV7Config) -> dict[str, str]:
    """BlinkDL name → ours for every tensor of a model of ``cfg``."""
    out = {"emb.weight": "embed.weight", "head.weight": "lm_head.weight",
           "ln_out.weight": "norm_f.weight", "ln_out.bias": "norm_f.bias",
           "blocks.0.ln0.weight": "ln0.weight", "blocks.0.ln0.bias": "ln0.bias"}
    for name in RWKV7ForCausalLM(cfg).state_dict():
        if name.startswith("layers."):
            _, i, part, rest = name.split(".", 3)
            src_part = {"mixer": "att"}.get(part, part)
            out[f"blocks.{i}.{src_part}.{rest}"] = name
    return out


# ---------------------------------------------------------------------------- fla's format
_FLA_LORA = {"w_lora": ("w1", "w2", "w0"), "a_lora": ("a1", "a2", "a0"),
             "v_lora": ("v1", "v2", "v0"), "g_lora": ("g1", "g2", None)}
_FLA_ATT = {"r_proj.weight": "receptance.weight", "k_proj.weight": "key.weight",
            "v_proj.weight": "value.weight", "o_proj.weight": "output.weight",
            "g_norm.weight": "ln_x.weight", "g_norm.bias": "ln_x.bias"}


def _fla_to_blinkdl(src: str, t: Tensor, where: str) -> tuple[str, Tensor]:
    """One flash-linear-attention ``RWKV7ForCausalLM`` tensor → its BlinkDL name and layout (the
    LoRA matrices are ``nn.Linear`` weights there, so transposed)."""
    top = {"model.embeddings.weight": "emb.weight", "lm_head.weight": "head.weight",
           "model.norm.weight": "ln_out.weight", "model.norm.bias": "ln_out.bias"}
    if src in top:
        return top[src], t
    parts = src.split(".")
    if len(parts) >= 5 and parts[:2] == ["model", "layers"] and parts[2].isdigit():
        i, part, rest = parts[2], parts[3], ".".join(parts[4:])
        norms = {"pre_norm": "ln0", "attn_norm": "ln1", "ffn_norm": "ln2"}
        if part in norms and rest in ("weight", "bias"):
            return f"blocks.{i}.{norms[part]}.{rest}", t
        if part == "ffn" and rest in ("x_k", "key.weight", "value.weight"):
            return f"blocks.{i}.ffn.{rest}", t
        if part == "attn":
            if rest in _FLA_ATT:
                return f"blocks.{i}.att.{_FLA_ATT[rest]}", t
            if rest in ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g", "k_k", "k_a", "r_k"):
                return f"blocks.{i}.att.{rest}", t
            lora, _, leaf = rest.partition(".lora.")
            if lora in _FLA_LORA and leaf in ("0.weight", "2.weight", "2.bias"):
                down, up, bias = _FLA_LORA[lora]
                name = {"0.weight": down, "2.weight": up, "2.bias": bias}[leaf]
                if name is not None:
                    return f"blocks.{i}.att.{name}", t if leaf == "2.bias" else t.t()
    raise ValueError(f"{where}: tensor {src!r} is not part of an RWKV-7 model in "
                     f"flash-linear-attention's layout")


def from_fla(tensors: dict[str, Tensor], cfg: dict, where: str) -> RWKV7ForCausalLM:
    """An ``RWKV7ForCausalLM`` from a flash-linear-attention (fla-hub) ``RWKV7ForCausalLM``
    directory's config dict and tensors: the tensors are renamed onto BlinkDL's names and read
    as :func:`from_blinkdl` reads a ``.pth`` (the same shape checks). Hybrid attention layers
    (``attn``), a value dim other than the hidden size and ``norm_first: false`` are not
    supported; a missing ``lm_head.weight`` with ``tie_word_embeddings`` reuses the embedding.
    """
    if cfg.get("attn"):
        raise ValueError(f"{where}: hybrid attention layers (config 'attn') are not supported")
    if not cfg.get("norm_first", True):
        raise ValueError(f"{where}: norm_first=false (no LayerNorm on the embedding) is not "
                         f"supported")
    value_dim = cfg.get("value_dim")
    hidden = cfg.get("hidden_size")
    if value_dim is not None and any(d != hidden for d in (
            value_dim if isinstance(value_dim, list) else [value_dim])):
        raise ValueError(f"{where}: value_dim={value_dim!r} != hidden_size={hidden!r} is not "
                         f"supported")
    sd: dict[str, Tensor] = {}
    for src, t in tensors.items():
        name, t = _fla_to_blinkdl(src, t, where)
        sd[name] = t
    if "head.weight" not in sd and cfg.get("tie_word_embeddings") and "emb.weight" in sd:
        sd["head.weight"] = sd["emb.weight"]
    if not cfg.get("norm_bias", True):  # LayerNorms without a bias: zero biases
        for name in [n for n in sd if n.endswith(("ln0.weight", "ln1.weight", "ln2.weight"))
                     or n == "ln_out.weight"]:
            sd.setdefault(name[:-len("weight")] + "bias", torch.zeros_like(sd[name]))
    train_len = cfg.get("max_position_embeddings")
    train_len = train_len if isinstance(train_len, int) and train_len > 0 else None
    eos = cfg.get("eos_token_id", 0)
    extra = dict(decay_scale=math.exp(-0.5), norm_eps=float(cfg.get("norm_eps", 1e-5)),
                 max_position_embeddings=train_len, bos_token_id=cfg.get("bos_token_id"),
                 eos_token_id=eos[0] if isinstance(eos, list) and eos else eos,
                 segment_len=train_len or DEFAULT_SEGMENT_LEN)
    head = cfg.get("head_dim") or 64
    extra["gn_eps"] = head * extra["norm_eps"]
    return from_blinkdl(sd, where, **extra)
