"""Low-precision weights for the large ``nn.Linear`` layers of a CPU model: int8 and bfloat16.

A decode step on the CPU reads every weight once per token, so at a few streams its time is
the bytes of weights read: int8 weights read a quarter of float32's, bfloat16 half. This module
gives a loaded float32 model such weights without a new file format:

* ``int8`` (``EngineConfig(quantization="int8")``, ``mcserve serve --quantization int8``):
  weight-only, symmetric, one float32 scale per output channel (row): ``w ≈ s · q`` with
  ``s = max|row| / 127`` and ``q = round(w / s)`` in [-127, 127];
* ``bf16`` (``EngineConfig(dtype="bfloat16")`` on the CPU): the weight rounded to bfloat16.

Only linears of at least ``MIN_NUMEL`` weights change (projections, MLPs, the LM head), and the
token embedding of that size (``apply_embedding_precision``, or with the head it is tied to), as
llama.cpp's Q8_0 and F16 files hold it: the small and sensitive parameters stay float32
(convolutions, A/Δ/D, norms, gates and routers, small LoRA-style matrices), as do activations,
residuals and the recurrent state.

Each changed layer's ``weight`` then stands for exactly the values the low-precision copy
represents (``s · q``, or the bfloat16 value), so everything that reads it (autograd,
``state_dict``, prefill in any form, the twins) computes with the same weights as the fast path:
the layer's forward (``packed_linear._PackedForward``) routes CPU float32 inference through the
C++ kernels of ``mcserve.kernels.cpu`` (``linear_q8`` / ``linear_bf16``) at any row count, and
the fused decode blocks (``Mamba2Block``, the native ``Block``) read the compact copy directly
(``lowp_of``). ``F.linear`` on the weight is the plain twin (autograd on, other devices).

Where those kernels run, the engine keeps only the compact copy (``release``): the parameter
becomes a ``compact_weight.CompactWeight``, which reports float32 and dequantizes for any other
reader, so an int8 model holds about a quarter of float32's bytes in its large weights and a
bf16 model half. Without the C++ kernels the float32 weights are kept, rounded to the copy's
values, and the linears compute with them at float32's speed.

The routed experts of a sparse MoE (``moe.Experts``, stacked ``(E, N, K)`` parameters rather than
linears) get the same treatment per expert matrix (``apply_expert_precision``), the copies
stacked (``stack_experts``) for the one C++ call that runs a layer's experts on the CPU.

The int8 kernel quantizes each input row to int16 (its own scale) and sums exactly in integers:
every instruction set and every batch size give bit-identical rows. The bf16 kernel has one
order of additions per output whatever the batch: greedy tokens do not depend on how many
streams run together (``tests/test_lowp_linear.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from mcserve.config import QUANTIZATIONS
from mcserve.kernels import cpu as cpu_ops
from mcserve.kernels.cpu.twins import pack_pairs, unpack_pairs
from mcserve.models.compact_weight import CompactWeight, compact_parameter
from mcserve.models.mc import MCMemory
from mcserve.models.moe import Experts
from mcserve.models.packed_linear import _PackedForward, _version

log = logging.getLogger(__name__)

#: the weight precisions this module applies
PRECISIONS = ("int8", "bf16")
#: smaller linears keep float32 weights: gates, routers and LoRA-style matrices are small and
#: sensitive, and their bytes are a rounding error of a decode step's
MIN_NUMEL = 2**16


@dataclass(frozen=True, eq=False)
class LowpWeight:
    """The compact copy of one linear's weight ``(N, K)``: ``data`` int8 or bfloat16 in the
    kernels' blocked layout (``kernels.cpu.twins.pack_pairs``), ``scales`` ``(N,)`` float32
    (per-output-channel for int8, ones for bfloat16)."""

    kind: str
    data: Tensor
    scales: Tensor
    in_features: int

    @property
    def out_features(self) -> int:
        return self.scales.numel()

    def weight(self) -> Tensor:
        """The int8 / bfloat16 weight ``(N, K)`` (unpacked)."""
        return unpack_pairs(self.data, self.out_features, self.in_features)

    def dequantized(self) -> Tensor:
        """The float32 weight these values represent exactly."""
        return self.weight().float() * self.scales[:, None]

    def rows(self, idx: Tensor) -> Tensor:
        """``self.dequantized()[idx]`` for a 1-D index, reading only those rows (a token
        embedding's lookup)."""
        return cpu_ops.packed_rows(self.data, self.scales, idx, self.in_features)

    def linear(self, x: Tensor, bias: Tensor | None = None) -> Tensor:
        """``F.linear(x, self.dequantized(), bias)`` through the C++ kernels where they apply."""
        if self.kind == "int8":
            return cpu_ops.linear_q8(x, self.data, self.scales, bias)
        return cpu_ops.linear_bf16(x, self.data, self.scales, bias)

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size() + self.scales.numel() * 4


def quantize_int8(w: Tensor, block_rows: int = 4096) -> tuple[Tensor, Tensor]:
    """``w (N, K)`` → int8 ``q`` and float32 ``scales`` with ``w ≈ scales[:, None] · q``:
    symmetric per row, ``scales = max|row| / 127`` (an all-zero row gets scale 0). Rows are
    quantized ``block_rows`` at a time, so the float32 temporaries of a large weight (an LM
    head of 100K rows) stay small."""
    w = w.detach()
    q = torch.empty(w.shape, dtype=torch.int8)
    scales = torch.empty(w.shape[0])
    for a in range(0, w.shape[0], block_rows):
        blk = w[a:a + block_rows].float()
        s = blk.abs().amax(dim=1) / 127
        q[a:a + block_rows] = torch.round(blk / torch.where(s > 0, s, 1)[:, None]).clamp_(-127,
                                                                                          127)
        scales[a:a + block_rows] = s
    return q, scales


def from_weight(kind: str, q: Tensor, scales: Tensor | None = None) -> LowpWeight:
    """A ``LowpWeight`` of an int8 (with its scales) or bfloat16 weight ``(N, K)``."""
    if scales is None:
        scales = torch.ones(q.shape[0])
    return LowpWeight(kind, pack_pairs(q), scales.float().contiguous(), q.shape[1])


def make_lowp(kind: str, w: Tensor) -> LowpWeight:
    """The compact copy of weight ``w`` in precision ``kind`` (one of ``PRECISIONS``)."""
    if kind == "int8":
        return from_weight("int8", *quantize_int8(w))
    if kind == "bf16":
        return from_weight("bf16", w.detach().to(torch.bfloat16))
    raise ValueError(f"weight precision must be one of {PRECISIONS}, got {kind!r}")


def stack(parts: list[LowpWeight]) -> LowpWeight:
    """Several linears' compact weights as one (rows concatenated), as their float weights are
    stacked for one matrix product; all of one kind and width."""
    kinds = {p.kind for p in parts}
    if len(kinds) != 1 or len({p.in_features for p in parts}) != 1:
        raise ValueError("cannot stack weights of different precisions or widths")
    return from_weight(parts[0].kind, torch.cat([p.weight() for p in parts]),
                       torch.cat([p.scales for p in parts]))


def lowp_of(module: nn.Module) -> LowpWeight | None:
    """The compact weight ``module`` computes with, or None: not a low-precision linear, or
    its float weight was replaced or changed in place since (then the float weight counts)."""
    fwd = module.__dict__.get("forward")
    if not isinstance(fwd, _PackedForward) or fwd.lowp is None:
        return None
    w = module._parameters.get("weight")
    if w is not fwd.weight or _version(w) != fwd.version:
        return None
    return fwd.lowp


def _overwrite(w: Tensor, values: Tensor) -> None:
    with torch.inference_mode(w.is_inference()), torch.no_grad():
        w.copy_(values)


def _holders(model: nn.Module) -> dict[int, list[tuple[nn.Module, str]]]:
    """Every (module, name) that holds each parameter of ``model``, by the parameter's id (a
    tied weight has several)."""
    out: dict[int, list[tuple[nn.Module, str]]] = {}
    for m in model.modules():
        for name, p in m._parameters.items():
            if p is not None:
                out.setdefault(id(p), []).append((m, name))
    return out


def _replace(holders: dict[int, list[tuple[nn.Module, str]]], old: Tensor, new: Tensor) -> None:
    """``new`` in place of parameter ``old`` wherever it is held: ``old``'s float32 storage
    is freed once nothing else refers to it."""
    for m, name in holders.pop(id(old), ()):
        m._parameters[name] = new


def apply_weight_precision(model: nn.Module, kind: str, min_numel: int = MIN_NUMEL,
                           release: bool = False) -> int:
    """Give every CPU float32 ``nn.Linear`` of ``model`` with at least ``min_numel`` weights a
    ``kind`` copy (``int8`` or ``bf16``) and route its forward through the C++ kernels (module
    docstring); a weight shared by several linears (or tied to an embedding) is converted once.
    ``release``: the parameter becomes a ``CompactWeight`` holding only that copy (layer by
    layer, so the peak is the float32 model plus one layer's copy), else its float32 values are
    rounded to the ones the copy holds and kept. Replaces a oneDNN-packed copy
    (``pack_linears``): the kernels take every row count. Idempotent; returns how many linears
    changed."""
    if kind not in PRECISIONS:
        raise ValueError(f"weight precision must be one of {PRECISIONS}, got {kind!r}")
    holders = _holders(model) if release else {}
    done: dict[int, tuple[LowpWeight, Tensor]] = {}
    n = 0
    for m in model.modules():
        if not isinstance(m, nn.Linear):
            continue
        fwd = m.__dict__.get("forward")
        if isinstance(fwd, _PackedForward) and fwd.lowp is not None:
            continue
        w = m.weight
        if id(w) in done:
            lp, new = done[id(w)]
        elif isinstance(w, CompactWeight):  # compacted as it was loaded (``compact_on_load``)
            lp, new = w.parts[0], w
            if lp.kind != kind:
                raise ValueError(f"a linear holds {lp.kind} weights, not {kind}")
            done[id(w)] = (lp, w)
        elif not w.is_cpu or w.dtype != torch.float32 or w.numel() < min_numel:
            continue
        else:
            lp = make_lowp(kind, w)
            if release:
                new = compact_parameter((lp,))
                _replace(holders, w, new)
            else:
                new = w
                _overwrite(w, lp.dequantized())
            done[id(new)] = (lp, new)  # a linear tied to this one now holds ``new``
        m.forward = _PackedForward(m, 1, pack=False, lowp=lp)
        n += 1
    if n and not cpu_ops.enabled():
        log.warning("%s weights without mcserve's C++ kernels (%s): the linears compute in "
                    "float32 with the rounded weights, at float32's speed", kind,
                    cpu_ops.status())
    elif n:  # probe the CPU now (the kernels' self-test), not at the first request
        info = cpu_ops.lowp_info()
        level = info["int8_impl" if kind == "int8" else "bf16_impl"]
        log.info("%s weights for %d linears; kernel level %s (0 scalar, 1 AVX2, 2 AVX-512, "
                 "3 VNNI / BF16; CPU: AVX2 %s, AVX-512 %s, VNNI %s, BF16 %s)", kind, n, level,
                 info["avx2_fma"], info["avx512"], info["avx512_vnni"], info["avx512_bf16"])
        if info["note"]:
            log.warning("low-precision kernels: %s", info["note"])
    return n


def _tied_to_linear(model: nn.Module, w: Tensor) -> bool:
    return any(isinstance(x, nn.Linear) and x.weight is w for x in model.modules())


def apply_embedding_precision(model: nn.Module, kind: str, min_numel: int = MIN_NUMEL,
                              release: bool = False) -> int:
    """Give every CPU float32 ``nn.Embedding`` of ``model`` with at least ``min_numel`` weights
    that is not tied to a linear (those convert with it) a ``kind`` copy, as llama.cpp's Q8_0
    and F16 files hold the token embedding: ``release`` makes the parameter a ``CompactWeight``
    (a lookup dequantizes only the rows it reads), else its float32 values are rounded to the
    copy's and kept. Idempotent; returns how many embeddings changed."""
    if kind not in PRECISIONS:
        raise ValueError(f"weight precision must be one of {PRECISIONS}, got {kind!r}")
    holders = _holders(model) if release else {}
    n = 0
    for m in model.modules():
        if not isinstance(m, nn.Embedding) or m.__dict__.get("lowp") is not None:
            continue
        w = m.weight
        if isinstance(w, CompactWeight):  # compacted as it was loaded (``compact_on_load``)
            m.lowp = w.parts[0]
            n += 1
            continue
        if (not w.is_cpu or w.dtype != torch.float32 or w.numel() < min_numel
                or _tied_to_linear(model, w)):
            continue
        m.lowp = make_lowp(kind, w)
        if release:
            _replace(holders, w, compact_parameter((m.lowp,)))
        else:
            _overwrite(w, m.lowp.dequantized())
        n += 1
    return n


@dataclass(eq=False)
class ExpertWeights:
    """The compact copies of one ``Experts`` module's matrices: ``w_in_data`` ``(E, ...)`` of
    every expert's input projection(s) ``(2I or I, D_e)`` packed as one tensor, ``down_data`` of
    the down projections ``(D_e, I)``, their scales ``(E, N)``, and ``w_in[e]`` / ``down[e]``,
    each expert's ``LowpWeight`` (views of those); ``params`` and ``versions`` the float
    parameters they were made from, so an in-place change or a replacement of those makes the
    float weights count again."""

    w_in: list[LowpWeight]
    down: list[LowpWeight]
    params: tuple[Tensor, Tensor]
    versions: tuple[int, int]
    w_in_data: Tensor
    w_in_scales: Tensor
    down_data: Tensor
    down_scales: Tensor

    def usable(self, experts: Experts, x: Tensor) -> bool:
        """Whether ``experts`` computes on ``x`` through these copies: CPU float32 inference
        with the C++ kernels, the float parameters the ones they were made from, unchanged."""
        ps = (experts.w_in, experts.down_proj)
        return (x.is_cpu and x.dtype == torch.float32 and cpu_ops.enabled()
                and not (torch.is_grad_enabled() and any(p.requires_grad for p in ps))
                and all(p is q for p, q in zip(ps, self.params))
                and tuple(_version(p) for p in ps) == self.versions)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.w_in_data, self.w_in_scales,
                                                           self.down_data, self.down_scales))


def stack_experts(parts: list[LowpWeight]) -> tuple[Tensor, Tensor, list[LowpWeight]]:
    """Every expert's copy of one matrix as one tensor ``(E, ...)`` and scales ``(E, N)``, and
    each expert's ``LowpWeight`` as views of those (what the C++ experts take in one call);
    parts that already are such views are taken as they are, without a copy."""
    base = parts[0].data._base
    if not (base is not None and base.dim() == 5 and base.shape[0] == len(parts)
            and all(p.data._base is base and p.data.data_ptr() == base[e].data_ptr()
                    for e, p in enumerate(parts))):
        base = torch.stack([p.data for p in parts])
    scales = torch.stack([p.scales for p in parts])
    views = [LowpWeight(p.kind, base[e], scales[e], p.in_features) for e, p in enumerate(parts)]
    return base, scales, views


def _expert_weights(m: Experts, names: tuple[str, str], copies: list[list[LowpWeight]],
                    release: bool) -> ExpertWeights:
    """``m``'s ``ExpertWeights`` from the two matrices' per-expert copies; ``release``: its
    parameters become ``CompactWeight``s of those copies' stacked views."""
    stacks = [stack_experts(parts) for parts in copies]
    if release:
        for name, (_, _, views) in zip(names, stacks):
            m._parameters[name] = compact_parameter(tuple(views), stacked=True)
    ps = tuple(m._parameters[name] for name in names)
    (wi, si, vi), (wd, sd, vd) = stacks
    return ExpertWeights(vi, vd, ps, tuple(_version(p) for p in ps), wi, si, wd, sd)


def apply_expert_precision(model: nn.Module, kind: str, min_numel: int = MIN_NUMEL,
                           release: bool = False) -> int:
    """Give the routed experts of every CPU float32 ``Experts`` module of ``model`` whose expert
    matrices hold at least ``min_numel`` weights each a ``kind`` copy per expert, as
    ``apply_weight_precision`` does for linears (``release``: the stacked parameters become
    ``CompactWeight``s of those copies, else their float values are rounded to the copies'); on
    the CPU, ``SparseMoE`` runs them in one C++ call (``kernels.cpu.moe_experts``). Idempotent;
    returns how many ``Experts`` modules changed."""
    if kind not in PRECISIONS:
        raise ValueError(f"weight precision must be one of {PRECISIONS}, got {kind!r}")
    n = 0
    for m in model.modules():
        if not isinstance(m, Experts) or m.__dict__.get("lowp") is not None:
            continue
        names = ("gate_up_proj" if m.gated else "up_proj", "down_proj")
        ps = tuple(m._parameters[name] for name in names)
        if all(isinstance(p, CompactWeight) for p in ps):  # compacted as they were loaded
            if any(p.parts[0].kind != kind for p in ps):
                raise ValueError(f"experts hold {ps[0].parts[0].kind} weights, not {kind}")
            m.lowp = _expert_weights(m, names, [list(p.parts) for p in ps], release=True)
            n += 1
            continue
        if any(not p.is_cpu or p.dtype != torch.float32 or p[0].numel() < min_numel
               or isinstance(p, CompactWeight) for p in ps):
            continue
        copies = []
        for p in ps:
            parts = []
            for e in range(p.shape[0]):  # one expert at a time: no second copy of the stack
                parts.append(make_lowp(kind, p[e]))
                if not release:
                    _overwrite(p[e], parts[-1].dequantized())
            copies.append(parts)
        m.lowp = _expert_weights(m, names, copies, release)
        n += 1
    return n


def compact_on_load(kind: str, min_numel: int = MIN_NUMEL
                    ) -> Callable[[nn.Module, str, Tensor], nn.Parameter | None]:
    """The loader's hook (``importing.ON_LOAD``) that makes the weights ``apply_weight_precision``
    and ``apply_expert_precision`` would convert (with ``release``) compact straight from the
    checkpoint's tensor, one tensor at a time: a low-precision model never holds its float32
    weights, not even while it loads. The engine's precision step then routes those layers."""
    if kind not in PRECISIONS:
        raise ValueError(f"weight precision must be one of {PRECISIONS}, got {kind!r}")

    def convert(model: nn.Module, name: str, t: Tensor) -> nn.Parameter | None:
        mod_name, _, leaf = name.rpartition(".")
        m = model.get_submodule(mod_name)
        if not t.is_cpu or not t.dtype.is_floating_point:
            return None
        if isinstance(m, nn.Linear) and leaf == "weight":
            if m.weight.dtype != torch.float32 or t.numel() < min_numel:
                return None
            return compact_parameter((make_lowp(kind, t),))
        if isinstance(m, nn.Embedding) and leaf == "weight":  # tied to a head or not
            if m.weight.dtype != torch.float32 or t.numel() < min_numel:
                return None
            return compact_parameter((make_lowp(kind, t),))
        if isinstance(m, Experts) and leaf in ("gate_up_proj", "up_proj", "down_proj"):
            if getattr(m, leaf).dtype != torch.float32 or t[0].numel() < min_numel:
                return None
            parts = [make_lowp(kind, t[e]) for e in range(t.shape[0])]
            return compact_parameter(tuple(stack_experts(parts)[2]), stacked=True)
        return None

    return convert


def weight_precision(model: nn.Module) -> dict[str, object]:
    """What the ``apply_*_precision`` functions did to ``model``: linears per precision,
    ``Experts`` modules and untied embeddings with compact copies, the bytes of all the compact
    copies and of the float32 weights they stand for, the float32 bytes still kept beside the
    copies (none once released), and ``held_bytes``: what every parameter of the model holds now
    (a ``CompactWeight`` its copies, a tied weight once)."""
    kinds: dict[str, int] = {}
    seen: set[int] = set()
    compact = full = kept = experts = 0
    embeddings = 0
    for m in model.modules():
        el = m.__dict__.get("lowp") if isinstance(m, nn.Embedding) else None
        if el is not None and id(el) not in seen and not _tied_to_linear(model, m.weight):
            seen.add(id(el))
            embeddings += 1
            compact += el.nbytes
            full += m.weight.numel() * 4
            kept += 0 if isinstance(m.weight, CompactWeight) else m.weight.numel() * 4
        ew = m.__dict__.get("lowp") if isinstance(m, Experts) else None
        if ew is not None:
            experts += 1
            compact += ew.nbytes
            full += sum(p.numel() * 4 for p in ew.params)
            kept += sum(p.numel() * 4 for p in ew.params if not isinstance(p, CompactWeight))
        lp = lowp_of(m)
        if lp is None:
            continue
        kinds[lp.kind] = kinds.get(lp.kind, 0) + 1
        if id(lp) not in seen:
            seen.add(id(lp))
            compact += lp.nbytes
            nbytes = lp.out_features * lp.in_features * 4
            full += nbytes
            kept += 0 if isinstance(m.weight, CompactWeight) else nbytes
    held = 0
    for p in {id(p): p for p in model.parameters()}.values():
        held += (p.nbytes_compact if isinstance(p, CompactWeight)
                 else p.numel() * p.element_size())
    return {"linears": kinds, "experts": experts, "embeddings": embeddings,
            "compact_bytes": compact,
            "float32_bytes": full, "float32_kept_bytes": kept, "held_bytes": held}


def load_dtype(dtype: str, device: str) -> str:
    """The dtype to load a checkpoint in for ``EngineConfig(dtype=..., device=...)``: bfloat16
    on the CPU loads float32 (only the large linears' weights become bfloat16, by
    ``prepare_cpu_weights``); everything else as asked."""
    if dtype == "bfloat16" and torch.device(device).type == "cpu":
        return "float32"
    return dtype


def load_compact(dtype: str, quantization: str | None, device: str) -> str | None:
    """The precision a checkpoint's large weights take as they load (``load_model``'s
    ``compact``) for ``EngineConfig(dtype=..., quantization=..., device=...)``: ``int8`` or
    ``bf16`` on the CPU where the C++ kernels run (the ones that read compact weights), else
    None (float32 loads, and ``prepare_cpu_weights`` converts what applies)."""
    if torch.device(device).type != "cpu" or not cpu_ops.enabled():
        return None
    if quantization is not None:
        return quantization if quantization in PRECISIONS else None
    return "bf16" if dtype == "bfloat16" else None


def prepare_cpu_weights(model: nn.Module, dtype: str, quantization: str | None,
                        release: bool | None = None) -> int:
    """The engine's precision step after loading a CPU model: ``quantization="int8"`` gives the
    large linears and the routed experts int8 weights, else ``dtype="bfloat16"`` gives them
    bfloat16 weights (of a model that is float32); returns how many linears and ``Experts``
    modules changed. ``release`` (default: when the C++ kernels run, which read the copies)
    keeps only the compact copies (``CompactWeight``), not the float32 weights beside them."""
    if quantization is not None:
        if quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be None or one of {QUANTIZATIONS}, got "
                             f"{quantization!r}")
        kind = quantization
    elif dtype == "bfloat16":
        kind = "bf16"
    else:
        return 0
    if release is None:
        release = cpu_ops.enabled()
    n = (apply_weight_precision(model, kind, release=release)
         + apply_expert_precision(model, kind, release=release)
         + apply_embedding_precision(model, kind, release=release))
    if kind == "bf16":
        bf16_readouts(model)
    if n:
        info = weight_precision(model)
        log.info("%s weights: %.1f MB held by the model's parameters (the converted ones "
                 "%.1f MB, %.1f MB in float32%s)", kind, info["held_bytes"] / 1e6,
                 info["compact_bytes"] / 1e6, info["float32_bytes"] / 1e6,
                 ", released" if release else ", kept beside them")
    return n


def bf16_dot() -> bool:
    """Whether this CPU computes bfloat16 products natively (AVX512-BF16; the C++ kernels'
    runtime probe, capped by ``MCSERVE_CPU_ISA``): bfloat16 GEMMs are then about twice
    float32's rate; without it they convert and run no faster than float32."""
    info = cpu_ops.lowp_info()
    return bool(info.get("avx512_bf16")) and int(info.get("bf16_impl", 0)) >= 3


def bf16_readouts(model: nn.Module, enable: bool | None = None) -> int:
    """Give the chunked prefill's dense cached readout (``kernels.mc_chunk``) of every MC
    memory of ``model`` bfloat16 GEMM operands (float32 accumulation; scores, selection, online
    term and states stay float32) when ``enable`` (default: ``bf16_dot()``), else float32;
    returns how many memories with such a readout (constant segments on the linear memory) now
    read it in bfloat16."""
    on = bf16_dot() if enable is None else enable
    n = 0
    for m in model.modules():
        mem = getattr(m, "memory", None)
        if isinstance(mem, MCMemory):
            mem.readout_dtype = torch.bfloat16 if on else None
            n += on and mem.chunked  # the memories whose prefill has that readout
    return n
