"""Fused single-token CPU kernels (C++, built on first use), with torch twins.

``ops()`` returns the compiled module, or ``None`` where it cannot be built; the reason is in
``status()`` (``build.py``: the sources, the build cache, the instruction set, the build lock).

The public functions below take the twin's signature (``twins.py``) and pick the C++ op when it
is built and the inputs qualify (CPU, float32, the layouts the op expects), the twin otherwise,
so callers never branch. ``tests/test_cpu_kernels.py`` and ``tests/test_cpu_prefill_readout.py``
compare each op with its twin.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor

from mcserve.kernels.cpu import twins
from mcserve.kernels.cpu.build import (  # noqa: F401  (re-exported)
    ISA_ENV,
    ISAS,
    LOWP_LEVELS,
    cpu_flags,
    enabled,
    isa,
    ops,
    requested_isa,
    status,
    twins_only,
)

log = logging.getLogger(__name__)

#: rows up to which ``linear`` takes the C++ matrix-vector path: beyond it the GEMM's blocking
#: (oneDNN / MKL) wins, since each weight row is reused by enough rows to be compute-bound
GEMV_MAX_ROWS = 2


def _f32_cpu(*ts: Tensor | None) -> bool:
    """Every tensor on the CPU in float32, and no gradient to record (the C++ ops have none)."""
    grad = torch.is_grad_enabled()
    return all(t is None or (t.device.type == "cpu" and t.dtype == torch.float32
                             and not (grad and t.requires_grad)) for t in ts)


def _state_ok(S: Tensor) -> bool:
    """S ``(B, H, K, V)`` with each head's (K, V) block contiguous: the layout the state steps
    walk (rows of the engine's slot pool qualify; a transposed view does not)."""
    return S.dim() == 4 and S.stride(-1) == 1 and S.stride(-2) == S.shape[-1]


# ---------------------------------------------------------------------------------- public ops
def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear`` (twin ``twins.linear``); the C++ matrix-vector path for a few rows."""
    m = ops()
    rows = x.numel() // max(1, x.shape[-1])
    if (m is None or rows > GEMV_MAX_ROWS or not _f32_cpu(x, weight, bias)
            or not weight.is_contiguous()):
        return twins.linear(x, weight, bias)
    y = m.gemv(x.reshape(rows, x.shape[-1]).contiguous(), weight, bias)
    return y.view(*x.shape[:-1], weight.shape[0])


def _rows(x: Tensor) -> Tensor:
    """x as contiguous rows ``(B, K)`` (itself when it already is: the common case)."""
    if x.dim() == 2 and x.is_contiguous():
        return x
    return x.reshape(x.numel() // max(1, x.shape[-1]), x.shape[-1]).contiguous()


def _unrows(y: Tensor, x: Tensor) -> Tensor:
    """The kernels' ``(B, N)`` result in x's leading shape."""
    return y if x.dim() == 2 else y.view(*x.shape[:-1], y.shape[-1])


def _packed_ok(x: Tensor, w: Tensor, scales: Tensor, dtype: torch.dtype) -> bool:
    N, K = scales.numel(), x.shape[-1]
    return (w.dtype == dtype and w.is_cpu and w.is_contiguous() and K > 0
            and tuple(w.shape) == (-(-N // 16), -(-K // 2), 16, 2))


def linear_q8(x: Tensor, qweight: Tensor, scales: Tensor, bias: Tensor | None = None) -> Tensor:
    """x ``(..., K)`` · (qweight · scales ``(N,)``)ᵀ + bias (twin ``twins.linear_q8``; qweight
    int8 in ``twins.pack_pairs``' layout), any number of rows: the C++ kernel (``lowp.cpp``)
    quantizes each row of x to int16 with its own scale and sums exactly in integers, so a row's
    result is the same at any batch size and on any instruction set (``lowp_info()``)."""
    m = ops()
    if m is None or not _f32_cpu(x, scales, bias) or not _packed_ok(x, qweight, scales,
                                                                    torch.int8):
        return twins.linear_q8(x, qweight, scales, bias)
    return _unrows(m.q8_linear(_rows(x), qweight, scales.contiguous(), bias), x)


def linear_bf16(x: Tensor, weight: Tensor, scales: Tensor, bias: Tensor | None = None
                ) -> Tensor:
    """x ``(..., K)`` float32 · (weight · scales ``(N,)``)ᵀ + bias with float32 sums (twin
    ``twins.linear_bf16``; weight bfloat16 in ``twins.pack_pairs``' layout), any number of rows:
    AMX-BF16 tiles or AVX512-BF16's dot product (x rounded to bfloat16) where the CPU has them,
    else the exact float32 x by FMA; a row's result does not depend on the batch size."""
    m = ops()
    if m is None or not _f32_cpu(x, scales, bias) or not _packed_ok(x, weight, scales,
                                                                    torch.bfloat16):
        return twins.linear_bf16(x, weight, scales, bias)
    return _unrows(m.bf16_linear(_rows(x), weight, scales.contiguous(), bias), x)


def packed_rows(P: Tensor, scales: Tensor, idx: Tensor, K: int) -> Tensor:
    """Rows ``idx (T,)`` of a packed int8 / bfloat16 weight as float32 times their scales (twin
    ``twins.packed_rows``): one C++ pass (``pairs.cpp``), a token embedding's lookup."""
    m = ops()
    if (m is None or not _f32_cpu(scales) or idx.dim() != 1 or idx.dtype != torch.int64
            or not idx.device.type == "cpu" or not P.is_contiguous()):
        return twins.packed_rows(P, scales, idx, K)
    return m.packed_rows(P, scales.contiguous(), idx, K)


def gated_mlp(x: Tensor, gate: Tensor, s_gate: Tensor, up: Tensor, s_up: Tensor, down: Tensor,
              s_down: Tensor, act: int = 0) -> Tensor:
    """``down(act(gate x) · up x)`` for x ``(..., D)`` and packed int8 / bfloat16 weights with
    their scales (twin ``twins.gated_mlp``, same signature), in one call (``mlp.cpp``): the rows
    in chunks, each chunk's projections and activation in one thread's caches, the activation
    on AMX tiles applied as the gate and up sums leave them; no ``(T, 2I)`` or ``(T, I)``
    tensor in memory. The products are ``linear_q8`` / ``linear_bf16``'s: a row's result does
    not depend on the others."""
    m = ops()
    D = x.shape[-1]
    if (m is None or not _f32_cpu(x, s_gate, s_up, s_down) or gate.dtype != up.dtype
            or gate.dtype != down.dtype or gate.dtype not in (torch.int8, torch.bfloat16)
            or not _packed_ok(x, gate, s_gate, gate.dtype) or not _packed_ok(x, up, s_up, up.dtype)
            or tuple(down.shape) != (-(-D // 16), -(-s_gate.numel() // 2), 16, 2)
            or not down.is_contiguous()):
        return twins.gated_mlp(x, gate, s_gate, up, s_up, down, s_down, act)
    return _unrows(m.gated_mlp(_rows(x), gate, s_gate.contiguous(), up, s_up.contiguous(), down,
                               s_down.contiguous(), act), x)


def moe_experts(x: Tensor, idx: Tensor, w: Tensor, w_in: Tensor, s_in: Tensor | None,
                down: Tensor, s_down: Tensor | None, gated: bool, act: int) -> Tensor:
    """A MoE layer's routed experts, packed int8 / bfloat16 with their scales or the float32
    stacks, weighted and summed per token (twin ``twins.moe_experts``, same signature): one C++
    call (``mlp.cpp``) for what a Python loop over the experts did; a row's result does not
    depend on the other tokens."""
    m = ops()
    lowp = w_in.dtype in (torch.int8, torch.bfloat16)
    if m is None or not _f32_cpu(x, w, s_in, s_down) or not (lowp or _f32_cpu(w_in, down)):
        return twins.moe_experts(x, idx, w, w_in, s_in, down, s_down, gated, act)
    return m.moe_experts(_rows(x), idx.contiguous(), w.contiguous(), w_in, s_in, down, s_down,
                         gated, act)


def outer_bf16_(X: Tensor, w: Tensor, q: Tensor) -> Tensor:
    """X ``(A, T, n, K)`` bfloat16 = w ``(A, T, n)`` ⊗ q ``(A, T, K)`` in place, each float32
    product rounded to nearest even (twin ``twins.outer_bf16_``, bit-equal on normal numbers):
    one C++ pass, with AVX512-BF16's conversion where the CPU has it (3.5x torch's mixed-dtype
    multiply; the scalar loop elsewhere 2.4x)."""
    m = ops()
    if (m is None or not _f32_cpu(w, q) or X.dtype != torch.bfloat16 or not X.is_contiguous()
            or q.stride(-1) != 1):
        return twins.outer_bf16_(X, w, q)
    return m.outer_bf16_(X, w, q)


def readout_bf16_fused(K: int, V: int) -> bool:
    """True when ``readout_bf16_`` runs in one C++ pass on AMX tiles for keys of K and values of
    V (V a multiple of 16, bfloat16 level 4 under the current cap)."""
    m = ops()
    return (m is not None and V % 16 == 0 and K > 0 and V > 0
            and int(m.lowp_info()["bf16_impl"]) >= 4)


def readout_bf16_(o: Tensor, w: Tensor, q: Tensor, S: Tensor) -> Tensor:
    """o ``(A, T, V)`` += Σ_j Σ_k q[:, :, k] · bf16(w[:, :, j]) · bf16(S_j)[k] in place with
    float32 sums (twin ``twins.readout_bf16_``, same signature; S in ``twins.ckpt_pairs``'
    layout): the bfloat16 cached readout of an MC prefill tile. On AMX tiles
    (``readout_bf16_fused``) the weights of 32 tokens and 32 checkpoints multiply 16 columns of
    32 checkpoints at once, and the sums meet the queries in float32; the twin elsewhere."""
    m = ops()
    if (m is None or not readout_bf16_fused(q.shape[-1], o.shape[-1]) or not _f32_cpu(o, w, q)
            or o.stride(-1) != 1 or w.stride(-1) != 1 or q.stride(-1) != 1
            or S.dtype != torch.bfloat16 or not S.is_contiguous()):
        return twins.readout_bf16_(o, w, q, S)
    return m.readout_bf16_amx_(o, w, q, S)


def readout_picks_bf16(S: Tensor, q: Tensor, idx: Tensor, w: Tensor,
                       out: Tensor | None = None) -> Tensor:
    """``readout_picks`` with bfloat16 operands and float32 sums (twin
    ``twins.readout_picks_bf16``, same signature): y ``(B, L, H, V)`` = Σ_j bf16(w_j·q)ᵀ
    S[idx_j], S ``(B, H, N, K/2, V, 2)`` bfloat16 in ``key_pairs_bf16_``' layout; with ``out``
    (contiguous float32 ``(B, L, H, V)``) the sums are added to it in place and it is returned.
    On AMX tiles (``readout_bf16_fused``, K a multiple of 32) 16 picks of a checkpoint per tile
    product; the twin elsewhere."""
    m = ops()
    K, V = q.shape[-1], S.shape[-2]
    if (m is None or K % 32 or not readout_bf16_fused(K, V) or not _f32_cpu(q, w)
            or S.dtype != torch.bfloat16 or not S.is_contiguous()
            or idx.dtype != torch.int64 or idx.device.type != "cpu"):
        return twins.readout_picks_bf16(S, q, idx, w, out)
    if out is not None and not (_f32_cpu(out) and out.is_contiguous()):
        return out.add_(m.readout_picks_bf16_amx(S, q, idx, w))
    return m.readout_picks_bf16_amx(S, q, idx, w, out)


def _ckpts_ok(dst: Tensor, src: Tensor) -> bool:
    """src float32 checkpoints ``(B, n, H, K, V)`` on the CPU, each (K, V) contiguous, and dst
    a contiguous bfloat16 tensor: what the C++ layout conversions read and write."""
    return (_f32_cpu(src) and src.dim() == 5 and src.stride(-1) == 1
            and src.stride(-2) == src.shape[-1] and dst.dtype == torch.bfloat16
            and dst.is_contiguous())


def key_pairs_bf16_(dst: Tensor, src: Tensor, offset: int) -> Tensor:
    """Checkpoints src ``(B, n, H, K, V)`` float32 into ``readout_picks_bf16``'s key pairs in
    place: dst ``(B, H, N, K/2, V, 2)`` bfloat16 at checkpoints offset .. offset + n, rounded
    to nearest even; one pass (twin ``twins.key_pairs_bf16_``)."""
    m = ops()
    if m is None or not _ckpts_ok(dst, src):
        return twins.key_pairs_bf16_(dst, src, offset)
    return m.key_pairs_bf16_(dst, src, offset)


def ckpt_pairs_bf16_(dst: Tensor, src: Tensor, offset: int) -> Tensor:
    """Checkpoints src ``(B, n, H, K, V)`` float32 into ``readout_bf16_``'s layout in place:
    dst ``(B, H, K·V/16, P, 16, 2)`` bfloat16 at checkpoints offset .. offset + n, rounded to
    nearest even; one pass (twin ``twins.ckpt_pairs_bf16_``)."""
    m = ops()
    if m is None or not _ckpts_ok(dst, src):
        return twins.ckpt_pairs_bf16_(dst, src, offset)
    return m.ckpt_pairs_bf16_(dst, src, offset)


def lowp_info() -> dict[str, object]:
    """What the low-precision kernels run on here: the CPU's features as they see them
    (``avx2_fma``, ``avx512``, ``avx512_vnni``, ``avx512_bf16``, ``amx_bf16`` with
    ``amx_note``: why not, when not), the implementation level each product uses (``int8_impl``,
    ``bf16_impl``: 0 scalar, 1 AVX2, 2 AVX-512, 3 VNNI / BF16, 4 AMX-BF16 tiles), the cap
    ``MCSERVE_CPU_ISA`` sets and why a level was dropped; ``{}`` without the C++ ops."""
    m = ops()
    return {} if m is None else dict(m.lowp_info())


def linear_step_(S: Tensor, q: Tensor, k: Tensor, v: Tensor, log_a: Tensor | None,
                 b: Tensor | None) -> Tensor:
    """One gated-linear-attention token in place (twin ``twins.linear_step_``)."""
    m = ops()
    if m is None or not _f32_cpu(S, q, k, v, log_a, b) or not _state_ok(S):
        return twins.linear_step_(S, q, k, v, log_a, b)
    return m.linear_step_(S, q, k, v, log_a, b)


def scans(*ts: Tensor | None) -> bool:
    """Whether ``linear_scan`` runs in C++ for these tensors (its twin is slower than the
    chunked form at any length)."""
    return ops() is not None and _f32_cpu(*ts)


def linear_scan(q: Tensor, k: Tensor, v: Tensor, log_a: Tensor | None, b: Tensor | None,
                initial_state: Tensor) -> tuple[Tensor, Tensor]:
    """A span of gated linear attention token by token: ``(o, final_state)`` (twin
    ``twins.linear_scan``)."""
    m = ops()
    if m is None or not _f32_cpu(q, k, v, log_a, b, initial_state):
        return twins.linear_scan(q, k, v, log_a, b, initial_state)
    o, S, _ = m.linear_scan(q, k, v, log_a, b, initial_state, 0, False)
    return o, S


def linear_scan_ends(q: Tensor, k: Tensor, v: Tensor, log_a: Tensor | None, b: Tensor | None,
                     initial_state: Tensor, chunk: int, restart: bool) -> tuple[Tensor, Tensor]:
    """``linear_scan`` that also keeps the state at the end of every ``chunk`` tokens: ``(o,
    ends)``, ends ``(B, ⌈T/chunk⌉, H, K, V)`` (the last the final state); with ``restart``
    every chunk after the first starts from zero (twin ``twins.linear_scan_ends``)."""
    if chunk < 1:
        raise ValueError(f"linear_scan_ends: chunk must be >= 1, got {chunk}")
    m = ops()
    if m is None or not _f32_cpu(q, k, v, log_a, b, initial_state):
        return twins.linear_scan_ends(q, k, v, log_a, b, initial_state, chunk, restart)
    o, _, ends = m.linear_scan(q, k, v, log_a, b, initial_state, chunk, restart)
    return o, ends


def delta_step_(S: Tensor, q: Tensor, k: Tensor, v: Tensor, log_a: Tensor | None,
                beta: Tensor | None) -> Tensor:
    """One (gated) delta-rule token in place (twin ``twins.delta_step_``)."""
    m = ops()
    if m is None or not _f32_cpu(S, q, k, v, log_a, beta) or not _state_ok(S):
        return twins.delta_step_(S, q, k, v, log_a, beta)
    return m.delta_step_(S, q, k, v, log_a, beta)


def rwkv7_step_(S: Tensor, r: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor,
                log_w: Tensor) -> Tensor:
    """One RWKV-7 token in place (twin ``twins.rwkv7_step_``)."""
    m = ops()
    if m is None or not _f32_cpu(S, r, k, v, a, b, log_w) or not _state_ok(S):
        return twins.rwkv7_step_(S, r, k, v, a, b, log_w)
    return m.rwkv7_step_(S, r, k, v, a, b, log_w)


def gla_vec_step_(S: Tensor, q: Tensor, k: Tensor, v: Tensor, log_a: Tensor | None,
                  b: Tensor | None) -> Tensor:
    """One vector-gated linear-attention token in place (twin ``twins.gla_vec_step_``)."""
    m = ops()
    if m is None or not _f32_cpu(S, q, k, v, log_a, b) or not _state_ok(S):
        return twins.gla_vec_step_(S, q, k, v, log_a, b)
    return m.gla_vec_step_(S, q, k, v, log_a, b)


def readout_paged(pool: Tensor, ids: Tensor, q: Tensor, w: Tensor) -> Tensor:
    """Weighted readout of pool blocks (twin ``twins.readout_paged``)."""
    m = ops()
    if m is None or not _f32_cpu(pool, q, w) or not pool.is_contiguous():
        return twins.readout_paged(pool, ids, q, w)
    return m.readout_paged(pool, ids, q, w)


def readout_picks(S: Tensor, q: Tensor, idx: Tensor, w: Tensor) -> Tensor:
    """Σ_j w[b, t, h, j]·S[b, idx[b, t, h, j], h]ᵀ q[b, t, h] over a prefill span, each picked
    state read once per tile of tokens (twin ``twins.readout_picks``): S ``(B, N, H, K, V)``,
    q ``(B, L, H, K)``, idx ``(B, L, H, k)`` int64, w ``(B, L, H, k)`` → ``(B, L, H, V)``."""
    m = ops()
    if (m is None or not _f32_cpu(S, q, w) or not S.is_contiguous()
            or idx.dtype != torch.int64 or idx.device.type != "cpu"):
        return twins.readout_picks(S, q, idx, w)
    return m.readout_picks(S, q, idx, w)


def paged_attention_decode(q: Tensor, k_pool: Tensor, v_pool: Tensor, tables: Tensor,
                           lengths: Tensor, scale: float) -> Tensor | None:
    """One decode query per row ``q (B, H, D)`` against its keys and values in a paged pool
    ``(NB, BS, Hkv, D)``, read in place (``kernels.attention.paged_decode``, whose twin is
    ``naive_paged_decode``); None when the C++ op does not take these inputs."""
    m = ops()
    if (m is None or not _f32_cpu(q, k_pool, v_pool) or not k_pool.is_contiguous()
            or not v_pool.is_contiguous()):
        return None
    return m.paged_attention_decode(q, k_pool, v_pool, tables, lengths, scale)


def topk_later(r: Tensor, k: int) -> Tensor:
    """Indices of each row's k largest entries of r ``(R, N)``, largest first, ties to the
    later index (twin ``twins.topk_later``). r holds no NaN."""
    m = ops()
    if m is None or not _f32_cpu(r) or r.dim() != 2 or r.stride(-1) != 1:
        return twins.topk_later(r, k)
    return m.topk_later(r, k)


def select_softmax(r: Tensor, visible: Tensor, r_on: Tensor, k: int
                   ) -> tuple[Tensor, Tensor, Tensor]:
    """Each row's k best scores among its first ``visible`` (``topk_later``'s order) and their
    softmax with the online score: r ``(R, N)``, visible ``(R,)`` int64, r_on ``(R,)`` → idx
    ``(R, k)``, w ``(R, k)``, w_on ``(R,)`` (twin ``twins.select_softmax``)."""
    m = ops()
    if (m is None or not _f32_cpu(r, r_on) or r.dim() != 2 or r.stride(-1) != 1
            or visible.dtype != torch.int64 or visible.device.type != "cpu"):
        return twins.select_softmax(r, visible, r_on, k)
    idx, w, w_on = m.select_softmax(r, visible, r_on, k)
    return idx, w, w_on


def dense_softmax_(r: Tensor, visible: Tensor, r_on: Tensor) -> Tensor:
    """Each row's softmax over its first ``visible`` scores and the online score, in place: r
    ``(R, N)`` becomes the weights (zero past the visible ones), visible ``(R,)`` int64, r_on
    ``(R,)``; returns the online weights ``(R,)`` (twin ``twins.dense_softmax_``)."""
    m = ops()
    if (m is None or not _f32_cpu(r, r_on) or r.dim() != 2 or r.stride(-1) != 1
            or visible.dtype != torch.int64 or visible.device.type != "cpu"):
        return twins.dense_softmax_(r, visible, r_on)
    return m.dense_softmax_(r, visible, r_on)


def mask_logits_(logits: Tensor, rows: Tensor, bitmask: Tensor) -> Tensor:
    """The grammar bitmask ``(R, W)`` int32 of rows ``rows`` (int64) applied to ``logits``
    ``(B, V)`` in place: tokens whose bit is clear become -inf (twin ``twins.mask_logits_``)."""
    m = ops()
    if (m is None or not _f32_cpu(logits) or not logits.is_contiguous()
            or rows.dtype != torch.int64 or rows.device.type != "cpu"
            or bitmask.dtype != torch.int32 or bitmask.device.type != "cpu"
            or not bitmask.is_contiguous()):
        return twins.mask_logits_(logits, rows, bitmask)
    return m.mask_logits_(logits, rows.contiguous(), bitmask)


def conv_span(tail: Tensor, x: Tensor, weight: Tensor, bias: Tensor | None = None,
              silu: bool = False) -> Tensor:
    """Depthwise causal conv of a span after its tail, then SiLU when ``silu``; one pass
    (twin ``twins.conv_span``)."""
    m = ops()
    if (m is None or not _f32_cpu(tail, x, weight, bias) or tail.stride(-1) != 1
            or x.stride(-1) != 1):
        return twins.conv_span(tail, x, weight, bias, silu)
    return m.conv_span(tail, x, weight, bias, silu)


def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    """silu(gate) · up ``(R, H)`` contiguous, one pass (twin ``twins.silu_mul``): gate and up
    ``(R, H)`` with unit column stride, as the halves of a stacked projection are."""
    m = ops()
    if (m is None or not _f32_cpu(gate, up) or gate.dim() != 2 or gate.stride(-1) != 1
            or up.stride(-1) != 1 or up.shape != gate.shape):
        return twins.silu_mul(gate, up)
    return m.silu_mul(gate, up)


def l2norm_(x: Tensor, group: int) -> Tensor:
    """Each group of ``group`` columns of x ``(R, D)`` divided by its L2 norm (at least 1e-12),
    in place; x may be a view of rows with unit column stride (twin ``twins.l2norm_``)."""
    m = ops()
    if m is None or not _f32_cpu(x) or x.dim() != 2 or x.stride(-1) != 1:
        return twins.l2norm_(x, group)
    return m.l2norm_(x, group)


def conv_step_(tail: Tensor, x: Tensor, weight: Tensor, bias: Tensor | None,
               silu: bool) -> Tensor:
    """One token of a depthwise causal conv, tail shifted in place (twin ``twins.conv_step_``)."""
    m = ops()
    if (m is None or not _f32_cpu(tail, x, weight, bias) or tail.stride(-1) != 1
            or x.stride(-1) != 1):
        return twins.conv_step_(tail, x, weight, bias, silu)
    return m.conv_step_(tail, x, weight, bias, silu)


def rms_norm(x: Tensor, weight: Tensor | None, eps: float, group: int, z: Tensor | None = None,
             norm_before_gate: bool = False) -> Tensor:
    """Grouped, optionally gated RMSNorm of x ``(R, D)`` (twin ``twins.rms_norm``)."""
    m = ops()
    if m is None or not _f32_cpu(x, weight, z) or x.stride(-1) != 1 or (
            z is not None and z.stride(-1) != 1) or (weight is not None
                                                     and not weight.is_contiguous()):
        return twins.rms_norm(x, weight, eps, group, z, norm_before_gate)
    return m.rms_norm(x, weight, eps, group, z, norm_before_gate)


def mc_scores_(seg_ksum: Tensor, k: Tensor, u: Tensor, seg_len: Tensor, ksum_pool: Tensor,
               table: Tensor, segment_len: int) -> Tensor:
    """MC routing scores of one token, key sum advanced in place (twin ``twins.mc_scores_``)."""
    m = ops()
    if (m is None or not _f32_cpu(seg_ksum, k, u, ksum_pool) or seg_ksum.stride(-1) != 1
            or not ksum_pool.is_contiguous()):
        return twins.mc_scores_(seg_ksum, k, u, seg_len, ksum_pool, table, segment_len)
    return m.mc_scores_(seg_ksum, k, u, seg_len, ksum_pool, table, segment_len)


def mc_step_readout_(S: Tensor, q: Tensor, k: Tensor, v: Tensor, log_a: Tensor | None,
                     b: Tensor | None, w_on: Tensor, pool: Tensor, ids: Tensor,
                     w_c: Tensor) -> Tensor:
    """Online step in place + weighted readout of pool blocks (twin ``twins.mc_step_readout_``)."""
    m = ops()
    if (m is None or not _f32_cpu(S, q, k, v, log_a, b, w_on, pool, w_c) or S.stride(-1) != 1
            or S.stride(-2) != S.shape[-1] or not pool.is_contiguous()):
        return twins.mc_step_readout_(S, q, k, v, log_a, b, w_on, pool, ids, w_c)
    return m.mc_step_readout_(S, q, k, v, log_a, b, w_on, pool, ids, w_c)


#: pools at least this large go on huge pages (smaller ones would waste most of a 2 MiB page)
HUGEPAGE_MIN_BYTES = 8 << 20


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> Tensor:
    """``torch.zeros``; on the CPU and from ``HUGEPAGE_MIN_BYTES`` on, on memory advised for
    transparent huge pages (``zeros_hugepage``), which the decode step reads with far fewer TLB
    misses. Same values, shape and dtype either way."""
    m = ops()
    numel = 1
    for d in shape:
        numel *= d
    if (m is None or torch.device(device).type != "cpu"
            or numel * torch.empty((), dtype=dtype).element_size() < HUGEPAGE_MIN_BYTES):
        return torch.zeros(shape, dtype=dtype, device=device)
    return m.zeros_hugepage(list(shape), dtype)
