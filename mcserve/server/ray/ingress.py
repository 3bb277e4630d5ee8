"""The ingress (``MCServeIngress``): the single-process app of ``build_app`` over
``RemoteAsyncEngine``, which sends each request to an engine replica through a Serve
``DeploymentHandle`` (``RemoteRequestStream``) and stands in for a local engine with
``RemoteEngineView``; plus the fan-out to every replica (``known_replicas``,
``gather_replicas``) behind the merged ``/metrics`` and the replica stats."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from fastapi import FastAPI
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST
from ray import serve
from starlette.types import ASGIApp

from mcserve.engine.outputs import RequestOutput
from mcserve.engine.prefix_keys import prompt_block_hashes, request_salt
from mcserve.errors import InvalidRequestError
from mcserve.server.async_engine import (
    AsyncEngine,
    EngineDeadError,
    EngineShutdownError,
    RequestFailedError,
)
from mcserve.server.errors import RETRY_AFTER_QUEUE_S, APIError, unavailable
from mcserve.server.ray.metrics import merge_metrics
from mcserve.server.ray.middleware import SERVED_BY, ReplicaHeaderMiddleware
from mcserve.server.ray.options import ENGINE_DEPLOYMENT, RayServeOptions
from mcserve.server.ray.router import short_id

logger = logging.getLogger("mcserve.server")

__all__ = ["MCServeIngress", "RemoteAsyncEngine", "RemoteEngineView", "RemoteRequestStream",
           "gather_replicas", "known_replicas"]


def _model_dir(engine: dict[str, Any]) -> Path:
    from mcserve.engine.llm_engine import DEFAULT_MODEL_DIR

    return Path(engine["model"]) if engine.get("model") else DEFAULT_MODEL_DIR


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


# tokens per routing key of a prompt when the model has no segment blocks (resume points only)
ROUTING_GRANULE = 256


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
        # the replicas keep resume points: chat message ends are sent along, and prompts of
        # models without segment blocks are routed by keys of ROUTING_GRANULE-token pieces
        self.keeps_resume_points = bool(info.get("keeps_resume_points", False))

    def stats(self) -> dict[str, Any]:
        return {}

    def prefix_hashes(self, ids: list[int], mc_overrides: dict[str, Any] | None) -> list[bytes]:
        """The keys ``LLMEngine.prefix_hashes`` gives (the routing key of a prompt); for a
        model without segment blocks whose replicas keep resume points, keys of
        ``ROUTING_GRANULE``-token pieces, so the turns of a conversation (and prompts that
        share a system prompt) go where their resume points are."""
        k = (mc_overrides or {}).get("mc_top_k")
        salt = request_salt(self.salt, k if isinstance(k, int) and k > 0 else None)
        if self.caches_prefixes:
            return prompt_block_hashes(ids, self.segment_len, salt)
        if self.keeps_resume_points:
            return prompt_block_hashes(ids, ROUTING_GRANULE, salt + b"|route")
        return []


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
                    resume_positions: list[int] | None = None,
                    ) -> list[RemoteRequestStream]:
        if not self._accepting:
            raise EngineShutdownError("the server is shutting down")
        for request_id, _, _ in requests:
            if request_id in self._remote:
                raise ValueError(f"request id {request_id!r} is already in use")
        served = SERVED_BY.get()
        view: RemoteEngineView = self.engine
        gen = self.handle.options(stream=True)
        streams: list[RemoteRequestStream] = []
        for request_id, prompt, ids in requests:
            if ids is None:
                ids = view.tokenizer.encode(prompt)
            req = {"request_id": request_id, "prompt": prompt, "prompt_token_ids": ids,
                   "params": params, "mc_overrides": mc_overrides or None,
                   "hashes": view.prefix_hashes(ids, mc_overrides),
                   "resume_positions": resume_positions or None}
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
                        shutdown_grace_s=o.shutdown_grace_s,
                        tool_call_parser=o.tool_call_parser, body_timeout_s=o.body_timeout_s)
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
