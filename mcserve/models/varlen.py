"""Variable-length (packed) prefill helpers the mixers share: sequences packed back to back,
grouped into runs at one phase (``phase_runs``), their short conv from each sequence's own tail
(``conv_varlen``) and the MC memory per run (``mix_varlen``); plus ``params_key``, the cheap
staleness test of cached parameter copies."""

from __future__ import annotations

import functools
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mcserve.kernels import dispatch
from mcserve.models.importing import ConvInput
from mcserve.models.mc import MCMemory
from mcserve.models.mc_state import MCLayerState
from mcserve.models.memory.linear import LinearMemory
from mcserve.models.state import LayerState


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


def check_varlen(input_ids: Tensor, states: list, lens: list[int]) -> None:
    """The arguments of a model's ``forward_varlen``: packed tokens ``(1, sum T)`` and one
    positive length per state; a ``ValueError`` naming what is wrong otherwise."""
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"input_ids must be (1, tokens), got shape {tuple(input_ids.shape)}")
    if len(states) != len(lens) or not lens or min(lens) < 1 \
            or sum(lens) != input_ids.shape[1]:
        raise ValueError(f"lens {lens} must be one positive length per state "
                         f"({len(states)}) summing to {input_ids.shape[1]} tokens")


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


class ParamsWatch:
    """``params_key``'s test for a fixed set of ``paths``, made once and checked every step:
    the same module and parameter objects at every hop of each path (so a replaced module or
    parameter is seen), each parameter at its storage and in-place version, and ``attrs``
    (``(module path, name)``) the same objects in those modules' own ``__dict__`` (e.g. a
    ``forward`` wrapper). About 0.2 microseconds a parameter, against a microsecond or more
    for walking the paths again."""

    def __init__(self, root: nn.Module, paths: tuple[tuple[str, ...], ...],
                 attrs: tuple[tuple[tuple[str, ...], str], ...] = ()):
        links: dict[tuple[int, str], tuple[dict, str, object]] = {}
        self.params: list[tuple[Tensor, int, int | None]] = []
        for path in paths:
            m = root
            for name in path[:-1]:
                links[(id(m._modules), name)] = (m._modules, name, m._modules[name])
                m = m._modules[name]
            p = m._parameters[path[-1]]
            links[(id(m._parameters), path[-1])] = (m._parameters, path[-1], p)
            if p is not None:
                self.params.append((p, p.data_ptr(), None if p.is_inference() else p._version))
        for mpath, name in attrs:
            m = root
            for hop in mpath:
                links[(id(m._modules), hop)] = (m._modules, hop, m._modules[hop])
                m = m._modules[hop]
            links[(id(m.__dict__), name)] = (m.__dict__, name, m.__dict__.get(name))
        self.links = list(links.values())

    def current(self) -> bool:
        """Whether nothing the watch covers changed since it was made."""
        for d, k, o in self.links:
            if d.get(k) is not o:
                return False
        for p, ptr, ver in self.params:
            if p.data_ptr() != ptr or (ver is not None and p._version != ver):
                return False
        return True


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
