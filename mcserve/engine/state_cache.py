"""The memory-state cache: the analogue of a paged KV cache for MC models (DESIGN.md §2.1).

Two preallocated pools on the model's device:

* **slots**: one per running sequence, the online state of every layer (memory, short-conv
  tail, key sum of the online segment, and for collapsed variants the summed cached state);
* **blocks**: one per cached segment checkpoint of one sequence, all layers: the memory at the
  segment's end (its readout state, and what is needed to resume from it), the conv tail, the
  segment's key sum, and for collapsed variants the running sum after it.

Blocks are reference counted and, with prefix caching, keyed by a chained hash of
(parent hash, the segment's token ids, the model + MC configuration), as vLLM keys KV blocks.
A block whose last owner left stays cached (evictable, least recently used first) until its
memory is needed. ``allocate`` returns None when the pool is exhausted; it never raises.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import torch
from torch import Tensor

from mcserve.models.native import MCForCausalLM


def block_hash(parent: bytes | None, token_ids: list[int], salt: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"root")
    h.update(salt)
    h.update(b",".join(str(t).encode() for t in token_ids))
    return h.digest()


class StateCache:
    def __init__(self, model: MCForCausalLM, num_blocks: int, num_slots: int,
                 enable_prefix_caching: bool = True, salt: bytes = b""):
        self.num_blocks = num_blocks
        self.num_slots = num_slots
        self.enable_prefix_caching = enable_prefix_caching
        self.salt = salt
        template = model.init_state(1)
        mems = [blk.mixer.memory for blk in model.layers]
        self.slot: list[dict[str, Tensor]] = []
        self.block: list[dict[str, Tensor]] = []
        for ls, mc in zip(template.layers, mems, strict=True):
            entries = {f"mem.{key}": t[0] for key, t in ls.mc.mem.items()}
            entries["seg_ksum"] = ls.mc.seg_ksum[0]
            if ls.conv is not None:
                entries["conv"] = ls.conv[0]
            if mc.collapsed:
                entries.update({f"csum.{key}": ls.mc.mem[key][0] for key in mc.family.readout_keys})
            self.slot.append({name: t.new_zeros((num_slots,) + t.shape)
                              for name, t in entries.items()})
            block = {name: t.new_zeros((num_blocks,) + t.shape) for name, t in entries.items()
                     if name != "seg_ksum"}
            block["ksum"] = ls.mc.seg_ksum.new_zeros((num_blocks,) + ls.mc.seg_ksum.shape[1:])
            self.block.append(block)
        self.free_slots: list[int] = list(range(num_slots - 1, -1, -1))
        self.free_blocks: list[int] = list(range(num_blocks - 1, -1, -1))
        self.ref = [0] * num_blocks
        self.hash_of: list[bytes | None] = [None] * num_blocks
        self.by_hash: dict[bytes, int] = {}
        self.evictable: OrderedDict[int, None] = OrderedDict()  # ref 0 but cached, LRU first
        self.prefix_queries = 0  # blocks looked up
        self.prefix_hits = 0  # blocks found
        self.bytes_per_block = sum(t[0].numel() * t.element_size()
                                   for layer in self.block for t in layer.values())
        self.bytes_per_slot = sum(t[0].numel() * t.element_size()
                                  for layer in self.slot for t in layer.values())

    # ------------------------------------------------------------------ slots
    def allocate_slot(self) -> int | None:
        return self.free_slots.pop() if self.free_slots else None

    def free_slot(self, slot: int) -> None:
        assert slot not in self.free_slots, f"slot {slot} freed twice"
        self.free_slots.append(slot)

    # ------------------------------------------------------------------ blocks
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks) + len(self.evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free_blocks

    def allocate(self, n: int) -> list[int] | None:
        if not self.can_allocate(n):
            return None
        out = []
        for _ in range(n):
            if self.free_blocks:
                bid = self.free_blocks.pop()
            else:  # evict the least recently used cached block
                bid, _ = self.evictable.popitem(last=False)
                del self.by_hash[self.hash_of[bid]]
                self.hash_of[bid] = None
            self.ref[bid] = 1
            out.append(bid)
        return out

    def free(self, block_ids: list[int]) -> None:
        for bid in block_ids:
            assert self.ref[bid] > 0, f"block {bid} freed twice"
            self.ref[bid] -= 1
            if self.ref[bid] == 0:
                if self.hash_of[bid] is not None:
                    self.evictable[bid] = None
                else:
                    self.free_blocks.append(bid)

    # ------------------------------------------------------------------ prefix reuse
    def lookup(self, hashes: list[bytes]) -> list[int]:
        """Longest run of cached blocks matching ``hashes``; they are referenced for the caller."""
        if not self.enable_prefix_caching:
            return []
        found = []
        for h in hashes:
            bid = self.by_hash.get(h)
            if bid is None:
                break
            found.append(bid)
        self.prefix_queries += len(hashes)
        self.prefix_hits += len(found)
        for bid in found:
            if self.ref[bid] == 0:
                del self.evictable[bid]
            self.ref[bid] += 1
        return found

    def register(self, bid: int, h: bytes) -> None:
        """Record that block ``bid`` holds the checkpoint for hash ``h`` (first writer wins)."""
        if self.enable_prefix_caching and h not in self.by_hash and self.hash_of[bid] is None:
            self.by_hash[h] = bid
            self.hash_of[bid] = h

    def is_whole(self) -> bool:
        """No block referenced and no slot taken: what every finished workload must leave."""
        return (len(self.free_slots) == self.num_slots and not any(self.ref)
                and self.num_free_blocks == self.num_blocks)

    def reset_prefix_cache(self) -> None:
        for bid in list(self.evictable):
            del self.by_hash[self.hash_of[bid]]
            self.hash_of[bid] = None
            self.free_blocks.append(bid)
        self.evictable.clear()

    # ------------------------------------------------------------------ copies
    def copy_block_to_slot(self, bid: int, slot: int, init_mem: list[dict[str, Tensor] | None]
                           ) -> None:
        """Resume from a checkpoint: the slot gets the state right after block ``bid``'s push.

        ``init_mem[l]`` is the layer's initial memory in independent mode (each segment starts
        from it), or None in checkpoint mode (the memory continues from the checkpoint).
        """
        for layer, sl, init in zip(self.block, self.slot, init_mem, strict=True):
            for name, t in sl.items():
                if name == "seg_ksum":
                    t[slot].zero_()
                elif name.startswith("mem.") and init is not None:
                    t[slot].copy_(init[name[4:]])
                else:
                    t[slot].copy_(layer[name][bid])

    def clear_slot(self, slot: int, init_mem: list[dict[str, Tensor]]) -> None:
        """A fresh sequence: initial memory, zero conv tail, zero sums."""
        for sl, init in zip(self.slot, init_mem, strict=True):
            for name, t in sl.items():
                if name.startswith("mem."):
                    t[slot].copy_(init[name[4:]])
                else:
                    t[slot].zero_()


def stack_init(mem: dict[str, Tensor]) -> dict[str, Tensor]:
    """A (1, ...) family state → per-row template (drops the batch dim)."""
    return {key: t[0] for key, t in mem.items()}


__all__ = ["StateCache", "block_hash", "stack_init", "torch"]
