"""The attention layer of hybrid models, its rotary embedding and the KV it keeps.

One ``Attention`` module serves every hybrid family: grouped-query heads, rotary embeddings as a
config defines them (partial rotary, linear and llama3 scaling, none at all), per-head q/k norms
(the family passes its own norm modules), an output gate (Qwen3-Next's sigmoid gate, interleaved
with the query per head) and a configurable scale. It runs three ways, matching the recurrent
blocks' contract:

* ``forward(x, kv, pos0)``: a batch at one position with a contiguous ``KVState`` (the model's
  own ``forward``: tests, eval, the reference runs);
* ``forward_varlen(x, batch)``: packed sequences ``(1, sum T, D)`` at their own positions, each
  continuing from its contiguous KV (``AttnBatch.prev``) or from the engine's paged pool
  (``AttnBatch.paged``);
* ``forward_paged(x, batch)``: one token per row ``(B, 1, D)`` against the paged pool.

The ops are ``mcserve.kernels.attention`` (fast forms and naive twins).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from mcserve.kernels import attention as ops


# ---------------------------------------------------------------------------- rotary
class Rotary:
    """Rotary position embedding on the first ``rotary_dim`` channels of each head, in the
    rotate-half layout transformers uses; frequencies computed in float32 as it does."""

    def __init__(self, head_dim: int, rotary_dim: int, theta: float,
                 scaling: dict[str, Any] | None = None):
        if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
            raise ValueError(f"rotary_dim {rotary_dim} must be even and in (0, {head_dim}]")
        self.rotary_dim = rotary_dim
        inv = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float()
                               / rotary_dim))
        self.attention_scaling = 1.0
        kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
        if kind == "linear":
            inv = inv / float(scaling["factor"])
        elif kind == "llama3":
            inv = _llama3(inv, scaling)
        elif kind != "default":
            raise ValueError(f"rope_type {kind!r} is not supported (supported: default, linear, "
                             f"llama3)")
        self.inv_freq = inv

    def cos_sin(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """``positions.shape + (rotary_dim,)`` cosines and sines."""
        f = positions[..., None].float() * self.inv_freq  # on the model's device (Attention)
        emb = torch.cat([f, f], -1)
        return ((emb.cos() * self.attention_scaling).to(dtype),
                (emb.sin() * self.attention_scaling).to(dtype))

    def apply(self, x: Tensor, cs: tuple[Tensor, Tensor]) -> Tensor:
        """x ``(..., T, H, D)`` with ``cs`` of positions ``(..., T)``."""
        cos, sin = (t.unsqueeze(-2) for t in cs)
        r = self.rotary_dim
        xr = x[..., :r]
        h = r // 2
        rot = torch.cat([-xr[..., h:], xr[..., :h]], -1)
        out = xr * cos + rot * sin
        return out if r == x.shape[-1] else torch.cat([out, x[..., r:]], -1)


def _llama3(inv: Tensor, s: dict[str, Any]) -> Tensor:
    factor, lo, hi = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old = float(s["original_max_position_embeddings"])
    lo_wl, hi_wl = old / lo, old / hi
    wl = 2 * math.pi / inv
    scaled = torch.where(wl > lo_wl, inv / factor, inv)
    smooth = (old / wl - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wl < hi_wl) & ~(wl > lo_wl)
    return torch.where(medium, smoothed, scaled)


def rotary_from_config(cfg: dict[str, Any], head_dim: int, *, default_theta: float = 10000.0,
                       partial: float | None = None) -> Rotary:
    """The rotary embedding a transformers config describes: ``rope_parameters`` (transformers
    5) or ``rope_theta`` + ``rope_scaling`` (earlier), ``partial_rotary_factor``."""
    params = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling") or None
    if scaling:
        params = {**scaling, **params}
    theta = params.get("rope_theta", cfg.get("rope_theta", default_theta))
    factor = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", partial))
    rdim = head_dim if factor is None else int(head_dim * factor)
    return Rotary(head_dim, rdim, float(theta), params)


# ---------------------------------------------------------------------------- KV
@dataclass
class KVState:
    """One attention layer's keys and values for a batch at one position: ``(B, S, Hkv, D)``."""

    k: Tensor
    v: Tensor

    @classmethod
    def empty(cls, batch: int, heads: int, dim: int, dtype: torch.dtype, device) -> KVState:
        z = torch.zeros(batch, 0, heads, dim, dtype=dtype, device=device)
        return cls(z, z.clone())

    def map_tensors(self, fn) -> KVState:
        return KVState(fn(self.k), fn(self.v))


@dataclass
class PagedKV:
    """The engine's KV pool and where one step's rows read and write it. Pools are
    ``(attention layers, num_blocks, block_size, Hkv, D)``; row b's tokens are in the blocks
    ``tables[b]`` lists (-1 pads), ``ctx[b]`` of them cached before the step, ``lens[b]`` new
    ones written at the flat rows ``slots`` (rows in order, block · block_size + offset)."""

    k: Tensor
    v: Tensor
    tables: Tensor
    ctx: list[int]
    lens: list[int]
    slots: Tensor
    lengths: Tensor | None = None  # (B,) ctx + lens on the device (decode masks)


@dataclass
class AttnBatch:
    """What the attention layers of one model call share: the tokens' positions (shaped like
    the token dims of the hidden states), each row's cached and new token counts, and where the
    KV before the call lives: contiguous per row (``prev[row][layer]``, the new KV goes to
    ``new``) or the paged pool."""

    positions: Tensor
    ctx: list[int]
    lens: list[int]
    prev: list[list[KVState]] | None = None
    paged: PagedKV | None = None
    new: list[list[KVState | None]] = field(default_factory=list)
    _rope: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.prev is not None and not self.new:
            self.new = [[None] * len(p) for p in self.prev]

    def rope(self, rotary: Rotary, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos/sin of ``positions`` for ``rotary``, computed once per call."""
        key = (id(rotary), dtype)
        if key not in self._rope:
            self._rope[key] = rotary.cos_sin(self.positions, dtype)
        return self._rope[key]


# ---------------------------------------------------------------------------- the layer
class Attention(nn.Module):
    """q/k/v/o projections around causal grouped-query attention (see the module docstring).
    ``index``: this layer's row in the engine's KV pools (its order among attention layers)."""

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int, head_dim: int, index: int, *,
                 rotary: Rotary | None, bias: bool = False, o_bias: bool | None = None,
                 q_norm: nn.Module | None = None, k_norm: nn.Module | None = None,
                 output_gate: bool = False, scale: float | None = None):
        super().__init__()
        if n_heads % n_kv_heads:
            raise ValueError(f"{n_heads} attention heads are not a multiple of {n_kv_heads} "
                             f"key/value heads")
        self.H, self.Hkv, self.D, self.index = n_heads, n_kv_heads, head_dim, index
        self.rotary = rotary
        self.output_gate = output_gate
        self.scale = head_dim ** -0.5 if scale is None else scale
        self.q_proj = nn.Linear(d_model, n_heads * head_dim * (2 if output_gate else 1), bias=bias)
        self.k_proj = nn.Linear(d_model, n_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(d_model, n_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(n_heads * head_dim, d_model, bias=bias if o_bias is None
                                else o_bias)
        self.q_norm = q_norm
        self.k_norm = k_norm

    def _apply(self, fn, recurse: bool = True):
        # the rotary frequencies stay float32 but follow the layer's device, so that a decode
        # step never copies them from the host (a sync, and no CUDA graph could hold it)
        super()._apply(fn, recurse)
        if self.rotary is not None:
            inv = self.rotary.inv_freq
            self.rotary.inv_freq = inv.to(fn(inv).device)  # fn's device, float32 kept
        return self

    def _qkv(self, x: Tensor, rope: tuple[Tensor, Tensor] | None
             ) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        *lead, _ = x.shape
        D = self.D
        q = self.q_proj(x)
        gate = None
        if self.output_gate:
            q, gate = q.view(*lead, self.H, 2 * D).chunk(2, dim=-1)
            gate = gate.reshape(*lead, self.H * D)
        q = q.reshape(*lead, self.H, D)
        k = self.k_proj(x).view(*lead, self.Hkv, D)
        v = self.v_proj(x).view(*lead, self.Hkv, D)
        if self.q_norm is not None:
            q = self.q_norm(q)
        if self.k_norm is not None:
            k = self.k_norm(k)
        if rope is not None:
            q, k = self.rotary.apply(q, rope), self.rotary.apply(k, rope)
        return q, k, v, gate

    def _out(self, o: Tensor, gate: Tensor | None) -> Tensor:
        o = o.reshape(*o.shape[:-2], self.H * self.D)
        if gate is not None:
            o = o * torch.sigmoid(gate)
        return self.o_proj(o)

    def forward(self, x: Tensor, kv: KVState, pos0: int) -> tuple[Tensor, KVState]:
        """x ``(B, T, D)`` at positions ``pos0 ..`` continuing from ``kv`` (``pos0`` tokens)."""
        T = x.shape[1]
        rope = None
        if self.rotary is not None:
            pos = torch.arange(pos0, pos0 + T, device=x.device)
            rope = self.rotary.cos_sin(pos, x.dtype)
        q, k, v, gate = self._qkv(x, rope)
        k = torch.cat([kv.k, k.to(kv.k.dtype)], 1)
        v = torch.cat([kv.v, v.to(kv.v.dtype)], 1)
        return self._out(ops.attend(q, k, v, self.scale), gate), KVState(k, v)

    def forward_varlen(self, x: Tensor, batch: AttnBatch) -> Tensor:
        """Packed sequences ``(1, sum T, D)``; row r has ``batch.lens[r]`` tokens after
        ``batch.ctx[r]`` cached ones."""
        rope = batch.rope(self.rotary, x.dtype) if self.rotary is not None else None
        q, k, v, gate = self._qkv(x, rope)
        pk = batch.paged
        if pk is not None:
            ops.write_pages(pk.k[self.index], pk.slots, k[0])
            ops.write_pages(pk.v[self.index], pk.slots, v[0])
        outs, s = [], 0
        for r, (c, n) in enumerate(zip(batch.ctx, batch.lens, strict=True)):
            if pk is not None:
                kr = ops.gather_pages(pk.k[self.index], pk.tables[r], c + n)[None]
                vr = ops.gather_pages(pk.v[self.index], pk.tables[r], c + n)[None]
            else:
                prev = batch.prev[r][self.index]
                kr = torch.cat([prev.k, k[:, s:s + n].to(prev.k.dtype)], 1)
                vr = torch.cat([prev.v, v[:, s:s + n].to(prev.v.dtype)], 1)
                batch.new[r][self.index] = KVState(kr, vr)
            outs.append(ops.attend(q[:, s:s + n], kr, vr, self.scale))
            s += n
        o = outs[0] if len(outs) == 1 else torch.cat(outs, 1)
        return self._out(o, gate)

    def forward_paged(self, x: Tensor, batch: AttnBatch) -> Tensor:
        """One token per row ``(B, 1, D)`` against the paged pool (``batch.paged``)."""
        rope = batch.rope(self.rotary, x.dtype) if self.rotary is not None else None
        q, k, v, gate = self._qkv(x, rope)
        pk = batch.paged
        kp, vp = pk.k[self.index], pk.v[self.index]
        ops.write_pages(kp, pk.slots, k[:, 0])
        ops.write_pages(vp, pk.slots, v[:, 0])
        o = ops.paged_decode(q, kp, vp, pk.tables, pk.lengths, self.scale)
        return self._out(o, gate)
