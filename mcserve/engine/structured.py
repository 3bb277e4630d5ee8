"""Constrained decoding (structured outputs) with llguidance.

A request's ``SamplingParams.structured_outputs`` (a JSON schema, ``json_object``, a regex, a
choice list or a Lark/GBNF grammar) is compiled into an llguidance ``LLMatcher`` over the
engine's tokenizer when the request is added; compiled matchers are cached by the constraint
(an LRU), and each sequence gets a copy, which follows its own tokens. Every engine step fills
the allowed-token bitmasks of all constrained rows of the batch in one llguidance call
(``fill``: Rust, the GIL released, no Python loop over the vocabulary); the sampler sets the
logits of the tokens a row may not take to -inf (``sampling.apply_token_bitmask``) and each
matcher then consumes its sampled token. See docs/engine-sampling.md.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from mcserve.engine.sampling_params import JSON_OPTIONS, StructuredOutputsParams
from mcserve.errors import InvalidRequestError

if TYPE_CHECKING:  # pragma: no cover
    import llguidance

    from mcserve.engine.tokenizer import Tokenizer

__all__ = ["JSON_OPTIONS", "BatchMasks", "StructuredOutputs", "grammar_text"]

log = logging.getLogger(__name__)

PARAM = "structured_outputs"
# the bitmasks of a batch's constrained sequences: the row of each (by seq_id), the bitmask
BatchMasks = tuple[dict[int, int], torch.Tensor]
CACHE_SIZE = 256  # compiled constraints kept (LRU), errors included
SLOW_COMPILE_S = 1.0  # a compile slower than this is logged


def _limits() -> llguidance.LLParserLimits:
    """Bounds on the work of compiling a constraint and of each step's mask (llguidance's own
    defaults, stated here): a constraint over them fails to compile, with a message, instead
    of holding the engine."""
    import llguidance as llg

    return llg.LLParserLimits(initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000,
                              step_max_items=50_000, max_lexer_states=250_000,
                              max_grammar_size=500_000, max_items_in_row=2000,
                              verbose_errors=False)


def grammar_text(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar of ``spec`` (not yet checked: ``StructuredOutputs.compile``
    does that). Raises ``InvalidRequestError`` for what llguidance refuses to read."""
    import llguidance as llg

    kind = spec.kind
    try:
        if kind in ("json", "json_object"):
            schema: Any = {"type": "object"} if kind == "json_object" else spec.json
            if isinstance(schema, str):
                schema = json.loads(schema)
            return llg.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
        if kind == "regex":
            return llg.LLMatcher.grammar_from_regex(spec.regex)
        if kind == "choice":
            return llg.grammar_from("choice", spec.choice)  # type: ignore[arg-type]
        return llg.grammar_from("grammar", spec.grammar)  # Lark, or GBNF converted to Lark
    except (ValueError, TypeError) as e:
        raise InvalidRequestError(f"{PARAM}: the {kind} constraint is invalid: {e}",
                                  param=PARAM) from None


class _VocabBytes:
    """llguidance's view of a tokenizer that is not a ``tokenizers`` one (RWKV's World trie):
    each id's bytes, the EOS id and an encoder (``llguidance.TokenizerWrapper`` reads these)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int):
        self._tok = tokenizer
        self.tokens = [(tokenizer._tokens.get(i, b"")  # type: ignore[attr-defined]
                        if i != tokenizer.eos_token_id else b"") for i in range(vocab_size)]
        self.eos_token_id = tokenizer.eos_token_id
        self.bos_token_id = None
        self.special_token_ids = [tokenizer.eos_token_id]

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tok.encode(text, add_special_tokens=False)


def ll_tokenizer(tokenizer: Tokenizer, vocab_size: int) -> llguidance.LLTokenizer:
    """The llguidance tokenizer of the engine's: a ``tokenizers`` backend through its JSON,
    RWKV's World vocabulary through its token bytes. The byte-level fallback (no vocabulary,
    no EOS) is refused with ``InvalidRequestError``."""
    import llguidance as llg

    from mcserve.engine.tokenizer import RWKVWorldTokenizer

    backend = getattr(tokenizer, "_backend", None)
    if isinstance(tokenizer, RWKVWorldTokenizer):
        return llg.LLTokenizer(llg.TokenizerWrapper(_VocabBytes(tokenizer, vocab_size)),
                               n_vocab=vocab_size)
    if backend is not None and hasattr(backend, "to_str"):
        eos = tokenizer.eos_token_id
        return llg.LLTokenizer(backend.to_str(), n_vocab=vocab_size,
                               eos_token=eos if eos is not None else None)
    raise InvalidRequestError(
        f"{PARAM}: constrained decoding needs a tokenizer with a vocabulary (a tokenizer.json); "
        "this model's tokenizer is the UTF-8 byte-level fallback (serve it with --tokenizer DIR)",
        param=PARAM)


class StructuredOutputs:
    """Compiled constraints (thread-safe, cached) and the batch's bitmasks (engine thread).

    ``compile(spec)`` returns the matcher template of a constraint, compiling it on first use
    (at most ``cache_size`` kept, least recently used out; a constraint that failed fails
    again at once). ``matcher(spec)`` is a fresh copy for one sequence. ``fill(matchers)``
    computes the allowed tokens of every matcher into an int32 ``(R, ceil(V/32))`` bitmask (bit
    ``t % 32`` of word ``t // 32`` set: token t allowed): in one call of llguidance's thread
    pool (``threads`` of them), or (``inline``; by default when the model runs on the CPU with
    torch's threads on every core) one matcher after another in the calling thread: a pool's
    threads would compete with torch's for the cores, and the model's next op would wait for a
    descheduled thread (docs/engine-sampling.md, Cost).
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, *, cache_size: int = CACHE_SIZE,
                 threads: int | None = None, device_type: str = "cpu",
                 inline: bool | None = None):
        self.tokenizer = tokenizer
        self.vocab_size = int(vocab_size)
        self.cache_size = cache_size
        self.threads = threads
        if inline is None:  # the CPU with torch's threads on every core: no pool of our own
            spare = (os.cpu_count() or 1) - torch.get_num_threads()
            inline = threads is None and device_type == "cpu" and spare < 1
        self.inline = inline  # ``fill`` in the calling thread
        self._lock = threading.Lock()
        self._ll: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._executor: llguidance.LLExecutor | None = None
        self._buffer: torch.Tensor | None = None
        self.num_compiled = 0  # constraints compiled (cache misses)

    @property
    def words(self) -> int:
        """int32 words per bitmask row."""
        return (self.vocab_size + 31) // 32

    def _tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._ll is None:
                try:
                    self._ll = ll_tokenizer(self.tokenizer, self.vocab_size)
                except InvalidRequestError:
                    raise
                except Exception as e:  # noqa: BLE001 - llguidance refused the vocabulary
                    raise InvalidRequestError(
                        f"{PARAM}: this model's tokenizer cannot be used for constrained "
                        f"decoding: {e}", param=PARAM) from None
            return self._ll

    def compile(self, spec: StructuredOutputsParams) -> llguidance.LLMatcher:
        """The matcher template of ``spec`` (do not advance it: copy it with ``matcher``).
        Raises ``InvalidRequestError`` (``param="structured_outputs"``) when it does not
        compile; the message says why."""
        import llguidance as llg

        key = spec.key
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
        if hit is None:
            ll = self._tokenizer()
            grammar = grammar_text(spec)
            t0 = time.perf_counter()
            matcher = llg.LLMatcher(ll, grammar, log_level=0, limits=_limits())
            if not matcher.is_error():
                # the first mask builds the lexer states every copy starts from (lazily, and it
                # can take long for a large regex): here, on the compiling thread, rather than
                # in the engine's step
                matcher.compute_bitmask()
            took = time.perf_counter() - t0
            if took > SLOW_COMPILE_S:
                log.warning("structured outputs: a %s constraint took %.1f s to compile",
                            spec.kind, took)
            hit = (f"{PARAM}: the {spec.kind} constraint does not compile: "
                   f"{matcher.get_error()}" if matcher.is_error() else matcher)
            with self._lock:
                self.num_compiled += 1
                self._cache[key] = hit
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
        if isinstance(hit, str):
            raise InvalidRequestError(hit, param=PARAM)
        return hit

    def matcher(self, spec: StructuredOutputsParams) -> llguidance.LLMatcher:
        """A matcher for one sequence: a copy of the compiled template, at its start."""
        return self.compile(spec).deep_copy()

    def fill_for(self, seqs: Sequence[Any]) -> BatchMasks | None:
        """The bitmasks of the constrained ones among ``seqs`` (``engine.sequence.Sequence``),
        in one ``fill``; None when none is constrained."""
        cons = [s for s in seqs if s.matcher is not None]
        if not cons:
            return None
        return {s.seq_id: i for i, s in enumerate(cons)}, self.fill([s.matcher for s in cons])

    def rows(self, seqs: Sequence[Any], filled: BatchMasks | None
             ) -> tuple[list[int], torch.Tensor] | None:
        """The sampler's ``token_bitmask`` for a batch of ``seqs``: the constrained rows and
        their bitmasks, taken from ``filled`` (``fill_for`` of a set of sequences that holds
        them; its matchers not advanced since), else filled now. None for a plain batch."""
        rows = [r for r, s in enumerate(seqs) if s.matcher is not None]
        if not rows:
            return None
        if filled is None or any(seqs[r].seq_id not in filled[0] for r in rows):
            filled = self.fill_for([seqs[r] for r in rows])
            assert filled is not None
        index, bitmask = filled
        picked = [index[seqs[r].seq_id] for r in rows]
        if picked != list(range(bitmask.shape[0])):
            bitmask = bitmask[picked]
        return rows, bitmask

    def fill(self, matchers: list[llguidance.LLMatcher]) -> torch.Tensor:
        """The allowed-token bitmasks ``(len(matchers), words)`` (int32, CPU) of the matchers'
        next tokens (a view of a buffer reused by the next call). A matcher in its error state
        allows no token: the sampler then picks one that the matcher refuses, which fails that
        request (``LLMEngine._append``)."""
        import llguidance as llg

        r = len(matchers)
        if self._buffer is None or self._buffer.shape[0] < r:
            self._buffer = torch.empty((max(r, 8), self.words), dtype=torch.int32)
        buf = self._buffer[:r]
        if self.inline:
            for i, m in enumerate(matchers):
                m.unsafe_compute_mask_ptr(buf[i].data_ptr(), self.words * 4)
            return buf
        if self._executor is None:
            self._executor = llg.LLExecutor(num_threads=self.threads)
        # what llguidance.torch.fill_next_token_bitmask_par does; that module is not imported:
        # it decorates a function with torch.compile at import, which loads torch._dynamo (2 s)
        self._executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)],
                                               buf.data_ptr(), self.words * 4, r)
        return buf
