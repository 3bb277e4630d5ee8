"""LLMEngine: requests in, one ``step()`` at a time, RequestOutputs out (not thread-safe).

step = scheduler decides → runner computes (prefill chunks, one ragged decode batch) → sampler
picks tokens → detokenise, check stops → finished sequences return their slot and blocks.
"""

from __future__ import annotations

import itertools
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mcserve.config import EngineConfig, MCConfig, ModelConfig
from mcserve.engine.host_malloc import keep_freed_memory, return_freed_memory
from mcserve.engine.kv_cache import KVCache
from mcserve.engine.outputs import CompletionOutput, Logprob, RequestOutput
from mcserve.engine.prefix_keys import prompt_block_hashes, request_salt
from mcserve.engine.resume import ResumeStore
from mcserve.engine.runner import ModelRunner
from mcserve.engine.sampling import Sampler, SamplingParams, make_generator, prompt_logprobs
from mcserve.engine.sampling_params import StructuredOutputsParams
from mcserve.engine.scheduler import Scheduler
from mcserve.engine.sequence import Sequence
from mcserve.engine.state_cache import PrefixExport, StateCache
from mcserve.engine.structured import BatchMasks, StructuredOutputs
from mcserve.engine.tokenizer import (
    IncrementalDetokenizer,
    Tokenizer,
    find_stop,
    load_tokenizer,
    stop_holdback,
)
from mcserve.errors import InvalidRequestError
from mcserve.models.lowp_linear import load_compact, load_dtype, prepare_cpu_weights
from mcserve.models.native import MCForCausalLM
from mcserve.models.packed_linear import pack_linears
from mcserve.models.registry import is_checkpoint_file, load_model

log = logging.getLogger(__name__)

DEFAULT_MODEL_DIR = Path(__file__).resolve().parent.parent / "assets" / "default_model"


class NonFiniteLogitsError(ArithmeticError):
    """The model's logits for a sequence hold NaN or inf (its state overflowed)."""


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence] = field(default_factory=list)
    error: str | None = None

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.seqs)


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, *, model: MCForCausalLM | None = None,
                 tokenizer: Tokenizer | None = None, model_name: str | None = None):
        self.config = config = config or EngineConfig()
        if model is None:
            path = Path(config.model) if config.model else DEFAULT_MODEL_DIR
            if not (path / "config.json").is_file() and not is_checkpoint_file(path):
                where = "the embedded default model" if not config.model else "MODEL"
                raise ValueError(f"{where}: no checkpoint at {path} (config.json missing)")
            model = load_model(path, dtype=load_dtype(config.dtype, config.device),
                               device=config.device, mc_overrides=config.mc_overrides(),
                               compact=load_compact(config.dtype, config.quantization,
                                                    config.device))
            if tokenizer is None:
                tokenizer = load_tokenizer(path, config.tokenizer)
            model_name = model_name or (path.name if config.model else "mcserve-default")
        model.eval()
        if model.device.type == "cpu":  # int8 / bfloat16 large linears (models/lowp_linear.py)
            if prepare_cpu_weights(model, config.dtype, config.quantization):
                return_freed_memory()  # the float32 weights the compact copies replaced
            keep_freed_memory()  # large temporaries reused warm, not re-faulted (host_malloc.py)
        if config.cpu_packed_weights and model.device.type == "cpu":
            pack_linears(model)
        self.model = model
        self.model_config: ModelConfig = model.config
        self.tokenizer = tokenizer or Tokenizer.byte_level()
        self.model_name = model_name or "mcserve"
        self.mc: MCConfig = self.model_config.mc
        salt = json.dumps(self.model_config.to_dict(), sort_keys=True).encode()
        # staging rows for the host blocks a selecting router picks: every row's picks at once
        # (each head stages into its own slice of a row)
        staging = config.max_num_seqs * self.mc.top_k if self.mc.selects else 0
        self.num_state_blocks = self._pool_size(config, self.mc)
        self.cache = StateCache(model, self.num_state_blocks, config.max_num_seqs,
                                config.enable_prefix_caching, salt=salt,
                                host_blocks=config.host_state_blocks, staging_blocks=staging)
        self.scheduler = Scheduler(
            self.cache, self.mc, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens)
        self.runner = ModelRunner(model, self.cache, self.mc, max_model_len=config.max_model_len)
        self.kv = KVCache.for_model(model, config)  # hybrids' attention layers; else None
        self.scheduler.kv = self.kv
        self.runner.attach_kv(self.kv)
        if not config.enforce_eager and model.device.type == "cuda":
            # one graph per (batch, table width) bucket, before any request: the decode step
            # then replays instead of launching its kernels one by one
            self.runner.capture_decode_graphs()
        self.scheduler.on_release = self.runner.release
        self.scheduler.on_keep = self.runner.keep
        self.resume = self._resume_store(config, salt)
        self.checkpoint_interval = self._checkpoint_interval(config)
        self.scheduler.resume = self.runner.resume = self.resume
        self.scheduler.interval = self.checkpoint_interval
        self.sampler = Sampler()
        self.requests: dict[str, _Request] = {}
        self._arrival = itertools.count()
        # sampling generators live on the logits' device (a CPU one fails a draw on CUDA)
        self._global_gen = torch.Generator(device=model.device).manual_seed(config.seed)
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self._token_text: dict[int, str] = {}  # decoded_token of reported logprobs
        # structured outputs: compiled constraints (llguidance loads on the first one)
        self.structured = StructuredOutputs(self.tokenizer, self.model_config.vocab_size,
                                            device_type=model.device.type)
        self._masks: BatchMasks | None = None  # this step's, filled before the sampler

    def _pool_size(self, config: EngineConfig, mc: MCConfig) -> int:
        """``num_state_blocks``, or when None: every slot at ``max_model_len`` (one block per
        completed segment), capped by the ``state_cache_mib`` budget; zero for variants whose
        checkpoints are not pool blocks (a block of a 130M Mamba2 is 19 MB, so a fixed count
        can exhaust host memory). With prefix caching the blocks get three quarters of the
        budget and the resume points the rest."""
        if config.num_state_blocks is not None:
            return config.num_state_blocks
        if not mc.caches_blocks:
            return 0
        want = config.max_num_seqs * (config.max_model_len // mc.segment_len)
        # with prefix caching, a quarter of the budget is left to the resume points
        share = 3 if config.enable_prefix_caching else 4
        budget = config.state_cache_mib * 2**20 * share // 4 // StateCache.block_bytes(self.model)
        return max(1, min(want, budget))

    def _resume_store(self, config: EngineConfig, salt: bytes) -> ResumeStore | None:
        """The resume points' store: the part of ``state_cache_mib`` the block pool leaves
        (at least a quarter of it), a host tier on a GPU, the disk tier when a directory is
        given. None with prefix caching off."""
        if not config.enable_prefix_caching:
            return None
        total = config.state_cache_mib * 2**20
        pool = self.cache.bytes_per_block * self.num_state_blocks
        layout = [{name: (tuple(t.shape[1:]), t.dtype) for name, t in sl.items()}
                  for sl in self.cache.slot]
        return ResumeStore(
            salt, layout, device=self.model.device, budget_bytes=max(total - pool, total // 4),
            host_bytes=(config.host_state_cache_mib * 2**20
                        if self.model.device.type != "cpu" else 0),
            disk_dir=config.state_cache_dir,
            disk_bytes=int(config.state_cache_disk_gib * 2**30),
            export_blocks=lambda hashes: self.cache.export_blocks(hashes, count=False),
            release_kv=None if self.kv is None else self.kv.free,
            kv_layout=None if self.kv is None else self.kv.layout,
            read_kv=None if self.kv is None else self.kv.read)

    def _checkpoint_interval(self, config: EngineConfig) -> int:
        """``checkpoint_interval``, or the store's default for this model and budget."""
        if self.resume is None:
            return 0
        if config.checkpoint_interval is not None:
            return config.checkpoint_interval
        if self.mc.caches_blocks and self.kv is None:
            # every segment block is a resume point already (the whole state where its segment
            # ends): a grid would only cut the prefill into more chunks
            return 0
        return self.resume.default_interval(config.max_model_len)

    def close(self) -> None:
        """Write the resume points held in memory to the disk tier (``state_cache_dir``), so
        that a restarted engine finds them. Call it once the engine is done."""
        if self.resume is not None:
            n = self.resume.flush()
            if n:
                log.info("state cache: %d resume point(s) written to %s", n,
                         self.config.state_cache_dir)

    # ------------------------------------------------------------------ describe
    def describe(self) -> str:
        m, c, mc = self.model_config, self.config, self.mc
        kind = getattr(m, "memory", None) or getattr(m, "model_type", "?")
        kv = self.kv
        return (f"model={self.model_name} ({kind}, {m.n_layers} layers, d={m.d_model}) "
                f"mc={mc.variant}/{mc.mode} segment_len={mc.segment_len} top_k={mc.top_k} "
                f"device={c.device} dtype={c.dtype} slots={c.max_num_seqs} "
                f"blocks={self.num_state_blocks} "
                f"({self.cache.bytes_per_block * self.num_state_blocks / 2**20:.0f} MiB) "
                f"prefix_caching={c.enable_prefix_caching}"
                + (f" kv_cache={kv.num_blocks * kv.block_size} tokens ({kv.num_blocks} blocks "
                   f"of {kv.block_size}, {kv.num_blocks * kv.bytes_per_block / 2**20:.0f} MiB)"
                   if kv is not None else "")
                + (f" resume_points={self.resume.capacity()} "
                   f"({self.resume.row_bytes / 2**20:.1f} MiB each, one every "
                   f"{self.checkpoint_interval or 'no'} prompt tokens"
                   + (f", disk tier {c.state_cache_dir}" if c.state_cache_dir else "") + ")"
                   if self.resume is not None else ""))

    # ------------------------------------------------------------------ requests
    def compile_structured(self, spec: StructuredOutputsParams | dict) -> None:
        """Compile a structured-outputs constraint into the cache now, so that the request that
        carries it does not compile it on the engine thread. Thread-safe (the server calls it
        from a worker thread); raises ``InvalidRequestError`` (``param="structured_outputs"``)
        when it does not compile."""
        if isinstance(spec, dict):
            spec = SamplingParams(structured_outputs=spec).structured_outputs
        self.structured.compile(spec)

    def add_request(self, request_id: str, prompt: str | None, params: SamplingParams | None = None,
                    *, prompt_token_ids: list[int] | None = None,
                    mc_overrides: dict | None = None,
                    resume_positions: list[int] | None = None) -> None:
        """Queue a request. A request the engine refuses raises ``InvalidRequestError`` (a
        ``ValueError``) whose ``param`` names the field at fault (``"prompt"``, ``"max_tokens"``,
        ``"mc_top_k"``...; None for ``request_id`` and ``params``).

        ``resume_positions``: prompt positions (1 .. prompt length) where the engine keeps a
        resume point as it computes the prompt (a document's or a system prompt's end, chat
        message ends); a later prompt that starts with the same tokens resumes there."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError("params must be a SamplingParams")
        if request_id in self.requests:
            raise InvalidRequestError(f"request_id {request_id!r} already exists")
        mc_top_k = self._check_overrides(mc_overrides or {})
        if prompt_token_ids is None:
            if not isinstance(prompt, str):
                raise InvalidRequestError("prompt must be a string (or pass prompt_token_ids)",
                                          param="prompt")
            prompt_token_ids = self.tokenizer.encode(prompt)
        ids = [int(t) for t in prompt_token_ids]
        if not ids:
            raise InvalidRequestError("prompt must not be empty", param="prompt")
        V = self.model_config.vocab_size
        if any(t < 0 or t >= V for t in ids):
            raise InvalidRequestError(f"prompt token ids must be in [0, {V})", param="prompt")
        L = self.config.max_model_len
        if len(ids) >= L:
            raise InvalidRequestError(
                f"prompt is {len(ids)} tokens, longer than max_model_len={L} minus one generated "
                f"token", param="prompt")
        total = len(ids) + (params.max_tokens or L - len(ids))
        if params.max_tokens is not None and total > L:
            raise InvalidRequestError(
                f"max_tokens={params.max_tokens} plus the prompt's {len(ids)} tokens exceeds "
                f"max_model_len={L}", param="max_tokens")
        C = self.mc.segment_len
        room = self.cache.num_blocks + (self.cache.num_host_blocks if self.scheduler.offload
                                        else 0)
        if self.mc.caches_blocks and min(total, L) // C > room:
            raise InvalidRequestError(
                f"the request needs up to {min(total, L) // C} state blocks but the pools hold "
                f"{room} (num_state_blocks, host_state_blocks for ssc)")
        marks = self._check_positions(resume_positions, len(ids))
        # the constraint compiles (or fails: a 400) before anything is queued
        template = (self.structured.compile(params.structured_outputs)
                    if params.structured_outputs is not None else None)
        req = _Request(request_id, prompt, ids, params)
        arrival = next(self._arrival)
        # blocks computed under another top_k are never shared: the override salts the hashes
        salt = request_salt(self.cache.salt, mc_top_k)
        for i in range(params.n):
            seq = Sequence(request_id, i, list(ids), params,
                           generator=make_generator(params.seed, self.model.device, i),
                           arrival=arrival,
                           mc_top_k=mc_top_k, salt=salt, resume_at=marks)
            seq.detok = IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens)
            if params.logprobs is not None:
                seq.logprobs = []
            if template is not None:
                seq.matcher = template.deep_copy()
            req.seqs.append(seq)
            self.scheduler.add(seq)
        self.requests[request_id] = req
        self.prompt_tokens_total += len(ids)

    @staticmethod
    def _check_positions(positions: list[int] | None, n: int) -> tuple[int, ...]:
        if positions is None:
            return ()
        try:
            got = [int(p) for p in positions]
        except (TypeError, ValueError):
            raise InvalidRequestError("resume_positions must be a list of integers",
                                      param="resume_positions") from None
        if any(isinstance(p, bool) or not 1 <= q <= n for p, q in zip(positions, got)):
            raise InvalidRequestError(f"resume_positions must lie in [1, {n}] (the prompt's "
                                      f"tokens)", param="resume_positions")
        return tuple(sorted(set(got)))

    def _check_overrides(self, overrides: dict) -> int | None:
        """Per-request MC settings this model allows: ``mc_top_k`` for a selecting variant
        (ssc)."""
        allowed = ("mc_top_k",) if self.mc.selects else ()
        bad = [k for k in overrides if k not in allowed]
        if bad:
            raise InvalidRequestError(
                f"mc overrides {sorted(bad)} are not supported per request by this model "
                f"(mc_variant={self.mc.variant!r}; allowed: {list(allowed)}); set them when "
                f"starting the engine", param=bad[0])
        k = overrides.get("mc_top_k")
        if k is None:
            return None
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise InvalidRequestError(f"mc_top_k must be a positive integer, got {k!r}",
                                      param="mc_top_k")
        return k

    def abort_request(self, request_id: str) -> None:
        req = self.requests.pop(request_id, None)
        if req is None:
            return
        for seq in req.seqs:
            if not seq.finished:
                seq.finish_reason = "abort"
                self.scheduler.finish(seq)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ------------------------------------------------------------------ step
    def step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        touched: dict[str, _Request] = {}
        to_sample: list[tuple[Sequence, torch.Tensor]] = []
        # the step's prefills of any lengths and phases go through the model in one
        # variable-length call; those that want every position's logits (prompt logprobs), and
        # private (loglinear) states, run alone
        calls: list[list] = []
        packed = []
        for item in sched.prefills:
            seq = item.seq
            touched[seq.request_id] = self.requests[seq.request_id]
            want_all = seq.params.prompt_logprobs is not None and not seq.output_ids
            if want_all or not self.runner.varlen:
                calls.append([item])
            else:
                packed.append(item)
        if packed:
            calls.append(packed)
        last: dict[int, torch.Tensor] = {}  # id(item) -> its last position's logits
        for group in calls:
            try:
                if len(group) > 1:
                    logits = self.runner.prefill_varlen(group)
                    last.update((id(item), row) for item, row in zip(group, logits, strict=True))
                    continue
                seq = group[0].seq
                want_all = seq.params.prompt_logprobs is not None and not seq.output_ids
                p0 = seq.num_computed_tokens
                logits = self.runner.prefill(group[0], want_all)
                if want_all:
                    self._prompt_logprobs(seq, p0, logits)
                last[id(group[0])] = logits[-1]
            except Exception as e:  # fails only the requests of this call
                self._free_unused_blocks(group)
                for item in group:
                    self._fail(self.requests[item.seq.request_id], e)
        for item in sched.prefills:  # in the scheduler's order
            seq = item.seq
            if id(item) in last and seq.num_computed_tokens == seq.num_tokens:
                to_sample.append((seq, last[id(item)]))
        batch = None  # the decode's logits, when they are all the rows to sample, in order
        if sched.decodes:
            try:
                logits = self.runner.decode(sched.decodes)
                batch = None if to_sample else logits
                for r, item in enumerate(sched.decodes):
                    to_sample.append((item.seq, logits[r]))
            except Exception as e:  # fails the batch's requests, which report as finished
                self._free_unused_blocks(sched.decodes)
                for item in sched.decodes:
                    req = self.requests[item.seq.request_id]
                    touched[req.request_id] = req
                    self._fail(req, e)
        n_rows = len(to_sample)
        to_sample = [(s, lg) for s, lg in to_sample if not s.finished]
        seqs: list[Sequence] = []
        if to_sample:
            # the constrained rows' allowed tokens, filled before anything waits for the logits:
            # on a GPU the model's step is still running
            self._masks = self.structured.fill_for([s for s, _ in to_sample])
            if batch is None or len(to_sample) != n_rows:
                batch = torch.stack([lg for _, lg in to_sample])
            seqs, logits = self._drop_non_finite([s for s, _ in to_sample], batch, touched)
        if seqs:
            try:
                results = self._sample(seqs, logits)
            except Exception:  # isolate the row that broke the batch: sample one by one
                results = []
                for r, s in enumerate(seqs):
                    try:
                        results.append(self._sample([s], logits[r:r + 1])[0])
                    except Exception as e:
                        results.append(e)
            for seq, res in zip(seqs, results, strict=True):
                req = self.requests[seq.request_id]
                touched[req.request_id] = req
                try:
                    if isinstance(res, Exception):
                        raise res
                    self._append(seq, *res)
                except Exception as e:
                    self._fail(req, e)
        outputs = []
        for req in touched.values():
            outputs.append(self._output(req))
            if req.finished:
                self.requests.pop(req.request_id, None)
        return outputs

    def _free_unused_blocks(self, items: list) -> None:
        """Blocks the scheduler allocated for a step that failed before they joined their
        sequence's table (the sequence's own blocks are freed when it finishes)."""
        for item in items:
            unused = [b for b in item.new_blocks if b not in item.seq.block_table]
            if unused:
                self.cache.free(unused)

    def _drop_non_finite(self, seqs: list[Sequence], logits: torch.Tensor,
                         touched: dict[str, _Request]) -> tuple[list[Sequence], torch.Tensor]:
        """Fail the sequences whose logits ``(B, V)`` hold NaN or inf; return the others.

        A recurrent state that overflowed its dtype (an unbounded memory such as plain ``dla``
        far past its training length, in float32) gives NaN logits: greedy decoding would
        return token 0 forever without a word, sampling would fail with a torch message.
        """
        if bool(torch.isfinite(logits.sum())):  # one reduction: NaN and inf propagate
            return seqs, logits
        finite = torch.isfinite(logits).all(dim=-1)  # (B,): a finite sum may have overflowed
        if bool(finite.all()):
            return seqs, logits
        for seq, ok in zip(seqs, finite.tolist(), strict=True):
            if not ok:
                req = self.requests[seq.request_id]
                touched[req.request_id] = req
                self._fail(req, NonFiniteLogitsError(
                    f"the model's logits are not finite (NaN or inf) at position "
                    f"{seq.num_tokens} of completion {seq.index}: its state overflowed in "
                    f"{self.config.dtype}; a shorter context, or dtype float64, may avoid it"))
        # _fail finishes every completion of the request, not only the bad row
        keep = [r for r, s in enumerate(seqs) if not s.finished]
        return [seqs[r] for r in keep], logits[keep]

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor) -> list[tuple]:
        # the constrained rows' bitmasks (filled by step(), else now); a plain batch has none
        filled, self._masks = self._masks, None
        masks = self.structured.rows(seqs, filled)
        out = self.sampler(
            logits.float(), [s.params for s in seqs],
            [s.generator or self._global_gen for s in seqs], [s.output_ids for s in seqs],
            [s.prompt_ids for s in seqs], token_bitmask=masks)
        return list(zip(out.token_ids, out.logprobs, out.top_logprobs, strict=True))

    def _prompt_logprobs(self, seq: Sequence, p0: int, logits: torch.Tensor) -> None:
        """Logits at positions p0..p0+n-1 score tokens p0+1..p0+n (first prompt token: None)."""
        n = seq.params.prompt_logprobs
        ids = seq.prompt_ids
        if seq.prompt_logprobs is None:
            seq.prompt_logprobs = [None]
        end = min(p0 + logits.shape[0], len(ids) - 1)
        if end > p0:
            lp = prompt_logprobs(logits[:end - p0].float(), ids[p0:end + 1], n)
            seq.prompt_logprobs.extend(self._with_text(e) for e in lp[1:])  # lp[0]: no context

    def _with_text(self, entry: dict[int, Logprob]) -> dict[int, Logprob]:
        """Fill ``decoded_token`` of the sampler's Logprobs: each token's own text (special
        tokens included: logprobs name every token), decoded once per engine."""
        for tid, lp in entry.items():
            text = self._token_text.get(tid)
            if text is None:
                text = self._token_text[tid] = self.tokenizer.decode(
                    [tid], skip_special_tokens=False)
            lp.decoded_token = text
        return entry

    def _append(self, seq: Sequence, tok: int, logprob: float,
                top: dict[int, Logprob] | None) -> None:
        p = seq.params
        if seq.matcher is not None and not seq.matcher.consume_token(tok):
            raise RuntimeError(f"structured outputs: the constraint refused token {tok}: "
                               f"{seq.matcher.get_error()}")
        seq.output_ids.append(tok)
        seq.cumulative_logprob += logprob
        if seq.logprobs is not None:
            seq.logprobs.append(self._with_text(top if top is not None
                                                else {tok: Logprob(logprob)}))
        self.generation_tokens_total += 1
        prev_len = len(seq.detok.text)
        seq.detok.add(tok)
        text = seq.detok.text
        reason = stop = None
        if not p.ignore_eos and tok == self.tokenizer.eos_token_id:
            reason = "stop"
        elif tok in (p.stop_token_ids or ()):
            reason, stop = "stop", tok
        elif p.stop:
            hit = find_stop(text, max(0, prev_len - max(len(s) for s in p.stop)), p.stop)
            if hit is not None:
                idx, s = hit
                text = text[:idx + len(s)] if p.include_stop_str_in_output else text[:idx]
                reason, stop = "stop", s
        done = reason is None and seq.matcher is not None and seq.matcher.is_stopped()
        if done:
            reason = "stop"  # the constraint is complete and allows nothing more
        if reason is None:
            if p.max_tokens is not None and len(seq.output_ids) >= p.max_tokens:
                reason = "length"
            elif seq.num_tokens >= self.config.max_model_len:
                reason = "length"
        if reason is not None:
            if stop is None and (reason == "length" or done):
                seq.detok.flush()
                text = seq.detok.text
            seq.text = text
            seq.finish_reason, seq.stop_reason = reason, stop
            self.runner.keep(seq)  # a client that sends the conversation on resumes here
            self.scheduler.finish(seq)
        else:
            hold = stop_holdback(text, p.stop) if p.stop else 0
            seq.text = text[:len(text) - hold]

    def _fail(self, req: _Request, err: Exception) -> None:
        req.error = f"{type(err).__name__}: {err}"
        for seq in req.seqs:
            if not seq.finished:
                seq.finish_reason = "error"
                self.scheduler.finish(seq)

    def _output(self, req: _Request) -> RequestOutput:
        outs = [CompletionOutput(
            index=s.index, text=s.text, token_ids=list(s.output_ids),
            cumulative_logprob=s.cumulative_logprob,
            logprobs=list(s.logprobs) if s.logprobs is not None else None,
            finish_reason=s.finish_reason, stop_reason=s.stop_reason) for s in req.seqs]
        first = req.seqs[0]
        return RequestOutput(
            request_id=req.request_id, prompt=req.prompt, prompt_token_ids=req.prompt_ids,
            outputs=outs, finished=req.finished, prompt_logprobs=first.prompt_logprobs,
            error=req.error, num_cached_tokens=first.num_cached_tokens)

    # ------------------------------------------------------------------ stats
    def stats(self) -> dict[str, float | int]:
        c = self.cache
        return {
            "num_requests_running": len({s.request_id for s in self.scheduler.running}),
            "num_requests_waiting": len({s.request_id for s in self.scheduler.waiting}
                                        - {s.request_id for s in self.scheduler.running}),
            "state_blocks_used": c.num_blocks - len(c.free_blocks) - len(c.evictable),
            "state_blocks_cached": len(c.evictable),
            "state_blocks_total": c.num_blocks,
            "state_slots_used": c.num_slots - len(c.free_slots),
            "state_slots_total": c.num_slots,
            "prefix_cache_queries": c.prefix_queries,
            "prefix_cache_hits": c.prefix_hits,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_swaps": self.scheduler.num_swaps,
            "host_blocks_used": c.num_host_blocks - c.num_free_host,
            "host_blocks_total": c.num_host_blocks,
            "host_bytes_moved": c.bytes_moved,
            "host_blocks_offloaded": c.num_offloaded,
            "host_blocks_fetched": c.num_fetched,
            "prompt_tokens_total": self.prompt_tokens_total,
            "generation_tokens_total": self.generation_tokens_total,
            "prompt_tokens_cached": self.scheduler.prompt_tokens_cached,
            "prompt_tokens_computed": (self.scheduler.prompt_tokens_admitted
                                       - self.scheduler.prompt_tokens_cached),
            **(self.resume.stats() if self.resume is not None else {}),
            **({"kv_blocks_used": self.kv.num_blocks - self.kv.num_free,
                "kv_blocks_total": self.kv.num_blocks,
                "kv_blocks_resume_points": self.resume.kv_held if self.resume else 0}
               if self.kv is not None else {}),
        }

    # ------------------------------------------------------------------ prefix export / import
    def prefix_hashes(self, token_ids: list[int], mc_overrides: dict | None = None
                      ) -> list[bytes]:
        """The prefix-cache keys the scheduler looks up for a prompt of ``token_ids``: one per
        complete segment that may be reused (at least one token is left to compute). Empty
        when this engine caches no blocks (prefix caching off, ``none``, ``loglinear``)."""
        if not (self.mc.caches_blocks and self.cache.enable_prefix_caching
                and self.cache.num_blocks):
            return []
        mc_top_k = self._check_overrides(mc_overrides or {})
        salt = request_salt(self.cache.salt, mc_top_k)
        return prompt_block_hashes([int(t) for t in token_ids], self.mc.segment_len, salt)

    def cached_prefix_blocks(self, hashes: list[bytes]) -> int:
        """How many leading blocks of ``hashes`` (``prefix_hashes``) this engine has cached."""
        return self.cache.cached_prefix(hashes)

    def export_prefix(self, token_ids: list[int] | None = None, *,
                      hashes: list[bytes] | None = None,
                      mc_overrides: dict | None = None) -> PrefixExport:
        """The cached checkpoints of the longest cached prefix of a prompt (``token_ids``, or
        its ``hashes`` from ``prefix_hashes``), detached from this engine: another engine of
        the same model and configuration resumes from them with ``import_prefix`` instead of
        recomputing that prefill. Empty (``num_blocks == 0``) when nothing is cached.

        Not thread-safe, like every engine call: run it where ``step()`` runs."""
        if hashes is None:
            if token_ids is None:
                raise InvalidRequestError("export_prefix needs token_ids or hashes")
            hashes = self.prefix_hashes(token_ids, mc_overrides)
        export = self.cache.export_blocks(list(hashes))
        if token_ids is not None and self.resume is not None and not self.runner.private:
            export.resume = self._export_resume([int(t) for t in token_ids], export,
                                                mc_overrides)
        return export

    def _export_resume(self, ids: list[int], export: PrefixExport,
                       mc_overrides: dict | None) -> dict | None:
        """The deepest resume point of ``ids`` past the blocks of ``export`` (and needing no
        more of them), as CPU copies; None when there is none."""
        C = self.mc.segment_len
        n = export.num_blocks
        salt = request_salt(self.cache.salt, self._check_overrides(mc_overrides or {}))
        accept = (lambda rp: rp.pos // C <= n) if self.mc.caches_blocks else None
        rp, _ = self.resume.lookup(ids, salt, n * C + 1 if self.mc.caches_blocks else 1,
                                   len(ids) - 1, accept, count=False)
        if rp is None:
            return None
        try:
            return self.resume.export_point(rp)
        finally:
            self.resume.unpin(rp)

    def import_prefix(self, export: PrefixExport) -> int:
        """Register the blocks of ``export`` (another engine's ``export_prefix``) in this
        engine's prefix cache, as cached blocks nobody holds (evictable like any other); a
        later request with that prefix hits them and computes only the rest. Returns the
        blocks written (those already cached here, or beyond a full pool, are skipped).

        Raises ``ValueError`` for an export of another model or configuration. The export's
        resume point, if any, joins this engine's resume points."""
        rp = export.resume if self.resume is not None else None
        if rp is not None:  # refused before anything is imported
            why = self.resume.check_point(rp)
            if why is not None:
                raise ValueError(f"the prefix export's resume point does not match this "
                                 f"engine's state: {why}")
        n = self.cache.import_blocks(export)
        if rp is not None:
            C = self.mc.segment_len
            self.resume.import_point(
                rp, export.hashes[:int(rp["pos"]) // C] if self.mc.caches_blocks else None)
        return n
