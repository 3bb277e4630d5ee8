"""The sparse mixture-of-experts MLP the hybrid families share (Granite-4.0-H, Qwen3-Next, Jamba,
Nemotron-H): :class:`SparseMoE`, its grouped fast path and :func:`naive_moe`, its plain twin.

Routing (``x``: one token, ``W_r``: the router, ``E`` experts, ``k`` chosen; the scores are
computed in float32 whatever the model's dtype):

* ``"softmax_topk"`` (Qwen3-Next, Jamba): ``p = softmax(W_r x)`` over all ``E`` experts; the
  ``k`` experts of largest ``p``, weighted ``p_i``, or ``p_i / sum_k p`` with
  ``norm_topk_prob`` (Qwen3-Next: ``norm_topk_prob`` from its config, default true; Jamba:
  never renormalised).
* ``"topk_softmax"`` (Granite-4.0-H, ``granitemoehybrid``): the ``k`` experts of largest logit
  ``l = W_r x``, weighted ``softmax`` over those ``k`` logits only (they sum to 1).
* ``"sigmoid"`` (Nemotron-H "E" layers): ``s = sigmoid(W_r x)``; the choice uses
  ``c = s + e_score_correction_bias``; with ``n_group > 1`` the experts are split into
  ``n_group`` equal groups in order, each scored by the sum of its two largest ``c``, and only
  the ``topk_group`` best groups stay eligible; the ``k`` eligible experts of largest ``c`` are
  weighted ``s_i`` (not ``c_i``), or ``s_i / (sum_k s + 1e-20)`` with ``norm_topk_prob``.

In every mode the weights are then multiplied by ``routed_scaling_factor`` (Nemotron-H's; 1.0
otherwise) and ``y = sum_k w_i expert_i(x) (+ shared(x))``.

Experts (``I``: ``intermediate``; ``D_e``: ``latent_size`` or ``d_model``), stored stacked
exactly as transformers 5.24 stores them, so importers map names with no reshape:

* gated (``gated=True``): ``experts.gate_up_proj`` ``(E, 2I, D_e)`` (rows ``[:I]`` the gate,
  ``[I:]`` the up projection), ``experts.down_proj`` ``(E, D_e, I)``;
  ``expert_i(x) = down_i · (act(gate_i · x) * (up_i · x))``;
* plain (``gated=False``, Nemotron-H): ``experts.up_proj`` ``(E, I, D_e)``,
  ``experts.down_proj`` ``(E, D_e, I)``; ``expert_i(x) = down_i · act(up_i · x)``.

Other tensors: ``router.weight`` ``(E, D)`` (``router.bias`` ``(E,)`` with ``router_bias``),
``e_score_correction_bias`` ``(E,)`` (sigmoid routing only), the optional shared expert
``shared_expert.{gate_proj, up_proj, down_proj}`` (``nn.Linear``; no ``gate_proj`` when
``shared_gated=False``; biases with ``shared_bias``), its optional gate
``shared_expert_gate.weight`` ``(1, D)`` (``shared(x) = sigmoid(g · x) * mlp(x)``), and
Nemotron-H's optional latent projections ``fc1_latent_proj``, ``fc2_latent_proj``
(``nn.Linear`` D -> latent -> D around the routed experts only; bias with ``latent_bias``).

The transformers names of each family (``P``: the layer's prefix; ours on the right):

* granitemoehybrid (``topk_softmax``): ``P.block_sparse_moe.router.weight`` -> ``router.weight``;
  ``P.block_sparse_moe.experts.{gate_up_proj, down_proj}`` -> ``experts.{same}``; its shared
  MLP ``P.shared_mlp.input_linear.weight`` ``(2I_s, D)`` split in rows ``[:I_s]`` ->
  ``shared_expert.gate_proj.weight`` and ``[I_s:]`` -> ``shared_expert.up_proj.weight``,
  ``P.shared_mlp.output_linear.weight`` -> ``shared_expert.down_proj.weight``;
* qwen3_next (``softmax_topk``, ``norm_topk_prob``): ``P.mlp.gate.weight`` -> ``router.weight``;
  ``P.mlp.experts.{gate_up_proj, down_proj}``, ``P.mlp.shared_expert.{gate,up,down}_proj.weight``
  and ``P.mlp.shared_expert_gate.weight`` -> the same names without ``P.mlp.``;
* jamba (``softmax_topk``): ``P.feed_forward.router.weight`` -> ``router.weight``;
  ``P.feed_forward.experts.{gate_up_proj, down_proj}`` -> ``experts.{same}``;
* nemotron_h (``sigmoid``, ``gated=False``): ``P.mixer.gate.weight`` -> ``router.weight``;
  ``P.mixer.gate.e_score_correction_bias`` -> ``e_score_correction_bias``;
  ``P.mixer.experts.{up_proj, down_proj}`` -> ``experts.{same}``;
  ``P.mixer.shared_experts.{up_proj, down_proj}.{weight, bias}`` -> ``shared_expert.{same}``;
  ``P.mixer.fc{1,2}_latent_proj.{weight, bias}`` -> ``fc{1,2}_latent_proj.{same}``.

Family settings: Granite ``SparseMoE(D, num_local_experts, num_experts_per_tok,
intermediate_size, routing="topk_softmax", shared_intermediate=shared_intermediate_size)`` (its
shared MLP is always added, unweighted: map it here or keep it outside, the sum is the same;
Granite with ``num_local_experts == 0`` has no MoE at all); Qwen3-Next ``SparseMoE(D,
num_experts, num_experts_per_tok, moe_intermediate_size, routing="softmax_topk",
norm_topk_prob=..., shared_intermediate=shared_expert_intermediate_size, shared_gate=True)``;
Jamba ``SparseMoE(D, num_experts, num_experts_per_tok, intermediate_size,
routing="softmax_topk")`` (no renormalisation, no shared expert); Nemotron-H ``SparseMoE(D,
n_routed_experts, num_experts_per_tok, moe_intermediate_size, routing="sigmoid", gated=False,
act=mlp_hidden_act ("relu2"), norm_topk_prob=..., routed_scaling_factor=..., n_group=...,
topk_group=..., shared_intermediate=moe_shared_expert_intermediate_size, shared_gated=False,
shared_bias=mlp_bias, latent_size=moe_latent_size, latent_bias=mlp_bias)``.

The fast path (``forward``) sorts the ``N·k`` (token, expert) pairs by expert and runs one
matmul pair per expert over exactly its tokens (experts with none are skipped), then adds the
weighted rows back with ``index_add_``. Two ways to run the experts (``impl``): ``"loop"``, one
matmul pair per expert with tokens (it reads the per-expert counts on the host: one sync per
call, so a static CUDA-graph decode step cannot capture it), and ``"grouped"``, one
``F.grouped_mm`` per projection over the expert offsets (no host sync: capturable), and
``"gathered"``, each pair's expert weights gathered by index and one batched matmul per
projection (no host sync; reads each chosen expert once per pair, so it pays only while the
pairs are few: a decode step). ``"auto"`` (the default) takes the grouped one where
``F.grouped_mm`` runs (bfloat16 on CUDA, SM 80+, rows a multiple of 8), else on CUDA the
gathered one while the pairs are no more than the experts (``max_sync_free_tokens``), on the CPU
``"cpu"``: the whole routed part in one C++ call (``kernels.cpu.moe_experts``: the pairs grouped
by expert, each expert's rows in one product from its int8 / bfloat16 copies or the float32
stacks, the activation and the weighted sum; silu, relu² and relu, inference only), and the
loop elsewhere (and where that call does not apply). With sigmoid routing the router and
``e_score_correction_bias`` stay float32 through ``.to(dtype)`` (``router_fp32``), as
transformers keeps them. :func:`naive_moe` is the same sum written out per token and per chosen
expert, for the tests.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mcserve.kernels import cpu as cpu_ops
from mcserve.models.compact_weight import CompactWeight

ROUTINGS = ("softmax_topk", "topk_softmax", "sigmoid")
#: how the experts run: "loop" (one matmul pair per expert with tokens; reads the counts on the
#: host), "cpu" (one C++ call for the layer), "grouped" (``F.grouped_mm`` over the expert
#: offsets, no host sync), "gathered", "auto" (the module docstring)
IMPLS = ("auto", "loop", "cpu", "grouped", "gathered")


def _relu2(x: Tensor) -> Tensor:
    return torch.square(F.relu(x))


#: activations by their transformers names (``hidden_act``, ``mlp_hidden_act``)
ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "relu": F.relu,
    "relu2": _relu2,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


#: the activations the C++ experts (``kernels.cpu.moe_experts``) compute, by their codes there
ACT_CODES = {"silu": 0, "swish": 0, "relu2": 1, "relu": 2}


def activation(name: str) -> Callable[[Tensor], Tensor]:
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"unsupported activation {name!r} (supported: "
                         f"{', '.join(sorted(ACTIVATIONS))})") from None


class Experts(nn.Module):
    """The ``E`` experts' weights, stacked (see the module docstring for the layout)."""

    def __init__(self, n_experts: int, d_in: int, intermediate: int, gated: bool = True):
        super().__init__()
        self.n_experts = n_experts
        self.intermediate = intermediate
        self.gated = gated
        if gated:
            self.gate_up_proj = nn.Parameter(torch.empty(n_experts, 2 * intermediate, d_in))
        else:
            self.up_proj = nn.Parameter(torch.empty(n_experts, intermediate, d_in))
        self.down_proj = nn.Parameter(torch.empty(n_experts, d_in, intermediate))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for p in self.parameters():
            nn.init.normal_(p, std=0.02)

    @property
    def w_in(self) -> Tensor:
        """``(E, 2I or I, D_e)``: the input projection(s) of every expert."""
        return self.gate_up_proj if self.gated else self.up_proj

    def compact(self, x: Tensor):
        """The int8 / bfloat16 copies of the experts (``lowp``, set by
        ``lowp_linear.apply_expert_precision``) if they apply to rows like ``x``, else None."""
        lowp = self.__dict__.get("lowp")
        return lowp if lowp is not None and lowp.usable(self, x) else None

    def one(self, e: int, x: Tensor, act: Callable[[Tensor], Tensor], compact=None) -> Tensor:
        """Expert ``e`` on the rows ``x`` ``(n, D_e)``: through ``compact`` (``compact(x)``'s
        copies, checked once per call of the layer) where given, else the float weights (which
        hold the same values) through ``kernels.cpu.linear``: the C++ matrix-vector product for
        the few rows an expert gets in a decode step on the CPU, ``F.linear`` otherwise."""
        if compact is not None:
            h = compact.w_in[e].linear(x)
        else:
            h = cpu_ops.linear(x, self.w_in[e])
        if self.gated:
            g, u = h.split(self.intermediate, dim=-1)
            h = act(g) * u
        else:
            h = act(h)
        if compact is not None:
            return compact.down[e].linear(h)
        return cpu_ops.linear(h, self.down_proj[e])


class SharedExpert(nn.Module):
    """``down(act(gate(x)) * up(x))`` (``gated``) or ``down(act(up(x)))``."""

    def __init__(self, d_model: int, intermediate: int, act: Callable[[Tensor], Tensor],
                 gated: bool = True, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(d_model, intermediate, bias=bias) if gated else None
        self.up_proj = nn.Linear(d_model, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, d_model, bias=bias)
        self.act = act

    def forward(self, x: Tensor) -> Tensor:
        if self.gate_proj is None:
            return self.down_proj(self.act(self.up_proj(x)))
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class SparseMoE(nn.Module):
    """A sparse mixture-of-experts MLP: ``(..., D) -> (..., D)``; the routing modes, weight
    layout and each family's settings are in the module docstring."""

    def __init__(self, d_model: int, n_experts: int, top_k: int, intermediate: int, *,
                 routing: str = "softmax_topk", norm_topk_prob: bool = False,
                 routed_scaling_factor: float = 1.0, n_group: int = 1, topk_group: int = 1,
                 router_bias: bool = False, gated: bool = True, act: str = "silu",
                 shared_intermediate: int | None = None, shared_gate: bool = False,
                 shared_gated: bool = True, shared_bias: bool = False,
                 latent_size: int | None = None, latent_bias: bool = False,
                 router_fp32: bool | None = None, impl: str = "auto"):
        super().__init__()
        if impl not in IMPLS:
            raise ValueError(f"unknown MoE impl {impl!r} (one of {', '.join(IMPLS)})")
        if routing not in ROUTINGS:
            raise ValueError(f"unknown MoE routing {routing!r} (one of {', '.join(ROUTINGS)})")
        for name, v in (("n_experts", n_experts), ("top_k", top_k),
                        ("intermediate", intermediate), ("n_group", n_group),
                        ("topk_group", topk_group)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"MoE {name} must be a positive integer, got {v!r}")
        if top_k > n_experts:
            raise ValueError(f"MoE top_k {top_k} exceeds the {n_experts} experts")
        if n_group > 1:
            if routing != "sigmoid":
                raise ValueError("MoE expert groups (n_group > 1) need routing='sigmoid'")
            if n_experts % n_group or n_experts // n_group < 2:
                raise ValueError(f"MoE n_group {n_group} must split the {n_experts} experts "
                                 f"into groups of at least 2")
            if topk_group > n_group:
                raise ValueError(f"MoE topk_group {topk_group} exceeds n_group {n_group}")
            if top_k > topk_group * (n_experts // n_group):
                raise ValueError(f"MoE top_k {top_k} exceeds the experts of {topk_group} "
                                 f"groups")
        self.d_model = d_model
        self.n_experts = n_experts
        self.top_k = top_k
        self.routing = routing
        self.norm_topk_prob = bool(norm_topk_prob)
        self.routed_scaling_factor = float(routed_scaling_factor)
        self.n_group = n_group
        self.topk_group = topk_group
        self.act_name = act
        self.impl = impl
        #: router weight, bias and score correction kept in float32 through ``.to(dtype)``
        #: (transformers keeps Nemotron-H's ``gate.weight`` and ``e_score_correction_bias``
        #: in float32); default: with sigmoid routing
        self.router_fp32 = routing == "sigmoid" if router_fp32 is None else bool(router_fp32)
        self.act = activation(act)
        self.act_code = ACT_CODES.get(act)  # the C++ experts' activation (None: not there)
        self.router = nn.Linear(d_model, n_experts, bias=router_bias)
        if routing == "sigmoid":
            self.register_buffer("e_score_correction_bias",
                                 torch.zeros(n_experts, dtype=torch.float32))
        else:
            self.e_score_correction_bias = None
        d_e = d_model if latent_size is None else latent_size
        if latent_size is not None:
            self.fc1_latent_proj = nn.Linear(d_model, latent_size, bias=latent_bias)
            self.fc2_latent_proj = nn.Linear(latent_size, d_model, bias=latent_bias)
        else:
            self.fc1_latent_proj = self.fc2_latent_proj = None
        self.experts = Experts(n_experts, d_e, intermediate, gated)
        self.shared_expert = (None if shared_intermediate is None else
                              SharedExpert(d_model, shared_intermediate, self.act,
                                           gated=shared_gated, bias=shared_bias))
        if shared_gate and self.shared_expert is None:
            raise ValueError("MoE shared_gate needs a shared expert (shared_intermediate)")
        self.shared_expert_gate = nn.Linear(d_model, 1, bias=False) if shared_gate else None

    def _fp32_tensors(self) -> list[tuple[nn.Module, str]]:
        out = [(self.router, n) for n in ("weight", "bias") if getattr(self.router, n) is not None]
        if self.e_score_correction_bias is not None:
            out.append((self, "e_score_correction_bias"))
        return out

    def _apply(self, fn, recurse=True):
        if not self.router_fp32:
            return super()._apply(fn, recurse)
        kept = [(m, n, getattr(m, n).data) for m, n in self._fp32_tensors()]
        super()._apply(fn, recurse)
        for m, n, old in kept:  # the new device, the old float32 values
            new = getattr(m, n)
            if new.dtype != torch.float32:
                new.data = old.to(device=new.device, dtype=torch.float32)
        return self

    # ------------------------------------------------------------------------------ routing
    def route(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """``(index (N, k) int64, weight (N, k) float32)`` of the tokens ``x`` ``(N, D)``."""
        if self.routing == "sigmoid":
            b = self.router.bias
            logits = F.linear(x.float(), self.router.weight.float(),
                              None if b is None else b.float())
        elif self.router.weight.dtype != x.dtype:  # a float32 router (router_fp32)
            logits = self.router(x.to(self.router.weight.dtype)).float()
        else:
            logits = self.router(x).float()
        k = self.top_k
        if self.routing == "softmax_topk":
            w, idx = torch.softmax(logits, dim=-1).topk(k, dim=-1)
            if self.norm_topk_prob:
                w = w / w.sum(dim=-1, keepdim=True)
        elif self.routing == "topk_softmax":
            top, idx = logits.topk(k, dim=-1)
            w = torch.softmax(top, dim=-1)
        else:
            s = torch.sigmoid(logits)
            choice = s + self.e_score_correction_bias.float()
            if self.n_group > 1:
                g = choice.view(-1, self.n_group, self.n_experts // self.n_group)
                group_score = g.topk(2, dim=-1).values.sum(dim=-1)
                keep = torch.zeros_like(group_score, dtype=torch.bool)
                keep.scatter_(1, group_score.topk(self.topk_group, dim=-1).indices, True)
                choice = g.masked_fill(~keep.unsqueeze(-1), float("-inf")).flatten(1)
            idx = choice.topk(k, dim=-1).indices
            w = s.gather(1, idx)
            if self.norm_topk_prob:
                w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        if self.routed_scaling_factor != 1.0:
            w = w * self.routed_scaling_factor
        return idx, w

    # ------------------------------------------------------------------------------ forward
    def _shared(self, x: Tensor) -> Tensor | None:
        if self.shared_expert is None:
            return None
        y = self.shared_expert(x)
        if self.shared_expert_gate is not None:
            y = torch.sigmoid(self.shared_expert_gate(x)) * y
        return y

    def _finish(self, x: Tensor, routed: Tensor, shape: torch.Size) -> Tensor:
        if self.fc2_latent_proj is not None:
            routed = self.fc2_latent_proj(routed)
        shared = self._shared(x)
        if shared is not None:
            routed = routed + shared
        return routed.view(shape)

    def _grouped_runs(self, dtype: torch.dtype, device: torch.device) -> bool:
        # F.grouped_mm: bfloat16 on CUDA (SM 80+), rows of 16-byte multiples
        w = self.experts.w_in
        return (device.type == "cuda" and dtype == torch.bfloat16 and w.dtype == torch.bfloat16
                and hasattr(F, "grouped_mm") and self.experts.down_proj.shape[1] % 8 == 0
                and self.experts.intermediate % 8 == 0
                and torch.cuda.get_device_capability(device) >= (8, 0))

    def _impl(self, h: Tensor) -> str:
        if self.impl != "auto":
            return self.impl
        if self._grouped_runs(h.dtype, h.device):
            return "grouped"
        if h.is_cuda and h.shape[0] * self.top_k <= self.n_experts:
            return "gathered"
        if h.is_cpu and self.act_code is not None:
            return "cpu"
        return "loop"

    def max_sync_free_tokens(self, dtype: torch.dtype, device: torch.device) -> int | None:
        """The most tokens one call takes without a host sync (what a CUDA graph of the decode
        step can hold): no bound (None) where the grouped path runs or a sync-free one is
        forced, else the gathered path's ``n_experts // top_k`` on CUDA (0 elsewhere: the loop
        syncs)."""
        if self.impl in ("loop", "cpu"):
            return 0
        if self.impl != "auto" or self._grouped_runs(dtype, device):
            return None
        return self.n_experts // self.top_k if device.type == "cuda" else 0

    def _sorted(self, idx: Tensor) -> tuple[Tensor, Tensor]:
        """The (token, expert) pairs in expert order: ``(order, token of each pair)``."""
        order = torch.argsort(idx.reshape(-1), stable=True)
        return order, order // idx.shape[1]

    def _cpu_experts(self, h: Tensor, idx: Tensor, w: Tensor) -> Tensor | None:
        """Every routed expert in one C++ call (``kernels.cpu.moe_experts``) where it applies:
        inference on float32 CPU rows with the experts' int8 / bfloat16 copies, or with float32
        experts held as such, an activation the call has; None elsewhere (the loop runs)."""
        ex = self.experts
        if self.act_code is None or not h.is_cpu:
            return None
        compact = ex.compact(h)
        if compact is not None:
            return cpu_ops.moe_experts(h, idx, w.float(), compact.w_in_data, compact.w_in_scales,
                                       compact.down_data, compact.down_scales, ex.gated,
                                       self.act_code)
        w_in, down = ex.w_in, ex.down_proj
        if (not cpu_ops.enabled() or h.dtype != torch.float32 or torch.is_grad_enabled()
                or isinstance(w_in, CompactWeight) or isinstance(down, CompactWeight)
                or w_in.dtype != torch.float32 or down.dtype != torch.float32):
            return None
        return cpu_ops.moe_experts(h, idx, w.float(), w_in.detach(), None, down.detach(), None,
                                   ex.gated, self.act_code)

    def _experts_loop(self, hs: Tensor, idx: Tensor) -> Tensor:
        """One matmul pair per expert with tokens, over exactly its rows of ``hs`` (one host
        sync: the counts)."""
        counts = torch.bincount(idx.reshape(-1), minlength=self.n_experts).tolist()
        ys = torch.empty(hs.shape, dtype=hs.dtype, device=hs.device)
        compact = self.experts.compact(hs)
        start = 0
        for e, c in enumerate(counts):
            if c:
                ys[start:start + c] = self.experts.one(e, hs[start:start + c], self.act, compact)
                start += c
        return ys

    def _experts_grouped(self, hs: Tensor, idx: Tensor) -> Tensor:
        """The same with ``F.grouped_mm`` over the expert offsets: no host sync."""
        flat = idx.reshape(-1)
        counts = torch.zeros(self.n_experts, dtype=torch.int32, device=hs.device)
        counts.index_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
        offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
        ex = self.experts
        grouped = getattr(F, "grouped_mm", None) or torch._grouped_mm
        h = grouped(hs, ex.w_in.transpose(-2, -1), offs=offs)
        if ex.gated:
            g, u = h.split(ex.intermediate, dim=-1)
            h = self.act(g) * u
        else:
            h = self.act(h)
        return grouped(h, ex.down_proj.transpose(-2, -1), offs=offs)

    def _experts_gathered(self, hs: Tensor, idx: Tensor, order: Tensor) -> Tensor:
        """The same with each pair's expert weights gathered by index: no host sync."""
        ex = self.experts
        e = idx.reshape(-1).index_select(0, order)  # each pair's expert, in pair order
        h = torch.bmm(ex.w_in.index_select(0, e), hs[:, :, None])[..., 0]
        if ex.gated:
            g, u = h.split(ex.intermediate, dim=-1)
            h = self.act(g) * u
        else:
            h = self.act(h)
        return torch.bmm(ex.down_proj.index_select(0, e), h[:, :, None])[..., 0]

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        idx, w = self.route(x)
        h = x if self.fc1_latent_proj is None else self.fc1_latent_proj(x)
        impl = self._impl(h)
        if impl == "cpu":
            out = self._cpu_experts(h, idx, w)
            if out is not None:
                return self._finish(x, out.to(h.dtype), shape)
        order, tok = self._sorted(idx)
        hs = h.index_select(0, tok)
        if impl == "grouped":
            ys = self._experts_grouped(hs, idx)
        elif impl == "gathered":
            ys = self._experts_gathered(hs, idx, order)
        else:
            ys = self._experts_loop(hs, idx)
        out = torch.zeros(h.shape, dtype=torch.float32, device=h.device)
        out.index_add_(0, tok, ys.float() * w.reshape(-1)[order, None])
        return self._finish(x, out.to(h.dtype), shape)

    def forward_naive(self, x: Tensor) -> Tensor:
        return naive_moe(self, x)


def naive_moe(moe: SparseMoE, x: Tensor) -> Tensor:
    """``moe(x)`` written out: for each token, for each of its chosen experts, the expert on
    that token alone, weighted and summed (the reference of the fast path)."""
    shape = x.shape
    x = x.reshape(-1, shape[-1])
    idx, w = moe.route(x)
    h = x if moe.fc1_latent_proj is None else moe.fc1_latent_proj(x)
    rows = []
    for t in range(x.shape[0]):
        acc = torch.zeros(h.shape[-1], dtype=torch.float32, device=x.device)
        for j in range(moe.top_k):
            e = int(idx[t, j])
            acc = acc + w[t, j] * moe.experts.one(e, h[t:t + 1], moe.act)[0].float()
        rows.append(acc)
    out = torch.stack(rows) if rows else h.new_zeros(0, h.shape[-1], dtype=torch.float32)
    return moe._finish(x, out.to(h.dtype), shape)
