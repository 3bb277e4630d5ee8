"""The memory-state cache: the analogue of a paged KV cache for MC models (docs/engine.md).

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

The slot pool has one extra row, the *scratch slot*: a static-shape decode step pads its batch
to a bucket size with rows that point there (and at no block), so they touch nothing that
matters. It is outside the accounting (``free_slots``, ``is_whole``).

**Host tier** (``host_blocks`` > 0): a second pool in host memory (pinned when the device is
CUDA). Preempted sequences are swapped there instead of recomputed. With ``ssc``, a running
sequence's blocks may also be *offloaded* there when the device pool is full: block ids at or
above ``host_base`` name host blocks, their key sums stay on the device (the router needs only
those), and the blocks a token selects are fetched into a per-layer staging area of the device
pool (LRU), so a sequence can have more cached segments than the device pool holds.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch
from torch import Tensor

from mcserve.engine.prefix_keys import salt_digest
from mcserve.kernels import cpu as cpu_ops
from mcserve.models.native import MCForCausalLM


class StateCache:
    def __init__(self, model: MCForCausalLM, num_blocks: int, num_slots: int,
                 enable_prefix_caching: bool = True, salt: bytes = b"", host_blocks: int = 0,
                 staging_blocks: int = 0):
        self.num_blocks = num_blocks
        self.num_host_blocks = host_blocks
        self.num_staging = staging_blocks if host_blocks else 0
        self.host_base = num_blocks + self.num_staging  # first id that names a host block
        self.num_slots = num_slots
        self.scratch_slot = num_slots  # the extra slot row behind the last real one
        self.enable_prefix_caching = enable_prefix_caching
        self.salt = salt
        template = model.init_state(1)
        mems = [blk.mixer.memory for blk in model.layers]
        self.slot: list[dict[str, Tensor]] = []
        self.block: list[dict[str, Tensor]] = []
        self.host: list[dict[str, Tensor]] = []
        for ls, mc in zip(template.layers, mems, strict=True):
            entries = {f"mem.{key}": t[0] for key, t in ls.mc.mem.items()}
            entries["seg_ksum"] = ls.mc.seg_ksum[0]
            if ls.conv is not None:
                entries["conv"] = ls.conv[0]
            if mc.collapsed:
                entries.update({f"csum.{key}": ls.mc.mem[key][0] for key in mc.family.readout_keys})
            # one row more than there are slots: the scratch slot (``scratch_slot``) that the
            # padded rows of a static decode batch read and write; never handed to a sequence
            self.slot.append({name: t.new_zeros((num_slots + 1,) + t.shape)
                              for name, t in entries.items()})
            block = {name: cpu_ops.zeros((self.host_base,) + t.shape, t.dtype, t.device)
                     for name, t in entries.items() if name != "seg_ksum"}
            # key sums of device AND host blocks live on the device: the ssc router reads them
            block["ksum"] = ls.mc.seg_ksum.new_zeros((self.host_base + host_blocks,)
                                                     + ls.mc.seg_ksum.shape[1:])
            self.block.append(block)
            pin = torch.device(block["ksum"].device).type == "cuda"
            self.host.append({name: (torch.zeros((host_blocks,) + t.shape[1:], dtype=t.dtype,
                                                 pin_memory=True) if pin else
                                     cpu_ops.zeros((host_blocks,) + t.shape[1:], t.dtype, "cpu"))
                              for name, t in block.items() if name != "ksum"})
        self.free_slots: list[int] = list(range(num_slots - 1, -1, -1))
        self.free_blocks: list[int] = list(range(num_blocks - 1, -1, -1))
        self.ref = [0] * num_blocks
        self.hash_of: list[bytes | None] = [None] * num_blocks
        self.by_hash: dict[bytes, int] = {}
        self.evictable: OrderedDict[int, None] = OrderedDict()  # ref 0 but cached, LRU first
        self.prefix_queries = 0  # blocks looked up
        self.prefix_hits = 0  # blocks found
        self.free_host: list[int] = list(range(host_blocks - 1, -1, -1))
        # per layer and head: host block id -> staging row, least recently used first. A head's
        # pick is staged into that head's slice of a row only (the readout reads pool[row, h]),
        # so a row serves one pick of every head and only the readout tensors are copied
        heads = template.layers[0].mc.seg_ksum.shape[1]
        self.readout_names = [[f"mem.{k}" for k in mc.family.readout_keys] for mc in mems]
        self.staged: list[list[OrderedDict[int, int]]] = [
            [OrderedDict() for _ in range(heads)] for _ in self.block]
        self.bytes_moved = 0  # host <-> device traffic (swaps, offloads, fetches)
        self.num_offloaded = 0  # blocks of running ssc sequences moved to the host tier
        self.num_fetched = 0  # (layer, host block) copies into staging for the ssc router
        self.bytes_per_block = self.block_bytes(model)
        self.bytes_per_slot = sum(t[0].numel() * t.element_size()
                                  for layer in self.slot for t in layer.values())

    @staticmethod
    def block_bytes(model: MCForCausalLM) -> int:
        """Bytes one device block of ``model`` takes (every layer's entries and key sum)."""
        total = 0
        for ls, blk in zip(model.init_state(1).layers, model.layers, strict=True):
            mc = blk.mixer.memory
            ts = [t[0] for t in ls.mc.mem.values()] + [ls.mc.seg_ksum[0]]
            if ls.conv is not None:
                ts.append(ls.conv[0])
            if mc.collapsed:
                ts += [ls.mc.mem[key][0] for key in mc.family.readout_keys]
            total += sum(t.numel() * t.element_size() for t in ts)
        return total

    # ------------------------------------------------------------------ slots
    def allocate_slot(self) -> int | None:
        return self.free_slots.pop() if self.free_slots else None

    def free_slot(self, slot: int) -> None:
        assert slot not in self.free_slots, f"slot {slot} freed twice"
        self.free_slots.append(slot)

    # ------------------------------------------------------------------ blocks
    @property
    def num_free_host(self) -> int:
        return len(self.free_host)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks) + len(self.evictable)

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
            if bid >= self.host_base:
                self._free_host(bid - self.host_base)
                continue
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
                and self.num_free_blocks == self.num_blocks
                and len(self.free_host) == self.num_host_blocks)

    # ------------------------------------------------------------------ host tier
    def _free_host(self, h: int) -> None:
        assert h not in self.free_host, f"host block {h} freed twice"
        for layer in self.staged:
            for staged in layer:
                staged.pop(h, None)
        self.free_host.append(h)

    def _copy_block(self, dst: list[dict[str, Tensor]], di: int,
                    src: list[dict[str, Tensor]], si: int) -> None:
        for d, s in zip(dst, src, strict=True):
            for name, t in d.items():
                if name != "ksum":
                    t[di].copy_(s[name][si], non_blocking=True)
        self.bytes_moved += self.bytes_per_block

    def to_host(self, bid: int) -> int | None:
        """Copy device block ``bid`` to a new host block (key sums mirrored); returns its id
        in the unified numbering (>= host_base), or None when the host tier is full. The
        device block keeps its reference; the caller frees it."""
        if not self.free_host:
            return None
        h = self.free_host.pop()
        self._copy_block(self.host, h, self.block, bid)
        for layer in self.block:
            layer["ksum"][self.host_base + h] = layer["ksum"][bid]
        return self.host_base + h

    def to_device(self, hid: int) -> int | None:
        """Bring host block ``hid`` back into a newly allocated device block (frees the host
        block); None when the device pool is full."""
        got = self.allocate(1)
        if got is None:
            return None
        bid, h = got[0], hid - self.host_base
        self._copy_block(self.block, bid, self.host, h)
        for layer in self.block:
            layer["ksum"][bid] = layer["ksum"][hid]
        self._free_host(h)
        return bid

    def fetch(self, layer: int, ids: Tensor, head_dim: int = -1) -> Tensor:
        """Map unified block ids to device rows for ``layer``; ``ids`` has one entry per head
        along ``head_dim`` (the pick of that head). Head h of a host block is copied into head
        h of a staging row (LRU cached per layer and head); only the readout state is copied.
        Used for the ssc router's selected blocks."""
        if not bool((ids >= self.host_base).any()):
            return ids
        dst, src = self.block[layer], self.host[layer]
        by_head = ids.movedim(head_dim, -1)  # (..., H)
        out = by_head.clone()
        for h, staged in enumerate(self.staged[layer]):
            col = by_head[..., h]
            host = col >= self.host_base
            if not bool(host.any()):
                continue
            wanted = (col[host] - self.host_base).unique().tolist()
            if len(wanted) > self.num_staging:
                raise RuntimeError(f"{len(wanted)} host blocks selected at once by one head but "
                                   f"only {self.num_staging} staging rows")
            for hid in wanted:  # hits first, so that this call's misses never evict them
                if hid in staged:
                    staged.move_to_end(hid)
            taken = set(staged.values())
            free_rows = [r for r in range(self.num_staging) if r not in taken]
            for hid in wanted:
                if hid in staged:
                    continue
                row = free_rows.pop() if free_rows else staged.popitem(last=False)[1]
                for name in self.readout_names[layer]:
                    part = dst[name][self.num_blocks + row, h]
                    part.copy_(src[name][hid, h], non_blocking=True)
                    self.bytes_moved += part.numel() * part.element_size()
                self.num_fetched += 1
                staged[hid] = row
            lut = torch.full((self.num_host_blocks,), -1, dtype=torch.long)
            for hid, row in staged.items():
                lut[hid] = self.num_blocks + row
            out[..., h][host] = lut.to(ids.device)[col[host] - self.host_base]
        return out.movedim(-1, head_dim)

    def read_block(self, layer: int, name: str, ids: list[int]) -> Tensor:
        """Rows of one layer's block tensor for unified ids (device or host), as a device
        tensor (host rows are copied: prefill of an offloaded sequence reads all its blocks)."""
        dev = self.block[layer][name]
        if not any(i >= self.host_base for i in ids):
            return dev[torch.tensor(ids, dtype=torch.long, device=dev.device)]
        rows = []
        for i in ids:
            if i >= self.host_base:
                rows.append(self.host[layer][name][i - self.host_base].to(dev.device))
                self.bytes_moved += rows[-1].numel() * rows[-1].element_size()
            else:
                rows.append(dev[i])
        return torch.stack(rows) if rows else dev[:0]

    def swap_out(self, table: list[int], slot: int) -> tuple[list[int], list] | None:
        """Move a preempted sequence to the host tier: its device blocks are copied to host
        blocks (and released), its slot saved. None (nothing done) when the host tier is full."""
        dev = [b for b in table if b < self.host_base]
        if len(dev) > len(self.free_host):
            return None
        new_table = [self.to_host(b) if b < self.host_base else b for b in table]
        self.free(dev)
        saved = [{name: t[slot].to("cpu", copy=True) for name, t in layer.items()}
                 for layer in self.slot]
        self.bytes_moved += self.bytes_per_slot
        self.free_slot(slot)
        return new_table, saved

    def swap_in(self, table: list[int], saved: list, slot: int, keep_on_host: bool
                ) -> list[int] | None:
        """Restore a swapped sequence into ``slot``; its host blocks come back to the device
        unless ``keep_on_host`` (ssc fetches what it selects). None when blocks are short."""
        n_host = sum(b >= self.host_base for b in table)
        if not keep_on_host and not self.can_allocate(n_host):
            return None
        for layer, data in zip(self.slot, saved, strict=True):
            for name, t in layer.items():
                t[slot].copy_(data[name])
        self.bytes_moved += self.bytes_per_slot
        if keep_on_host:
            return list(table)
        return [self.to_device(b) if b >= self.host_base else b for b in table]

    def offload_one(self, table: list[int]) -> int | None:
        """ssc: move the oldest device block of ``table`` that nobody shares to the host tier,
        freeing a device block. Returns its index in the table, or None."""
        if not self.free_host:
            return None
        for i, b in enumerate(table):
            if b < self.host_base and self.ref[b] == 1:
                table[i] = self.to_host(b)
                self.free([b])
                self.num_offloaded += 1
                return i
        return None

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

    # ------------------------------------------------------------------ prefix export / import
    def cached_prefix(self, hashes: list[bytes]) -> int:
        """How many leading ``hashes`` are cached here (no reference taken, no stats counted)."""
        if not self.enable_prefix_caching:
            return 0
        n = 0
        for h in hashes:
            if h not in self.by_hash:
                break
            n += 1
        return n

    def export_blocks(self, hashes: list[bytes], count: bool = True) -> PrefixExport:
        """Copies of the blocks of the longest cached run of ``hashes``, every layer's entries
        (key sums included), on the CPU: what another cache needs to resume from that prefix
        (the last block holds the state at the last boundary). The blocks stay cached and
        become the most recently used (the prefix is hot)."""
        n = self.cached_prefix(hashes)
        ids = [self.by_hash[h] for h in hashes[:n]]
        for bid in ids:
            if bid in self.evictable:
                self.evictable.move_to_end(bid)
        layers: list[dict[str, Tensor]] = []
        for layer in self.block:
            idx = torch.tensor(ids, dtype=torch.long, device=layer["ksum"].device)
            layers.append({name: t.index_select(0, idx).to("cpu")
                           for name, t in layer.items()})
        export = PrefixExport(hashes=list(hashes[:n]), salt_digest=salt_digest(self.salt),
                              layers=layers)
        if count:  # a transfer to another engine (not the disk tier's own copies)
            self.num_exported += n
            self.bytes_exported += export.nbytes
        return export

    def import_blocks(self, export: PrefixExport) -> int:
        """Register the blocks of ``export`` (from ``export_blocks`` of a cache of the same
        model and MC configuration) as cached blocks here: reference count 0, evictable like
        any block whose owner left, found by ``lookup``. Hashes already cached are skipped.
        Stops early when the pool has no block to spare. Returns the blocks written.

        Raises ``ValueError`` when the export comes from another model or configuration."""
        if export.salt_digest != salt_digest(self.salt):
            raise ValueError("the prefix export comes from another model or MC configuration")
        if len(export.layers) != len(self.block):
            raise ValueError(f"the prefix export has {len(export.layers)} layers, this cache "
                             f"{len(self.block)}")
        for li, (mine, theirs) in enumerate(zip(self.block, export.layers, strict=True)):
            for name, t in mine.items():
                got = theirs.get(name)
                if got is None or got.shape[1:] != t.shape[1:] or got.dtype != t.dtype:
                    raise ValueError(f"the prefix export's layer {li} entry {name!r} does not "
                                     f"match this cache's")
        if not self.enable_prefix_caching or not export.hashes:
            return 0
        # hold every block of the chain while importing: allocating the missing ones must not
        # evict the cached ones of the same chain
        held: list[int] = []
        rows: list[int] = []  # rows of the export written, and the blocks they went to
        dest: list[int] = []
        for i, h in enumerate(export.hashes):
            bid = self.by_hash.get(h)
            if bid is not None:
                if self.ref[bid] == 0:
                    del self.evictable[bid]
                self.ref[bid] += 1
                held.append(bid)
                continue
            got = self.allocate(1)
            if got is None:
                break
            held.append(got[0])
            rows.append(i)
            dest.append(got[0])
        if dest:
            for mine, theirs in zip(self.block, export.layers, strict=True):
                dev = mine["ksum"].device
                src_idx = torch.tensor(rows, dtype=torch.long)
                dst_idx = torch.tensor(dest, dtype=torch.long, device=dev)
                for name, t in mine.items():
                    t.index_copy_(0, dst_idx, theirs[name].index_select(0, src_idx).to(dev))
            for i, bid in zip(rows, dest, strict=True):
                self.register(bid, export.hashes[i])
        self.free(held)
        self.num_imported += len(dest)
        self.bytes_imported += len(dest) * self.bytes_per_block
        return len(dest)

    # counters of the prefix transfers (class defaults: the pools' constructor stays as it is)
    num_exported = 0  # blocks copied out by export_blocks
    num_imported = 0  # blocks written by import_blocks
    bytes_exported = 0
    bytes_imported = 0


@dataclass
class PrefixExport:
    """The cached segment checkpoints of a prompt prefix, detached from their engine.

    ``hashes[i]`` is the prefix-cache key of segment i (``chain_hashes``); ``layers[l][name]``
    stacks that layer's block entry ``name`` of every segment, ``(num_blocks, ...)``, on the
    CPU. The last block holds the state at the last segment boundary, from which an engine
    resumes. ``salt_digest`` names the model + MC configuration the blocks belong to.
    ``resume``: the deepest resume point of the prompt past those blocks, when the export was
    made from token ids (``key``, ``pos``, ``segment_fill`` and ``rows``, one dict of slot
    entries per layer). Plain tensors and bytes: it pickles, so it can go through a queue, a
    file or Ray's object store.
    """

    hashes: list[bytes]
    salt_digest: bytes
    layers: list[dict[str, Tensor]] = field(default_factory=list)
    resume: dict | None = None

    @property
    def num_blocks(self) -> int:
        return len(self.hashes)

    @property
    def nbytes(self) -> int:
        rows = self.resume["rows"] if self.resume else []
        return sum(t.numel() * t.element_size()
                   for layer in self.layers + rows for t in layer.values())
