"""Resume points: the whole recurrent state of a sequence at a token position, kept so that a
later request whose prompt starts with the same tokens computes only the rest (docs/engine.md).

A resume point is a copy of one slot row of the state cache (every layer's online memory, conv
tail, partial-segment key sum and collapsed sum: exactly what a running sequence continues
from), or for private states (``loglinear``) a copy of the sequence's model state. For MC
models with constant segments the cached segments before the position stay pool blocks, found
through their own keys; the resume point adds the partial segment.

Keys are ``prefix_keys.resume_key``: the hash of the tokens before the position, salted by
model and MC configuration. Three tiers, each bounded in bytes, least recently used first out:

* **device**: tensors on the model's device (host memory on a CPU-only machine);
* **host** (GPU only): pinned host copies, where device points spill first;
* **disk** (``state_cache_dir``): one self-describing safetensors file per point (format,
  salt fingerprint, key, position, a checksum of the tensors), indexed at start-up, loaded on a
  hit; a file that fails any check is skipped with one warning, never loaded.

A point handed to the scheduler is *pinned* until the runner has copied it into the slot;
pinned points are never evicted.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import math
import os
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from mcserve.engine.prefix_keys import ResumeHasher, salt_digest
from mcserve.engine.state_cache import PrefixExport

log = logging.getLogger(__name__)

FORMAT = "mcserve-resume-1"
_SUFFIX = ".safetensors"
_MISS_MEMORY = 4096  # keys of recently dropped points, to say why a prompt missed


@dataclass(eq=False)
class ResumePoint:
    key: bytes
    pos: int  # tokens whose effect is in the state
    segment_fill: int  # tokens of the online segment at ``pos``
    nbytes: int
    rows: list[dict[str, Tensor]] | None = None  # slot layout, one dict per layer
    private: Any = None  # a ModelState (private states: loglinear)
    tier: str = "device"  # "device" | "host" | "disk"
    pins: int = 0
    # MC models with segment blocks: the keys of the blocks before ``pos`` (what the point
    # needs in the pool), and, read back from disk, their contents until imported
    block_hashes: list[bytes] = field(default_factory=list)
    blocks: PrefixExport | None = None
    # hybrid models: the KV pool blocks of the tokens before ``pos`` (the store holds a
    # reference on each; the last one may be partial). Leaving the device tier, the point
    # copies that KV out (``kv``) and gives the blocks back (``release_kv``)
    kv_blocks: list[int] | None = None
    # a hybrid's point out of the KV pool (host tier, disk, export): that KV as tensors
    # ``(attention layers, pos, Hkv, D)``, keys and values; written into new blocks on a hit
    kv: tuple[Tensor, Tensor] | None = None


def _checksum(tensors: dict[str, Tensor]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _flat(rows: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    return {f"{li}.{name}": t for li, layer in enumerate(rows) for name, t in layer.items()}


class ResumeStore:
    """The resume points of one engine (not thread-safe: the engine thread owns it).

    ``layout[l]`` maps each slot tensor name of layer l to the (shape, dtype) of one row: what
    a point holds and what a disk file must match. ``budget_bytes`` bounds the device tier,
    ``host_bytes`` the host tier (0: none; the engine gives none to a CPU device, whose tier
    is host memory already), ``disk_bytes`` the disk tier in ``disk_dir``."""

    def __init__(self, salt: bytes, layout: list[dict[str, tuple[tuple[int, ...], torch.dtype]]],
                 *, device: torch.device, budget_bytes: int, host_bytes: int = 0,
                 disk_dir: str | os.PathLike | None = None, disk_bytes: int = 0,
                 export_blocks: Callable[[list[bytes]], PrefixExport] | None = None,
                 release_kv: Callable[[list[int]], None] | None = None,
                 kv_layout: tuple[int, int, int, torch.dtype] | None = None,
                 read_kv: Callable[[list[int], int], tuple[Tensor, Tensor]] | None = None):
        self.salt = salt
        self.digest = salt_digest(salt).hex()
        self.layout = layout
        self.device = torch.device(device)
        self.budget_bytes = int(budget_bytes)
        self.host_budget = int(host_bytes)
        self.disk_dir = Path(disk_dir) if disk_dir else None
        self.disk_budget = int(disk_bytes)
        self.export_blocks = export_blocks  # copies of pool blocks by key (for disk files)
        self.release_kv = release_kv  # gives a hybrid point's KV blocks back to the KV pool
        self.kv_layout = kv_layout  # hybrids: (attention layers, Hkv, D, dtype) of their KV
        self.read_kv = read_kv  # hybrids: CPU copies of the KV of (blocks, tokens)
        self.kv_held = 0  # KV blocks the points hold
        self.points: OrderedDict[bytes, ResumePoint] = OrderedDict()  # memory tiers, LRU first
        self.disk: OrderedDict[bytes, ResumePoint] = OrderedDict()  # disk tier, LRU first
        self.positions: Counter[int] = Counter()  # pos -> points there (every tier)
        self.used = {"device": 0, "host": 0, "disk": 0}
        self.dropped: OrderedDict[bytes, None] = OrderedDict()  # recently dropped keys
        self.num_taken = 0
        self.num_hits = 0
        self.num_evicted = 0  # dropped from the last tier
        self.num_spilled_host = 0
        self.num_spilled_disk = 0
        self.num_loaded_disk = 0
        self.num_bad_files = 0
        self.row_bytes = sum(math.prod(shape) * torch.empty((), dtype=dt).element_size()
                             for layer in layout for shape, dt in layer.values())
        if self.disk_dir is not None:
            self._index_disk()

    # ------------------------------------------------------------------ queries
    def __len__(self) -> int:
        return len(self.points) + len(self.disk)

    def has(self, key: bytes) -> bool:
        return key in self.points or key in self.disk

    def touch(self, key: bytes) -> None:
        if key in self.points:
            self.points.move_to_end(key)
        elif key in self.disk:
            self.disk.move_to_end(key)

    def capacity(self) -> int:
        """How many points of this model's state the device tier holds."""
        return self.budget_bytes // max(1, self.row_bytes)

    def lookup(self, token_ids: list[int], salt: bytes, lo: int, hi: int,
               accept: Callable[[ResumePoint], bool] | None = None, count: bool = True
               ) -> tuple[ResumePoint | None, str]:
        """The deepest resume point at a position in ``[lo, hi]`` whose key matches
        ``token_ids`` under ``salt`` (and that ``accept`` takes), pinned for the caller
        (``unpin`` once copied), with the reason of a miss (``"no match"``, ``"evicted"``,
        ``"different salt"``). A point on disk is loaded (and moves to the device tier); one
        that fails to load is dropped with a warning and the next deepest is tried."""
        cands = [p for p in self.positions if lo <= p <= hi]
        if not cands:
            return None, "no match"
        keys = ResumeHasher(salt).keys(token_ids, cands)
        for p in sorted(cands, reverse=True):
            k = keys[p]
            rp = self.points.get(k)
            if rp is None and k in self.disk:
                rp = self._load(self.disk[k])
            if rp is None or (accept is not None and not accept(rp)):
                continue
            self.points.move_to_end(k)
            rp.pins += 1
            self.num_hits += count
            return rp, ""
        if any(keys[p] in self.dropped for p in cands):
            return None, "evicted"
        if salt != self.salt:
            base = ResumeHasher(self.salt).keys(token_ids, cands)
            if any(self.has(k) for k in base.values()):
                return None, "different salt"
        return None, "no match"

    def unpin(self, rp: ResumePoint) -> None:
        rp.pins -= 1
        self._fit()

    # ------------------------------------------------------------------ taking points
    def put_rows(self, key: bytes, pos: int, segment_fill: int,
                 rows: list[dict[str, Tensor]], block_hashes: list[bytes] | None = None,
                 kv_blocks: list[int] | None = None,
                 kv: tuple[Tensor, Tensor] | None = None) -> None:
        """Keep ``rows`` (the caller's copies of a slot row, every layer) as the resume point
        ``key`` at ``pos``, after the pool blocks ``block_hashes`` (MC segment blocks); for a
        hybrid, with the KV blocks ``kv_blocks`` whose references the caller hands over (given
        back at once when the point is not kept), or its KV as tensors ``kv``."""
        nbytes = sum(t.numel() * t.element_size() for layer in rows for t in layer.values())
        if kv is not None:
            nbytes += sum(t.numel() * t.element_size() for t in kv)
        self._add(ResumePoint(key, pos, segment_fill, nbytes, rows=rows,
                              block_hashes=list(block_hashes or ()), kv_blocks=kv_blocks, kv=kv))

    def put_private(self, key: bytes, pos: int, segment_fill: int, state: Any) -> None:
        """Keep a copy of a private model state (``loglinear``) as the resume point ``key``."""
        state = copy.deepcopy(state)
        nbytes = 0
        for ls in state.layers:
            ts = list(ls.mc.mem.values()) + list(ls.mc.cached.values()) + [ls.mc.seg_ksum,
                                                                          ls.mc.cached_ksum]
            if ls.conv is not None:
                ts.append(ls.conv)
            nbytes += sum(t.numel() * t.element_size() for t in ts)
        self._add(ResumePoint(key, pos, segment_fill, nbytes, private=state))

    def _add(self, rp: ResumePoint) -> None:
        if self.has(rp.key) or rp.nbytes > self.budget_bytes:
            self.touch(rp.key)
            if rp.kv_blocks is not None:
                self.release_kv(rp.kv_blocks)
            return
        if rp.kv_blocks is not None:
            self.kv_held += len(rp.kv_blocks)
        self.dropped.pop(rp.key, None)
        self.points[rp.key] = rp
        self.positions[rp.pos] += 1
        self.used["device"] += rp.nbytes
        self.num_taken += 1
        self._fit()

    # ------------------------------------------------------------------ tiers
    def _fit(self) -> None:
        """Spill or drop least recently used unpinned points until every tier fits."""
        for tier, budget in (("device", self.budget_bytes), ("host", self.host_budget)):
            while self.used[tier] > budget:
                victim = next((rp for rp in self.points.values()
                               if rp.tier == tier and not rp.pins), None)
                if victim is None:
                    break
                self._spill(victim)

    def drop_kv(self, enough: Callable[[], bool]) -> None:
        """Move unpinned hybrid points out of the KV pool, least recently used first, until
        ``enough()``: their KV blocks are wanted by a running sequence."""
        for rp in [p for p in self.points.values() if p.kv_blocks is not None and not p.pins]:
            if enough():
                return
            self._spill(rp)  # to the host or disk tier with its KV copied out, else dropped

    def _materialize(self, rp: ResumePoint) -> int:
        """A hybrid point's KV copied out of the KV pool (host memory), its blocks given back;
        returns the bytes the point grew by."""
        rp.kv = self.read_kv(rp.kv_blocks, rp.pos)
        self.release_kv(rp.kv_blocks)
        self.kv_held -= len(rp.kv_blocks)
        rp.kv_blocks = None
        grow = sum(t.numel() * t.element_size() for t in rp.kv)
        rp.nbytes += grow
        return grow

    def _spill(self, rp: ResumePoint) -> None:
        """Move ``rp`` one tier down: device -> host -> disk -> dropped. A hybrid's point
        leaves the device tier with its KV copied out of the KV pool (or is dropped when no
        tier below takes it)."""
        if rp.kv_blocks is not None:
            if self.disk_dir is None and not self.host_budget:
                del self.points[rp.key]
                self.used[rp.tier] -= rp.nbytes
                self._forget(rp)
                return
            self.used[rp.tier] += self._materialize(rp)
        if rp.tier == "device" and rp.rows is not None and self.host_budget >= rp.nbytes:
            pin = torch.cuda.is_available()
            rp.rows = [{n: t.to("cpu", copy=True).pin_memory() if pin else t.to("cpu", copy=True)
                        for n, t in layer.items()} for layer in rp.rows]
            if rp.kv is not None:
                rp.kv = tuple(t.to("cpu") for t in rp.kv)
            self.used["device"] -= rp.nbytes
            self.used["host"] += rp.nbytes
            rp.tier = "host"
            self.num_spilled_host += 1
            return
        del self.points[rp.key]
        self.used[rp.tier] -= rp.nbytes
        if rp.rows is not None and self.disk_dir is not None and self._write(rp):
            return
        self._forget(rp)

    def _forget(self, rp: ResumePoint) -> None:
        if rp.kv_blocks is not None:
            self.release_kv(rp.kv_blocks)
            self.kv_held -= len(rp.kv_blocks)
            rp.kv_blocks = None
        rp.kv = None
        self.positions[rp.pos] -= 1
        if not self.positions[rp.pos]:
            del self.positions[rp.pos]
        self.num_evicted += 1
        self.dropped[rp.key] = None
        while len(self.dropped) > _MISS_MEMORY:
            self.dropped.popitem(last=False)

    # ------------------------------------------------------------------ disk tier
    def _path(self, key: bytes) -> Path:
        assert self.disk_dir is not None
        return self.disk_dir / f"{key.hex()}{_SUFFIX}"

    def _write(self, rp: ResumePoint) -> bool:
        """``rp`` as a file of the disk tier (its rows dropped from memory); False when it
        does not fit or the write failed (warned)."""
        from safetensors.torch import save_file

        if rp.nbytes > self.disk_budget:
            return False
        while self.used["disk"] + rp.nbytes > self.disk_budget and self.disk:
            _, old = self.disk.popitem(last=False)
            self._unlink(old)
            self.used["disk"] -= old.nbytes
            self._forget(old)
        tensors = {n: t.detach().to("cpu").contiguous() for n, t in _flat(rp.rows).items()}
        if rp.kv is not None:
            tensors["kv.k"], tensors["kv.v"] = (t.to("cpu").contiguous() for t in rp.kv)
        if rp.block_hashes:  # the segment blocks before it go into the file too
            if rp.blocks is not None:  # read back from disk and not used since
                export = rp.blocks
            elif self.export_blocks is not None:
                export = self.export_blocks(rp.block_hashes)
            else:
                return False
            if export.num_blocks < len(rp.block_hashes):  # some were evicted: of no use
                return False
            tensors.update({f"b.{n}": t.contiguous() for n, t in _flat(export.layers).items()})
        meta = {"format": FORMAT, "salt": self.digest, "key": rp.key.hex(), "pos": str(rp.pos),
                "segment_fill": str(rp.segment_fill),
                "blocks": ",".join(h.hex() for h in rp.block_hashes),
                "checksum": _checksum(tensors)}
        path = self._path(rp.key)
        tmp = path.with_suffix(".tmp")
        try:
            self.disk_dir.mkdir(parents=True, exist_ok=True)
            save_file(tensors, str(tmp), metadata=meta)
            os.replace(tmp, path)
        except OSError as e:
            log.warning("state cache: could not write a resume point to %s: %s", path, e)
            tmp.unlink(missing_ok=True)
            return False
        rp.rows, rp.kv, rp.tier = None, None, "disk"
        rp.nbytes = path.stat().st_size
        self.disk[rp.key] = rp
        self.used["disk"] += rp.nbytes
        self.num_spilled_disk += 1
        return True

    def _unlink(self, rp: ResumePoint) -> None:
        try:
            self._path(rp.key).unlink(missing_ok=True)
        except OSError as e:
            log.warning("state cache: could not remove %s: %s", self._path(rp.key), e)

    def _check_meta(self, meta: dict[str, str] | None, path: Path) -> str | None:
        """Why the header of ``path`` does not belong to this cache (None: it does)."""
        if not meta or meta.get("format") != FORMAT:
            return "not a resume point file"
        if meta.get("salt") != self.digest:
            return "another model or MC configuration"
        if meta.get("key") != path.name[:-len(_SUFFIX)]:
            return "its name does not match its key"
        if not (meta.get("pos", "").isdigit() and meta.get("segment_fill", "").isdigit()):
            return "a malformed header"
        return None

    def _index_disk(self) -> None:
        """Index the files of ``disk_dir`` (headers only; tensors are read on a hit), oldest
        first; skip, with one warning line, the files that are not this cache's."""
        from safetensors import safe_open

        assert self.disk_dir is not None
        if not self.disk_dir.is_dir():
            return
        skipped: Counter[str] = Counter()
        files = sorted(self.disk_dir.glob(f"*{_SUFFIX}"), key=lambda f: f.stat().st_mtime)
        for f in files:
            try:
                with safe_open(str(f), framework="pt") as fh:
                    meta = fh.metadata()
            except Exception:  # noqa: BLE001 - a corrupt header is skipped, never fatal
                skipped["unreadable"] += 1
                continue
            why = self._check_meta(meta, f)
            if why is not None:
                skipped[why] += 1
                continue
            key = bytes.fromhex(meta["key"])
            size = f.stat().st_size
            if self.used["disk"] + size > self.disk_budget:
                skipped["over the disk budget"] += 1
                continue
            rp = ResumePoint(key, int(meta["pos"]), int(meta["segment_fill"]), size,
                             tier="disk")
            self.disk[key] = rp
            self.positions[rp.pos] += 1
            self.used["disk"] += size
        if skipped:
            self.num_bad_files += sum(skipped.values())
            log.warning("state cache: skipped %d file(s) in %s (%s)", sum(skipped.values()),
                        self.disk_dir, ", ".join(f"{n}: {why}" for why, n in skipped.items()))

    def _load(self, rp: ResumePoint) -> ResumePoint | None:
        """Read a disk point into the device tier; None (dropped, warned) when its file fails
        any check: unreadable or truncated, another configuration, shapes, checksum."""
        from safetensors import safe_open

        path = self._path(rp.key)
        del self.disk[rp.key]
        self.used["disk"] -= rp.nbytes
        try:
            with safe_open(str(path), framework="pt") as fh:
                meta = fh.metadata()
                why = self._check_meta(meta, path)
                tensors = {n: fh.get_tensor(n) for n in fh.keys()} if why is None else {}
            if why is None:
                why = self._check_tensors(tensors, meta)
        except Exception as e:  # noqa: BLE001 - a corrupt file is skipped, never fatal
            why = f"unreadable ({type(e).__name__})"
        if why is not None:
            log.warning("state cache: skipped resume point file %s: %s", path, why)
            self.num_bad_files += 1
            self._unlink(rp)
            self._forget(rp)
            return None
        self._unlink(rp)
        rows = [{name: tensors[f"{li}.{name}"].to(self.device) for name in layer}
                for li, layer in enumerate(self.layout)]
        rp.rows, rp.tier = rows, "device"
        if "kv.k" in tensors:
            rp.kv = (tensors["kv.k"], tensors["kv.v"])
        hashes = [bytes.fromhex(h) for h in meta.get("blocks", "").split(",") if h]
        rp.block_hashes = hashes
        if hashes:
            n_layers = len(self.layout)
            layers: list[dict[str, Tensor]] = [{} for _ in range(n_layers)]
            for name, t in tensors.items():
                if name.startswith("b."):
                    li, _, entry = name[2:].partition(".")
                    layers[int(li)][entry] = t
            rp.blocks = PrefixExport(hashes=hashes, salt_digest=salt_digest(self.salt),
                                     layers=layers)
        rp.nbytes = sum(t.numel() * t.element_size() for layer in rows for t in layer.values())
        if rp.kv is not None:
            rp.nbytes += sum(t.numel() * t.element_size() for t in rp.kv)
        self.points[rp.key] = rp
        self.used["device"] += rp.nbytes
        self.num_loaded_disk += 1
        return rp

    def check_rows(self, rows: list[dict[str, Tensor]]) -> str | None:
        """Why ``rows`` (one dict of slot entries per layer) is not a state of this model
        (None: it is): the layers, entry names, shapes and dtypes of ``layout``."""
        if len(rows) != len(self.layout):
            return f"{len(rows)} layers, this model has {len(self.layout)}"
        for li, (row, want) in enumerate(zip(rows, self.layout)):
            if set(row) != set(want):
                return f"layer {li}'s entries differ from this model's state"
            for name, (shape, dtype) in want.items():
                t = row[name]
                if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
                    return (f"entry {li}.{name} is {tuple(t.shape)} {t.dtype}, expected "
                            f"{shape} {dtype}")
        return None

    def check_kv(self, kv: tuple[Tensor, ...] | None, pos: int) -> str | None:
        """Why ``kv`` (keys and values) is not the attention KV of ``pos`` tokens of this
        model (None: it is, or the model has no attention layers and ``kv`` is None)."""
        if self.kv_layout is None:
            return None if kv is None else "attention KV this model does not have"
        if kv is None or len(kv) != 2:
            return "its attention KV is missing"
        n, hkv, d, dtype = self.kv_layout
        for t in kv:
            if tuple(t.shape) != (n, pos, hkv, d) or t.dtype != dtype:
                return (f"its attention KV is {tuple(t.shape)} {t.dtype}, expected "
                        f"{(n, pos, hkv, d)} {dtype}")
        return None

    def _check_tensors(self, tensors: dict[str, Tensor], meta: dict[str, str]) -> str | None:
        n_blocks = len([h for h in meta.get("blocks", "").split(",") if h])
        blocks = {n for n in tensors if n.startswith("b.")}
        if bool(blocks) != bool(n_blocks) or any(tensors[n].shape[0] != n_blocks
                                                 for n in blocks):
            return "its blocks do not match its header"
        why = self.check_kv(tuple(tensors[n] for n in ("kv.k", "kv.v") if n in tensors) or None,
                            int(meta["pos"]))
        if why is not None:
            return why
        rows: list[dict[str, Tensor]] = [{} for _ in self.layout]
        for name, t in tensors.items():
            if name.startswith("kv."):
                continue
            li, _, entry = name.partition(".")
            if name in blocks or not li.isdigit() or int(li) >= len(rows):
                if name not in blocks:
                    return f"an entry {name!r} this model's state does not have"
                continue
            rows[int(li)][entry] = t
        why = self.check_rows(rows)
        if why is not None:
            return why
        if _checksum(tensors) != meta.get("checksum"):
            return "checksum mismatch"
        return None

    def default_interval(self, max_model_len: int) -> int:
        """The grid of resume points when none is configured: 256 prompt tokens if the device
        tier holds 32 points of this model, else the power-of-two multiple of 256 that keeps
        the grid of a ``max_model_len`` prompt within about 32 points (at most 4096)."""
        fit, interval = self.capacity(), 256
        while interval < 4096 and fit < 32 and interval * 32 < max_model_len:
            interval *= 2
            fit *= 2
        return interval

    def export_point(self, rp: ResumePoint) -> dict:
        """``rp`` detached from this store (CPU copies; for ``PrefixExport.resume``)."""
        out = {"key": rp.key, "pos": rp.pos, "segment_fill": rp.segment_fill,
               "rows": [{name: t.to("cpu", copy=True) for name, t in layer.items()}
                        for layer in rp.rows]}
        if rp.kv_blocks is not None:  # a hybrid's: its KV too
            out["kv"] = self.read_kv(rp.kv_blocks, rp.pos)
        elif rp.kv is not None:
            out["kv"] = tuple(t.to("cpu", copy=True) for t in rp.kv)
        return out

    def check_point(self, point: dict) -> str | None:
        """Why an ``export_point`` is not a state of this model (None: it is)."""
        return (self.check_rows(point["rows"])
                or self.check_kv(point.get("kv"), int(point["pos"])))

    def import_point(self, point: dict, block_hashes: list[bytes] | None) -> None:
        """Keep an ``export_point`` of another store of the same model as a resume point here.
        Raises ``ValueError`` when its state is not this model's."""
        why = self.check_point(point)
        if why is not None:
            raise ValueError(f"the prefix export's resume point does not match this engine's "
                             f"state: {why}")
        kv = point.get("kv")
        self.put_rows(point["key"], int(point["pos"]), int(point["segment_fill"]),
                      [{k: t.to(self.device) for k, t in r.items()} for r in point["rows"]],
                      block_hashes, kv=None if kv is None else tuple(kv))

    def flush(self) -> int:
        """Write every point held in memory to the disk tier (at shutdown, so a restarted
        engine finds them); returns the points written. No-op without a disk tier."""
        if self.disk_dir is None:
            return 0
        n = 0
        for rp in list(self.points.values()):
            if rp.rows is None or rp.pins:
                continue
            if rp.kv_blocks is not None:  # a hybrid's: its KV out of the pool, into the file
                self.used[rp.tier] += self._materialize(rp)
            del self.points[rp.key]
            self.used[rp.tier] -= rp.nbytes
            if self._write(rp):
                n += 1
            else:
                self._forget(rp)
        return n

    def stats(self) -> dict[str, int]:
        return {
            "resume_points": len(self.points),
            "resume_points_disk": len(self.disk),
            "resume_bytes_device": self.used["device"],
            "resume_bytes_host": self.used["host"],
            "resume_bytes_disk": self.used["disk"],
            "resume_points_taken": self.num_taken,
            "resume_points_hit": self.num_hits,
            "resume_points_evicted": self.num_evicted,
            "resume_points_spilled_host": self.num_spilled_host,
            "resume_points_spilled_disk": self.num_spilled_disk,
            "resume_points_loaded_disk": self.num_loaded_disk,
            "resume_files_skipped": self.num_bad_files,
        }

