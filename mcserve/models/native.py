"""The native MC language model ``MCForCausalLM`` (model_type ``mcserve``).

embedding → N × [RMSNorm → MC mixer → RMSNorm → SwiGLU MLP] → RMSNorm → LM head (optionally tied).

Contract (docs/engine.md): ``forward(input_ids, state) -> (logits, state)`` for a batch of
sequences at the same position, associative over any split of the tokens, so one call is a
prefill and one call per token is decode. The state is a ``ModelState``; it is never modified in
place, which makes prefix reuse and preemption a matter of keeping a reference.

The model base ``RecurrentLM`` is in ``base.py``, the states in ``state.py``, the packed-prefill
helpers in ``varlen.py`` and ``RMSNorm``/``SwiGLU`` in ``layers.py``.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mcserve.config import MCConfig, ModelConfig
from mcserve.kernels import cpu as cpu_ops
from mcserve.models.base import RecurrentLM
from mcserve.models.importing import ConvInput, causal_conv
from mcserve.models.layers import RMSNorm, SwiGLU
from mcserve.models.lowp_linear import LowpWeight, lowp_of
from mcserve.models.lowp_linear import stack as stack_lowp
from mcserve.models.mc import MCMemory
from mcserve.models.mc_state import PagedLayer
from mcserve.models.memory.linear import LinearMemory, SWLAMemory
from mcserve.models.packed_linear import is_packed
from mcserve.models.state import LayerState
from mcserve.models.varlen import conv_varlen, mix_sequence, mix_varlen, params_key, phase_runs


def make_family(cfg: ModelConfig):
    if cfg.memory == "linear":
        return LinearMemory()
    if cfg.memory == "swla":
        return SWLAMemory()
    from mcserve.models.memory.deep import DLAMemory, TitansMemory

    return DLAMemory(cfg.inner_chunk) if cfg.memory == "dla" else TitansMemory(cfg.inner_chunk)


# the parameters a native block's fused decode call reads as they are (besides the stacked
# projections and the conv)
_FUSED_PATHS = (("norm1", "weight"), ("mixer", "out_norm", "weight"), ("mixer", "o_proj", "weight"),
                ("norm2", "weight"), ("mlp", "up", "weight"), ("mlp", "down", "weight"))


class MCMixer(nn.Module):
    """Token mixer: q, k, v, u projections, short conv, per-head gates, MC memory, output gate."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.cfg = cfg
        H, K = cfg.n_heads, cfg.head_dim
        self.H, self.K = H, K
        self.family = make_family(cfg)
        self.memory = MCMemory(self.family, cfg.mc)
        self.use_u = cfg.mc.routes and not cfg.share_uq
        self.qkv = nn.Linear(cfg.d_model, 3 * H * K, bias=False)
        self.u_proj = nn.Linear(cfg.d_model, H * K, bias=False) if self.use_u else None
        self.gate_names = self._gate_names()
        self.gate_proj = (nn.Linear(cfg.d_model, len(self.gate_names) * H)
                          if self.gate_names else None)
        if cfg.conv_size > 0:
            self.conv = nn.Conv1d(3 * H * K, 3 * H * K, cfg.conv_size, groups=3 * H * K,
                                  bias=False)
        else:
            self.conv = None
        self.out_norm = RMSNorm(K, cfg.norm_eps)
        self.g_proj = nn.Linear(cfg.d_model, H * K, bias=False)
        self.o_proj = nn.Linear(H * K, cfg.d_model, bias=False)
        if cfg.memory in ("dla", "titans"):
            E = cfg.memory_expansion * K
            self.w1_init = nn.Parameter(torch.randn(H, K, E) / math.sqrt(E))
            self.w2_init = nn.Parameter(torch.randn(H, E, K) / math.sqrt(K))

    def _gate_names(self) -> tuple[str, ...]:
        cfg = self.cfg
        if cfg.memory in ("linear", "swla"):
            names = ("log_a",) if cfg.use_decay_gate else ()
            if cfg.use_write_gate:
                names += ("b", "c") if cfg.memory == "swla" else ("b",)
            return names
        if cfg.memory == "dla":
            return ("eta",)
        return ("eta", "a", "m") if cfg.use_decay_gate else ("eta", "m")

    def reset_gate_bias(self) -> None:
        """Start decays near 1 (long memory), writes and learning rates moderate."""
        if self.gate_proj is None:
            return
        nn.init.zeros_(self.gate_proj.bias)
        bias = self.gate_proj.bias.data.view(len(self.gate_names), self.H)
        for i, name in enumerate(self.gate_names):
            if name in ("log_a", "a"):
                # spread decay rates over heads, as multi-scale retention does
                bias[i] = torch.linspace(3.0, 6.0, self.H)
            elif name == "eta":
                bias[i] = -2.0

    def init_memory(self) -> dict[str, Tensor] | None:
        if self.cfg.memory in ("dla", "titans"):
            return {"w1": self.w1_init, "w2": self.w2_init}
        return None

    def init_state(self, batch: int, dtype: torch.dtype, device) -> LayerState:
        mc = self.memory.init_state(batch, self.H, self.K, self.K, dtype=dtype, device=device,
                                    init=self.init_memory())
        conv = (torch.zeros(batch, self.cfg.conv_size - 1, 3 * self.H * self.K, dtype=dtype,
                            device=device) if self.conv is not None else None)
        return LayerState(mc, conv)

    def gates(self, x: Tensor) -> dict[str, Tensor]:
        if self.gate_proj is None:
            return {}
        B, T, _ = x.shape
        return self._gate_acts(self.gate_proj(x).view(B, T, len(self.gate_names), self.H))

    def _gate_acts(self, raw: Tensor) -> dict[str, Tensor]:
        """Pre-activations ``(B, T, n_gates, H)`` → the named gates, each ``(B, T, H)``."""
        out = {}
        for i, name in enumerate(self.gate_names):
            g = raw[:, :, i]
            if name == "log_a":
                out[name] = F.logsigmoid(g) / 8.0  # a = sigmoid^(1/8): stays close to 1
            else:  # eta, b, c, a (titans), m
                out[name] = torch.sigmoid(g)
        if self.cfg.memory == "titans":
            # Titans' inner loop is gradient descent with momentum on ||M(k) - v||^2, and every
            # token of an inner chunk adds its gradient at the chunk's starting weights: with
            # eta in (0, 1) the chunk's step is up to ~C/(1 - m) times one token's, which
            # overshoots (the memory blows up to inf within a few chunks; MQAR training hit NaN
            # in tens of steps). (1 - m)/C bounds the chunk's step by one token's; 1/4 keeps that
            # step below 1/curvature: for unit keys at init the loss's curvature is about
            # 2||h||^2 + 2||W1 gelu'||^2 ~ 2 + 1 (with only /C, MQAR still hit NaN at step 347).
            # Not a bound for trained weights: training W^init raises the curvature, and at an
            # outer learning rate of 1e-2 4 of 6 MQAR runs still blew up (none at 3e-3; step
            # limits on the inner update stopped the learning). docs/deep-memory.md, "Gates in
            # the native model".
            out["eta"] = out["eta"] * (1.0 - out["m"]) / (4 * self.cfg.inner_chunk)
        return out

    def _project(self, x: Tensor, conv_tail: Tensor | None, keep_conv_input: bool = False):
        """x ``(B, T, D)`` → q, k, v, u ``(B, T, H, K)``, gates, and the new conv tail; with
        ``keep_conv_input`` also the conv's input ``(B, w - 1 + T, 3HK)`` (None without a conv),
        from which ``fill_conv_tails`` cuts the tail at each recorded checkpoint."""
        qkv = self.qkv(x)  # (B, T, 3HK)
        full = None
        if self.conv is not None:
            qkv, conv_tail, full = self._conv(qkv, conv_tail)
        q, k, v, u, gates = self._heads(x, qkv)
        if keep_conv_input:
            return q, k, v, u, gates, conv_tail, full
        return q, k, v, u, gates, conv_tail

    def _conv(self, qkv: Tensor, conv_tail: Tensor) -> tuple[Tensor, Tensor, ConvInput]:
        """The short causal conv + SiLU of one span of qkv ``(B, T, 3HK)`` after the conv tail
        ``(B, w - 1, 3HK)`` → the output ``(B, T, 3HK)``, the new tail and the conv's input
        (tail and span, ``ConvInput``)."""
        full = ConvInput(conv_tail, qkv)  # [tail; qkv] (B, w-1+T, 3HK), not concatenated
        # depthwise causal conv as w shifted multiply-adds: torch's grouped conv1d is orders of
        # magnitude slower on CPU for these shapes (and in float64)
        out = causal_conv(full, self.conv.weight[:, 0], silu=True)
        return out, full.new_tail(), full

    def _heads(self, x: Tensor, qkv: Tensor):
        """Token-wise: x ``(B, T, D)`` and the conv's output ``(B, T, 3HK)`` → q, k, v, u
        ``(B, T, H, K)`` (q and k normalised) and the gates."""
        B, T, _ = x.shape
        H, K = self.H, self.K
        if torch.is_grad_enabled() or not qkv.is_cpu or not qkv.is_contiguous():
            q, k, v = qkv.view(B, T, 3, H, K).unbind(2)  # each (B, T, H, K)
            q = F.normalize(q, dim=-1)
            k = F.normalize(k, dim=-1)
        else:  # CPU inference: q and k normalised in place, one pass
            cpu_ops.l2norm_(qkv.view(B * T, 3 * H * K)[:, :2 * H * K], K)
            q, k, v = qkv.view(B, T, 3, H, K).unbind(2)
        u = self.u_proj(x).view(B, T, H, K) if self.u_proj is not None else q
        return q, k, v, u, self.gates(x)

    def _decode_weights(self) -> tuple[Tensor, Tensor | None]:
        """The projections of x (qkv, u, g, gates) stacked into one weight, so decode reads
        them with one matrix-vector product. Rebuilt when a source weight changes."""
        paths = self.__dict__.get("_decode_paths")
        if paths is None:
            names = [n for n in ("qkv", "u_proj", "g_proj", "gate_proj")
                     if getattr(self, n) is not None]
            paths = tuple((n, "weight") for n in names) + (
                (("gate_proj", "bias"),) if self.gate_proj is not None else ())
            self.__dict__["_decode_paths"] = paths
        key = params_key(self, paths)
        cached = self.__dict__.get("_decode_cat")
        if cached is None or cached[0] != key:
            mods = [getattr(self, n) for n, p in paths if p == "weight"]
            w = torch.cat([m.weight.detach() for m in mods])
            b = None
            if self.gate_proj is not None:  # the only projection with a bias
                b = torch.zeros(w.shape[0], dtype=w.dtype, device=w.device)
                b[-self.gate_proj.out_features:] = self.gate_proj.bias.detach()
            cached = (key, w, b)
            self.__dict__["_decode_cat"] = cached  # not a buffer: stays out of state_dict
        return cached[1], cached[2]

    def _decode_lowp(self) -> LowpWeight | None:
        """The stacked projections of ``_decode_weights`` in int8 or bfloat16 when every one of
        them has such weights (``lowp_linear``; the small gate projection usually keeps float32,
        and then the stack does too), else None. Rebuilt when one changes."""
        parts = [lowp_of(getattr(self, n)) for n in ("qkv", "u_proj", "g_proj", "gate_proj")
                 if getattr(self, n) is not None]
        if any(p is None for p in parts) or len({p.kind for p in parts}) != 1:
            return None
        key = tuple(id(p) for p in parts)
        cached = self.__dict__.get("_decode_lowp_cat")
        if cached is None or cached[0] != key:
            # the parts stay referenced, so their ids stay theirs
            cached = self.__dict__["_decode_lowp_cat"] = (key, stack_lowp(parts), parts)
        return cached[1]

    def _project_decode(self, x: Tensor, pl: PagedLayer):
        """``_project`` for one token per row (inference): one product for every projection and
        a one-pass conv that shifts ``pl.conv`` in place (``kernels.cpu``)."""
        B = x.shape[0]
        H, K = self.H, self.K
        w, b = self._decode_weights()
        sizes = [3 * H * K] + [H * K] * (self.u_proj is not None) + [H * K]
        if self.gate_proj is not None:
            sizes.append(self.gate_proj.out_features)
        lp = self._decode_lowp() if cpu_ops.enabled() else None
        y = cpu_ops.linear(x[:, 0], w, b) if lp is None else lp.linear(x[:, 0], b)
        parts = list(y.split(sizes, dim=-1))  # each (B, n)
        qkv = parts.pop(0)
        u = parts.pop(0).view(B, 1, H, K) if self.u_proj is not None else None
        g = parts.pop(0)
        if self.conv is not None:
            if not pl.inplace:
                pl.conv = pl.conv.clone()
            qkv = cpu_ops.conv_step_(pl.conv, qkv, self.conv.weight[:, 0], None, True)
        q, k, v = qkv.view(B, 1, 3, H, K).unbind(2)  # each (B, 1, H, K)
        q = F.normalize(q, dim=-1)
        k = F.normalize(k, dim=-1)
        gates = self._gate_acts(parts[0].view(B, 1, -1, H)) if parts else {}
        return q, k, v, q if u is None else u, gates, g[:, None]

    def _fused_paged(self, x: Tensor, pl: PagedLayer) -> Tensor | None:
        """The decode step as one stacked projection, one fused kernel call (conv step, q/k
        norm, gates, state update, readout, MC, per-head norm and output gate:
        ``dispatch.fused_linear_decode``, Triton) and o_proj, when a kernel backend is active
        (CUDA tensors, or ``MCSERVE_KERNELS=triton``) and the step fits it: the gated linear
        memory, one token per row, states writable in place, every block on the device,
        constant segments, no autograd. ``None`` otherwise: the unfused path, its twin."""
        from mcserve.kernels import dispatch

        mc_kw = (self.memory.fused_decode_kwargs(x, pl, self.K) if self.cfg.memory == "linear"
                 else None)
        if mc_kw is None:
            return None
        B, H, K = x.shape[0], self.H, self.K
        HK = H * K
        w, bias = self._decode_weights()
        has_u = self.u_proj is not None
        n_gates = len(self.gate_names) * H
        qkv, *u, g, raw = F.linear(x[:, 0], w, bias).split(
            [3 * HK] + [HK] * has_u + [HK, n_gates], dim=-1)
        gate = {name: raw[:, i * H:(i + 1) * H] for i, name in enumerate(self.gate_names)}
        y = dispatch.fused_linear_decode(
            qkv, g, pl.mem["S"], q_offset=0, k_offset=HK, v_offset=2 * HK,
            conv_tail=pl.conv, conv_weight=None if self.conv is None else self.conv.weight[:, 0],
            normalize_qk=True, u=u[0].view(B, H, K) if has_u else None, gate_mode="sigmoid",
            log_a=gate.get("log_a"), b=gate.get("b"), decay_scale=1 / 8,
            norm_weight=self.out_norm.weight, norm_group=K, norm_eps=self.out_norm.eps,
            norm_before_gate=True, **mc_kw)
        return self.o_proj(y)[:, None]

    def _output(self, x: Tensor, y: Tensor, g: Tensor | None = None) -> Tensor:
        B, T = x.shape[:2]
        HK = self.H * self.K
        if g is None and (torch.is_grad_enabled() or not y.is_cpu):
            y = self.out_norm(y).reshape(B, T, HK) * F.silu(self.g_proj(x))
        else:  # CPU inference: per-head norm and the silu(g) gate in one op
            g = self.g_proj(x) if g is None else g
            y = cpu_ops.rms_norm(y.reshape(B * T, HK), self.out_norm.weight, self.out_norm.eps,
                                 self.K, g.reshape(B * T, HK), True).view(B, T, HK)
        return self.o_proj(y)

    def forward(self, x: Tensor, state: LayerState) -> tuple[Tensor, LayerState]:
        q, k, v, u, gates, conv, full = self._project(x, state.conv, keep_conv_input=True)
        y, state = mix_sequence(self.memory, state, q, k, v, u, gates, self.init_memory(), conv,
                                full, self.cfg.conv_size)
        return self._output(x, y), state

    def forward_varlen(self, x: Tensor, states: list[LayerState], lens: list[int]
                       ) -> tuple[Tensor, list[LayerState]]:
        """Sequences packed back to back, x ``(1, sum T, D)`` with lengths ``lens``, each from
        its own batch-of-one state: the projections, gates, short conv (``conv_varlen``) and
        output run once on the packed tokens, the memory per sequence on its slice
        (``mix_varlen``: consecutive sequences at one phase with equal lengths as one batch,
        ``phase_runs``; MC ``none`` on the kernel backend as one call). Returns
        ``(1, sum T, D)`` and each sequence's new state; equals ``forward`` per sequence."""
        runs = phase_runs(states, lens)
        qkv = self.qkv(x)  # (1, L, 3HK)
        convs: list[Tensor | None] = [None] * len(runs)
        fulls: list[ConvInput | None] = [None] * len(runs)
        if self.conv is not None:
            qkv, convs, fulls = conv_varlen(qkv, states, lens, runs, self.conv.weight[:, 0], None)
        q, k, v, u, gates = self._heads(x, qkv)
        y, states = mix_varlen(self.memory, states, lens, runs, q, k, v, u, gates,
                               self.init_memory(), convs, fulls, self.cfg.conv_size)
        return self._output(x, y), states

    def forward_paged(self, x: Tensor, pl: PagedLayer) -> Tensor:
        """One token per row of a ragged batch (see ``PagedLayer``); updates ``pl``."""
        y = self._fused_paged(x, pl)
        if y is not None:
            return y
        with pl.gathered() as pl:
            if not torch.is_grad_enabled() and x.is_cpu:
                q, k, v, u, gates, g = self._project_decode(x, pl)
                return self._output(x, self.memory.decode_paged(pl, q, k, v, u, gates), g)
            q, k, v, u, gates, pl.conv = self._project(x, pl.conv)
            return self._output(x, self.memory.decode_paged(pl, q, k, v, u, gates))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.norm1 = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mixer = MCMixer(cfg, layer_idx)
        self.norm2 = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = SwiGLU(cfg.d_model, cfg.mlp_hidden)

    def _residual(self, x: Tensor, h: Tensor) -> Tensor:
        """The mixer's output ``h`` added to the stream, then the MLP's."""
        x = x + h
        return x + self.mlp(self.norm2(x))

    def forward(self, x: Tensor, state: LayerState) -> tuple[Tensor, LayerState]:
        h, state = self.mixer(self.norm1(x), state)
        return self._residual(x, h), state

    def forward_varlen(self, x: Tensor, states: list[LayerState], lens: list[int]
                       ) -> tuple[Tensor, list[LayerState]]:
        """Packed sequences ``(1, sum T, D)`` (see ``MCMixer.forward_varlen``)."""
        h, states = self.mixer.forward_varlen(self.norm1(x), states, lens)
        return self._residual(x, h), states

    def forward_paged(self, x: Tensor, pl: PagedLayer) -> Tensor:
        fused = self._fused_decode(x, pl)
        if fused is not None:
            return fused
        return self._residual(x, self.mixer.forward_paged(self.norm1(x), pl))

    @staticmethod
    def _fused_variant(mc: MCConfig) -> int | None:
        """The one-call C++ block's code for ``mc`` (kernels.cpu.native_block_decode_): 0 no
        segments, 1 routing over every cached block, 2 routing over the top_k picks; None for
        what it does not handle (fixed weights, logarithmic segments)."""
        if not mc.segmented:
            return 0
        if not mc.caches_blocks or not mc.routes:
            return None
        return 2 if mc.selects else 1

    def _fused_weights(self) -> tuple:
        """The block's weights and shape arguments of ``native_block_decode_`` (cached: looking
        up a dozen module attributes costs more than the call's Python overhead otherwise)."""
        mixer = self.mixer
        w_in, b_in = mixer._decode_weights()  # validates the projection weights
        # the forward wrappers (which hold int8 / bfloat16 copies), kept alive by the cache so
        # that their ids stay theirs
        fw = tuple(lin.__dict__.get("forward") for lin in (
            mixer.qkv, mixer.u_proj, mixer.g_proj, mixer.gate_proj, mixer.o_proj, self.mlp.up,
            self.mlp.down) if lin is not None)
        key = (id(w_in), params_key(self, _FUSED_PATHS if mixer.conv is None
                                    else _FUSED_PATHS + (("mixer", "conv", "weight"),)),
               tuple(id(f) for f in fw))
        cached = self.__dict__.get("_fused_args")
        if cached is None or cached[1] != key:
            names = mixer.gate_names
            lps = (mixer._decode_lowp(), lowp_of(mixer.o_proj), lowp_of(self.mlp.up),
                   lowp_of(self.mlp.down))

            def ws(lp: LowpWeight | None, w: Tensor) -> tuple[Tensor, Tensor | None]:
                # an int8 / bfloat16 copy (and its scales) where the weights have one
                return (w.detach(), None) if lp is None else (lp.data, lp.scales)

            args = (self.norm1.eps, self.norm1.weight.detach(), *ws(lps[0], w_in), b_in,
                    None if mixer.conv is None else mixer.conv.weight.detach()[:, 0],
                    mixer.out_norm.weight.detach(), mixer.out_norm.eps,
                    *ws(lps[1], mixer.o_proj.weight), self.norm2.weight.detach(),
                    *ws(lps[2], self.mlp.up.weight), *ws(lps[3], self.mlp.down.weight),
                    mixer.H, mixer.K, mixer.u_proj is not None, "log_a" in names, "b" in names)
            cached = (args, key, fw)
            self.__dict__["_fused_args"] = cached
        return cached[0]

    def _fused_decode(self, x: Tensor, pl: PagedLayer) -> Tensor | None:
        """The whole block for one token per row as one C++ call (``native_block_decode_``),
        when it applies: CPU float32 inference on the gated linear memory, states writable in
        place; host-tier blocks are read from ``pl.host_pool`` in place. ``None`` otherwise (the
        Python path, its twin, which fetches host blocks into staging rows)."""
        mixer = self.mixer
        variant = self._fused_variant(mixer.memory.cfg)
        if variant is None or type(mixer.family) is not LinearMemory or pl.rows is not None:
            return None
        host = None
        if pl.fetch is not None:  # host-tier blocks: read in place on the CPU, if the pool is
            host = (pl.host_pool or {}).get("S")  # given (else the Python path fetches them)
            if host is None or not host.is_cpu or not host.is_contiguous():
                return None
        if (not pl.inplace or torch.is_grad_enabled() or not x.is_cpu
                or x.dtype != torch.float32 or x.shape[1] != 1 or cpu_ops.ops() is None):
            return None
        S = pl.mem["S"]
        if S.stride(-1) != 1 or S.stride(-2) != S.shape[-1] or not pl.pool["S"].is_contiguous():
            return None
        B = x.shape[0]
        if B > cpu_ops.GEMV_MAX_ROWS and any(
                is_packed(lin) for lin in (mixer.o_proj, self.mlp.up, self.mlp.down)):
            return None  # a batch: oneDNN's packed GEMM (Python path) beats the block's plain one
        y = cpu_ops.ops().native_block_decode_(
            x.view(B, -1), *self._fused_weights(),
            S, pl.conv, pl.seg_ksum, pl.seg_len, pl.table, pl.pool["S"], pl.ksum_pool,
            mixer.cfg.segment_len, variant, mixer.cfg.mc_top_k, pl.top_k, host, pl.host_base)
        return y.view(x.shape)


class MCForCausalLM(RecurrentLM):
    @property
    def decode_state_rows(self) -> bool:
        """Whether the decode step reads the engine's slot pools through a row index
        (``PagedLayer.rows``): the gated linear memory's fused decode does."""
        return self.config.memory == "linear"

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.n_layers))
        self.norm = RMSNorm(config.d_model, config.norm_eps)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.reset_parameters()
        if config.tie_embeddings:
            self.lm_head.weight = self.embed.weight

    def reset_parameters(self) -> None:
        std = 0.02
        for name, p in self.named_parameters():
            if p.dim() >= 2 and "init" not in name:
                nn.init.normal_(p, std=std)
        for block in self.layers:  # residual branches scaled down with depth (GPT-2 style)
            nn.init.normal_(block.mixer.o_proj.weight, std=std / math.sqrt(2 * len(self.layers)))
            nn.init.normal_(block.mlp.down.weight, std=std / math.sqrt(2 * len(self.layers)))
            if block.mixer.conv is not None:
                nn.init.normal_(block.mixer.conv.weight, std=1.0 / block.mixer.cfg.conv_size)
            block.mixer.reset_gate_bias()

    def _head(self, x: Tensor) -> Tensor:
        return self.lm_head(self.norm(x))

    def save_pretrained(self, path: str | Path, tokenizer_files: dict | None = None) -> None:
        from mcserve.models.checkpoint import save_checkpoint

        save_checkpoint(self, path, tokenizer_files=tokenizer_files)

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype | None = None,
                        device: str | torch.device = "cpu") -> MCForCausalLM:
        from mcserve.models.checkpoint import load_checkpoint

        return load_checkpoint(path, cls, dtype=dtype, device=device)
