"""The engine replica (``MCServeEngine``, one Serve replica = one ``LLMEngine``), its
``ReplicaAsyncEngine`` (engine calls queued on the engine thread between steps), and the
prefix migration between replicas (``export_prefix`` / ``_migrate``). torch and the engine are
imported when a replica starts, not with this module."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from typing import Any

import ray
from prometheus_client import generate_latest as _generate_latest
from ray import serve

from mcserve.engine.outputs import RequestOutput
from mcserve.engine.prefix_keys import chain_hashes
from mcserve.errors import InvalidRequestError
from mcserve.server.async_engine import (
    AsyncEngine,
    EngineDeadError,
    EngineShutdownError,
    QueueFullError,
    RequestFailedError,
    _Cmd,
)
from mcserve.server.metrics import EngineStatsCollector, ServerMetrics
from mcserve.server.ray.metrics import MigrationMetrics
from mcserve.server.ray.options import RayServeOptions
from mcserve.server.ray.router import short_id

logger = logging.getLogger("mcserve.server")

__all__ = ["MCServeEngine", "ReplicaAsyncEngine"]

# how long a replica waits for a holder's prefix export before it recomputes instead
MIGRATION_TIMEOUT_S = 30.0
# bound on how long an engine-thread call may wait (a dead engine thread never answers)
ENGINE_CALL_TIMEOUT_S = 60.0
# how long a holder asked for a prefix that one of its running prefills is computing waits for
# it before exporting what it has (below MIGRATION_TIMEOUT_S: the asker must get an answer)
EXPORT_WAIT_S = 10.0


class ReplicaAsyncEngine(AsyncEngine):
    """``AsyncEngine`` that also runs arbitrary engine calls on its engine thread, between
    steps and in order with the requests added: an import queued before a request's "add" is
    in the engine before the scheduler looks that request's prefix up."""

    def call_soon(self, fn: Callable[[Any], Any]) -> asyncio.Future[Any]:
        """Queue ``fn(engine)`` on the engine thread; its result (or exception) lands in the
        returned future."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        if self.dead_error is not None:
            fut.set_exception(EngineDeadError(f"the engine stopped: {self.dead_error}"))
            return fut
        self.start()
        with self._cond:
            self._commands.append(_Cmd("call", "", {"fn": fn, "fut": fut, "loop": loop}))
            self._cond.notify()
        return fut

    async def call(self, fn: Callable[[Any], Any], timeout: float = ENGINE_CALL_TIMEOUT_S
                   ) -> Any:
        return await asyncio.wait_for(self.call_soon(fn), timeout)

    def _apply(self, cmds: list[_Cmd]) -> list[tuple[Any, Any]]:
        out: list[tuple[Any, Any]] = []
        batch: list[_Cmd] = []
        for cmd in cmds:  # in order: a call queued before an "add" runs before it
            if cmd.kind != "call":
                batch.append(cmd)
                continue
            if batch:
                out += super()._apply(batch)
                batch = []
            a = cmd.args
            try:
                res, exc = a["fn"](self.engine), None
            except Exception as e:  # noqa: BLE001 - handed to the caller
                res, exc = None, e
            try:
                a["loop"].call_soon_threadsafe(_settle, a["fut"], res, exc)
            except RuntimeError:  # the loop closed: nobody waits
                pass
        if batch:
            out += super()._apply(batch)
        return out


def _settle(fut: asyncio.Future[Any], res: Any, exc: BaseException | None) -> None:
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(res)


# most block hashes a replica reports per routing-stats period (16 bytes each): a pool of
# millions of blocks would otherwise ship megabytes every second
MAX_REPORTED_HASHES = 65536


def _cached_hashes(engine: Any) -> list[bytes]:
    """The hashes of the blocks in use, then of the cached ones most recently used first, up to
    ``MAX_REPORTED_HASHES`` (run on the engine thread)."""
    c = engine.cache
    held = [h for bid, h in enumerate(c.hash_of) if h is not None and c.ref[bid] > 0]
    out = held[:MAX_REPORTED_HASHES]
    for bid in reversed(c.evictable):
        if len(out) >= MAX_REPORTED_HASHES:
            break
        h = c.hash_of[bid]
        if h is not None:
            out.append(h)
    return out


def _export_when_computed(engine: Any, hashes: list[bytes]) -> Any:
    """``engine.export_prefix(hashes=hashes)``, or None while a running prefill is computing
    the first block of ``hashes`` that is not cached yet: the export then waits for it instead
    of sending less and having the asker recompute the rest (run on the engine thread, between
    steps: asked again, it runs after the next step)."""
    n = engine.cache.cached_prefix(hashes)
    if n < len(hashes):
        C = engine.mc.segment_len
        for s in engine.scheduler.running:
            if (s.is_prefill and len(s.block_hashes) <= n <= s.num_tokens // C - 1
                    and chain_hashes(s.all_ids, C, s.salt, n + 1, s.block_hashes)[-1]
                    == hashes[n]):
                return None
    return engine.export_prefix(hashes=hashes)


def _error_item(e: BaseException) -> dict[str, Any]:
    """An engine-side error as data, so the ingress maps it to the single server's answer
    (Ray would otherwise wrap it in its own exception types)."""
    if isinstance(e, InvalidRequestError):
        return {"error": "invalid", "message": str(e), "param": e.param}
    if isinstance(e, ValueError):
        return {"error": "invalid", "message": str(e), "param": None}
    if isinstance(e, QueueFullError):
        return {"error": "queue_full", "message": str(e)}
    if isinstance(e, (EngineShutdownError, EngineDeadError)):
        return {"error": "unavailable", "message": str(e)}
    if isinstance(e, RequestFailedError):
        return {"error": "failed", "message": str(e)}
    return {"error": "failed", "message": f"{type(e).__name__}: {e}"}


class MCServeEngine:
    """One Serve replica: one ``LLMEngine``. Methods are called through a handle routed by
    ``StateAffinityRouter``; requests are plain dicts (the router reads ``hashes`` and ``to``,
    and writes ``route``)."""

    def __init__(self, options: RayServeOptions):
        import torch

        from mcserve.config import EngineConfig
        from mcserve.engine.llm_engine import LLMEngine

        self.options = options
        torch.set_num_threads(max(1, options.cpu_threads))
        ctx = serve.get_replica_context()
        self.replica_id = ctx.replica_id.to_full_id_str()
        self.name = short_id(self.replica_id)
        self.app_name = ctx.app_name
        self.deployment = ctx.deployment
        # a checkpoint that cannot load raises here: Serve fails the deployment with it
        self.llm = LLMEngine(EngineConfig(**options.engine))
        self.metrics = ServerMetrics()
        self.migration = MigrationMetrics(self.metrics.registry)
        self.aengine = ReplicaAsyncEngine(self.llm,
                                          max_waiting_requests=options.max_waiting_requests,
                                          metrics=self.metrics)
        self.metrics.registry.register(EngineStatsCollector(self.aengine))
        self.aengine.start()
        self._peers: Any = None
        # prefix fetches in flight, by (holder, last hash): concurrent requests share one
        self._fetches: dict[tuple[str, bytes], asyncio.Future[dict[str, Any]]] = {}
        # prefix hashes of the requests in flight here (export_prefix: could one be computing
        # what another replica asks for?)
        self._inflight_hashes: dict[bytes, int] = {}
        # a model without segment blocks keeps resume points only: the routing keys of the
        # prompts served here stand for them in the routing stats (most recent last)
        self._served_keys: OrderedDict[bytes, None] = OrderedDict()
        logger.info("replica %s: %s", self.name, self.llm.describe())

    def _peer_handle(self) -> Any:
        if self._peers is None:
            self._peers = serve.get_deployment_handle(self.deployment, self.app_name)
        return self._peers

    # -- info, health, stats -------------------------------------------------------------------
    async def info(self, req: dict[str, Any] | None = None) -> dict[str, Any]:
        """What the ingress needs to stand in for a local engine (and to hash prompts)."""
        llm = self.llm
        m = llm.model_config
        return {
            "replica": self.name, "pid": os.getpid(), "model_name": llm.model_name,
            "max_model_len": int(llm.config.max_model_len),
            "vocab_size": int(m.vocab_size),
            "max_position_embeddings": getattr(m, "max_position_embeddings", None),
            "mc_variant": llm.mc.variant, "mc_selects": bool(llm.mc.selects),
            "segment_len": int(llm.mc.segment_len), "salt": llm.cache.salt,
            "caches_prefixes": bool(llm.prefix_hashes(list(range(2 * llm.mc.segment_len + 1)))),
            "keeps_resume_points": getattr(llm, "resume", None) is not None,
            "describe": llm.describe(),
        }

    async def check_health(self) -> None:
        """Serve restarts a replica whose engine thread died."""
        if self.aengine.dead_error is not None:
            raise RuntimeError(f"the engine stopped: {self.aengine.dead_error}")

    async def record_routing_stats(self) -> dict[str, Any]:
        """The block hashes cached here, for the routers (Serve polls this periodically)."""
        if not self.llm.mc.caches_blocks:
            return {"replica": self.name, "cached": list(reversed(self._served_keys))}
        try:
            hashes = await self.aengine.call(_cached_hashes, timeout=5.0)
        except Exception:  # noqa: BLE001 - stats must not fail the replica
            hashes = []
        return {"replica": self.name, "cached": hashes}

    async def metrics_text(self, req: dict[str, Any] | None = None) -> dict[str, Any]:
        """This replica's Prometheus exposition (the ingress merges all replicas')."""
        return {"replica": self.name,
                "text": _generate_latest(self.metrics.registry).decode()}

    async def stats(self, req: dict[str, Any] | None = None) -> dict[str, Any]:
        c = self.llm.cache
        s = dict(self.aengine.stats())
        s.update(replica=self.name, pools_whole=await self.aengine.call(
            lambda e: e.cache.is_whole() and not e.has_unfinished_requests()),
            num_imported=c.num_imported, num_exported=c.num_exported,
            bytes_imported=c.bytes_imported, bytes_exported=c.bytes_exported)
        return s

    # -- prefix migration ----------------------------------------------------------------------
    async def export_prefix(self, req: dict[str, Any]) -> dict[str, Any]:
        """The blocks of ``req["hashes"]``'s longest cached prefix, put in Ray's object store
        (the caller fetches them by reference). Only when this replica is ``req["to"]``: a
        pinned call that lands elsewhere (the holder died) answers with nothing."""
        if req.get("to") not in (None, self.name):
            return {"replica": self.name, "blocks": 0}
        hashes = list(req.get("hashes") or [])
        if req.get("ids") is not None:  # a model without blocks: its deepest resume point
            ids = list(req["ids"])
            export = await self.aengine.call(lambda e: e.export_prefix(ids))
            if export.resume is None:
                return {"replica": self.name, "blocks": 0}
            return {"replica": self.name, "blocks": 0, "resume": export.resume["pos"],
                    "nbytes": export.nbytes, "ref": [ray.put(export)]}
        # read from the event loop, as ``_migrate`` reads its own index: nothing of it cached
        # here, and no request here that could be computing it (evicted, or a stale guess of
        # the router): say so at once rather than after the engine thread's current step
        n = self.llm.cached_prefix_blocks(hashes)
        computing = n < len(hashes) and self._inflight_hashes.get(hashes[n], 0) > 0
        if not n and not computing:
            return {"replica": self.name, "blocks": 0}
        # a request here is prefilling the rest (the first turns of a new shared prompt, sent
        # to both replicas at once): wait for its blocks, step by step, and send them all; it
        # started before the asker could, so it finishes first
        deadline = time.monotonic() + EXPORT_WAIT_S
        export = None
        while export is None:
            if not computing or time.monotonic() > deadline:
                export = await self.aengine.call(lambda e: e.export_prefix(hashes=hashes))
            else:
                export = await self.aengine.call(lambda e: _export_when_computed(e, hashes))
        if not export.num_blocks:
            return {"replica": self.name, "blocks": 0}
        self.migration.exported_blocks.inc(export.num_blocks)
        # in a list: Serve hands the reference over as is, and the object store serves the
        # bytes to the caller (zero-copy on the same node)
        return {"replica": self.name, "blocks": export.num_blocks, "nbytes": export.nbytes,
                "ref": [ray.put(export)]}

    async def _migrate(self, req: dict[str, Any]) -> dict[str, Any] | None:
        """When another replica holds more of this request's prefix than this one has (the
        router names it in ``req["route"]``), fetch that prefix's blocks from it and queue
        their import before the request's "add", so the scheduler finds them. Requests of one
        prefix that arrive together share one fetch. None: nothing to do."""
        route = req.get("route") or {}
        holder, want = route.get("holder"), int(route.get("holder_blocks") or 0)
        hashes = list(req.get("hashes") or [])[:want]
        if not holder or holder == self.name or not hashes:
            return None
        # a model without segment blocks routes by keys of token pieces, and migrates the
        # holder's deepest resume point of the prompt instead of blocks
        ids = None
        if not self.llm.mc.caches_blocks:
            ids = req.get("prompt_token_ids")
            if self.llm.resume is None or not ids:
                return None
        key = (holder, hashes[-1])
        task = self._fetches.get(key)
        if task is not None:  # another request is fetching this prefix: its import will do
            await asyncio.shield(task)
            return None
        # read from the event loop, not queued on the engine thread: membership tests of the
        # prefix index are atomic under the GIL, and a stale answer costs at most a fetch (or
        # a recompute); the scheduler's own lookup decides what is reused
        if ids is None and self.llm.cached_prefix_blocks(hashes) >= len(hashes):
            return None
        task = asyncio.ensure_future(self._fetch(holder, hashes, ids))
        self._fetches[key] = task
        try:
            return await asyncio.shield(task)
        finally:
            self._fetches.pop(key, None)

    async def _fetch(self, holder: str, hashes: list[bytes], ids: list[int] | None = None
                     ) -> dict[str, Any]:
        t0 = time.perf_counter()
        try:
            ask = {"to": holder, "hashes": hashes, **({"ids": ids} if ids is not None else {})}
            resp = await asyncio.wait_for(self._peer_handle().export_prefix.remote(ask),
                                          MIGRATION_TIMEOUT_S)
            if resp.get("replica") != holder or not (resp.get("blocks") or resp.get("resume")):
                return {"from": holder, "blocks": 0}
            export = await asyncio.wait_for(resp["ref"][0], MIGRATION_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - the holder died or is slow: recompute
            logger.warning("replica %s: migrating %d blocks from %s failed (%s: %s); "
                           "recomputing", self.name, len(hashes), holder, type(e).__name__, e)
            return {"from": holder, "blocks": 0, "failed": True}
        # queued now, before any request of this prefix is added
        fut = self.aengine.call_soon(lambda eng: eng.import_prefix(export))
        fetched = time.perf_counter() - t0
        self.migration.seconds.observe(fetched)
        return {"from": holder, "future": fut, "seconds": fetched, "nbytes": export.nbytes,
                "exported": export.num_blocks,
                "resume": export.resume["pos"] if export.resume is not None else None}

    # -- generation ----------------------------------------------------------------------------
    async def generate(self, req: dict[str, Any]) -> AsyncIterator[Any]:
        """Stream one request: first ``{"accepted": ...}`` (or an error item), then the
        engine's cumulative ``RequestOutput``s, or an error item if it fails on the way."""
        hashes = list(req.get("hashes") or [])
        for h in hashes:
            self._inflight_hashes[h] = self._inflight_hashes.get(h, 0) + 1
        gen = self._generate(req)
        try:
            async for item in gen:
                yield item
        finally:
            await gen.aclose()  # its own finally (the abort) runs now, not when collected
            for h in hashes:
                left = self._inflight_hashes.get(h, 0) - 1
                if left > 0:
                    self._inflight_hashes[h] = left
                else:
                    self._inflight_hashes.pop(h, None)
            if not self.llm.mc.caches_blocks and self.llm.resume is not None:
                for h in hashes:  # its resume points are here now (a guess the router checks)
                    self._served_keys[h] = None
                    self._served_keys.move_to_end(h)
                while len(self._served_keys) > MAX_REPORTED_HASHES:
                    self._served_keys.popitem(last=False)

    async def _generate(self, req: dict[str, Any]) -> AsyncIterator[Any]:
        rid = req["request_id"]
        ids = req.get("prompt_token_ids")
        migration = None
        route = req.get("route")
        if route:
            self.migration.routed.labels(reason=str(route.get("reason"))).inc()
            migration = await self._migrate(req)
        try:
            marks = req.get("resume_positions")
            stream = self.aengine.submit(rid, req.get("prompt"), req["params"],
                                         prompt_token_ids=ids,
                                         mc_overrides=req.get("mc_overrides"),
                                         **({"resume_positions": marks} if marks else {}))
        except Exception as e:  # noqa: BLE001 - queue full, shutting down, engine dead
            yield _error_item(e)
            return
        try:
            await stream.wait_accepted()
        except Exception as e:  # noqa: BLE001 - refused by the engine
            yield _error_item(e)
            return
        info: dict[str, Any] = {"accepted": True, "replica": self.name}
        if migration is not None:
            migration = dict(migration)
            fut = migration.pop("future", None)
            blocks = 0
            if fut is not None:
                try:
                    blocks = await asyncio.wait_for(fut, ENGINE_CALL_TIMEOUT_S)
                except Exception as e:  # noqa: BLE001 - a failed import: recomputed
                    logger.warning("replica %s: import failed: %s", self.name, e)
                    migration["failed"] = True
            resumed = migration.get("resume") is not None and not migration.get("failed")
            if blocks or resumed:
                outcome = "imported"
                self.migration.blocks.inc(blocks)
                nbytes = self.llm.cache.bytes_per_block * blocks
                if resumed:
                    self.migration.resume_points.inc()
                    nbytes = int(migration.get("nbytes") or 0)
                self.migration.bytes.inc(nbytes)
                migration["nbytes"] = nbytes
            else:
                outcome = "failed" if migration.get("failed") else "empty"
            self.migration.migrations.labels(outcome=outcome).inc()
            migration["blocks"] = blocks
            info["migration"] = migration
        yield info
        last: RequestOutput | None = None
        try:
            async for out in stream:
                last = out
                yield out
        except Exception as e:  # noqa: BLE001 - failed inside the engine, or shut down
            yield _error_item(e)
        finally:
            stream.abort()
            if last is not None and last.finished:
                recomputed = len(last.prompt_token_ids) - (last.num_cached_tokens or 0)
                self.migration.recomputed.inc(max(0, recomputed))

    async def __del__(self) -> None:
        # Serve has already waited for the ongoing requests (graceful_shutdown_timeout_s)
        await self.aengine.shutdown(0.0)
