"""Scale-out with Ray Serve: N engine replicas behind one OpenAI-compatible endpoint.

::

    HTTP ─▶ Serve proxy ─▶ MCServeIngress (build_app over RemoteAsyncEngine)
                              │ DeploymentHandle, streamed; StateAffinityRouter picks the replica
                              ▼
                           MCServeEngine × N (one LLMEngine each, on its engine thread)
                              │ export_prefix through the same handle + Ray's object store
                              ▼
                           the replica that holds a prompt's cached prefix

* **Ingress** (``MCServeIngress``): the single-process app of ``build_app`` (same routes,
  validation, errors, streaming, drain), over ``RemoteAsyncEngine``, which submits each
  request to the engine deployment through a Serve ``DeploymentHandle`` instead of a local
  engine thread. It tokenizes (so the prompt's segment-aligned block hashes, the engine's
  prefix-cache keys, travel with the request), answers with an ``x-mcserve-replica`` header,
  and serves every replica's ``mcserve:`` metrics on one ``/metrics`` with a ``replica`` label.
* **Engine replicas** (``MCServeEngine``): an ``LLMEngine`` driven by an ``AsyncEngine``, with
  calls queued on the engine thread between steps for the prefix export / import.
* **Routing** (``StateAffinityRouter``, a Ray Serve ``RequestRouter``): a request goes to the
  replica holding the longest cached prefix of its prompt (what it routed there, and the block
  hashes each replica reports through ``record_routing_stats``); when that replica's queue is
  longer than the shortest by more than ``imbalanced_threshold``, to the least loaded one,
  which then *migrates* the prefix: it asks the holder (the same handle, pinned to it) for
  ``export_prefix``, gets the blocks through Ray's object store, imports them and prefills only
  the rest. Token-identical to a recompute (tests/test_ray_serve.py).

``build_serve_app(options)`` builds the Serve application (``mcserve serve --replicas N``);
``app_builder(args)`` is the same for ``serve run mcserve.server.ray_app:app_builder`` and a
KubeRay RayService (docs/scale-out.md).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
from fastapi import FastAPI
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram
from prometheus_client import generate_latest as _generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from ray import serve
from ray.serve.config import RequestRouterConfig
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mcserve.engine.outputs import RequestOutput
from mcserve.engine.prefix_keys import chain_hashes, prompt_block_hashes, request_salt
from mcserve.errors import InvalidRequestError
from mcserve.server.app import DRAIN_SETTLE_S
from mcserve.server.async_engine import (
    AsyncEngine,
    EngineDeadError,
    EngineShutdownError,
    QueueFullError,
    RequestFailedError,
    _Cmd,
)
from mcserve.server.errors import RETRY_AFTER_QUEUE_S, APIError, unavailable
from mcserve.server.metrics import EngineStatsCollector, ServerMetrics
from mcserve.server.ray_router import StateAffinityRouter, short_id

logger = logging.getLogger("mcserve.server")

__all__ = [
    "ENGINE_DEPLOYMENT",
    "DeploymentFailed",
    "INGRESS_DEPLOYMENT",
    "REPLICA_HEADER",
    "MCServeEngine",
    "MCServeIngress",
    "RayServeOptions",
    "RemoteAsyncEngine",
    "StateAffinityRouter",
    "app_builder",
    "build_serve_app",
    "deploy",
]

ENGINE_DEPLOYMENT = "MCServeEngine"
INGRESS_DEPLOYMENT = "MCServeIngress"
REPLICA_HEADER = "x-mcserve-replica"
# how long a replica waits for a holder's prefix export before it recomputes instead
MIGRATION_TIMEOUT_S = 30.0
# bound on how long an engine-thread call may wait (a dead engine thread never answers)
ENGINE_CALL_TIMEOUT_S = 60.0
# how long a holder asked for a prefix that one of its running prefills is computing waits for
# it before exporting what it has (below MIGRATION_TIMEOUT_S: the asker must get an answer)
EXPORT_WAIT_S = 10.0


# --------------------------------------------------------------------------------------------
# options
# --------------------------------------------------------------------------------------------


@dataclass
class RayServeOptions:
    """What ``mcserve serve --replicas N`` deploys: the engine flags (``EngineConfig`` fields)
    and the server flags of the single-process server, plus the replica layout."""

    engine: dict[str, Any] = field(default_factory=dict)  # EngineConfig(**engine)
    replicas: int = 2
    cpu_threads: int = 1  # torch threads (and Ray CPUs) per replica
    num_gpus: float | None = None  # per replica; None: 1 when the device is CUDA, else 0
    router: str = "state"  # "state" (StateAffinityRouter) or "pow2" (Ray Serve's default)
    # queue-length gap beyond which affinity yields to load: small, since the replica that
    # takes the request migrates the prefix instead of recomputing it
    imbalanced_threshold: int = 1
    routing_stats_period_s: float = 1.0
    max_ongoing_requests: int = 256  # per replica, for Serve's router; the engine queues
    api_key: str | None = None
    served_model_name: str | None = None
    max_body_bytes: int = 4 * 2**20
    max_waiting_requests: int | None = 512  # per replica: beyond it, 429
    shutdown_grace_s: float = 10.0
    ingress_replicas: int = 1
    max_constructor_retry_count: int = 1  # a replica that cannot load the model fails fast
    health_check_period_s: float = 2.0
    app_name: str = "mcserve"


def _model_dir(engine: dict[str, Any]) -> Path:
    from mcserve.engine.llm_engine import DEFAULT_MODEL_DIR

    return Path(engine["model"]) if engine.get("model") else DEFAULT_MODEL_DIR


# --------------------------------------------------------------------------------------------
# engine replica
# --------------------------------------------------------------------------------------------


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


class MigrationMetrics:
    """Per-replica counters of prefix migrations, in the replica's Prometheus registry."""

    def __init__(self, registry: CollectorRegistry):
        self.migrations = Counter(
            "mcserve:state_migrations",
            "Prefix migrations this replica asked for, by outcome (imported: blocks came from "
            "the holder; empty: the holder had nothing; failed: recomputed instead).",
            ["outcome"], registry=registry)
        self.blocks = Counter("mcserve:state_migrated_blocks",
                              "State blocks imported from another replica.", registry=registry)
        self.bytes = Counter("mcserve:state_migrated_bytes",
                             "Bytes of state blocks imported from another replica.",
                             registry=registry)
        self.seconds = Histogram(
            "mcserve:state_migration_seconds",
            "Time to fetch a prefix's blocks from the holder and queue their import.",
            registry=registry,
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0))
        self.recomputed = Counter(
            "mcserve:prompt_tokens_recomputed",
            "Prompt tokens prefilled because no cached state (local or migrated) covered "
            "them.", registry=registry)
        self.routed = Counter(
            "mcserve:routed_requests",
            "Requests the state-affinity router sent here, by reason (affinity: this replica "
            "held the longest cached prefix; fallback: another did but was busier, so the "
            "prefix was migrated; cold: no replica held a prefix of it).", ["reason"],
            registry=registry)
        self.exported_blocks = Counter(
            "mcserve:state_exported_blocks",
            "State blocks this replica exported to others.", registry=registry)


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
            "describe": llm.describe(),
        }

    async def check_health(self) -> None:
        """Serve restarts a replica whose engine thread died."""
        if self.aengine.dead_error is not None:
            raise RuntimeError(f"the engine stopped: {self.aengine.dead_error}")

    async def record_routing_stats(self) -> dict[str, Any]:
        """The block hashes cached here, for the routers (Serve polls this periodically)."""
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
        key = (holder, hashes[-1])
        task = self._fetches.get(key)
        if task is not None:  # another request is fetching this prefix: its import will do
            await asyncio.shield(task)
            return None
        # read from the event loop, not queued on the engine thread: membership tests of the
        # prefix index are atomic under the GIL, and a stale answer costs at most a fetch (or
        # a recompute); the scheduler's own lookup decides what is reused
        have = self.llm.cached_prefix_blocks(hashes)
        if have >= len(hashes):
            return None
        task = asyncio.ensure_future(self._fetch(holder, hashes))
        self._fetches[key] = task
        try:
            return await asyncio.shield(task)
        finally:
            self._fetches.pop(key, None)

    async def _fetch(self, holder: str, hashes: list[bytes]) -> dict[str, Any]:
        t0 = time.perf_counter()
        try:
            resp = await asyncio.wait_for(
                self._peer_handle().export_prefix.remote({"to": holder, "hashes": hashes}),
                MIGRATION_TIMEOUT_S)
            if resp.get("replica") != holder or not resp.get("blocks"):
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
                "exported": export.num_blocks}

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

    async def _generate(self, req: dict[str, Any]) -> AsyncIterator[Any]:
        rid = req["request_id"]
        ids = req.get("prompt_token_ids")
        migration = None
        route = req.get("route")
        if route:
            self.migration.routed.labels(reason=str(route.get("reason"))).inc()
            migration = await self._migrate(req)
        try:
            stream = self.aengine.submit(rid, req.get("prompt"), req["params"],
                                         prompt_token_ids=ids,
                                         mc_overrides=req.get("mc_overrides"))
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
            if blocks:
                outcome = "imported"
                self.migration.blocks.inc(blocks)
                nbytes = self.llm.cache.bytes_per_block * blocks
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


# --------------------------------------------------------------------------------------------
# router
# --------------------------------------------------------------------------------------------

def known_replicas(app_name: str, deployment: str = ENGINE_DEPLOYMENT) -> list[str]:
    """Short ids of the live replicas of ``deployment`` (Serve names its replica actors
    ``SERVE_REPLICA::<app>#<deployment>#<id>``)."""
    prefix = f"SERVE_REPLICA::{app_name}#{deployment}#"
    names = ray.util.list_named_actors(all_namespaces=True)
    return sorted(short_id(a["name"]) for a in names
                  if isinstance(a, dict) and str(a.get("name", "")).startswith(prefix))



async def gather_replicas(handle: Any, method: str, names: list[str],
                          timeout_s: float = 10.0) -> dict[str, Any]:
    """``{replica: method's answer}`` from each of ``names``: calls pinned with ``to`` (the
    state-affinity router honours it; under another router a call may land elsewhere, so the
    answers are kept by the replica that gave them and the missing ones asked again, a bounded
    number of times). One call at a time: siblings of one request (``RemoteRequestStream``)."""
    out: dict[str, Any] = {}
    for _ in range(4):
        missing = [n for n in names if n not in out]
        if not missing:
            break
        for n in missing:
            if n in out:
                continue
            try:
                res = await asyncio.wait_for(getattr(handle, method).remote({"to": n}),
                                             timeout_s)
            except Exception as e:  # noqa: BLE001 - a replica restarting: the others answer
                logger.warning("%s of replica %s: %s: %s", method, n, type(e).__name__, e)
                continue
            if isinstance(res, dict) and res.get("replica") in names:
                out.setdefault(res["replica"], res.get("text", res))
    return out


# --------------------------------------------------------------------------------------------
# ingress
# --------------------------------------------------------------------------------------------

# replicas that served the HTTP request being handled (ReplicaHeaderMiddleware sets the list,
# RemoteRequestStream appends to it)
_SERVED_BY: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar(
    "mcserve_served_by", default=None)


class ReplicaHeaderMiddleware:
    """Adds ``x-mcserve-replica: <id>[,<id>...]`` to responses that an engine replica
    served (a response starts only after its requests were accepted)."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        served: list[str] = []
        token = _SERVED_BY.set(served)

        async def send_with_header(message: Message) -> None:
            if message["type"] == "http.response.start" and served:
                names = ",".join(dict.fromkeys(served))
                message = {**message, "headers": [*message.get("headers", []),
                                                  (REPLICA_HEADER.encode(), names.encode())]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_header)
        finally:
            _SERVED_BY.reset(token)


_RETRYABLE = (ray.exceptions.RayActorError, serve.exceptions.RayServeException)


class RemoteRequestStream:
    """``RequestStream`` over a streamed handle call to an engine replica.

    The call starts once ``after`` is set (the previous stream of the same HTTP request was
    accepted): calls made from one Serve request share its internal request id, by which the
    router matches a routing decision to its request, so siblings routed at the same time
    could take each other's decision and leave one unassigned."""

    def __init__(self, request_id: str, owner: RemoteAsyncEngine,
                 start: Callable[[], Any], served: list[str] | None,
                 after: asyncio.Event | None = None):
        self.request_id = request_id
        self._owner = owner
        self._start = start
        self._after = after
        self._response: Any = None
        self.started = asyncio.Event()  # accepted or failed: the next sibling may start
        self._served = served
        self._accepted = False
        self._error: BaseException | None = None
        self.finished = False
        self.replica: str | None = None
        self.migration: dict[str, Any] | None = None

    def _fail_with(self, e: BaseException) -> None:
        self._error = e

    async def _next(self) -> Any:
        if self._error is not None:
            raise self._error
        if self._response is None:
            if self._after is not None:
                await self._after.wait()
            if self._error is not None or self.finished:
                raise self._error or EngineShutdownError("the request was aborted")
            self._response = self._start()
        try:
            item = await self._response.__anext__()
        except BaseException as e:
            if self._error is not None:  # aborted by a drain: say so, not how it ended
                raise self._error from None
            if isinstance(e, StopAsyncIteration):
                raise EngineDeadError("the engine replica ended the stream early") from None
            if isinstance(e, _RETRYABLE):
                where = f"engine replica {self.replica}" if self.replica else "an engine replica"
                raise unavailable(f"{where} failed while serving the request "
                                  f"({type(e).__name__}); retry it") from None
            raise
        if isinstance(item, dict) and "error" in item:
            raise _api_error(item)
        return item

    async def wait_accepted(self) -> None:
        if self._accepted:
            return
        try:
            item = await self._next()
        except BaseException:
            self._done()
            raise
        finally:
            self.started.set()
        self._accepted = True
        self.replica = item.get("replica")
        self.migration = item.get("migration")
        if self._served is not None and self.replica:
            self._served.append(self.replica)

    def __aiter__(self) -> RemoteRequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        if not self._accepted:
            await self.wait_accepted()
        try:
            out = await self._next()
        except BaseException:
            self._done()
            raise
        if out.finished:
            self._done()
        return out

    def _done(self) -> None:
        self.finished = True
        self.started.set()
        self._owner._forget(self.request_id)

    def cancel(self) -> None:
        if self._response is not None:
            self._response.cancel()

    def abort(self) -> None:
        if not self.finished:
            self._done()
            self.cancel()


def _api_error(item: dict[str, Any]) -> BaseException:
    kind, msg = item.get("error"), str(item.get("message") or "")
    if kind == "invalid":
        return InvalidRequestError(msg, param=item.get("param"))
    if kind == "queue_full":
        return APIError(429, msg, code="queue_full",
                        headers={"Retry-After": str(RETRY_AFTER_QUEUE_S)})
    if kind == "unavailable":
        return unavailable(msg)
    return RequestFailedError(msg)


@dataclass
class _Config:
    max_model_len: int


@dataclass
class _MC:
    variant: str | None
    selects: bool | None


@dataclass
class _ModelConfig:
    vocab_size: int
    max_position_embeddings: int | None


class RemoteEngineView:
    """What ``build_app`` reads of a local engine, for engines that live in replicas."""

    def __init__(self, info: dict[str, Any], tokenizer: Any):
        self.tokenizer = tokenizer
        self.model_name = info["model_name"]
        self.config = _Config(info["max_model_len"])
        self.model_config = _ModelConfig(info["vocab_size"], info["max_position_embeddings"])
        self.mc = _MC(info["mc_variant"], info["mc_selects"])
        self.segment_len = int(info["segment_len"])
        self.salt: bytes = info["salt"]
        self.caches_prefixes = bool(info["caches_prefixes"])

    def stats(self) -> dict[str, Any]:
        return {}

    def prefix_hashes(self, ids: list[int], mc_overrides: dict[str, Any] | None) -> list[bytes]:
        """The keys ``LLMEngine.prefix_hashes`` gives (the routing key of a prompt)."""
        if not self.caches_prefixes:
            return []
        k = (mc_overrides or {}).get("mc_top_k")
        salt = request_salt(self.salt, k if isinstance(k, int) and k > 0 else None)
        return prompt_block_hashes(ids, self.segment_len, salt)


class RemoteAsyncEngine(AsyncEngine):
    """The ``AsyncEngine`` of the ingress: requests go to engine replicas through a Serve
    handle (``MCServeEngine.generate``, streamed) instead of a local engine thread. What
    ``build_app`` and ``ServerState`` use of an ``AsyncEngine`` behaves the same: submit,
    streams, abort, drain, in-flight count."""

    def __init__(self, handle: Any, view: RemoteEngineView):
        super().__init__(view)
        self.handle = handle
        self._remote: dict[str, RemoteRequestStream] = {}

    @property
    def num_in_flight(self) -> int:
        return len(self._remote)

    def start(self) -> None:  # no engine thread here
        self._accepting = True

    def submit_many(self, requests: list[tuple[str, str | None, list[int] | None]],
                    params: Any, *, mc_overrides: dict[str, Any] | None = None,
                    ) -> list[RemoteRequestStream]:
        if not self._accepting:
            raise EngineShutdownError("the server is shutting down")
        for request_id, _, _ in requests:
            if request_id in self._remote:
                raise ValueError(f"request id {request_id!r} is already in use")
        served = _SERVED_BY.get()
        view: RemoteEngineView = self.engine
        gen = self.handle.options(stream=True)
        streams: list[RemoteRequestStream] = []
        for request_id, prompt, ids in requests:
            if ids is None:
                ids = view.tokenizer.encode(prompt)
            req = {"request_id": request_id, "prompt": prompt, "prompt_token_ids": ids,
                   "params": params, "mc_overrides": mc_overrides or None,
                   "hashes": view.prefix_hashes(ids, mc_overrides)}
            stream = RemoteRequestStream(
                request_id, self, lambda req=req: gen.generate.remote(req), served,
                after=streams[-1].started if streams else None)
            self._remote[request_id] = stream
            streams.append(stream)
        return streams

    def _forget(self, request_id: str) -> None:
        self._remote.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        stream = self._remote.get(request_id)
        if stream is not None:
            stream.abort()

    def abort_all(self, message: str = "the server is shutting down") -> int:
        streams = list(self._remote.values())
        for s in streams:
            s._fail_with(EngineShutdownError(message))
            s.started.set()
            s.cancel()
        self._remote.clear()
        return len(streams)

    async def shutdown(self, grace_s: float = 0.0) -> None:
        self._accepting = False
        if grace_s > 0:
            await self.wait_idle(grace_s)
        self.abort_all("the server shut down")

    def close(self, timeout: float = 10.0) -> None:
        self._accepting = False
        self.abort_all("the server shut down")


class _MergedMetrics(Collector):
    def __init__(self, families: Iterable[Metric]):
        self.families = list(families)

    def collect(self) -> Iterable[Metric]:
        return self.families


def merge_metrics(texts: dict[str, str], extra: Iterable[Metric] = ()) -> bytes:
    """One Prometheus exposition of several replicas' ``mcserve:`` metrics, each sample
    labelled ``replica``."""
    merged: dict[str, Metric] = {}
    for replica, text in sorted(texts.items()):
        for fam in text_string_to_metric_families(text):
            if not fam.name.startswith("mcserve:"):
                continue
            out = merged.get(fam.name)
            if out is None:
                out = merged[fam.name] = Metric(fam.name, fam.documentation, fam.type)
            for s in fam.samples:
                out.add_sample(s.name, {**s.labels, "replica": replica}, s.value,
                               s.timestamp, s.exemplar)
    reg = CollectorRegistry(auto_describe=False)
    reg.register(_MergedMetrics([*merged.values(), *extra]))
    return _generate_latest(reg)


@serve.ingress()
class MCServeIngress:
    """The OpenAI-compatible app (``build_app``) in front of the engine replicas."""

    async def __init__(self, engine: Any, options: RayServeOptions):
        from mcserve.engine.tokenizer import load_tokenizer

        self.options = options
        self.handle = engine
        # also starts this process's router of the engine deployment
        info = await self.handle.info.remote()
        self.tokenizer = load_tokenizer(_model_dir(options.engine),
                                        options.engine.get("tokenizer"))
        self.view = RemoteEngineView(info, self.tokenizer)
        self.aengine = RemoteAsyncEngine(self.handle, self.view)
        self._api: FastAPI | None = None

    def __serve_build_asgi_app__(self) -> ASGIApp:
        from mcserve.server.app import build_app

        o = self.options
        app = build_app(self.aengine, api_key=o.api_key, served_model_name=o.served_model_name,
                        max_body_bytes=o.max_body_bytes, max_waiting_requests=None,
                        shutdown_grace_s=o.shutdown_grace_s)
        # /metrics: every replica's registry, labelled, instead of this process's
        app.router.routes = [r for r in app.router.routes
                             if getattr(r, "path", None) != "/metrics"]

        @app.get("/metrics", include_in_schema=False)
        async def merged_metrics() -> Response:
            return Response(await self.metrics_exposition(), media_type=CONTENT_TYPE_LATEST)

        app.add_middleware(ReplicaHeaderMiddleware)
        self._api = app
        return app

    async def metrics_exposition(self) -> bytes:
        app_name = serve.get_replica_context().app_name
        names = known_replicas(app_name)
        texts = await gather_replicas(self.handle, "metrics_text", names)
        return merge_metrics(texts)

    async def replica_stats(self) -> dict[str, Any]:
        """Every engine replica's ``stats`` (pools, prefix cache, transfers), by replica."""
        names = known_replicas(serve.get_replica_context().app_name)
        return await gather_replicas(self.handle, "stats", names, timeout_s=30.0)

    async def drain(self, grace_s: float | None = None) -> int:
        """The single server's drain (503 for new requests, grace for running ones, then
        aborts answered); ``mcserve serve --replicas`` runs it on SIGTERM."""
        assert self._api is not None
        return await self._api.state.drain(grace_s)


# --------------------------------------------------------------------------------------------
# application
# --------------------------------------------------------------------------------------------


def build_serve_app(options: RayServeOptions) -> Any:
    """The Serve application: ``options.replicas`` engine replicas behind the ingress."""
    from mcserve.config import EngineConfig

    EngineConfig(**options.engine)  # bad flags fail here, not in every replica
    device = str(options.engine.get("device") or "cpu")
    gpus = options.num_gpus
    if gpus is None:
        gpus = 1.0 if device.startswith("cuda") else 0.0
    actor: dict[str, Any] = {"num_cpus": max(1, options.cpu_threads)}
    if gpus:
        actor["num_gpus"] = gpus
    env = {"OMP_NUM_THREADS": str(max(1, options.cpu_threads))}
    for key in ("MCSERVE_CPU_KERNELS", "MCSERVE_CPU_KERNELS_PORTABLE", "MCSERVE_CPU_ISA"):
        if key in os.environ:
            env[key] = os.environ[key]
    actor["runtime_env"] = {"env_vars": env}
    if options.router == "state":
        router = RequestRouterConfig(
            request_router_class=StateAffinityRouter,
            request_router_kwargs={"imbalanced_threshold": options.imbalanced_threshold},
            request_routing_stats_period_s=options.routing_stats_period_s)
    elif options.router == "pow2":
        router = RequestRouterConfig(request_routing_stats_period_s=options.routing_stats_period_s)
    else:
        raise ValueError(f"router must be 'state' or 'pow2', got {options.router!r}")
    engine = serve.deployment(
        MCServeEngine, name=ENGINE_DEPLOYMENT, num_replicas=options.replicas,
        ray_actor_options=actor, max_ongoing_requests=options.max_ongoing_requests,
        request_router_config=router,
        max_constructor_retry_count=options.max_constructor_retry_count,
        health_check_period_s=options.health_check_period_s,
        graceful_shutdown_timeout_s=options.shutdown_grace_s,
    )
    ingress = serve.deployment(
        MCServeIngress, name=INGRESS_DEPLOYMENT, num_replicas=options.ingress_replicas,
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=max(1024, options.max_ongoing_requests * options.replicas),
        graceful_shutdown_timeout_s=options.shutdown_grace_s,
    )
    return ingress.bind(engine.bind(options), options)


_INT_FIELDS = ("replicas", "cpu_threads", "imbalanced_threshold", "max_ongoing_requests",
               "max_body_bytes", "max_waiting_requests", "ingress_replicas",
               "max_constructor_retry_count")
_FLOAT_FIELDS = ("num_gpus", "routing_stats_period_s", "shutdown_grace_s",
                 "health_check_period_s")


def options_from_args(args: dict[str, Any]) -> RayServeOptions:
    """``RayServeOptions`` from flat string-or-typed arguments (``serve run ... key=value``,
    a RayService's ``args``): the engine's fields by their ``EngineConfig`` names, the rest
    by ``RayServeOptions`` names."""
    import dataclasses

    from mcserve.config import EngineConfig

    engine_fields = {f.name: f for f in dataclasses.fields(EngineConfig) if f.init}
    opt_fields = {f.name for f in dataclasses.fields(RayServeOptions)} - {"engine"}
    engine: dict[str, Any] = {}
    opts: dict[str, Any] = {}
    for key, val in args.items():
        k = key.replace("-", "_")
        if k in opt_fields:
            if k in _INT_FIELDS and val is not None:
                val = int(val)
            elif k in _FLOAT_FIELDS and val is not None:
                val = float(val)
            opts[k] = val
        elif k in engine_fields:
            engine[k] = _engine_value(engine_fields[k], val)
        else:
            raise ValueError(f"unknown argument {key!r}")
    if engine.get("model"):
        engine["model"] = str(Path(engine["model"]).expanduser().resolve())
    return RayServeOptions(engine=engine, **opts)


def _engine_value(f: Any, val: Any) -> Any:
    if not isinstance(val, str):
        return val
    ann = str(f.type).replace(" ", "")
    if ann.startswith("bool"):
        return val.strip().lower() in ("1", "true", "yes", "on")
    if ann.startswith("int"):
        return int(val)
    if ann.startswith("float|tuple"):
        return float(val) if "," not in val else tuple(float(v) for v in val.split(","))
    if ann.startswith("float"):
        return float(val)
    return val


def app_builder(args: dict[str, Any]) -> Any:
    """Application builder for ``serve run mcserve.server.ray_app:app_builder model=DIR
    replicas=2 ...`` and a KubeRay RayService's ``import_path`` (``args`` as in
    ``options_from_args``)."""
    return build_serve_app(options_from_args(dict(args or {})))


# --------------------------------------------------------------------------------------------
# mcserve serve --replicas N
# --------------------------------------------------------------------------------------------


def _free_port(host: str) -> int:
    import socket

    with socket.socket() as s:
        s.bind((host if host not in ("", "0.0.0.0", "::") else "127.0.0.1", 0))
        return int(s.getsockname()[1])


class DeploymentFailed(RuntimeError):
    """A replica could not start; the message is the replica's own error (the loader's)."""


def _failure_reason(app_name: str) -> str | None:
    """The last line of the traceback a failed deployment of ``app_name`` reports: the error
    its replicas' constructor raised (``ValueError: MODEL: no checkpoint at ...``)."""
    try:
        app = serve.status().applications.get(app_name)
    except Exception:  # noqa: BLE001 - no status: the caller keeps Serve's message
        return None
    if app is None:
        return None
    for d in app.deployments.values():
        lines = [ln.strip() for ln in str(d.message or "").splitlines() if ln.strip()]
        if str(d.status).endswith("DEPLOY_FAILED") and lines:
            return lines[-1]
    return None


def deploy(options: RayServeOptions, *, route_prefix: str = "/", blocking: bool = False
           ) -> Any:
    """``serve.run`` of ``build_serve_app(options)`` as application ``options.app_name``;
    returns the ingress handle. A replica that cannot start fails it with
    ``DeploymentFailed(<its error>)`` (after ``max_constructor_retry_count`` tries), not a
    hang and not Serve's generic message."""
    try:
        return serve.run(build_serve_app(options), name=options.app_name,
                         route_prefix=route_prefix, blocking=blocking)
    except RuntimeError as e:
        reason = _failure_reason(options.app_name)
        if reason is None:
            raise
        raise DeploymentFailed(reason) from e


def run_serve_ray(args: Any, config: Any, *, api_key: str | None,
                  ready: Callable[[int, str], None]) -> int:
    """``mcserve serve MODEL --replicas N [--ray-address ADDR]``: start (or join) a Ray
    cluster, deploy the replicas and the ingress, serve until SIGTERM / Ctrl-C, then drain as
    the single server does (503 for new requests, ``--shutdown-timeout`` for running ones,
    the rest aborted and answered) and take the application down.

    ``config``: the validated ``EngineConfig`` of the flags; ``ready(port, served_name)`` is
    called once the application answers."""
    import dataclasses
    import signal

    from mcserve.cli_args import CLIError

    engine = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init}
    if engine.get("model"):
        engine["model"] = str(Path(engine["model"]).expanduser().resolve())
    options = RayServeOptions(
        engine=engine, replicas=args.replicas, cpu_threads=args.replica_threads,
        router=args.router, api_key=api_key, served_model_name=args.served_model_name,
        max_body_bytes=args.max_body_bytes, max_waiting_requests=args.max_waiting_requests,
        shutdown_grace_s=args.shutdown_timeout)
    started_ray = args.ray_address is None
    if started_ray:
        gpus = options.replicas if str(config.device).startswith("cuda") else None
        ray.init(num_cpus=max(os.cpu_count() or 1, options.replicas * options.cpu_threads),
                 num_gpus=gpus, include_dashboard=False)
    else:
        ray.init(address=args.ray_address)
    port = args.port or _free_port(args.host)
    try:
        serve.start(http_options={"host": args.host, "port": port})
        try:
            handle = deploy(options)
        except DeploymentFailed as e:
            serve.delete(options.app_name)
            raise CLIError(f"the replicas could not start: {e}") from None
        served = args.served_model_name or (Path(engine["model"]).name if engine.get("model")
                                            else "mcserve-default")
        logger.info("mcserve serving %s with %d replicas (Ray Serve, router %s) on port %d",
                    served, options.replicas, options.router, port)
        ready(port, served)
        signals = {"n": 0}
        stop = threading.Event()

        def on_signal(signum: int, frame: Any) -> None:
            signals["n"] += 1
            if signals["n"] >= 3:
                os._exit(1)
            stop.set()

        old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            while not stop.wait(0.5):
                pass
            logger.info("shutting down: draining (up to %.1f s for running requests)",
                        options.shutdown_grace_s)
            grace = options.shutdown_grace_s if signals["n"] < 2 else 0.0
            try:
                aborted = handle.drain.remote(grace).result(
                    timeout_s=grace + DRAIN_SETTLE_S + 10)
                if aborted:
                    logger.info("shutting down: aborted %d request(s)", aborted)
            except Exception as e:  # noqa: BLE001 - still take the application down
                logger.warning("draining failed: %s", e)
        finally:
            for s, h in old.items():
                signal.signal(s, h)
        serve.delete(options.app_name)
    finally:
        if started_ray:
            serve.shutdown()
            ray.shutdown()
    logger.info("mcserve stopped")
    return 0
