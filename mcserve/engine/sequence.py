"""A sequence owns its token ids, its counters, its state slot and its block table (nano-vllm)."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Any

import torch

from mcserve.engine.outputs import Logprob
from mcserve.engine.prefix_keys import ResumeHasher
from mcserve.engine.sampling import SamplingParams

_ids = itertools.count()


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    index: int  # which of the request's n completions
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None = None
    arrival: int = 0  # admission order: FCFS, and the newest is preempted first
    seq_id: int = field(default_factory=lambda: next(_ids))
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    num_computed_tokens: int = 0  # tokens whose effect is in the state
    num_cached_tokens: int = 0  # prompt tokens that came from the prefix cache
    slot: int | None = None
    saved_slot: list | None = None  # the slot's contents while swapped out to the host tier
    block_table: list[int] = field(default_factory=list)  # one block per cached segment
    block_hashes: list[bytes] = field(default_factory=list)  # hash of each completed segment
    kv_table: list[int] = field(default_factory=list)  # hybrids: KV pool blocks, in order
    segment_fill: int = 0  # tokens in the online segment (< segment_len between steps)
    cumulative_logprob: float = 0.0
    logprobs: list[dict[int, Logprob]] | None = None  # per generated token, when asked for
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    text: str = ""
    detok: object | None = None  # IncrementalDetokenizer
    error: str | None = None
    mc_top_k: int | None = None  # per-request override of MCConfig.top_k (selecting variants)
    salt: bytes = b""  # prefix-hash salt: model + MC config (+ per-request MC overrides)
    resume_at: tuple[int, ...] = ()  # prompt positions to keep resume points at (sorted)
    hasher: ResumeHasher | None = field(default=None, repr=False)  # resume keys of all_ids
    admitted: bool = False  # admitted once (its cached prompt tokens are counted)
    # the llguidance matcher of a constrained request (structured outputs): the tokens this
    # completion may take next; it consumes each sampled token
    matcher: Any = field(default=None, repr=False)
    _table_cache: tuple | None = field(default=None, repr=False)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def ids(self, start: int, stop: int) -> list[int]:
        """``all_ids[start:stop]``, without building ``all_ids`` when the span is within the
        prompt (a long prompt's segments are read one by one as they complete)."""
        if stop <= len(self.prompt_ids):
            return self.prompt_ids[start:stop]
        return self.all_ids[start:stop]

    @property
    def last_id(self) -> int:
        """The newest token (what decode feeds), without building ``all_ids``."""
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    def table_tensor(self, device: torch.device | str) -> torch.Tensor:
        """``block_table`` as a long tensor on ``device``, rebuilt only when the table changed
        (decode builds its block table from these every step; a 32K context holds 512 blocks,
        and comparing two lists costs far less than making the tensor)."""
        cached = self._table_cache
        if (cached is None or cached[0] != self.block_table
                or cached[1].device != torch.device(device)):
            cached = (list(self.block_table),
                      torch.tensor(self.block_table, dtype=torch.long, device=device))
            self._table_cache = cached
        return cached[1]

    def resume_key(self, pos: int) -> bytes:
        """The resume key of this sequence's first ``pos`` tokens (incremental: positions
        usually grow)."""
        if self.hasher is None:
            self.hasher = ResumeHasher(self.salt)
        return self.hasher.key(self.all_ids, pos)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_prefill(self) -> bool:
        """More than the last sampled token left to compute (prompt, or recompute)."""
        return self.num_uncomputed > 1 or not self.output_ids

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
