"""Sampling parameters and the batched sampler (vLLM-compatible names and semantics).

``SamplingParams`` holds one request's decoding settings and validates them; it lives in the
torch-free ``mcserve.engine.sampling_params`` (the HTTP server imports it from there) and is
re-exported here. ``Sampler`` turns a batch of next-token logits into tokens, one
``SamplingParams`` and one ``torch.Generator`` per row. The processing (penalties, temperature,
top-k, top-p, min-p) is vectorised over the batch; only the final multinomial draw loops over
the seeded rows, so that a seeded request draws the same tokens whatever else is in the batch.

Logprob convention (as vLLM): every reported logprob is taken from the *raw* model distribution,
``log_softmax`` of the unprocessed logits, whatever penalties, temperature or truncation chose the
token. Under a constraint (structured outputs) the raw logits are those after the allowed-token
mask, as in vLLM, where the grammar bitmask is applied before the sampler: the logprobs of the
masked distribution. See docs/engine-sampling.md.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mcserve.engine.outputs import Logprob
from mcserve.engine.sampling_params import MAX_LOGPROBS, SamplingParams, _is_int
from mcserve.kernels import cpu as cpu_ops

__all__ = [
    "MAX_LOGPROBS",
    "Sampler",
    "SamplerOutput",
    "SamplingParams",
    "apply_token_bitmask",
    "make_generator",
    "prompt_logprobs",
]

_GOLDEN = 0x9E3779B97F4A7C15  # spreads the seeds of a request's n completions apart


def make_generator(
    seed: int | None, device: torch.device | str = "cpu", index: int = 0
) -> torch.Generator | None:
    """A generator for completion ``index`` of a request with ``seed`` (None: no seed -> None).

    Completion 0 uses ``seed`` itself; the others get seeds spread from it, so a request's ``n``
    completions differ from one another but each reproduces.
    """
    if seed is None:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed((seed + index * _GOLDEN) % 2**64)
    return gen


# --- sampler -------------------------------------------------------------------------------------


@dataclass
class SamplerOutput:
    """One sampled token per batch row."""

    token_ids: list[int]
    # log-prob of the sampled token under the raw model distribution (log_softmax of the logits)
    logprobs: list[float]
    # rows whose params.logprobs is not None: {token_id: Logprob} (raw logprob and rank, no
    # text: the engine decodes it), the top ``logprobs`` alternatives in decreasing order, then
    # the sampled token if it is not among them
    top_logprobs: list[dict[int, Logprob] | None]


def _row_tensor(values: Sequence[float], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=device)


class Sampler:
    """Batched next-token sampling. Stateless; one instance can serve every step.

    Processing order per row: repetition, frequency and presence penalties (from the row's
    generated tokens) -> greedy rows (temperature 0 or top_k = 1) take the argmax ->
    temperature -> top-k -> top-p -> min-p -> a multinomial draw with the row's generator (the
    global torch generator when it is None). Generators must live on the logits' device.
    """

    def __call__(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        output_token_ids: Sequence[Sequence[int]],
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
        token_bitmask: tuple[Sequence[int], torch.Tensor] | None = None,
    ) -> SamplerOutput:
        """Sample one token per row of ``logits`` (B, V).

        ``prompt_token_ids`` is optional: when given, the repetition penalty also covers the
        prompt's tokens (as vLLM's does); presence and frequency penalties only ever count the
        generated tokens.

        ``token_bitmask``: ``(rows, bitmask)`` for the constrained rows of the batch: row
        ``rows[j]`` may only take the tokens whose bit is set in ``bitmask[j]`` (int32
        ``(len(rows), ceil(V / 32))``, llguidance's layout); see ``apply_token_bitmask``.
        The logprobs of those rows are those of the masked distribution.
        """
        if logits.dim() != 2:
            raise ValueError(f"logits must be (batch, vocab), got shape {tuple(logits.shape)}")
        b, v = logits.shape
        for name, seq in (("params", params), ("generators", generators),
                          ("output_token_ids", output_token_ids)):
            if len(seq) != b:
                raise ValueError(f"{name} has {len(seq)} entries for a batch of {b}")
        if prompt_token_ids is not None and len(prompt_token_ids) != b:
            raise ValueError(f"prompt_token_ids has {len(prompt_token_ids)} entries "
                             f"for a batch of {b}")
        device = logits.device
        logits = logits.float()
        if token_bitmask is not None and len(token_bitmask[0]):
            logits = apply_token_bitmask(logits, *token_bitmask)
        raw_logprobs = torch.log_softmax(logits, dim=-1)

        x = _apply_penalties(logits, params, output_token_ids, prompt_token_ids)

        sampled = torch.empty(b, dtype=torch.long, device=device)
        # top_k = 1 is greedy by definition: take the argmax (same tie-breaking, no draw)
        greedy_rows = [i for i, p in enumerate(params) if p.greedy or p.top_k == 1]
        random_rows = [i for i, p in enumerate(params) if not (p.greedy or p.top_k == 1)]
        if greedy_rows:
            if len(greedy_rows) == b:
                sampled = x.argmax(dim=-1)
            else:
                g = torch.tensor(greedy_rows, device=device)
                sampled[g] = x[g].argmax(dim=-1)
        if random_rows:
            r = torch.tensor(random_rows, device=device)
            rp = [params[i] for i in random_rows]
            y = x if len(random_rows) == b else x[r]
            y = y / _row_tensor([p.temperature for p in rp], device, y.dtype)[:, None]
            y = _apply_top_k_top_p(y, [p.top_k for p in rp], [p.top_p for p in rp])
            y = _apply_min_p(y, [p.min_p for p in rp])
            probs = torch.softmax(y, dim=-1)
            drawn = _draw(probs, [generators[i] for i in random_rows])
            if len(random_rows) == b:
                sampled = drawn
            else:
                sampled[r] = drawn

        token_logprobs = raw_logprobs.gather(1, sampled[:, None]).squeeze(1)

        token_list = sampled.tolist()
        logprob_list = token_logprobs.tolist()
        top: list[dict[int, Logprob] | None] = [None] * b
        want = [i for i, p in enumerate(params) if p.logprobs is not None]
        if want:  # only the rows that asked: ranks cost a pass over their vocabulary
            w = torch.tensor(want, device=device)
            entries = _logprob_entries(raw_logprobs[w], sampled[w], token_logprobs[w],
                                       [params[i].logprobs for i in want])
            for i, entry in zip(want, entries, strict=True):
                top[i] = entry
        return SamplerOutput(token_ids=token_list, logprobs=logprob_list, top_logprobs=top)

    @staticmethod
    def prompt_logprobs(
        logits: torch.Tensor, token_ids: torch.Tensor | Sequence[int], n: int
    ) -> list[dict[int, Logprob] | None]:
        """See :func:`prompt_logprobs`."""
        return prompt_logprobs(logits, token_ids, n)


def apply_token_bitmask(
    logits: torch.Tensor, rows: Sequence[int], bitmask: torch.Tensor
) -> torch.Tensor:
    """``logits`` (B, V) with the tokens that ``bitmask`` does not allow set to -inf in
    ``rows`` (a new tensor; the input is not modified). ``bitmask[j]`` holds the allowed tokens
    of row ``rows[j]``: bit ``t % 32`` of int32 word ``t // 32`` (llguidance's layout); tokens
    past the bitmask's ``32 * words`` are not allowed. On the CPU one pass over the words
    (``kernels.cpu.mask_logits_``, in place on a copy); elsewhere unpacked for all rows at once
    by shifts on the device (the int32 words cross to it, not a (R, V) mask)."""
    b, v = logits.shape
    r = len(rows)
    if bitmask.dim() != 2 or bitmask.shape[0] != r or bitmask.dtype != torch.int32:
        raise ValueError(f"bitmask must be int32 ({r}, words), got {tuple(bitmask.shape)} "
                         f"{bitmask.dtype}")
    device = logits.device
    if device.type == "cpu":  # one pass over the words (C++; a torch twin without it)
        idx = torch.tensor(list(rows), dtype=torch.long)
        return cpu_ops.mask_logits_(logits.clone(memory_format=torch.contiguous_format), idx,
                                    bitmask.contiguous())
    shifts = torch.arange(32, dtype=torch.int32, device=device)
    bm = bitmask.to(device, non_blocking=True)
    allowed = ((bm[:, :, None] >> shifts) & 1).view(r, -1).bool()
    if allowed.shape[1] < v:
        allowed = torch.nn.functional.pad(allowed, (0, v - allowed.shape[1]), value=False)
    allowed = allowed[:, :v]
    neg_inf = torch.tensor(-math.inf, dtype=logits.dtype, device=device)
    if r == b and list(rows) == list(range(b)):
        return torch.where(allowed, logits, neg_inf)
    idx = torch.tensor(list(rows), dtype=torch.long, device=device)
    out = logits.clone()
    out[idx] = torch.where(allowed, logits[idx], neg_inf)
    return out


def _logprob_entries(
    logprobs: torch.Tensor, chosen: torch.Tensor, chosen_lp: torch.Tensor, ns: Sequence[int]
) -> list[dict[int, Logprob]]:
    """Per row r of ``logprobs`` (R, V): ``{token_id: Logprob}`` holding the top ``ns[r]``
    alternatives (decreasing), then ``chosen[r]`` (log-prob ``chosen_lp[r]``) if it is not among
    them. A rank is 1 + the number of tokens with a strictly larger log-prob (ties share one):
    an alternative's is counted among the top ``max(ns)`` (every larger token is in there), the
    chosen token's over the whole row."""
    chosen_rank = ((logprobs > chosen_lp[:, None]).sum(-1) + 1).tolist()
    n_max = min(max(ns, default=0), logprobs.shape[1])
    if n_max > 0:
        vals, ids = logprobs.topk(n_max, dim=-1)
        ranks = ((vals[:, None, :] > vals[:, :, None]).sum(-1) + 1).tolist()
        vals_l, ids_l = vals.tolist(), ids.tolist()
    out = []
    for r, (tok, lp) in enumerate(zip(chosen.tolist(), chosen_lp.tolist(), strict=True)):
        n = min(ns[r], n_max)
        entry = {ids_l[r][j]: Logprob(vals_l[r][j], ranks[r][j]) for j in range(n)}
        entry.setdefault(tok, Logprob(lp, chosen_rank[r]))
        out.append(entry)
    return out


def _token_counts(
    rows: Sequence[Sequence[int]], vocab: int, device: torch.device
) -> torch.Tensor:
    """(len(rows), vocab) int64 occurrence counts of each row's token ids (out-of-range ignored)."""
    flat: list[int] = []
    for r, ids in enumerate(rows):
        base = r * vocab
        flat.extend(base + t for t in ids if 0 <= t < vocab)
    idx = torch.tensor(flat, dtype=torch.long, device=device)
    return torch.bincount(idx, minlength=len(rows) * vocab).view(len(rows), vocab)


def _apply_penalties(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    output_token_ids: Sequence[Sequence[int]],
    prompt_token_ids: Sequence[Sequence[int]] | None,
) -> torch.Tensor:
    rows = [
        i for i, p in enumerate(params)
        if p.presence_penalty != 0 or p.frequency_penalty != 0 or p.repetition_penalty != 1
    ]
    if not rows:
        return logits
    device, v = logits.device, logits.shape[1]
    counts = _token_counts([output_token_ids[i] for i in rows], v, device)
    seen = counts > 0
    if prompt_token_ids is not None:
        seen = seen | (_token_counts([prompt_token_ids[i] for i in rows], v, device) > 0)
    ps = [params[i] for i in rows]
    rep = _row_tensor([p.repetition_penalty for p in ps], device, logits.dtype)[:, None]
    freq = _row_tensor([p.frequency_penalty for p in ps], device, logits.dtype)[:, None]
    pres = _row_tensor([p.presence_penalty for p in ps], device, logits.dtype)[:, None]

    r = torch.tensor(rows, device=device)
    y = logits[r]
    y = torch.where(seen, torch.where(y > 0, y / rep, y * rep), y)
    y = y - freq * counts.to(y.dtype) - pres * (counts > 0).to(y.dtype)
    out = logits.clone()
    out[r] = y
    return out


def _apply_top_k_top_p(
    logits: torch.Tensor, top_k: Sequence[int], top_p: Sequence[float]
) -> torch.Tensor:
    """Mask (to -inf) what top-k, then top-p (over the top-k renormalised), drop.

    Only the rows that truncate are touched. When each of them has a top-k, only the largest k
    candidates are ranked (``topk``) instead of sorting the whole vocabulary.
    """
    r, v = logits.shape
    ks = [k if 0 < k < v else v for k in top_k]
    rows = [i for i in range(r) if ks[i] < v or top_p[i] < 1.0]
    if not rows:
        return logits
    device = logits.device
    sub = logits if len(rows) == r else logits[torch.tensor(rows, device=device)]
    k_max = max(ks[i] for i in rows)
    if k_max < v:
        vals, idx = sub.topk(k_max, dim=-1)  # sorted, decreasing
    else:
        vals, idx = sub.sort(dim=-1, descending=True, stable=True)
    if any(ks[i] < k_max for i in rows):
        k = torch.tensor([ks[i] for i in rows], device=device)
        ranks = torch.arange(vals.shape[1], device=device)
        vals = vals.masked_fill(ranks[None, :] >= k[:, None], -math.inf)
    if any(top_p[i] < 1.0 for i in rows):
        p = _row_tensor([top_p[i] for i in rows], device, vals.dtype)[:, None]
        probs = torch.softmax(vals, dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        # the top token always stays, also when top_p underflows to 0 in float32 (1e-300):
        # masking every token would leave nothing to draw from
        not_top = torch.arange(vals.shape[1], device=device)[None, :] > 0
        vals = vals.masked_fill((mass_before >= p) & (p < 1.0) & not_top, -math.inf)
    out = torch.full_like(sub, -math.inf).scatter_(-1, idx, vals)
    if len(rows) == r:
        return out
    full = logits.clone()
    full[torch.tensor(rows, device=device)] = out
    return full


def _apply_min_p(logits: torch.Tensor, min_p: Sequence[float]) -> torch.Tensor:
    if not any(m > 0 for m in min_p):
        return logits
    m = _row_tensor(min_p, logits.device, logits.dtype)[:, None]
    probs = torch.softmax(logits, dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * m
    return logits.masked_fill(probs < threshold, -math.inf)


def _draw(probs: torch.Tensor, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """One multinomial draw per row; seeded rows one by one (batch-independent), others at once."""
    out = torch.empty(probs.shape[0], dtype=torch.long, device=probs.device)
    unseeded = [i for i, g in enumerate(generators) if g is None]
    for i, gen in enumerate(generators):
        if gen is not None:
            out[i] = torch.multinomial(probs[i], 1, generator=gen)[0]
    if unseeded:
        u = torch.tensor(unseeded, device=probs.device)
        out[u] = torch.multinomial(probs[u], 1).squeeze(1)
    return out


# --- prompt logprobs -----------------------------------------------------------------------------


def prompt_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor | Sequence[int], n: int
) -> list[dict[int, Logprob] | None]:
    """Prompt logprobs of a sequence of T tokens, from the raw model distribution.

    ``logits`` is (T, V) (or (T-1, V)): row t is the model's output after reading token t.
    Entry 0 is None (the first token has no context); entry i >= 1 maps the top ``n``
    alternatives at position i (decreasing) and token i itself to their ``Logprob`` (log-prob
    given the tokens before i, from row i-1 of ``logits``, and rank; no text).

    For a prompt processed in chunks, call it per chunk with the previous chunk's last logits row
    and last token prepended, and drop the leading None.
    """
    ids = torch.as_tensor(token_ids, dtype=torch.long, device=logits.device).reshape(-1)
    t = ids.numel()
    if logits.dim() != 2 or logits.shape[0] not in (t, t - 1):
        raise ValueError(f"logits must be ({t} or {t - 1}, vocab) for {t} tokens, "
                         f"got shape {tuple(logits.shape)}")
    if not _is_int(n) or n < 0:
        raise ValueError(f"n must be a non-negative integer, got {n!r}")
    if t == 0:
        return []
    result: list[dict[int, Logprob] | None] = [None]
    if t == 1:
        return result
    lp = torch.log_softmax(logits[: t - 1].float(), dim=-1)
    targets = ids[1:]
    chosen = lp.gather(1, targets[:, None]).squeeze(1)
    result.extend(_logprob_entries(lp, targets, chosen, [n] * (t - 1)))
    return result
