"""AsyncEngine: the engine protocol (`workers/protocol.py`) over an `EngineCore` stepping in a thread.

The step loop runs in one background thread that owns the core (the model call blocks for tens of
milliseconds, so it never runs on the event loop). Requests and aborts reach it through a
thread-safe inbox; token deltas come back to each request's asyncio queue via
``loop.call_soon_threadsafe``. Closing a request's generator (client gone) aborts it, which frees
its KV chunks on the next step.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

from chunkserve.workers.engine import EngineConfig, EngineCore
from chunkserve.workers.protocol import GenerateDelta, GenerateRequest

logger = logging.getLogger(__name__)


class EngineError(RuntimeError):
    """A request failed inside the engine (the message says why); other requests are unaffected."""


class AsyncEngine:
    """Implements `EngineProtocol`; see the module docstring."""

    def __init__(self, config: EngineConfig | None = None, core: EngineCore | None = None) -> None:
        self.core = core or EngineCore(config)
        self.tokenizer = self.core.tokenizer
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._sinks: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self._stats: dict[str, Any] = self.core.stats()
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._stats_time = 0.0
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="chunkserve-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ public API
    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateDelta]:
        """Stream token deltas for one request; the last delta has a finish_reason."""
        loop = asyncio.get_running_loop()
        sink: asyncio.Queue = asyncio.Queue()
        rid = request.request_id
        with self._lock:
            if rid in self._sinks:
                raise ValueError(f"duplicate request id {rid!r}")
            self._sinks[rid] = (loop, sink)
        self._post("add", request)
        finished = False
        try:
            while True:
                item = await sink.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                yield item
                if item.finish_reason is not None:
                    finished = True
                    return
        finally:
            with self._lock:
                self._sinks.pop(rid, None)
            if not finished:
                self._post("abort", rid)

    async def abort(self, request_id: str) -> None:
        self._post("abort", request_id)

    def stats(self) -> dict[str, Any]:
        """A snapshot taken by the engine thread after its last step (never blocks)."""
        return dict(self._stats)

    def drain_cache_events(self) -> list:
        """Chunk-hash events since the last call (for the cluster index)."""
        out: list = []
        while True:
            try:
                out.append(self._events.get_nowait())
            except queue.Empty:
                return out

    def shutdown(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=10)

    # ------------------------------------------------------------------ engine thread
    def _post(self, kind: str, payload: Any) -> None:
        self._inbox.put((kind, payload))
        self._wake.set()

    def _emit(self, rid: str, item: Any) -> None:
        with self._lock:
            target = self._sinks.get(rid)
        if target is not None:
            loop, sink = target
            try:
                loop.call_soon_threadsafe(sink.put_nowait, item)
            except RuntimeError:  # the caller's loop is closed
                self._inbox.put(("abort", rid))

    def _drain_inbox(self) -> None:
        core = self.core
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                req: GenerateRequest = payload
                try:
                    core.add_request(req.request_id, list(req.prompt_token_ids), req.sampling, req.cache_salt)
                except ValueError as e:
                    self._emit(req.request_id, EngineError(str(e)))
            elif kind == "abort":
                core.abort(payload)

    def _loop(self) -> None:
        core = self.core
        while not self._stop.is_set():
            self._drain_inbox()
            if not core.has_work():
                self._stats = core.stats()
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            try:
                outs = core.step()
            except Exception as e:  # a bug must not kill the loop silently: fail the running requests
                logger.exception("engine step failed")
                for req in list(core.scheduler.running) + list(core.scheduler.waiting):
                    core.abort(req.request_id)
                    self._emit(req.request_id, EngineError(f"engine step failed: {e}"))
                continue
            for ev in core.cache.drain_events():
                self._events.put(ev)
            now = time.monotonic()
            for out in outs:
                req = out.req
                self._emit(req.request_id, GenerateDelta(
                    request_id=req.request_id, token_ids=out.token_ids, text=out.text,
                    num_prompt_tokens=len(req.prompt), num_cached_tokens=max(req.num_cached, 0),
                    num_output_tokens=len(req.output), finish_reason=out.finish_reason, logprobs=out.logprobs,
                    first_token_time=req.first_token_time if len(req.output) == 1 else None,
                    extra={"time": now}))
            if now - self._stats_time > 0.1:
                self._stats, self._stats_time = core.stats(), now
