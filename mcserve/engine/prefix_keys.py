"""The keys of the state cache: chained hashes of token prefixes, salted by model and MC
configuration (and per-request MC overrides). One home for them: the scheduler, the runner,
the engine's export/import and the Ray router all key prefixes here, so equal keys mean equal
prefixes everywhere. Pure Python (no torch): the server and the router import it freely.

Two kinds of key (docs/engine.md, "Resume points"):

* **block keys** (``chain_hashes``): one per complete segment of ``segment_len`` tokens,
  chaining the previous segment's key, for the pool blocks MC reads;
* **resume keys** (``resume_key``, ``ResumeHasher``): one per token position, the hash of
  every token before it, for resume points (the whole recurrent state at that position).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterable


def request_salt(base: bytes, mc_top_k: int | None) -> bytes:
    """The salt of a request's keys: the engine's (model + MC configuration) plus a per-request
    ``mc_top_k`` (later layers' states depend on it, so states computed under another top_k
    are never shared)."""
    return base + (f"|top_k={mc_top_k}".encode() if mc_top_k else b"")


def salt_digest(salt: bytes) -> bytes:
    """A short fingerprint of a cache's hash salt (model + MC configuration)."""
    return hashlib.blake2b(salt, digest_size=16).digest()


def block_hash(parent: bytes | None, token_ids: list[int], salt: bytes) -> bytes:
    """One link of the chain: the hash of a segment's tokens after the segment hashed
    ``parent`` (None: the first segment), under ``salt`` (model + MC configuration)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"root")
    h.update(salt)
    h.update(",".join(map(str, token_ids)).encode())
    return h.digest()


def chain_hashes(token_ids: list[int], segment_len: int, salt: bytes, stop: int,
                 done: list[bytes] | None = None) -> list[bytes]:
    """The prefix-cache keys of segments ``len(done) .. stop - 1`` of ``token_ids``.

    Segment s covers tokens ``[s·segment_len, (s+1)·segment_len)``; its key chains the key of
    segment s - 1 (the last of ``done``, the keys already computed), so equal keys mean equal
    whole prefixes. The scheduler keys a prompt's segments with it to look them up, the runner
    each segment as it completes to register its block: the same function, the same keys.
    """
    out: list[bytes] = []
    parent = done[-1] if done else None
    for s in range(len(done or ()), stop):
        parent = block_hash(parent, token_ids[s * segment_len:(s + 1) * segment_len], salt)
        out.append(parent)
    return out


def prompt_block_hashes(token_ids: list[int], segment_len: int, salt: bytes) -> list[bytes]:
    """The block keys a request with prompt ``token_ids`` may reuse: every complete segment
    that leaves at least one token to compute (its logits are needed)."""
    return chain_hashes(token_ids, segment_len, salt, max(0, (len(token_ids) - 1) // segment_len))


class ResumeHasher:
    """Resume keys of one token sequence at increasing positions, in one pass over the tokens:
    the key at position p hashes the salt and tokens ``[0, p)``. Asking for a position below
    the last one asked restarts from the beginning (a recompute after preemption)."""

    def __init__(self, salt: bytes):
        self.salt = salt
        self._reset()

    def _reset(self) -> None:
        self._h = hashlib.blake2b(digest_size=16)
        self._h.update(b"resume|")
        self._h.update(self.salt)
        self._pos = 0

    def key(self, token_ids: list[int], pos: int) -> bytes:
        """The key of ``token_ids[:pos]`` (the ids before ``self._pos`` must not have changed
        since the last call)."""
        if pos < self._pos:
            self._reset()
        if pos > self._pos:
            self._h.update(array("q", token_ids[self._pos:pos]).tobytes())
            self._pos = pos
        return self._h.copy().digest()

    def keys(self, token_ids: list[int], positions: Iterable[int]) -> dict[int, bytes]:
        """``{p: key of token_ids[:p]}`` for every p of ``positions`` (any order)."""
        return {p: self.key(token_ids, p) for p in sorted(set(positions))}


def resume_key(token_ids: list[int], pos: int, salt: bytes) -> bytes:
    """The resume key of ``token_ids[:pos]`` under ``salt`` (what ``ResumeHasher`` gives)."""
    return ResumeHasher(salt).key(token_ids, pos)
