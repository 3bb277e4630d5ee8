"""Shared pieces of the recall experiments (``mqar.py``, ``niah.py``, ``ablations.py`` ...).

* **Tasks**, generated on the fly from a ``torch.Generator`` (same seed → same tokens):

  - ``mqar_batch``: Multi-Query Associative Recall in Zoology's formulation (Arora et al. 2024,
    ``zoology/data/associative_recall.py::multiquery_ar``): ``num_pairs`` key–value pairs, keys
    drawn without replacement from the lower half of the vocabulary (1 .. V/2 − 1), values from
    the upper half (V/2 .. V − 1); then the queries: every key once more, at gaps drawn without
    replacement from a power law (p(g) ∝ g^(a − 1), a = 0.01) over the rest of the sequence, the
    other positions random tokens. The target at a query is its value; every other target is
    ``IGNORE`` (the loss and the accuracy see only the answers).
  - ``passkey_batch``: S-NIAH-1 (passkey retrieval) at the token level: a haystack of a repeated
    filler "sentence", a needle ``[NEEDLE] d1 … dn [END]`` at a chosen depth, and at the end
    ``[QUERY] d1 … dn``; the targets are the n passkey digits after ``[QUERY]`` (teacher forced:
    all n right ⇔ greedy decoding returns the passkey).

* **Models**: ``build_model`` gives either mcserve's own ``MCForCausalLM`` (any memory family and
  MC variant, trained through its parallel forward) or ``TinyTransformer``, a causal softmax
  attention baseline of the same depth and width (torch SDPA, RoPE, the same SwiGLU MLP, RMSNorm
  and tied embeddings).

* **Training/eval**: ``train_run(spec)`` trains one model from a plain-dict spec (AdamW, linear
  warm-up + cosine decay, gradient clipping, float32, one torch thread) and evaluates it on fixed
  evaluation sets along the way; ``run_many`` runs specs in 1..N worker processes and appends each
  result to a JSONL file as it finishes (``--resume`` skips finished runs).
"""

from __future__ import annotations

import json
import math
import multiprocessing as mp
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
RESULTS_DIR = HERE / "results"
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(ROOT / "bench"))  # bench/common.py: environment info, tables, JSON

import common as _bench_common  # noqa: E402
from common import env_info, env_line, print_table  # noqa: E402, F401 (re-exported)

from mcserve.config import ModelConfig  # noqa: E402
from mcserve.models.layers import RMSNorm, SwiGLU  # noqa: E402
from mcserve.models.native import MCForCausalLM  # noqa: E402

IGNORE = -100


def results_path(name: str | os.PathLike) -> Path:
    """Where :func:`write_json` writes ``name``: ``experiments/recall/results/<name>`` for a bare
    file name, ``name`` itself for a path. Writes nothing."""
    p = Path(name)
    return RESULTS_DIR / p if p.parent == Path(".") else p


def write_json(data: Any, name: str | os.PathLike, *, extra: str | os.PathLike | None = None
               ) -> list[Path]:
    """Write ``data`` as JSON to :func:`results_path` ``(name)`` (and ``extra`` if given)."""
    return _bench_common.write_json(data, results_path(name),
                                    extra=None if extra is None else results_path(extra))

# --------------------------------------------------------------------------- MQAR


def mqar_batch(batch: int, seq_len: int, num_pairs: int, vocab: int, gen: torch.Generator,
               power_a: float = 0.01, random_non_queries: bool = True) -> tuple[Tensor, Tensor]:
    """One MQAR batch: ``inputs`` and ``targets``, both ``(batch, seq_len)`` long.

    Layout (Zoology): ``k1 v1 k2 v2 … kP vP`` then the query region, where key ``k_i`` sits at
    offset ``2·g_i`` (g_i the power-law gap) and the target at that position is ``v_i``.
    """
    half = vocab // 2
    context = 2 * num_pairs
    space = (seq_len - context) // 2
    if num_pairs < 1 or num_pairs > half - 1:
        raise ValueError(f"num_pairs must be in 1..{half - 1} for vocab {vocab}, got {num_pairs}")
    if space < num_pairs:
        raise ValueError(f"seq_len {seq_len} too short for {num_pairs} pairs (needs ≥ 4·pairs)")
    keys = torch.rand(batch, half - 1, generator=gen).argsort(1)[:, :num_pairs] + 1
    values = torch.rand(batch, vocab - half, generator=gen).argsort(1)[:, :num_pairs] + half
    kvs = torch.empty(batch, context, dtype=torch.long)
    kvs[:, 0::2] = keys
    kvs[:, 1::2] = values
    g = torch.arange(1, space + 1, dtype=torch.float64)
    p = power_a * g ** (power_a - 1)
    gaps = torch.multinomial((p / p.sum()).expand(batch, space), num_pairs, replacement=False,
                             generator=gen)
    queries = torch.zeros(batch, seq_len - context + 1, dtype=torch.long)
    queries.scatter_(1, 2 * gaps, keys)
    examples = torch.cat([kvs, queries], 1)  # (batch, seq_len + 1)
    labels = torch.full((batch, seq_len + 1), IGNORE, dtype=torch.long)
    labels.scatter_(1, 2 * gaps + context + 1, values)
    inputs, targets = examples[:, :-1].clone(), labels[:, 1:].clone()
    if random_non_queries:
        noise = torch.randint(vocab, inputs.shape, generator=gen)
        inputs = torch.where(inputs == 0, noise, inputs)
    return inputs, targets


# --------------------------------------------------------------------------- passkey (S-NIAH-1)

# token ids of the passkey task (vocabulary 256, like the MQAR models)
PK_NEEDLE, PK_END, PK_QUERY = 1, 2, 3
PK_DIGIT0 = 16  # digits are 16..25
PK_FILLER0, PK_FILLER_N = 32, 64  # filler vocabulary 32..95
PK_SENTENCE = 12  # length of the repeated filler "sentence"


def passkey_batch(batch: int, seq_len: int, gen: torch.Generator, n_digits: int = 5,
                  depth: float | None = None) -> tuple[Tensor, Tensor]:
    """One passkey batch ``(inputs, targets)`` of ``(batch, seq_len)``.

    The haystack repeats one filler sentence (drawn once per batch from ``gen``, as the paper's
    "The grass is green…" repeats one sentence), starting at a random phase per row. The needle
    sits at ``depth`` ∈ [0, 1] of the haystack (uniformly random per row when None). Targets are
    the ``n_digits`` digits after ``[QUERY]``; everything else is ``IGNORE``.
    """
    needle_len = n_digits + 2
    tail = 1 + n_digits  # [QUERY] d1..dn, the last digit is only a target
    hay = seq_len + 1 - needle_len - tail  # filler tokens in the (seq_len + 1)-token example
    if hay < 1:
        raise ValueError(f"seq_len {seq_len} too short for a {n_digits}-digit passkey")
    sentence = torch.randint(PK_FILLER0, PK_FILLER0 + PK_FILLER_N, (PK_SENTENCE,), generator=gen)
    phase = torch.randint(PK_SENTENCE, (batch, 1), generator=gen)
    filler = sentence[(phase + torch.arange(hay)[None]) % PK_SENTENCE]  # (batch, hay)
    digits = torch.randint(10, (batch, n_digits), generator=gen) + PK_DIGIT0
    if depth is None:
        at = torch.randint(hay + 1, (batch,), generator=gen)
    else:
        at = torch.full((batch,), round(depth * hay), dtype=torch.long)
    ex = torch.empty(batch, seq_len + 1, dtype=torch.long)
    labels = torch.full((batch, seq_len + 1), IGNORE, dtype=torch.long)
    needle = torch.cat([torch.full((batch, 1), PK_NEEDLE), digits, torch.full((batch, 1), PK_END)],
                       1)
    for b in range(batch):
        a = int(at[b])
        ex[b, :a] = filler[b, :a]
        ex[b, a:a + needle_len] = needle[b]
        ex[b, a + needle_len:a + needle_len + hay - a] = filler[b, a:]
    ex[:, -tail:] = torch.cat([torch.full((batch, 1), PK_QUERY), digits], 1)
    labels[:, -n_digits:] = digits
    return ex[:, :-1].clone(), labels[:, 1:].clone()


# --------------------------------------------------------------------------- models


class _RoPE(nn.Module):
    def __init__(self, head_dim: int, base: float = 10000.0):
        super().__init__()
        inv = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, x: Tensor) -> Tensor:  # x (B, H, T, D)
        T = x.shape[2]
        ang = torch.arange(T, dtype=torch.float32, device=x.device)[:, None] * self.inv_freq
        cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
        x1, x2 = x[..., 0::2], x[..., 1::2]
        out = torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1)
        return out.flatten(-2)


class _AttnBlock(nn.Module):
    def __init__(self, d_model: int, n_heads: int, head_dim: int, mlp_hidden: int, eps: float,
                 conv_size: int):
        super().__init__()
        self.H, self.K = n_heads, head_dim
        self.norm1 = RMSNorm(d_model, eps)
        self.qkv = nn.Linear(d_model, 3 * n_heads * head_dim, bias=False)
        # the same short causal depthwise conv (+ SiLU) on q, k, v as MCMixer (0 disables it)
        self.conv = (nn.Parameter(torch.randn(3 * n_heads * head_dim, conv_size) / conv_size)
                     if conv_size > 0 else None)
        self.o_proj = nn.Linear(n_heads * head_dim, d_model, bias=False)
        self.norm2 = RMSNorm(d_model, eps)
        self.mlp = SwiGLU(d_model, mlp_hidden)
        self.rope = _RoPE(head_dim)

    def forward(self, x: Tensor) -> Tensor:
        B, T, _ = x.shape
        qkv = self.qkv(self.norm1(x))
        if self.conv is not None:
            w = self.conv.shape[1]
            full = F.pad(qkv, (0, 0, w - 1, 0))
            out = full[:, :T] * self.conv[:, 0]
            for j in range(1, w):
                out = out + full[:, j:j + T] * self.conv[:, j]
            qkv = F.silu(out)
        q, k, v = qkv.view(B, T, 3, self.H, self.K).permute(2, 0, 3, 1, 4)
        q, k = self.rope(q), self.rope(k)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o_proj(y.transpose(1, 2).reshape(B, T, self.H * self.K))
        return x + self.mlp(self.norm2(x))


class TinyTransformer(nn.Module):
    """Causal softmax-attention LM of the same depth/width as an ``MCForCausalLM`` config.

    Same embedding, RMSNorms, SwiGLU MLP, tied LM head and (with ``cfg.conv_size`` > 0) the same
    short causal conv on q, k, v as ``MCMixer``; the token mixer is causal softmax attention
    (torch SDPA) with RoPE instead of a recurrent memory, and no output gate.
    ``forward(ids, state=None) -> (logits, None)`` so that it drops into the same loops.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(
            _AttnBlock(cfg.d_model, cfg.n_heads, cfg.head_dim, cfg.mlp_hidden, cfg.norm_eps,
                       cfg.conv_size)
            for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        std = 0.02
        for name, p in self.named_parameters():
            if p.dim() >= 2 and "conv" not in name:
                nn.init.normal_(p, std=std)
        for blk in self.layers:
            nn.init.normal_(blk.o_proj.weight, std=std / math.sqrt(2 * cfg.n_layers))
            nn.init.normal_(blk.mlp.down.weight, std=std / math.sqrt(2 * cfg.n_layers))
        self.lm_head.weight = self.embed.weight

    def forward(self, input_ids: Tensor, state: Any = None) -> tuple[Tensor, None]:
        x = self.embed(input_ids)
        for blk in self.layers:
            x = blk(x)
        return self.lm_head(self.norm(x)), None


def model_config(d_model: int = 64, memory: str = "linear", variant: str = "none",
                 vocab: int = 256, head_dim: int = 32, **mc: Any) -> ModelConfig:
    """The benchmark's 2-layer config: heads of width ``head_dim`` (default 32: d_model 64 → 2
    heads, 128 → 4; 16 gives d_model 64 four heads of 16, a quarter of the state)."""
    n_heads = max(1, d_model // head_dim)
    mc = dict(mc)
    if memory in ("dla", "titans"):
        seg = mc.get("segment_len", 32)
        mc.setdefault("inner_chunk", min(16, seg))
    return ModelConfig(vocab_size=vocab, d_model=d_model, n_layers=2, n_heads=n_heads,
                       head_dim=head_dim, memory=memory, mc_variant=variant, **mc)


def build_model(spec: dict[str, Any]) -> nn.Module:
    """``spec["family"]`` is a memory family or ``"attention"``; ``spec["mc"]`` extra config."""
    family = spec["family"]
    mc = dict(spec.get("mc", {}))
    if family == "attention":
        cfg = model_config(spec["d_model"], "linear", "none", spec.get("vocab", 256),
                           spec.get("head_dim", 32), conv_size=mc.get("conv_size", 4))
        return TinyTransformer(cfg)
    cfg = model_config(spec["d_model"], family, spec["variant"], spec.get("vocab", 256),
                       spec.get("head_dim", 32), **mc)
    model = MCForCausalLM(cfg)
    hook = spec.get("hook")
    if hook:  # "module:function" applied to the fresh model (ablations)
        mod, fn = hook.split(":")
        getattr(__import__(mod), fn)(model)
    return model


def state_floats(model: nn.Module, seq_len: int) -> int | None:
    """Floats of memory the last tokens of a ``seq_len`` sequence read (all layers; online +
    cached; for ``loglinear`` the most any position up to ``seq_len`` reads); for attention its
    KV cache, 2·T·H·K per layer."""
    cfg = model.config
    if isinstance(model, TinyTransformer):
        return 2 * seq_len * cfg.n_heads * cfg.head_dim * cfg.n_layers
    K = cfg.head_dim
    per = K * K if cfg.memory in ("linear", "swla") else 2 * K * cfg.memory_expansion * K
    per *= cfg.n_heads
    v = cfg.mc_variant
    if v == "none":
        n = 1
    elif v == "loglinear":  # the most segments any position up to seq_len has
        n = max(bin(t).count("1") for t in range(1, seq_len + 1))
    else:
        n = -(-seq_len // cfg.segment_len)
    return per * n * cfg.n_layers


# --------------------------------------------------------------------------- training


def masked_ce(logits: Tensor, targets: Tensor) -> Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE)


@torch.no_grad()
def answer_accuracy(model: nn.Module, inputs: Tensor, targets: Tensor, batch: int = 128
                    ) -> tuple[int, int, int, int]:
    """(correct answers, answers, fully correct examples, examples) by argmax (on the model's
    device; the sets may live on the CPU)."""
    model.eval()
    dev = next(model.parameters()).device
    hit = tot = ex_hit = 0
    for i in range(0, inputs.shape[0], batch):
        x, y = inputs[i:i + batch].to(dev), targets[i:i + batch].to(dev)
        logits, _ = model(x)
        mask = y != IGNORE
        ok = (logits.argmax(-1) == y) & mask
        hit += int(ok.sum())
        tot += int(mask.sum())
        ex_hit += int((ok.sum(1) == mask.sum(1)).sum())
    model.train()
    return hit, tot, ex_hit, inputs.shape[0]


def lr_at(step: int, steps: int, lr: float, warmup: int) -> float:
    if step < warmup:
        return lr * (step + 1) / warmup
    prog = (step - warmup) / max(1, steps - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, prog))))


def make_optimizer(model: nn.Module, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (decay if p.dim() >= 2 and "embed" not in name and "init" not in name
         else no_decay).append(p)
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.98), eps=1e-8)


def train_loop(model: nn.Module, sample: Callable[[int, torch.Generator], tuple[Tensor, Tensor]],
               evaluate: Callable[[nn.Module, bool], dict[str, Any]], *, steps: int, lr: float,
               seed: int, warmup: int | None = None, weight_decay: float = 0.1,
               eval_at: list[int] | tuple[int, ...] = (), max_seconds: float | None = None,
               log: Callable[[str], None] = print, log_every: int = 50,
               device: str | torch.device = "cpu") -> dict[str, Any]:
    """Train ``model`` for ``steps`` steps on ``sample(step, gen)``; ``evaluate(model, final)``.

    ``sample`` draws on the CPU from the seeded generator (the same tokens on every device);
    the batch is then moved to ``device``, where ``model`` must already be.
    Returns losses, evaluations at ``eval_at`` steps and at the end, timing, and whether the
    ``max_seconds`` safety limit cut the run short.
    """
    gen = torch.Generator().manual_seed(seed)
    opt = make_optimizer(model, lr, weight_decay)
    warmup = warmup if warmup is not None else max(1, steps // 10)
    losses: list[float] = []
    curve: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    train_s = 0.0
    truncated = False
    step = 0
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else None
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, lr, warmup)
        ts = time.perf_counter()
        x, y = sample(step, gen)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        logits, _ = model(x)
        loss = masked_ce(logits, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if sync is not None:
            sync()
        train_s += time.perf_counter() - ts
        losses.append(float(loss.detach()))
        if not math.isfinite(losses[-1]):
            log(f"  step {step + 1}: loss is {losses[-1]}, stopping")
            break
        if (step + 1) % log_every == 0:
            avg = sum(losses[-log_every:]) / log_every
            log(f"  step {step + 1}/{steps} loss {avg:.3f} ({train_s / (step + 1):.2f} s/step)")
        if step + 1 in eval_at and step + 1 < steps:
            curve.append({"step": step + 1, **evaluate(model, False)})
        if max_seconds is not None and time.perf_counter() - t0 > max_seconds:
            truncated = step + 1 < steps
            if truncated:
                log(f"  time limit: stopping after {step + 1} of {steps} steps")
            break
    final = evaluate(model, True)
    return {
        "steps_done": step + 1, "truncated": truncated, "final_loss": (
            sum(losses[-20:]) / max(1, len(losses[-20:])) if losses else None),
        "loss_every_10": [round(sum(losses[i:i + 10]) / len(losses[i:i + 10]), 4)
                          for i in range(0, len(losses), 10)],
        "curve": curve, "eval": final, "train_s": round(train_s, 1),
        "s_per_step": round(train_s / max(1, len(losses)), 3),
        "total_s": round(time.perf_counter() - t0, 1),
    }


# --------------------------------------------------------------------------- run many specs


def spec_key(spec: dict[str, Any]) -> str:
    return spec["name"]


def load_done(jsonl: Path) -> dict[str, dict[str, Any]]:
    done = {}
    if jsonl.exists():
        for line in jsonl.read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                if "error" not in r:
                    done[r["spec"]["name"]] = r
    return done


def _worker(args: tuple[Callable, dict[str, Any], str, int]) -> dict[str, Any]:
    fn, spec, jsonl, threads = args
    torch.set_num_threads(threads)
    try:
        res = fn(spec)
    except Exception as e:  # record and go on: one broken run must not lose the others
        res = {"spec": spec, "error": f"{type(e).__name__}: {e}",
               "traceback": traceback.format_exc()}
    with open(jsonl, "a", encoding="utf-8") as f:
        f.write(json.dumps(res) + "\n")
    return res


def run_many(fn: Callable[[dict[str, Any]], dict[str, Any]], specs: list[dict[str, Any]],
             jsonl: str | os.PathLike, *, jobs: int = 1, threads: int = 1, resume: bool = False,
             start_method: str = "fork") -> list[dict[str, Any]]:
    """Run ``fn(spec)`` for every spec (``jobs`` processes, ``threads`` torch threads each);
    each result is appended to ``jsonl`` when it finishes. With ``resume`` the specs already in
    ``jsonl`` are not run again; without it they are run again and the newest line of a name
    wins. Lines of other specs are kept either way, so several invocations can share one file.
    Returns the results in spec order. Use ``start_method`` "spawn" for CUDA runs (a forked
    child cannot use CUDA once the parent has)."""
    jsonl = Path(jsonl)
    jsonl.parent.mkdir(parents=True, exist_ok=True)
    done = load_done(jsonl) if resume else {}
    todo = [s for s in specs if spec_key(s) not in done]
    args = [(fn, s, str(jsonl), threads) for s in todo]
    if jobs <= 1 or len(todo) <= 1:
        for a in args:
            _worker(a)
    else:
        ctx = mp.get_context(start_method)
        with ctx.Pool(jobs, maxtasksperchild=1) as pool:
            for _ in pool.imap_unordered(_worker, args):
                pass
    allres = {}
    for line in jsonl.read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            allres[r["spec"]["name"]] = r
    return [allres[spec_key(s)] for s in specs if spec_key(s) in allres]


def set_seed(seed: int) -> None:
    torch.manual_seed(seed)
