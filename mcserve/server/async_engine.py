"""``AsyncEngine``: the synchronous ``LLMEngine`` driven from a background thread for asyncio.

``LLMEngine`` is not thread-safe, so every engine call (``add_request``, ``abort_request``,
``step``, ``stats``) runs on one engine thread. The event loop talks to that thread through a
command list guarded by a condition variable:

* ``submit`` registers a per-request stream and queues an "add" command; the engine thread adds
  the request and answers "accepted" (or the ``ValueError`` the engine raised) on the stream.
* While the engine has unfinished requests the thread calls ``step()`` in a loop and hands each
  step's outputs to the event loop(s) with one ``loop.call_soon_threadsafe`` per loop per step.
  With nothing to do it sleeps on the condition (no busy loop).
* ``abort`` (a cancelled or disconnected client) drops the stream at once and queues an "abort"
  command, which the thread runs before its next step, so the request's state blocks are freed
  within one engine step.

Engine statistics are snapshotted by the engine thread after every iteration, so ``/metrics``
never touches the engine from the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from mcserve.engine.outputs import RequestOutput

logger = logging.getLogger("mcserve.server")

__all__ = [
    "AsyncEngine",
    "EngineDeadError",
    "EngineShutdownError",
    "QueueFullError",
    "RequestFailedError",
    "RequestMetricsSink",
    "RequestStream",
]


class QueueFullError(RuntimeError):
    """Too many requests wait for the engine (``max_waiting_requests``): retry later."""


class EngineShutdownError(RuntimeError):
    """The engine is shutting down and takes no new requests."""


class EngineDeadError(RuntimeError):
    """The engine thread stopped after an unrecoverable error."""


class RequestFailedError(RuntimeError):
    """The engine failed this request (``RequestOutput.error``); other requests go on."""


class RequestMetricsSink(Protocol):
    """Receives per-request timings (called from the engine thread; must be thread-safe)."""

    def observe_queue_time(self, seconds: float) -> None: ...
    def observe_ttft(self, seconds: float) -> None: ...
    def observe_itl(self, seconds: float) -> None: ...
    def observe_e2e(self, seconds: float) -> None: ...
    def count_finished(self, reason: str) -> None: ...


_ACCEPTED = object()  # the engine took the request
# a step that raises fails the requests in flight; this many in a row (even with nothing left
# to fail) means the engine itself is broken and the thread stops
MAX_CONSECUTIVE_STEP_FAILURES = 3


@dataclass
class _Timing:
    arrival: float
    scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    num_tokens: int = 0


@dataclass
class _Cmd:
    kind: str  # "add" | "abort"
    request_id: str
    args: dict[str, Any] = field(default_factory=dict)


def _snapshot(out: RequestOutput) -> RequestOutput:
    """What the event loop may read while the engine thread goes on.

    ``LLMEngine.step()`` returns fresh ``RequestOutput`` / ``CompletionOutput`` objects with
    copied token and logprob lists every step; only ``prompt_logprobs`` is a list the engine
    keeps extending during a chunked prefill, so that one is copied here.
    """
    plp = out.prompt_logprobs
    if plp is not None:
        out.prompt_logprobs = list(plp)
    return out


class RequestStream:
    """The outputs of one request as an async iterator (cumulative ``RequestOutput``s).

    Outputs that pile up while the consumer is busy are coalesced: since they are cumulative, the
    iterator returns only the latest. It raises ``RequestFailedError`` when the engine failed the
    request and ``ValueError`` when the engine refused it.
    """

    def __init__(self, request_id: str, owner: AsyncEngine, loop: asyncio.AbstractEventLoop):
        self.request_id = request_id
        self._owner = owner
        self.loop = loop
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._accepted = False
        self.finished = False
        self.timing = _Timing(arrival=time.perf_counter())

    # called on the event loop by the engine thread's call_soon_threadsafe
    def _put(self, item: Any) -> None:
        self._queue.put_nowait(item)

    async def wait_accepted(self) -> None:
        """Wait until the engine took the request; raises what ``add_request`` raised."""
        while not self._accepted:
            item = await self._queue.get()
            if item is _ACCEPTED:
                self._accepted = True
            elif isinstance(item, BaseException):
                self.finished = True
                raise item
            else:  # an output before the marker cannot happen, but keep it
                self._accepted = True
                self._queue.put_nowait(item)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        if not self._accepted:
            await self.wait_accepted()
        item = await self._queue.get()
        while not isinstance(item, BaseException) and not self._queue.empty():
            nxt = self._queue.get_nowait()
            if nxt is _ACCEPTED:
                continue
            item = nxt
            if isinstance(item, BaseException):
                break
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item

    def abort(self) -> None:
        """Abort the request unless it already finished (idempotent)."""
        if not self.finished:
            self.finished = True
            self._owner.abort(self.request_id)


class AsyncEngine:
    """Runs an ``LLMEngine`` on a background thread and exposes it to asyncio.

    ``max_waiting_requests``: the most requests that may wait (submitted, not yet scheduled by the
    engine, i.e. no output yet); ``submit`` raises ``QueueFullError`` beyond it. None: no limit.
    """

    def __init__(
        self,
        engine: Any,
        *,
        max_waiting_requests: int | None = None,
        metrics: RequestMetricsSink | None = None,
    ) -> None:
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        self.metrics = metrics
        self._cond = threading.Condition()
        self._commands: list[_Cmd] = []
        self._streams: dict[str, RequestStream] = {}
        self._waiting: set[str] = set()  # submitted, no output yet
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._accepting = True
        self._dead: BaseException | None = None
        self._stats: dict[str, Any] = {}
        self.num_steps = 0
        self._step_failures = 0  # consecutive failed steps
        self._snapshot_stats()

    # --- public API (event loop side) ------------------------------------------------------------

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def dead_error(self) -> BaseException | None:
        return self._dead

    @property
    def accepting(self) -> bool:
        return self._accepting and self._dead is None

    @property
    def num_in_flight(self) -> int:
        with self._cond:
            return len(self._streams)

    def stats(self) -> dict[str, Any]:
        """The engine's ``stats()`` as of the end of the last engine-thread iteration."""
        return self._stats

    def start(self) -> None:
        """Start the engine thread (idempotent). After ``close()`` it starts a new one and takes
        requests again (an app whose lifespan runs more than once, as test clients do)."""
        with self._cond:
            if self._thread is not None and self._thread.is_alive():
                return
            if self._dead is not None:
                return
            self._stopping = False
            self._accepting = True
            self._thread = threading.Thread(
                target=self._run, name="mcserve-engine", daemon=True
            )
            self._thread.start()

    def submit(
        self,
        request_id: str,
        prompt: str | None,
        params: Any,
        *,
        prompt_token_ids: list[int] | None = None,
        mc_overrides: dict[str, Any] | None = None,
        resume_positions: list[int] | None = None,
    ) -> RequestStream:
        """Queue one request; returns its stream (``await stream.wait_accepted()`` next)."""
        return self.submit_many(
            [(request_id, prompt, prompt_token_ids)], params, mc_overrides=mc_overrides,
            resume_positions=resume_positions,
        )[0]

    def submit_many(
        self,
        requests: list[tuple[str, str | None, list[int] | None]],
        params: Any,
        *,
        mc_overrides: dict[str, Any] | None = None,
        resume_positions: list[int] | None = None,
    ) -> list[RequestStream]:
        """Queue several requests (id, prompt, prompt_token_ids) sharing params, all or none.
        ``resume_positions``: prompt positions to keep resume points at (chat message ends).

        Raises ``QueueFullError`` when they would take the waiting queue over its limit,
        ``EngineShutdownError`` / ``EngineDeadError`` when no requests are taken.
        """
        if self._dead is not None:
            raise EngineDeadError(f"the engine stopped: {self._dead}")
        if not self._accepting:
            raise EngineShutdownError("the server is shutting down")
        self.start()
        loop = asyncio.get_running_loop()
        streams = []
        with self._cond:
            limit = self.max_waiting_requests
            if limit is not None and len(self._waiting) + len(requests) > limit:
                raise QueueFullError(
                    f"{len(self._waiting)} requests are waiting (limit {limit}); retry later"
                )
            for request_id, _, _ in requests:
                if request_id in self._streams:
                    raise ValueError(f"request id {request_id!r} is already in use")
            for request_id, prompt, ids in requests:
                stream = RequestStream(request_id, self, loop)
                self._streams[request_id] = stream
                self._waiting.add(request_id)
                args: dict[str, Any] = {"prompt": prompt, "params": params}
                if ids is not None:
                    args["prompt_token_ids"] = ids
                if mc_overrides:
                    args["mc_overrides"] = mc_overrides
                if resume_positions:
                    args["resume_positions"] = resume_positions
                self._commands.append(_Cmd("add", request_id, args))
                streams.append(stream)
            self._cond.notify()
        return streams

    async def generate(
        self,
        request_id: str,
        prompt: str | None,
        params: Any,
        *,
        prompt_token_ids: list[int] | None = None,
        mc_overrides: dict[str, Any] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Submit a request and yield its outputs; aborts it when the consumer stops early."""
        stream = self.submit(
            request_id, prompt, params, prompt_token_ids=prompt_token_ids,
            mc_overrides=mc_overrides,
        )
        try:
            async for out in stream:
                yield out
        finally:
            stream.abort()

    def abort(self, request_id: str) -> None:
        """Abort a request (idempotent, safe from any thread); its blocks are freed before the
        engine's next step."""
        with self._cond:
            stream = self._streams.pop(request_id, None)
            if stream is None:
                return
            self._waiting.discard(request_id)
            self._commands.append(_Cmd("abort", request_id))
            self._cond.notify()
        stream.finished = True
        if self.metrics is not None:
            self.metrics.count_finished("abort")

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no request is in flight (True) or ``timeout`` seconds passed (False)."""
        deadline = time.monotonic() + timeout
        while self.num_in_flight:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.02)
        return True

    def stop_accepting(self) -> None:
        """Refuse new requests (``EngineShutdownError``); those in flight go on."""
        self._accepting = False

    def abort_all(self, message: str = "the server is shutting down") -> int:
        """Abort every request in flight (safe from any thread); returns how many.

        Unlike ``abort`` (the consumer went away), each stream's consumer is still there and is
        told why: its next read raises ``EngineShutdownError(message)``, so that a handler can
        answer it (a 503, or a final SSE error event) instead of seeing its stream end mute.
        """
        with self._cond:
            streams = list(self._streams.values())
            self._streams.clear()
            self._waiting.clear()
            for stream in streams:
                self._commands.append(_Cmd("abort", stream.request_id))
            self._cond.notify()
        err = EngineShutdownError(message)
        for stream in streams:
            if self.metrics is not None:
                self.metrics.count_finished("abort")
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody listens
                stream.loop.call_soon_threadsafe(stream._put, err)
        return len(streams)

    async def shutdown(self, grace_s: float = 0.0) -> None:
        """Stop taking requests, let in-flight ones finish for up to ``grace_s`` seconds, abort
        the rest and stop the engine thread."""
        self._accepting = False
        if grace_s > 0:
            await self.wait_idle(grace_s)
        await asyncio.to_thread(self.close)

    def close(self, timeout: float = 10.0) -> None:
        """Abort everything in flight (their consumers get ``EngineShutdownError``) and join the
        engine thread (blocking)."""
        self._accepting = False
        self.abort_all("the server shut down")
        with self._cond:
            self._stopping = True
            self._cond.notify()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    # --- engine thread -------------------------------------------------------------------------

    def _run(self) -> None:
        busy = False
        while True:
            with self._cond:
                while not self._commands and not busy and not self._stopping:
                    self._cond.wait()
                cmds, self._commands = self._commands, []
                stopping = self._stopping
            try:
                deliveries = self._apply(cmds)
                if stopping:
                    self._deliver(deliveries)
                    self._snapshot_stats()
                    self._close_engine()
                    break
                if self.engine.has_unfinished_requests():
                    self._step(deliveries)  # snapshots the stats itself
                else:
                    self._snapshot_stats()  # e.g. after aborts that emptied the engine
                    self._deliver(deliveries)
                busy = self.engine.has_unfinished_requests()
            except BaseException as e:  # noqa: BLE001 - keep the thread's death visible
                logger.exception("the engine thread failed")
                self._die(e)
                return

    def _close_engine(self) -> None:
        """The engine's own shutdown work (resume points written to the disk tier)."""
        close = getattr(self.engine, "close", None)
        if close is None:
            return
        try:
            close()
        except Exception:  # noqa: BLE001 - shutting down anyway
            logger.exception("closing the engine failed")

    def _apply(self, cmds: list[_Cmd]) -> list[tuple[RequestStream, Any]]:
        out: list[tuple[RequestStream, Any]] = []
        for cmd in cmds:
            if cmd.kind == "abort":
                try:
                    self.engine.abort_request(cmd.request_id)
                except Exception:  # noqa: BLE001 - an abort must never stop the loop
                    logger.exception("abort_request(%s) failed", cmd.request_id)
                continue
            with self._cond:
                stream = self._streams.get(cmd.request_id)
            if stream is None:  # aborted before it was added
                continue
            a = cmd.args
            kwargs: dict[str, Any] = {}
            if "prompt_token_ids" in a:
                kwargs["prompt_token_ids"] = a["prompt_token_ids"]
            if "mc_overrides" in a:
                kwargs["mc_overrides"] = a["mc_overrides"]
            if "resume_positions" in a:
                kwargs["resume_positions"] = a["resume_positions"]
            try:
                self.engine.add_request(cmd.request_id, a["prompt"], a["params"], **kwargs)
            except Exception as e:  # noqa: BLE001 - refused: tell the caller, keep going
                with self._cond:
                    self._streams.pop(cmd.request_id, None)
                    self._waiting.discard(cmd.request_id)
                err = e if isinstance(e, ValueError) else RequestFailedError(
                    f"the engine refused the request: {type(e).__name__}: {e}"
                )
                if not isinstance(e, ValueError):
                    logger.exception("add_request(%s) failed", cmd.request_id)
                out.append((stream, err))
                continue
            out.append((stream, _ACCEPTED))
        return out

    def _step(self, deliveries: list[tuple[RequestStream, Any]]) -> None:
        t0 = time.perf_counter()
        try:
            outputs = self.engine.step()
        except Exception as e:  # noqa: BLE001 - fail the requests in flight, not the server
            logger.exception("engine step failed; failing the requests in flight")
            self.num_steps += 1
            self._step_failures += 1
            self._fail_all(deliveries, e)
            if self._step_failures >= MAX_CONSECUTIVE_STEP_FAILURES:
                raise  # the engine is broken: _run marks it dead (health 503)
            return
        self.num_steps += 1
        self._step_failures = 0
        # before the outputs go out, so that a client that got its answer reads fresh metrics
        self._snapshot_stats()
        now = time.perf_counter()
        m = self.metrics
        for out in outputs:
            with self._cond:
                stream = self._streams.get(out.request_id)
                if stream is None:  # aborted meanwhile
                    continue
                self._waiting.discard(out.request_id)
                if out.finished:
                    self._streams.pop(out.request_id, None)
            t = stream.timing
            if t.scheduled is None:
                t.scheduled = t0
                if m is not None:
                    m.observe_queue_time(max(0.0, t0 - t.arrival))
            ntok = sum(len(c.token_ids) for c in out.outputs)
            if ntok > t.num_tokens:
                if t.first_token is None:
                    t.first_token = now
                    if m is not None:
                        m.observe_ttft(now - t.arrival)
                elif m is not None and t.last_token is not None:
                    m.observe_itl(now - t.last_token)
                t.last_token = now
                t.num_tokens = ntok
            if out.finished:
                if m is not None:
                    m.observe_e2e(now - t.arrival)
                    m.count_finished(_finish_reason(out))
                if out.error is not None:
                    deliveries.append((stream, RequestFailedError(out.error)))
                    continue
            deliveries.append((stream, _snapshot(out)))
        self._deliver(deliveries)

    def _fail_all(self, deliveries: list[tuple[RequestStream, Any]], e: Exception) -> None:
        with self._cond:
            streams = list(self._streams.values())
            self._streams.clear()
            self._waiting.clear()
        err = RequestFailedError(f"engine step failed: {type(e).__name__}: {e}")
        for stream in streams:
            try:
                self.engine.abort_request(stream.request_id)
            except Exception:  # noqa: BLE001
                logger.exception("abort_request(%s) failed", stream.request_id)
            deliveries.append((stream, err))
            if self.metrics is not None:
                self.metrics.count_finished("error")
        self._snapshot_stats()
        self._deliver(deliveries)

    def _deliver(self, deliveries: list[tuple[RequestStream, Any]]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, Any]]] = {}
        for stream, item in deliveries:
            by_loop.setdefault(stream.loop, []).append((stream, item))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the loop closed: nobody listens any more
                for stream, _ in items:
                    self.abort(stream.request_id)

    def _die(self, e: BaseException) -> None:
        self._dead = e
        self._accepting = False
        with self._cond:
            streams = list(self._streams.values())
            self._streams.clear()
            self._waiting.clear()
        err = EngineDeadError(f"the engine stopped: {type(e).__name__}: {e}")
        self._deliver([(s, err) for s in streams])

    def _snapshot_stats(self) -> None:
        try:
            stats = dict(self.engine.stats())
        except Exception:  # noqa: BLE001 - metrics must not take the engine down
            logger.exception("engine.stats() failed")
            return
        self._stats = stats


def _put_all(items: list[tuple[RequestStream, Any]]) -> None:
    for stream, item in items:
        stream._put(item)


def _finish_reason(out: RequestOutput) -> str:
    if out.error is not None:
        return "error"
    reasons: list[str] = [c.finish_reason for c in out.outputs if c.finish_reason is not None]
    return reasons[0] if reasons else "stop"

