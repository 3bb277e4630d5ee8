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

import torch
from torch import Tensor

from mcserve.kernels import cpu as cpu_ops


class KVCache:
    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, num_blocks: int,
                 block_size: int, dtype: torch.dtype, device: torch.device | str):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"the KV pool needs at least one block of at least one token, got "
                             f"{num_blocks} blocks of {block_size}")
        self.block_size = block_size
        self.num_blocks = num_blocks
        shape = (n_layers, num_blocks, block_size, n_kv_heads, head_dim)
        self.k: Tensor = cpu_ops.zeros(shape, dtype, device)
        self.v: Tensor = cpu_ops.zeros(shape, dtype, device)
        self.ref = [0] * num_blocks
        self.free_list: list[int] = list(range(num_blocks - 1, -1, -1))
        self.bytes_per_block = 2 * n_layers * block_size * n_kv_heads * head_dim * \
            torch.empty((), dtype=dtype).element_size()

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

    def is_whole(self, held: int = 0) -> bool:
        """Every reference is one of the ``held`` that resume points hold, and every block
        nobody references is free."""
        return (sum(self.ref) == held
                and sorted(self.free_list) == [b for b, r in enumerate(self.ref) if r == 0])
