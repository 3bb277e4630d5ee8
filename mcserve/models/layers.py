"""Layers several model families share: RMS norms (in the input's dtype or in float32 at
least, and grouped and gated) and the gated MLPs (SwiGLU with a stacked gate/up projection,
GatedMLP with separate ones).

At CPU inference with int8 or bfloat16 weights (``lowp_linear``) a gated MLP is one C++ call,
``kernels.cpu.gated_mlp``: the rows in chunks, each chunk's projections and activation in one
thread's caches (at 8192 prefill rows the default model's SwiGLU takes 2.1× as long through the
separate products and activation: ``python bench/cpu_kernels.py --prefill``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mcserve.kernels import cpu as cpu_ops
from mcserve.models.importing import up as _up
from mcserve.models.lowp_linear import lowp_of


class RMSNorm(nn.Module):
    """x / rms(x) · w in x's dtype (``F.rms_norm``); CPU float32 inference as one C++ pass."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        D = x.shape[-1]
        if (not torch.is_grad_enabled() and x.is_cpu and x.dtype == torch.float32
                and x.is_contiguous()):  # one C++ pass (2.3x F.rms_norm's at 2K x 256)
            return cpu_ops.rms_norm(x.view(-1, D), self.weight, self.eps, D).view(x.shape)
        return F.rms_norm(x, (D,), self.weight, self.eps)


class RMSNormF32(nn.Module):
    """x / rms(x) · w, computed in float32 at least (as transformers' Mamba2RMSNorm)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        D = x.shape[-1]
        if x.numel() <= 8 * D and not torch.is_grad_enabled() and x.is_cpu:  # decode: one C++ op
            return cpu_ops.rms_norm(x.reshape(-1, D), self.weight, self.eps, D).view(x.shape)
        h = F.rms_norm(_up(x), (D,), eps=self.eps)  # one fused op
        return self.weight * h.to(x.dtype)


class GatedRMSNorm(nn.Module):
    """RMSNorm over groups of ``group_size`` channels, gated by silu(z) before or after it."""

    def __init__(self, dim: int, group_size: int, eps: float, norm_before_gate: bool):
        super().__init__()
        self.eps = eps
        self.group_size = group_size
        self.norm_before_gate = norm_before_gate
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, y: Tensor, z: Tensor) -> Tensor:
        D = y.shape[-1]
        if y.numel() <= 8 * D and not torch.is_grad_enabled() and y.is_cpu:  # decode: one C++ op
            return cpu_ops.rms_norm(y.reshape(-1, D), self.weight, self.eps, self.group_size,
                                    z.reshape(-1, D), self.norm_before_gate).view(y.shape)
        dtype = y.dtype
        h = _up(y)
        if not self.norm_before_gate:
            h = h * F.silu(_up(z))
        *pre, d = h.shape
        g = h.view(*pre, d // self.group_size, self.group_size)
        h = F.rms_norm(g, (self.group_size,), eps=self.eps).view(*pre, d)
        if self.norm_before_gate:
            h = h * F.silu(_up(z))
        return self.weight * h.to(dtype)


class SwiGLU(nn.Module):
    """down(silu(gate) · up) with gate and up as one stacked projection ``up`` (2·hidden rows)."""

    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.up = nn.Linear(d_model, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        if not torch.is_grad_enabled() and x.is_cpu and x.dtype == torch.float32:
            lu, ld = lowp_of(self.up), lowp_of(self.down)
            hidden = self.down.in_features
            if lu is not None and ld is not None and lu.kind == ld.kind and hidden % 16 == 0:
                # the stacked weight's gate blocks are its first hidden / 16 blocks of 16 rows
                nb = hidden // 16
                return cpu_ops.gated_mlp(x, lu.data[:nb], lu.scales[:hidden], lu.data[nb:],
                                         lu.scales[hidden:], ld.data, ld.scales)
        gate, up = self.up(x).chunk(2, dim=-1)
        if torch.is_grad_enabled():
            return self.down(F.silu(gate) * up)
        if x.is_cpu:  # one pass into a contiguous (T, hidden), which the next GEMM reads as is
            shape = gate.shape
            h = cpu_ops.silu_mul(gate.reshape(-1, shape[-1]), up.reshape(-1, shape[-1]))
            return self.down(h.view(shape))
        # inference: in place on the projection's output (two fewer (T, hidden) temporaries)
        return self.down(F.silu(gate, inplace=True).mul_(up))


class GatedMLP(nn.Module):
    """down_proj(silu(gate_proj(x)) · up_proj(x)), fla's GatedMLP with ``hidden_act: swish``."""

    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(d_model, hidden, bias=False)
        self.up_proj = nn.Linear(d_model, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        if torch.is_grad_enabled():
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        lps = [lowp_of(m) for m in (self.gate_proj, self.up_proj, self.down_proj)]
        if (x.is_cpu and x.dtype == torch.float32 and all(lp is not None for lp in lps)
                and len({lp.kind for lp in lps}) == 1
                and all(m.bias is None for m in (self.gate_proj, self.up_proj, self.down_proj))):
            (g, u, d) = lps
            return cpu_ops.gated_mlp(x, g.data, g.scales, u.data, u.scales, d.data, d.scales)
        if x.is_cpu:  # one pass for the SiLU and the product
            g, u = self.gate_proj(x), self.up_proj(x)
            return self.down_proj(cpu_ops.silu_mul(g.reshape(-1, g.shape[-1]),
                                                   u.reshape(-1, u.shape[-1])).view(g.shape))
        # inference: in place on the gate projection's output (two fewer temporaries)
        return self.down_proj(F.silu(self.gate_proj(x), inplace=True).mul_(self.up_proj(x)))
