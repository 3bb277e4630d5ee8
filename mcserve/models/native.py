"""The native MC language model ``MCForCausalLM`` (model_type ``mcserve``).

embedding → N × [RMSNorm → MC mixer → RMSNorm → SwiGLU MLP] → RMSNorm → LM head (optionally tied).

Contract (docs/engine.md): ``forward(input_ids, state) -> (logits, state)`` for a batch of
sequences at the same position, associative over any split of the tokens, so one call is a
prefill and one call per token is decode. The state is a ``ModelState``; it is never modified in
place, which makes prefix reuse and preemption a matter of keeping a reference.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mcserve.config import MCConfig, ModelConfig
from mcserve.kernels import cpu as cpu_ops
from mcserve.kernels import dispatch
from mcserve.models.importing import ConvInput, causal_conv
from mcserve.models.lowp_linear import LowpWeight, lowp_of
from mcserve.models.lowp_linear import stack as stack_lowp
from mcserve.models.mc import MCLayerState, MCMemory, PagedLayer
from mcserve.models.memory.linear import LinearMemory, SWLAMemory
from mcserve.models.packed_linear import is_packed


def make_family(cfg: ModelConfig):
    if cfg.memory == "linear":
        return LinearMemory()
    if cfg.memory == "swla":
        return SWLAMemory()
    from mcserve.models.memory.deep import DLAMemory, TitansMemory

    return DLAMemory(cfg.inner_chunk) if cfg.memory == "dla" else TitansMemory(cfg.inner_chunk)


@dataclass
class LayerState:
    mc: MCLayerState
    conv: Tensor | None  # (B, conv_size - 1, C) last pre-conv inputs; None without a conv


@dataclass
class ModelState:
    layers: list[LayerState]

    @property
    def pos(self) -> int:
        return self.layers[0].mc.pos

    def map_tensors(self, fn) -> ModelState:
        return ModelState([
            LayerState(ls.mc.map_tensors(fn), None if ls.conv is None else fn(ls.conv))
            for ls in self.layers
        ])


def fill_conv_tails(record: list[dict], conv_input: ConvInput | None, pos0: int,
                    conv_size: int) -> None:
    """Give each checkpoint recorded in a span (``MCLayerState.record``) its conv tail: the last
    ``conv_size - 1`` conv inputs up to its position. ``conv_input`` is the span's input with
    the previous tail in front, for a span starting at ``pos0``; None (no conv) leaves the
    records without one."""
    for r in record:
        if "conv" not in r:
            off = r["pos"] - pos0
            r["conv"] = None if conv_input is None else conv_input.rows(off, conv_size - 1)


def spans(lens: list[int]) -> list[tuple[int, int]]:
    """(start, end) of each sequence in tokens packed back to back with lengths ``lens``."""
    out, s = [], 0
    for n in lens:
        out.append((s, s + n))
        s += n
    return out


def phase_runs(states: list[LayerState], lens: list[int]) -> list[tuple[int, int, int, int]]:
    """Runs of consecutive packed sequences whose sequence mixing runs as one batch: the same
    number of tokens from the same phase (position, fill of the online segment, cached segments,
    top_k override, recording checkpoints or not). Each run is (first sequence, end sequence,
    first token, end token)."""
    def key(i: int) -> tuple:
        m = states[i].mc
        return (lens[i], m.pos, m.seg_len, m.n_segments, m.num_cached, tuple(m.cached_len),
                tuple(m.cached_pos), m.top_k, m.record is None)

    runs, sp = [], spans(lens)
    i = 0
    for j in range(1, len(lens) + 1):
        if j == len(lens) or key(j) != key(i):
            runs.append((i, j, sp[i][0], sp[j - 1][1]))
            i = j
    return runs


def params_key(root: nn.Module, paths: tuple[tuple[str, ...], ...]) -> tuple:
    """Identity, storage and in-place version of the parameters at ``paths`` (submodule names,
    then the parameter's, from ``root``; None for an absent bias), read through the modules'
    own dicts: a cheap test
    that copies or argument tuples built from them are current (an ``nn.Module`` attribute
    lookup costs about half a microsecond, and a decode step made a dozen per layer)."""
    out = []
    for path in paths:
        m = root
        for name in path[:-1]:
            m = m._modules[name]
        p = m._parameters[path[-1]]
        out.append(None if p is None else
                   (id(p), p.data_ptr(), None if p.is_inference() else p._version))
    return tuple(out)


# the parameters a native block's fused decode call reads as they are (besides the stacked
# projections and the conv)
_FUSED_PATHS = (("norm1", "weight"), ("mixer", "out_norm", "weight"), ("mixer", "o_proj", "weight"),
                ("norm2", "weight"), ("mlp", "up", "weight"), ("mlp", "down", "weight"))


@functools.lru_cache(maxsize=64)
def _conv_layout(lens: tuple[int, ...], w1: int, device: torch.device
                 ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Index tables of ``causal_conv_varlen`` for sequences of ``lens`` packed back to back and
    ``w1`` (= W - 1) tail rows each (cached: every layer of a call, and calls with the same
    lengths, reuse them). The gathers read ``src = [tails (N·w1, C); x[sel]]``:

    ``sel`` ``(S,)`` the packed rows of x that a sequence's head rows or new tail read; ``rows``
    ``(R,)`` the packed rows less than w1 from their sequence's start (the rows whose window
    reaches into the tail); ``taps`` ``(w1, R)`` the src row tap j < w1 reads for each of them;
    ``tail_rows`` ``(N·w1,)`` the src rows of each sequence's new tail (the last w1 rows of
    ``[tail; x]``)."""
    N = len(lens)
    sel: list[int] = []
    at_x: dict[int, int] = {}  # packed row -> src row

    def x_row(r: int) -> int:
        if r not in at_x:
            at_x[r] = N * w1 + len(sel)
            sel.append(r)
        return at_x[r]

    rows: list[int] = []
    taps: list[list[int]] = [[] for _ in range(w1)]
    tail_rows: list[int] = []
    start = 0
    for i, n in enumerate(lens):
        def at(p: int, i: int = i, start: int = start) -> int:  # row p of [tail_i; x_i]
            return i * w1 + p if p < w1 else x_row(start + p - w1)

        for o in range(min(w1, n)):
            rows.append(start + o)
            for j in range(w1):
                taps[j].append(at(o + j))
        tail_rows += [at(p) for p in range(n, n + w1)]
        start += n

    def t(x: list) -> Tensor:
        return torch.tensor(x, dtype=torch.long, device=device)

    return t(sel), t(rows), t(taps).view(w1, len(rows)), t(tail_rows)


def causal_conv_varlen(x: Tensor, tails: Tensor, lens: list[int], w: Tensor
                       ) -> tuple[Tensor, Tensor]:
    """``causal_conv`` of N sequences packed back to back, x ``(1, sum T, C)`` with lengths
    ``lens``, each after its own tail (``tails`` ``(N, W - 1, C)``), with ``w`` ``(C, W)`` →
    the packed output ``(1, sum T, C)`` and each sequence's new tail ``(N, W - 1, C)``.

    A fixed number of ops whatever N (a GPU launches them once, not once per sequence): the W
    shifted multiply-adds over the packed rows, which are right except for the first W - 1 rows
    of each sequence (their window reads the previous sequence's last rows instead of the
    tail); those rows are computed again from ``[tails; x]`` with one gather per tap and
    scattered back. Each row adds its taps in ``causal_conv``'s order."""
    W = w.shape[1]
    w1 = W - 1
    X = x[0]  # (L, C)
    L, C = X.shape
    wt = w.t().contiguous()  # (W, C): the taps as contiguous rows (see causal_conv)
    out = X * wt[w1]
    if w1 == 0:
        return out[None], tails
    for j in range(w1):
        s = w1 - j
        if s < L:
            out[s:].addcmul_(X[:L - s], wt[j])
    sel, rows, taps, tail_rows = _conv_layout(tuple(lens), w1, x.device)
    src = torch.cat([tails.reshape(-1, C), X.index_select(0, sel)])  # (N·w1 + S, C)
    head = X.index_select(0, rows) * wt[w1]  # (R, C)
    for j in range(w1):
        head.addcmul_(src.index_select(0, taps[j]), wt[j])
    out.index_copy_(0, rows, head)
    return out[None], src.index_select(0, tail_rows).view(len(lens), w1, C)


def conv_varlen(xc: Tensor, states: list[LayerState], lens: list[int],
                runs: list[tuple[int, int, int, int]], w: Tensor, bias: Tensor | None
                ) -> tuple[Tensor, list[Tensor], list[ConvInput]]:
    """A mixer's short conv (``w`` ``(C, W)``, optional bias ``(C,)``) + SiLU over the packed
    ``xc`` ``(1, sum T, C)``, each sequence from its own tail, as one ``causal_conv_varlen``.
    Returns the packed outputs ``(1, sum T, C)`` and, per run of ``phase_runs`` (its sequences
    as rows), the new tails ``(B, W - 1, C)`` and the conv inputs (for ``fill_conv_tails``):
    views of the packed tensors."""
    tails = (states[0].conv if len(states) == 1
             else torch.cat([st.conv for st in states])).to(xc.dtype)  # (N, W - 1, C)
    out, new = causal_conv_varlen(xc, tails, lens, w)
    if bias is not None:
        out += bias
    C = xc.shape[-1]
    convs, inputs = [], []
    for i, j, s, e in runs:
        convs.append(new[i:j])
        inputs.append(ConvInput(tails[i:j], xc[:, s:e].reshape(j - i, lens[i], C)))
    return F.silu(out, inplace=True), convs, inputs


def mix_sequence(memory: MCMemory, state: LayerState, q: Tensor, k: Tensor, v: Tensor,
                 u: Tensor, gates: dict[str, Tensor], init: dict[str, Tensor] | None,
                 conv: Tensor | None, conv_input: ConvInput | None, conv_size: int
                 ) -> tuple[Tensor, LayerState]:
    """The MC memory over one span of ``state``'s rows (q, k, u ``(B, T, H, K)``, v
    ``(B, T, H, V)``) → y ``(B, T, H, V)`` and the layer's new state with conv tail ``conv``;
    the checkpoints the span records (``MCLayerState.record``) get their conv tails from
    ``conv_input``."""
    y, mc = memory.forward(state.mc, q, k, v, u, gates, init=init)
    if state.mc.record is not None:
        fill_conv_tails(state.mc.record, conv_input, state.mc.pos, conv_size)
    return y, LayerState(mc, conv)


def _stack_rows(states: list[MCLayerState]) -> MCLayerState:
    """Batch-of-one MC states at one phase → one batched state (recording into a new list when
    theirs record)."""
    if len(states) == 1:
        return states[0]
    m0 = states[0]
    return replace(
        m0, mem={k: torch.cat([m.mem[k] for m in states]) for k in m0.mem},
        seg_ksum=torch.cat([m.seg_ksum for m in states]),
        cached={k: torch.cat([m.cached[k] for m in states]) for k in m0.cached},
        cached_ksum=torch.cat([m.cached_ksum for m in states]),
        cached_len=list(m0.cached_len), cached_pos=list(m0.cached_pos), _stack=None,
        record=None if m0.record is None else [])


def _row(x: Tensor | dict | object, i: int) -> Tensor | dict | object:
    """Row i (kept as a batch of one) of every tensor in a checkpoint record's values."""
    if isinstance(x, Tensor):
        return x[i:i + 1]
    if isinstance(x, dict):
        return {k: _row(t, i) for k, t in x.items()}
    return x


def _split_rows(ls: LayerState, states: list[LayerState]) -> list[LayerState]:
    """A batched layer state → one batch-of-one state per row; row i's checkpoint records go
    into ``states[i]``'s record list (the list its caller handed in)."""
    if len(states) == 1:
        return [ls]
    out = []
    for i, st in enumerate(states):
        mc = ls.mc.map_tensors(lambda t, i=i: t[i:i + 1])
        if ls.mc.record is not None:
            st.mc.record.extend(_row(r, i) for r in ls.mc.record)
            mc.record = st.mc.record
        out.append(LayerState(mc, None if ls.conv is None else ls.conv[i:i + 1]))
    return out


def mix_varlen(memory: MCMemory, states: list[LayerState], lens: list[int],
               runs: list[tuple[int, int, int, int]], q: Tensor, k: Tensor, v: Tensor,
               u: Tensor, gates: dict[str, Tensor], init: dict[str, Tensor] | None,
               convs: list[Tensor | None], conv_inputs: list[ConvInput | None],
               conv_size: int
               ) -> tuple[Tensor, list[LayerState]]:
    """``mix_sequence`` over the packed q, k, u ``(1, sum T, H, K)``, v ``(1, sum T, H, V)`` and
    gates ``(1, sum T, H, ...)``, each sequence from its own batch-of-one state, one call per
    run of ``phase_runs`` (its sequences as rows; ``convs``/``conv_inputs`` per run, from
    ``conv_varlen``), or one call for all of them where ``packs_memory``. Returns the packed y
    ``(1, sum T, H, V)`` and each sequence's new layer state."""
    if packs_memory(memory, q):
        return _mix_packed_linear(memory, states, lens, runs, q, k, v, gates, convs)
    ys, out = [], []
    for r, (i, j, s, e) in enumerate(runs):
        B, T = j - i, lens[i]

        def rows(t: Tensor, s: int = s, e: int = e, B: int = B, T: int = T) -> Tensor:
            return t[:, s:e].reshape(B, T, *t.shape[2:])  # (B, T, ...)

        st = LayerState(_stack_rows([ls.mc for ls in states[i:j]]), None)
        qr = rows(q)
        y, ls = mix_sequence(memory, st, qr, rows(k), rows(v), qr if u is q else rows(u),
                             {g: rows(t) for g, t in gates.items()}, init, convs[r],
                             conv_inputs[r], conv_size)
        ys.append(y.reshape(1, B * T, *y.shape[2:]))
        out += _split_rows(ls, states[i:j])
    return (ys[0] if len(ys) == 1 else torch.cat(ys, 1)), out


def packs_memory(memory: MCMemory, q: Tensor) -> bool:
    """Whether ``mix_varlen`` runs the memory of every sequence as one variable-length call
    (``LinearMemory.scan_varlen``): the gated linear memory without segments (MC ``none``: the
    scan is all there is, so phases do not matter) on the kernel backend, where one launch per
    run would leave a GPU idle."""
    return (not memory.cfg.segmented and type(memory.family) is LinearMemory
            and dispatch.get_backend(q) == "triton")


def _mix_packed_linear(memory: MCMemory, states: list[LayerState], lens: list[int],
                       runs: list[tuple[int, int, int, int]], q: Tensor, k: Tensor, v: Tensor,
                       gates: dict[str, Tensor], convs: list[Tensor | None]
                       ) -> tuple[Tensor, list[LayerState]]:
    """``mix_varlen`` for ``packs_memory``: the scan of all sequences as one call on the packed
    tensors from their stacked states; each sequence's state moves on by its tokens as
    ``MCMemory.forward`` moves it (nothing but ``mem`` and ``pos`` changes without segments,
    and no checkpoint is recorded)."""
    S0 = torch.cat([ls.mc.mem["S"] for ls in states]) if len(states) > 1 \
        else states[0].mc.mem["S"]  # (N, H, K, V)
    y, mem = memory.family.scan_varlen({"S": S0}, q, k, v, gates, lens)
    S = mem["S"]  # (N, H, K, V)
    out = []
    for r, (i, j, _, _) in enumerate(runs):
        for n in range(i, j):
            mc = states[n].mc
            out.append(LayerState(
                replace(mc, mem={"S": S[n:n + 1]}, pos=mc.pos + lens[n],
                        cached_len=list(mc.cached_len), cached_pos=list(mc.cached_pos)),
                None if convs[r] is None else convs[r][n - i:n - i + 1]))
    return y, out


class RMSNorm(nn.Module):
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
        out = F.silu(causal_conv(full, self.conv.weight[:, 0]), inplace=True)
        return out, full.new_tail(), full

    def _heads(self, x: Tensor, qkv: Tensor):
        """Token-wise: x ``(B, T, D)`` and the conv's output ``(B, T, 3HK)`` → q, k, v, u
        ``(B, T, H, K)`` (q and k normalised) and the gates."""
        B, T, _ = x.shape
        H, K = self.H, self.K
        q, k, v = qkv.view(B, T, 3, H, K).unbind(2)  # each (B, T, H, K)
        q = F.normalize(q, dim=-1)
        k = F.normalize(k, dim=-1)
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
        if g is None:
            y = self.out_norm(y).reshape(B, T, self.H * self.K) * F.silu(self.g_proj(x))
        else:  # decode: per-head norm and the silu(g) gate in one op
            HK = self.H * self.K
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


class SwiGLU(nn.Module):
    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.up = nn.Linear(d_model, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.up(x).chunk(2, dim=-1)
        if torch.is_grad_enabled():
            return self.down(F.silu(gate) * up)
        # inference: in place on the projection's output (two fewer (T, hidden) temporaries)
        return self.down(F.silu(gate, inplace=True).mul_(up))


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


class RecurrentLM(nn.Module):
    """What every recurrent LM the engine drives shares: ``embed``, ``layers`` of blocks with
    ``forward(x, LayerState)``/``forward_paged(x, PagedLayer)`` and ``mixer.init_state``, and a
    ``_head``. The native model and the imported ones (``mamba2.py``) subclass it."""

    def _head(self, x: Tensor) -> Tensor:
        raise NotImplementedError

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    def init_state(self, batch: int = 1) -> ModelState:
        return ModelState([blk.mixer.init_state(batch, self.dtype, self.device)
                           for blk in self.layers])

    def forward(self, input_ids: Tensor, state: ModelState | None = None, *,
                last_only: bool = False) -> tuple[Tensor, ModelState]:
        """input_ids ``(B, T)`` → logits ``(B, T, vocab)`` and the state after the last token.

        ``last_only``: logits of the last position only, ``(B, 1, vocab)``; the LM head of a
        large vocabulary over every prompt token otherwise dominates a long prefill.
        """
        if input_ids.dim() != 2:
            shape = tuple(input_ids.shape)
            raise ValueError(f"input_ids must be (batch, tokens), got shape {shape}")
        if state is None:
            state = self.init_state(input_ids.shape[0])
        x = self.embed(input_ids)
        new_layers = []
        for blk, ls in zip(self.layers, state.layers, strict=True):
            x, ls = blk(x, ls)
            new_layers.append(ls)
        if last_only:
            x = x[:, -1:]
        return self._head(x), replace(state, layers=new_layers)

    @property
    def packs_varlen(self) -> bool:
        """Whether ``forward_varlen`` runs the sequences packed: every block has a
        ``forward_varlen(x, layer_states, lens)``."""
        return all(callable(getattr(blk, "forward_varlen", None)) for blk in self.layers)

    def forward_varlen(self, input_ids: Tensor, states: list[ModelState], lens: list[int]
                       ) -> tuple[Tensor, list[ModelState]]:
        """Several sequences in one call, their tokens packed back to back: input_ids
        ``(1, sum T)``, sequence i has ``lens[i]`` tokens and continues from ``states[i]`` (a
        batch-of-one state, at any position). Returns the last position's logits of each
        sequence ``(n, vocab)`` and each sequence's new state; the same as ``forward`` on each
        sequence alone (``last_only``).

        With ``packs_varlen`` the token-wise work (embedding, norms, projections, MLPs, the LM
        head on the n last positions) and the short conv (each sequence from its own tail) run
        once over the packed tokens and only the MC memory per sequence on its slice,
        consecutive sequences at one phase with equal lengths as one batch (``phase_runs``: put
        such sequences next to each other; the gated linear memory without segments on the
        kernel backend: all of them in one call); otherwise the call runs ``forward`` on each
        sequence in turn. A checkpoint list
        in a layer's ``MCLayerState.record`` gets that sequence's checkpoints. The tensors of
        ``states`` are not modified.
        """
        if input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise ValueError(f"input_ids must be (1, tokens), got shape {tuple(input_ids.shape)}")
        if len(states) != len(lens) or not lens or min(lens) < 1 \
                or sum(lens) != input_ids.shape[1]:
            raise ValueError(f"lens {lens} must be one positive length per state "
                             f"({len(states)}) summing to {input_ids.shape[1]} tokens")
        if not self.packs_varlen:
            rows, new_states = [], []
            for (s, e), st in zip(spans(lens), states, strict=True):
                logits, st = self(input_ids[:, s:e], st, last_only=True)
                rows.append(logits[0, -1])
                new_states.append(st)
            return torch.stack(rows), new_states
        x = self.embed(input_ids)  # (1, L, D)
        per_layer = []  # [layer][sequence]
        for li, blk in enumerate(self.layers):
            x, lss = blk.forward_varlen(x, [st.layers[li] for st in states], lens)
            per_layer.append(lss)
        last = torch.tensor([e - 1 for _, e in spans(lens)], device=x.device)
        logits = self._head(x[:, last])[0]  # (n, V)
        return logits, [replace(st, layers=[lss[i] for lss in per_layer])
                        for i, st in enumerate(states)]

    def forward_paged(self, input_ids: Tensor, layers: list[PagedLayer]) -> Tensor:
        """Decode one token for each row of a ragged batch: input_ids ``(B, 1)`` → ``(B, 1, V)``.

        The rows may be at different positions with different numbers of cached segments; the
        ``PagedLayer`` views are updated in place (online memory, conv tail, key sums).
        """
        x = self.embed(input_ids)
        for blk, pl in zip(self.layers, layers, strict=True):
            x = blk.forward_paged(x, pl)
        return self._head(x)


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
