"""Memory Caching with logarithmic segmentation (the ``loglinear`` variant).

The token at position n reads one segment per set bit of n: the cached checkpoints end at
``log_boundaries(n)`` and the online segment ends at n, so the segmentation changes every token.
``LogLinearMixin`` holds the methods of ``MCMemory`` that handle it:

- ``_log_advance`` re-segments a state for the next token; ``MCMemory.forward`` calls it before
  each one-token piece (every family, and short spans such as decode).
- ``forward_loglinear_linear`` is the span path over the ``linear`` family, with no per-token
  loop: every checkpoint is a decayed sum of writes, so a chunk of ``_LOG_CHUNK`` tokens is one
  masked quadratic form (``_log_chunk``, on the position tables of ``_log_index``) plus a readout
  of the memories carried into the chunk.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from mcserve.config import MCConfig
from mcserve.models.mc_state import MCLayerState
from mcserve.models.memory.base import MemoryFamily


def log_boundaries(n: int) -> list[int]:
    """Cached checkpoint positions for the token at position n under logarithmic segmentation.

    Prefix sums of n's binary expansion, largest power first, without n itself
    (n = 37 = 100101₂ → [32, 36]).
    """
    out, acc = [], 0
    for j in range(n.bit_length() - 1, -1, -1):
        if n >> j & 1:
            acc += 1 << j
            out.append(acc)
    return out[:-1]


_LOG_CHUNK = 64  # loglinear span path: tokens per chunk; its temporaries are O(B·H·chunk²)


@dataclass(frozen=True)
class _LogIndex:
    """Position-only tables for one loglinear chunk: tokens at positions p0+1 .. p0+L.

    A token at position n reads one segment per set bit i of n: (clear_low(n, i+1),
    clear_low(n, i)], clear_low(x, i) = x with its bits below i cleared. Indexing segments by bit
    (not by rank) gives every token of the chunk the same level axis. Positions ≤ p0 are
    *carried* (0, the stack's boundaries, p0); positions > p0 are in the chunk. A "slot" numbers
    both: carried position cp[r] → r, chunk position x → m + x - p0 (so p0 has slot m either way).
    """

    is_set: Tensor  # (L, nbits) bool: bit i of n is set, i.e. the level is a segment of n
    in_chunk: Tensor  # (L, nbits) bool: a segment of n that ends inside the chunk
    slot_e: Tensor  # (L, nbits) long: slot of the segment's end
    slot_s: Tensor  # (L, nbits) long: slot of the segment's start
    length: Tensor  # (L, nbits) long: tokens in the segment (1 for unset levels, never 0)
    ce: Tensor  # (L, nbits) long: chunk offset e - p0 of the end (0 for carried ends)
    w_slot: Tensor  # (L, nbits) long: carried slot (≤ m) of the end, m for in-chunk ends
    lev_mask: Tensor  # (L, nbits, nbits) bool: [i' ≤ i, level i ends in the chunk, i' is set]
    lev_tj: Tensor  # (L, L) long: level of token t's segment that holds key j (0 where j > t)
    ce_tj: Tensor  # (L, L) long: chunk offset of that segment's end
    causal: Tensor  # (L, L) bool: j ≤ t


@functools.lru_cache(maxsize=256)  # ~0.1 MB each; covers 16k-token training spans
def _log_index(p0: int, L: int, device: torch.device) -> _LogIndex:
    """The tables of ``_LogIndex`` (cached: training and every layer revisit the same chunks)."""
    cp = [0] + log_boundaries(p0) + ([p0] if p0 else [])  # carried positions
    m = len(cp) - 1
    n = torch.arange(p0 + 1, p0 + L + 1, device=device)  # (L,) positions of the chunk's tokens
    bits = torch.arange((p0 + L).bit_length(), device=device)
    e = (n[:, None] >> bits) << bits  # (L, nbits)
    s = (n[:, None] >> (bits + 1)) << (bits + 1)
    is_set = e != s
    in_chunk = is_set & (e > p0)
    cp_t = torch.tensor(cp, device=device)

    def slot(x: Tensor) -> Tensor:
        # unset levels may name positions that are not carried: clamp them to a valid slot
        return torch.where(x > p0, m + x - p0, torch.searchsorted(cp_t, x).clamp(max=m))

    # key j (position x_j) lies in token n's segment of the highest bit where x_j - 1 and n differ
    causal = n[None, :] <= n[:, None]  # (L, L)
    d = torch.where(causal, (n[None, :] - 1) ^ n[:, None], 1)  # ≥ 1
    lev = torch.frexp(d.double()).exponent.long() - 1  # bit_length - 1, exact below 2^53
    return _LogIndex(
        is_set=is_set, in_chunk=in_chunk, slot_e=slot(e), slot_s=slot(s),
        length=(e - s).clamp_min(1), ce=torch.where(in_chunk, e - p0, 0),
        w_slot=torch.where(in_chunk, m, slot(e)).clamp(max=m),
        # unset levels i' hold a placeholder C: masked, or exp(C − C[e_i]) could overflow
        lev_mask=in_chunk[:, :, None] & is_set[:, None, :] & (bits[None, :] <= bits[:, None]),
        lev_tj=lev, ce_tj=((n[:, None] >> lev) << lev) - p0, causal=causal,
    )


class LogLinearMixin:
    """The ``loglinear`` methods of ``MCMemory``, which inherits them (``family`` and ``cfg`` are
    its attributes)."""

    family: MemoryFamily
    cfg: MCConfig

    def _log_advance(self, st: MCLayerState) -> None:
        """Re-segment for the next token (position pos + 1) under logarithmic segmentation.

        The boundaries of n + 1 are a subset of those of n plus n itself, so the cached blocks
        form a stack: push the state at n, pop the tail that is no longer a boundary and merge
        those segments' key sums into the new online segment.
        """
        n = st.pos
        if n == 0:
            return
        keep = set(log_boundaries(n + 1))
        if n in keep:  # n even: the state at n becomes a checkpoint, nothing merges
            st.append({key: st.mem[key] for key in self.family.readout_keys}, st.seg_ksum,
                      st.seg_len, n)
            st.seg_ksum = torch.zeros_like(st.seg_ksum)
            st.seg_len = 0
            return
        n_keep = sum(1 for p in st.cached_pos if p in keep)  # kept ones are a prefix of the stack
        st.seg_ksum = st.seg_ksum + st.cached_ksum[:, n_keep:].sum(1)
        st.seg_len += sum(st.cached_len[n_keep:])
        st.truncate(n_keep)

    # ------------------------------------------------------------------ loglinear, linear family
    def forward_loglinear_linear(self, state: MCLayerState, q: Tensor, k: Tensor, v: Tensor,
                                 u: Tensor, gates: dict[str, Tensor],
                                 init: dict[str, Tensor] | None = None
                                 ) -> tuple[Tensor, MCLayerState]:
        """``forward`` for ``loglinear`` over ``LinearMemory`` without a per-token loop.

        Same signature, result and returned state as the per-token loop (``loglinear_fast =
        False``). Every cached S_b is a decayed sum of writes, so inside a chunk
        y_t = Σ_j W(t, j)·(q_t·b_j k_j)·v_j + (carried memories read with their gates), with
        W(t, j) = Σ_ℓ γ_ℓ(t)·exp(C[e_ℓ] − C[j])·[j ≤ e_ℓ] over the token's segments ℓ that end
        at e_ℓ inside the chunk (C = cumulative log decay). Chunks are aligned to multiples of
        ``_LOG_CHUNK`` positions; the state is brought to each chunk end exactly as the loop
        leaves it (stack = the boundaries of that position).
        """
        del init  # the linear family starts from zero; checkpoint mode never restarts it
        T = q.shape[1]
        st = replace(state, cached_len=list(state.cached_len), cached_pos=list(state.cached_pos))
        log_a, b = gates.get("log_a"), gates.get("b")
        kb = k if b is None else k * b[..., None]  # (B, T, H, K) the write gate scales the key
        sizes, t0 = [], 0
        while t0 < T:
            sizes.append(min(T - t0, _LOG_CHUNK - (st.pos + t0) % _LOG_CHUNK))
            t0 += sizes[-1]
        # split, not slice: a slice's backward writes a zero tensor of the whole span per chunk
        parts = [x.split(sizes, dim=1) for x in (q, k, kb, v, u)]
        las = log_a.split(sizes, dim=1) if log_a is not None else [None] * len(sizes)
        ys = [self._log_chunk(st, *xs, la) for *xs, la in zip(*parts, las, strict=True)]
        y = torch.cat(ys, dim=1) if ys else v.new_zeros(v.shape)
        return y, st

    def _log_chunk(self, st: MCLayerState, q: Tensor, k: Tensor, kb: Tensor, v: Tensor,
                   u: Tensor, log_a: Tensor | None) -> Tensor:
        """One chunk of ``forward_loglinear_linear``: updates ``st`` and returns y (B, L, H, V).

        ``kb`` is k times the write gate; ``log_a`` ``(B, L, H)`` or None (no decay).
        """
        B, L, H, K = q.shape
        p0, N = st.pos, st.num_cached
        cp = [0] + st.cached_pos + ([p0] if p0 else [])  # carried positions (see _LogIndex)
        if st.cached_pos != log_boundaries(p0) or (p0 and st.seg_len != p0 - cp[-2]):
            raise ValueError("state is not a loglinear state at its position")
        m = len(cp) - 1
        ix = _log_index(p0, L, q.device)

        def take(x: Tensor, idx: Tensor) -> Tensor:  # x (B, H, L, n) gathered per token by idx
            return x.gather(-1, idx.expand(B, H, *idx.shape))

        # ---- gates γ over each token's segments (levels = bits of its position)
        # key sum of the carried segment (cp[r-1], cp[r]] at r - 1: the stack's, then online
        cks = torch.cat([st.cached_ksum, st.seg_ksum[:, None]], 1) if p0 else st.cached_ksum
        zero = st.seg_ksum[:, None].new_zeros(B, 1, H, K)
        # G(slot): key sum of a segment = G(end) − G(start) when it ends in the chunk; carried
        # starts hold minus the carried sums after them, so no long prefix sums cancel
        G = torch.cat([-cks.flip(1).cumsum(1).flip(1), zero, k.cumsum(1)], 1)  # (B, m+1+L, H, K)
        uG = torch.einsum("bthk,bshk->bhts", u, G)  # (B, H, L, m+1+L)
        uC = torch.einsum("bthk,brhk->bhtr", u, torch.cat([zero, cks], 1))  # (B, H, L, m+1)
        r = torch.where(ix.in_chunk, take(uG, ix.slot_e) - take(uG, ix.slot_s),
                        take(uC, ix.w_slot))  # (B, H, L, nbits) ⟨u_t, segment key sum⟩
        r = r / (ix.length.to(q.dtype) * math.sqrt(K))
        gamma = torch.softmax(r.masked_fill(~ix.is_set, float("-inf")), dim=-1)

        # ---- C: log decay from p0 to each chunk offset, (B, H, L+1) with C[..., 0] = 0
        if log_a is None:
            Cc = q.new_zeros(B, H, L + 1)
        else:
            Cc = torch.nn.functional.pad(log_a.cumsum(1).transpose(1, 2), (1, 0))
        Ce = take(Cc[:, :, None, :].expand(B, H, L, L + 1), ix.ce)  # (B, H, L, nbits) C[e_ℓ]
        # A(t, i) = Σ_{i' ≤ i} γ_i'·exp(C[e_i'] − C[e_i]): the weight of a key in level i's
        # segment, referred to that segment's end (later segments hold it too, decayed)
        diff = Ce[..., None, :] - Ce[..., :, None]  # (B, H, L, i, i')
        A = (diff.masked_fill(~ix.lev_mask, float("-inf")).exp() * gamma[..., None, :]).sum(-1)
        C_e = take(Cc[:, :, None, :].expand(B, H, L, L + 1), ix.ce_tj)  # (B, H, L, L) C[e(t,j)]
        W = (C_e - Cc[:, :, None, 1:]).masked_fill(~ix.causal, float("-inf")).exp()
        W = W * take(A, ix.lev_tj)  # (B, H, L, L)
        att = torch.einsum("bthk,bjhk->bhtj", q, kb) * W
        y = torch.einsum("bhtj,bjhv->bthv", att, v)  # (B, L, H, V)

        # ---- carried memories: segments ending ≤ p0 read the stack / S_p0 with their γ;
        # segments ending in the chunk read S_p0 decayed to their end (the writes before p0)
        contrib = gamma * Ce.exp()  # Ce = 0 on carried levels
        w = q.new_zeros(B, H, L, m + 1).scatter_add(-1, ix.w_slot.expand(B, H, L, -1), contrib)
        S0 = st.mem["S"]  # (B, H, K, V) state at p0
        y = y + torch.einsum("bthk,bhkv->bthv", q, S0) * w[..., m].transpose(1, 2)[..., None]
        if N:
            y = y + self.family.readout_mix(st.cached, q, w[..., 1:N + 1].permute(0, 2, 3, 1))

        # ---- state at the chunk end: keep the boundaries of pe that are ≤ p0, add the new ones
        pe = p0 + L
        bnd = log_boundaries(pe)
        new = [x for x in bnd if x > p0]
        n_keep = sum(1 for x in st.cached_pos if x <= p0 and x in bnd)  # a prefix of the stack

        def ksum(s: int, e: int) -> Tensor:  # key sum of (s, e], e > p0, (B, H, K)
            if s > p0:
                return k[:, s - p0:e - p0].sum(1)
            return cks[:, cp.index(s):].sum(1) + k[:, :e - p0].sum(1)

        seg_ksum, seg_len = st.seg_ksum, st.seg_len
        st.truncate(n_keep)
        if p0 in bnd:  # the state at p0 becomes a checkpoint
            st.append({"S": S0}, seg_ksum, seg_len, p0)
        S, a, prev = S0, 0, max((x for x in bnd if x <= p0), default=0)
        for x in new + [pe]:  # the states nest: one decayed chunk sum per step
            e = x - p0
            dec = (Cc[..., e:e + 1] - Cc[..., a + 1:e + 1]).exp().transpose(1, 2)  # (B, l, H)
            S = S * (Cc[..., e] - Cc[..., a]).exp()[..., None, None] + torch.einsum(
                "bjhk,bjhv->bhkv", kb[:, a:e] * dec[..., None], v[:, a:e])
            if x < pe:
                st.append({"S": S}, ksum(prev, x), x - prev, x)
                prev = x
            a = e
        st.mem = {"S": S}
        st.seg_ksum = ksum(prev, pe)
        st.seg_len = pe - prev
        st.pos = pe
        return y
