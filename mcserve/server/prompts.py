"""Prompt text -> token ids for the routes, without stalling the event loop.

A prompt near the body limit (4 MiB) takes seconds to tokenize, and ``tokenizers``'
``Tokenizer.encode`` holds the GIL all along: run on the event loop (or on the engine thread)
it freezes every other request, ``/health`` included. So ``PromptEncoder``:

* refuses text that cannot be encoded as UTF-8 (a lone surrogate such as ``"\\ud800"``, which
  JSON allows) with a 400 naming the field, before any tokenizer sees it;
* refuses, from its UTF-8 length alone, a prompt that is certainly longer than the context, when
  the tokenizer bounds the bytes one token covers (``max_bytes_per_token``; only where that bound
  is exact);
* tokenizes long texts (and detokenizes long id lists) on a worker thread through
  ``encode_batch`` (``decode_batch``), which release the GIL, with at most ``max_concurrent`` of
  them at a time, so that one client cannot take every core.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
from typing import Any

from mcserve.engine.tokenizer import Tokenizer
from mcserve.server.errors import APIError

logger = logging.getLogger("mcserve.server")

# texts up to this many characters tokenize inline: well under a millisecond, less than the
# hand-off to a thread costs
INLINE_CHARS = 8192
# long tokenizations at a time (each takes a core for up to a few seconds)
DEFAULT_MAX_CONCURRENT = 2
# pre-tokenizers that only split the text (no character is dropped or rewritten)
_SPLITTING_PRE_TOKENIZERS = {"ByteLevel", "Digits", "Punctuation"}


def check_utf8(text: str, param: str, what: str = "the prompt") -> int:
    """The UTF-8 length of ``text``; a 400 naming ``param`` when it holds a lone surrogate
    (valid in a JSON string as ``\\ud800``, not a character any tokenizer can encode)."""
    try:
        return len(text.encode("utf-8"))
    except UnicodeEncodeError as e:
        bad = text[e.start]
        raise APIError(400, f"{what} holds a lone surrogate U+{ord(bad):04X} at character "
                       f"{e.start}, which is not valid Unicode text", param=param) from None


def max_bytes_per_token(tok: Any) -> int | None:
    """The most UTF-8 bytes of input text one token can stand for, when that bound is exact;
    None when it is not known.

    Exact for the byte-level ``Tokenizer`` (one token per byte) and for a byte-level BPE
    ``tokenizers`` backend without normalizer whose pre-tokenizers only split and whose
    vocabulary holds all 256 byte symbols: its tokens then partition the text's bytes, each
    vocabulary entry standing for one byte per symbol, each added token for its own content.
    """
    if not isinstance(tok, Tokenizer):
        return None
    backend = getattr(tok, "_backend", None)
    if backend is None:
        return 1
    try:
        spec = json.loads(backend.to_str())
        from tokenizers.pre_tokenizers import ByteLevel
    except Exception:  # noqa: BLE001 - an unknown backend: no bound, tokenize as usual
        return None
    if spec.get("normalizer") is not None:
        return None
    pre = spec.get("pre_tokenizer") or {}
    parts = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    kinds = {p.get("type") for p in parts}
    if "ByteLevel" not in kinds or not kinds <= _SPLITTING_PRE_TOKENIZERS | {"Split"}:
        return None
    if any(p.get("type") == "Split" and p.get("behavior") == "Removed" for p in parts):
        return None
    model = spec.get("model") or {}
    vocab = model.get("vocab")
    if model.get("type") != "BPE" or not isinstance(vocab, dict):
        return None
    if any(ch not in vocab for ch in ByteLevel.alphabet()):
        return None
    longest = max((len(token) for token in vocab), default=1)
    for added in spec.get("added_tokens") or []:
        longest = max(longest, len(str(added.get("content", "")).encode("utf-8")))
    return max(1, longest)


class _BatchBackend:
    """A ``tokenizers.Tokenizer`` whose ``encode`` and ``decode`` go through ``encode_batch`` and
    ``decode_batch`` (which release the GIL, where the single calls do not); everything else is
    the wrapped backend's."""

    def __init__(self, backend: Any):
        self._backend = backend

    def encode(self, text: str, add_special_tokens: bool = True) -> Any:
        return self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode_batch([ids], skip_special_tokens=skip_special_tokens)[0]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)


def _gil_free(tok: Any) -> Any:
    """``tok`` with an ``encode`` that lets other threads run (same ids, same special tokens)."""
    backend = getattr(tok, "_backend", None)
    if not isinstance(tok, Tokenizer) or backend is None or not hasattr(backend,
                                                                        "encode_batch"):
        return tok
    clone = copy.copy(tok)
    clone._backend = _BatchBackend(backend)
    return clone


class PromptEncoder:
    """Tokenizes prompts for the routes (see the module docstring)."""

    def __init__(self, tokenizer: Any, max_model_len: int, *,
                 max_concurrent: int = DEFAULT_MAX_CONCURRENT):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.bytes_per_token = max_bytes_per_token(tokenizer)
        self._threaded = _gil_free(tokenizer)
        self._max_concurrent = max_concurrent
        self._sem: asyncio.Semaphore | None = None

    def _semaphore(self) -> asyncio.Semaphore:
        # made on first use: it belongs to the loop that serves (tests run several apps)
        if self._sem is None:
            self._sem = asyncio.Semaphore(self._max_concurrent)
        return self._sem

    async def encode(self, text: str, *, add_special_tokens: bool, param: str,
                     limit: bool = True) -> list[int]:
        """Token ids of ``text``. With ``limit``, a 400 naming ``param`` when the prompt leaves
        no room for one generated token (``max_model_len``)."""
        nbytes = check_utf8(text, param)
        L = self.max_model_len
        bpt = self.bytes_per_token
        if limit and bpt is not None and nbytes > bpt * (L - 1):
            at_least = -(-nbytes // bpt)
            raise APIError(400, f"the prompt is {nbytes} bytes of UTF-8, so at least "
                           f"{at_least} tokens, longer than max_model_len={L} minus one "
                           f"generated token", param=param)
        if len(text) <= INLINE_CHARS:
            ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        else:
            async with self._semaphore():
                ids = await asyncio.to_thread(self._threaded.encode, text,
                                              add_special_tokens=add_special_tokens)
        if limit and len(ids) >= L:
            raise APIError(400, f"the prompt is {len(ids)} tokens, longer than max_model_len="
                           f"{L} minus one generated token", param=param)
        return list(ids)

    async def decode(self, ids: list[int], vocab_size: int, param: str = "tokens") -> str:
        """The text of ``ids`` (special tokens skipped); a 400 naming ``param`` for an id out of
        the vocabulary."""

        def run() -> str:
            bad = next((t for t in ids if not 0 <= t < vocab_size), None)
            if bad is not None:
                raise APIError(400, f"{param}: token id {bad} is out of range [0, {vocab_size})",
                               param=param)
            return self._threaded.decode(ids)

        if len(ids) <= INLINE_CHARS:
            return run()
        async with self._semaphore():
            return await asyncio.to_thread(run)
