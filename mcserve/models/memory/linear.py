"""Matrix-valued memories: ``linear`` (gated LA, Mamba2/RetNet-style) and ``swla`` (c = 2).

Decay gates are passed as ``log_a`` (log of a ∈ (0, 1], so ≤ 0): Mamba2's a = exp(Δ·A) then needs
no log of an exponential, and long products of a stay exact as sums.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

from mcserve.kernels import cpu as cpu_ops
from mcserve.kernels import dispatch
from mcserve.kernels.gla import chunk_gla
from mcserve.models.memory.base import State

_BLOCKS_PER_MATMUL = 16  # bounds the (B, n, H, T, V) intermediate in prefill


def _readout_mix_linear(S: Tensor, q: Tensor, w: Tensor) -> Tensor:
    """Σ_n w_n S_nᵀ q. S ``(B, N, H, K, V)``, q ``(B, T, H, K)``, w ``(B, T, N, H)``.

    Batched matmuls over (b, n, h) read every state in place: an einsum contracting (n, k)
    would first copy the whole (B, N, H, K, V) stack into a (b, h, n·k, v) layout.
    """
    out = None
    for n0 in range(0, S.shape[1], _BLOCKS_PER_MATMUL):
        sl = slice(n0, n0 + _BLOCKS_PER_MATMUL)
        wq = (w[:, :, sl, :, None] * q[:, :, None]).permute(0, 2, 3, 1, 4)  # (B, n, H, T, K)
        part = torch.matmul(wq, S[:, sl]).sum(1)  # (B, H, T, V)
        out = part if out is None else out + part
    if out is None:
        return q.new_zeros(q.shape[:3] + S.shape[-1:])
    return out.transpose(1, 2)


def _readout_mix_linear_paged(pool: State, ids: Tensor, q: Tensor, w: Tensor) -> Tensor:
    """Σ_n w_n S_{ids[n]}ᵀ q reading the block pool in place (one token per row).

    pool["S"] ``(num_blocks, H, K, V)``; ids ``(B, n, H)`` block row per (row, pick, head);
    q ``(B, 1, H, K)``; w ``(B, 1, n, H)``. One embedding bag per (row, head) sums the pool rows
    S[id, h, k, :] weighted by w_n·q_k.
    """
    S = pool["S"]
    if S.is_cpu and cpu_ops.enabled():  # one pass over the picked blocks in C++ (same sum)
        return cpu_ops.readout_paged(S, ids, q[:, 0], w[:, 0])[:, None]
    _, H, K, V = S.shape
    B, n, _ = ids.shape
    heads = torch.arange(H, device=ids.device)
    rows = ((ids * H + heads) * K)[..., None] + torch.arange(K, device=ids.device)  # (B,n,H,K)
    rows = rows.permute(0, 2, 1, 3).reshape(B * H, n * K)
    wts = w[:, 0].permute(0, 2, 1)[..., None] * q[:, 0, :, None, :]  # (B, H, n, K)
    y = F.embedding_bag(rows, S.reshape(-1, V), mode="sum",
                        per_sample_weights=wts.reshape(B * H, n * K))
    return y.view(B, 1, H, V)


@functools.lru_cache(maxsize=64)
def cu_seqlens(lens: tuple[int, ...], device: torch.device) -> Tensor:
    """``(N + 1,)`` int64 start offsets of sequences of ``lens`` packed back to back (and the
    total at the end), on ``device`` (cached: every layer of a varlen call uses the same)."""
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int64, device=device)


class LinearMemory:
    """S_t = a_t·S_{t-1} + b_t·k_t v_tᵀ; readout Sᵀq."""

    name = "linear"
    gate_names = ("log_a", "b")
    readout_keys = ("S",)
    linear = True

    def init_state(self, batch: int, heads: int, k_dim: int, v_dim: int, *,
                   dtype: torch.dtype, device: torch.device | str,
                   init: dict[str, Tensor] | None = None) -> State:
        return {"S": torch.zeros(batch, heads, k_dim, v_dim, dtype=dtype, device=device)}

    def scan(self, state: State, q: Tensor, k: Tensor, v: Tensor, gates: dict[str, Tensor]
             ) -> tuple[Tensor, State]:
        log_a, b = gates.get("log_a"), gates.get("b")
        if q.shape[1] > 1 and dispatch.get_backend(q) == "triton":
            # the chunk-parallel prefill kernel, the span as one segment: a few launches
            # instead of chunk_gla's dozen small ops per 64-token chunk (a GPU idles on those)
            o, S, _, _ = dispatch.chunk_linear_prefill(q, k, v, log_a, b, state["S"],
                                                       segment_len=q.shape[1])
            return o, {"S": S}
        o, S = chunk_gla(q, k, v, log_a, b, state["S"])
        return o, {"S": S}

    def scan_varlen(self, state: State, q: Tensor, k: Tensor, v: Tensor,
                    gates: dict[str, Tensor], lens: list[int]) -> tuple[Tensor, State]:
        """``scan`` of N sequences packed back to back as one kernel call: q, k
        ``(1, sum T, H, K)``, v ``(1, sum T, H, V)``, gates ``(1, sum T, H)``, sequence i has
        ``lens[i]`` tokens and starts from row i of ``state`` (``S`` ``(N, H, K, V)``). Returns
        the packed o ``(1, sum T, H, V)`` and the N final states; equals ``scan`` per sequence.

        ``chunk_linear_prefill`` with ``cu_seqlens`` (its varlen layout): segments longer than
        the whole pack, so no sequence completes one and nothing but the scan happens (in
        ``checkpoint`` mode a boundary only emits a state, never restarts one)."""
        L = q.shape[1]
        o, S, _, _ = dispatch.chunk_linear_prefill(
            q, k, v, gates.get("log_a"), gates.get("b"), state["S"], segment_len=L + 1,
            cu_seqlens=cu_seqlens(tuple(lens), q.device), mode="checkpoint")
        return o, {"S": S}

    def step_(self, state: State, q: Tensor, k: Tensor, v: Tensor, gates: dict[str, Tensor]
              ) -> Tensor:
        """``scan`` of one token (T = 1) that updates ``state["S"]`` in place; returns o.

        The engine's decode passes views of its slot pool here, so the state is read and
        written where it lives, in one pass that also reads out (C++ on CPU, or the torch twin
        ``kernels.cpu.twins.linear_step_``), instead of a gather, two out-of-place passes, the
        readout and a scatter back.
        """
        log_a, b = gates.get("log_a"), gates.get("b")
        o = cpu_ops.linear_step_(state["S"], q[:, 0], k[:, 0], v[:, 0],  # one pass over S
                                 None if log_a is None else log_a[:, 0],
                                 None if b is None else b[:, 0])
        return o[:, None]  # (B, 1, H, V)

    def readout_mix(self, mem: State, q: Tensor, w: Tensor) -> Tensor:
        return _readout_mix_linear(mem["S"], q, w)

    readout_mix_paged = staticmethod(_readout_mix_linear_paged)  # reads the pool in place


class SWLAMemory:
    """Sliding-window LA with c = 2: S_t = a_t·S_{t-1} + b_t·k_{t-1}v_{t-1}ᵀ + c_t·k_t v_tᵀ.

    Linear in the writes, so it is two gated-LA streams with the same decay: the current token
    (write c, from the carried S) and the previous token (write b, from zero), summed.
    """

    name = "swla"
    gate_names = ("log_a", "b", "c")
    readout_keys = ("S",)
    linear = True

    def init_state(self, batch: int, heads: int, k_dim: int, v_dim: int, *,
                   dtype: torch.dtype, device: torch.device | str,
                   init: dict[str, Tensor] | None = None) -> State:
        z = dict(dtype=dtype, device=device)
        return {
            "S": torch.zeros(batch, heads, k_dim, v_dim, **z),
            "k_prev": torch.zeros(batch, heads, k_dim, **z),  # zero: no token before the start
            "v_prev": torch.zeros(batch, heads, v_dim, **z),
        }

    def scan(self, state: State, q: Tensor, k: Tensor, v: Tensor, gates: dict[str, Tensor]
             ) -> tuple[Tensor, State]:
        if q.shape[1] == 0:
            return v.new_zeros(v.shape), dict(state)
        log_a = gates.get("log_a")
        k_prev = torch.cat([state["k_prev"][:, None], k[:, :-1]], dim=1)  # (B, T, H, K)
        v_prev = torch.cat([state["v_prev"][:, None], v[:, :-1]], dim=1)
        o1, S1 = chunk_gla(q, k, v, log_a, gates.get("c"), state["S"])
        o2, S2 = chunk_gla(q, k_prev, v_prev, log_a, gates.get("b"), torch.zeros_like(state["S"]))
        return o1 + o2, {"S": S1 + S2, "k_prev": k[:, -1], "v_prev": v[:, -1]}

    def readout_mix(self, mem: State, q: Tensor, w: Tensor) -> Tensor:
        return _readout_mix_linear(mem["S"], q, w)

    readout_mix_paged = staticmethod(_readout_mix_linear_paged)  # reads the pool in place
