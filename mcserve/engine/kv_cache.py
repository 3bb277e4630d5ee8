"""The paged KV cache of a hybrid model's attention layers (docs/engine.md).

Keys and values of every attention layer live in two preallocated pools ``(attention layers,
num_blocks, block_size, Hkv, D)``. A sequence owns a KV block table (``Sequence.kv_table``):
token p of the sequence is in block ``kv_table[p // block_size]`` at row ``p % block_size``.
The block size is the KV pool's own (16 tokens by default), independent of the recurrent state's
size: no page-size unification.

Blocks are reference counted. A resume point of a hybrid model holds references on the blocks
before its position, so a later request restores the recurrent state and the attention KV of the
same token together: it shares the full blocks and copies the rows of the last, partial one into
a block of its own (``copy_rows``); the sequence that wrote them only ever writes rows after
them. ``allocate`` returns None when the pool is short; it never raises.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from mcserve.kernels import cpu as cpu_ops
from mcserve.models.attention import PagedKV

if TYPE_CHECKING:
    from torch import nn

    from mcserve.config import EngineConfig
    from mcserve.engine.sequence import Sequence


class KVCache:
    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, num_blocks: int,
                 block_size: int, dtype: torch.dtype, device: torch.device | str):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"the KV pool needs at least one block of at least one token, got "
                             f"{num_blocks} blocks of {block_size}")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.layout = (n_layers, n_kv_heads, head_dim, dtype)  # what a KV copy must match
        # one block more than ``num_blocks``: the scratch block the padded rows of a static
        # decode step write and read (never handed out)
        self.scratch = num_blocks
        shape = (n_layers, num_blocks + 1, block_size, n_kv_heads, head_dim)
        self.k: Tensor = cpu_ops.zeros(shape, dtype, device)
        self.v: Tensor = cpu_ops.zeros(shape, dtype, device)
        self.ref = [0] * num_blocks
        self.free_list: list[int] = list(range(num_blocks - 1, -1, -1))
        self.bytes_per_block = 2 * n_layers * block_size * n_kv_heads * head_dim * \
            torch.empty((), dtype=dtype).element_size()

    @classmethod
    def for_model(cls, model: nn.Module, config: EngineConfig) -> KVCache | None:
        """The pool of a hybrid model's attention layers (``num_kv_blocks``, else
        ``kv_cache_mib``'s worth); None for a model without attention layers."""
        if not getattr(model, "attn_layers", None):
            return None
        if model.config.mc.log_segmented:
            raise ValueError("mc_variant loglinear is not supported on hybrid models (its "
                             "states are private to each sequence; the KV is paged)")
        n, hkv, d = model.kv_spec()
        bs = config.kv_block_size
        per = cls.block_bytes(n, hkv, d, bs, model.dtype)
        blocks = config.num_kv_blocks or config.kv_cache_mib * 2**20 // per
        if blocks < 1:
            raise ValueError(f"kv_cache_mib={config.kv_cache_mib} holds no KV block of "
                             f"{per / 2**20:.1f} MiB ({bs} tokens)")
        return cls(n, hkv, d, blocks, bs, model.dtype, model.device)

    @staticmethod
    def block_bytes(n_layers: int, n_kv_heads: int, head_dim: int, block_size: int,
                    dtype: torch.dtype) -> int:
        return 2 * n_layers * block_size * n_kv_heads * head_dim * \
            torch.empty((), dtype=dtype).element_size()

    # ------------------------------------------------------------------ blocks
    def blocks_for(self, tokens: int) -> int:
        """Blocks that ``tokens`` tokens of one sequence occupy."""
        return -(-tokens // self.block_size)

    @property
    def num_free(self) -> int:
        return len(self.free_list)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self.free_list)

    def allocate(self, n: int) -> list[int] | None:
        if n > len(self.free_list):
            return None
        out = [self.free_list.pop() for _ in range(n)]
        for b in out:
            self.ref[b] = 1
        return out

    def share(self, ids: list[int]) -> None:
        """One more owner for each block of ``ids``."""
        for b in ids:
            assert self.ref[b] > 0, f"KV block {b} is free"
            self.ref[b] += 1

    def free(self, ids: list[int]) -> None:
        """One owner less for each block of ``ids``; a block nobody owns is free again."""
        for b in ids:
            self.ref[b] -= 1
            assert self.ref[b] >= 0, f"KV block {b} freed twice"
            if self.ref[b] == 0:
                self.free_list.append(b)

    def copy_rows(self, src: int, dst: int, n: int) -> None:
        """The first ``n`` token rows of block ``src`` into block ``dst`` (every layer)."""
        self.k[:, dst, :n].copy_(self.k[:, src, :n])
        self.v[:, dst, :n].copy_(self.v[:, src, :n])

    def read(self, blocks: list[int], n: int) -> tuple[Tensor, Tensor]:
        """CPU copies of the keys and values of a sequence's first ``n`` tokens, held in
        ``blocks``: each ``(attention layers, n, Hkv, D)``."""
        idx = torch.tensor(blocks, dtype=torch.long, device=self.k.device)
        L = self.k.shape[0]

        def one(pool: Tensor) -> Tensor:
            got = pool.index_select(1, idx).reshape(L, -1, *pool.shape[3:])[:, :n]
            return got.to("cpu").contiguous()

        return one(self.k), one(self.v)

    def write(self, table: list[int], kv: tuple[Tensor, Tensor]) -> None:
        """Keys and values of a sequence's first tokens ``(attention layers, n, Hkv, D)`` into
        the blocks of ``table`` (a resume point read back from the host, a disk or another
        engine)."""
        n, bs = kv[0].shape[1], self.block_size
        blocks = torch.tensor(table[:self.blocks_for(n)], dtype=torch.long)
        rows = (blocks[:, None] * bs + torch.arange(bs)).reshape(-1)[:n].to(self.k.device)
        for pool, t in zip((self.k, self.v), kv, strict=True):
            pool.view(pool.shape[0], -1, *pool.shape[3:]).index_copy_(
                1, rows, t.to(pool.device, pool.dtype))

    def is_whole(self, held: int = 0) -> bool:
        """Every reference is one of the ``held`` that resume points hold, and every block
        nobody references is free."""
        return (sum(self.ref) == held
                and sorted(self.free_list) == [b for b, r in enumerate(self.ref) if r == 0])

    # ------------------------------------------------------------------ one step's view
    def view(self, seqs: list[Sequence], lens: list[int]) -> PagedKV:
        """The pool as one model call sees it: rows ``seqs`` computing ``lens`` tokens each
        after the ``num_computed_tokens`` they have. The rows the new tokens are written at
        come from the padded tables in one tensor expression."""
        dev = self.k.device
        ctx = [s.num_computed_tokens for s in seqs]
        width = max(len(s.kv_table) for s in seqs)
        tables = torch.tensor([s.kv_table + [-1] * (width - len(s.kv_table)) for s in seqs],
                              dtype=torch.long)
        if all(n == 1 for n in lens):  # decode: one token per row
            row = torch.arange(len(seqs))
            pos = torch.tensor(ctx, dtype=torch.long)
        else:
            n = torch.tensor(lens)
            row = torch.repeat_interleave(torch.arange(len(seqs)), n)
            first = torch.tensor([0] + lens[:-1]).cumsum(0).repeat_interleave(n)
            pos = (torch.tensor(ctx, dtype=torch.long).repeat_interleave(n)
                   + torch.arange(sum(lens)) - first)
        bs = self.block_size
        slots = tables[row, pos // bs] * bs + pos % bs
        lengths = torch.tensor([c + n for c, n in zip(ctx, lens, strict=True)], device=dev)
        return PagedKV(self.k, self.v, tables.to(dev), ctx, list(lens), slots.to(dev), lengths)
