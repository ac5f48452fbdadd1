"""AsyncEngine: the engine protocol (`workers/protocol.py`) over an `EngineCore` stepping in a thread.

The step loop runs in one background thread that owns the core (the model call blocks for tens of
milliseconds, so it never runs on the event loop). Requests and aborts reach it through a
thread-safe inbox; each step's token deltas go back to the requests' asyncio queues in one
``loop.call_soon_threadsafe`` per event loop (not one per token). ``generate(request, batching)``
coalesces a request's deltas into fewer, larger items (`workers/streaming.py`). Closing a request's
generator (client gone) aborts it, which frees its KV chunks on the next step. Failures are typed
(`protocol.EngineError` and its subclasses): a request the core rejects, a step that raises
(`EngineStepError`, for the requests it was running), an engine that is shut down or whose thread died
(`EngineDeadError`, for every request still waiting and every later one). With ``cores`` (a
`node_cores.NodeCores` slot) the engine thread marks its worker busy or idle on the node before each step
and, while its steps are short (decode), runs them on the threads that gives it: an idle worker's cores are
lent to the busy ones. A long step (a prefill) runs on the worker's own share, so that a peer that turns
busy meanwhile never shares its cores with lent threads for longer than one short step.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from typing import Any

import torch

from chunkserve.workers.cpu_budget import lower_thread_priority
from chunkserve.workers.engine import EngineConfig, EngineCore
from chunkserve.workers.node_cores import NodeCores
from chunkserve.workers.protocol import (
    EngineDeadError,
    EngineError,
    EngineStats,
    EngineStepError,
    FirstTokenTimeline,
    GenerateDelta,
    GenerateRequest,
    InvalidRequestError,
    InvalidSamplingError,
)
from chunkserve.workers.sampling import SamplingParams
from chunkserve.workers.sched_types import Request
from chunkserve.workers.streaming import StreamBatching, coalesce
from chunkserve.workers.thread_clock import ThreadClock
from chunkserve.workers.tree_summary import ForestUsage, summarize_forest

logger = logging.getLogger(__name__)
SNAPSHOT_WAIT_S = 2.0  # `cached_hashes` waits this long for the engine thread (a step), then answers stale
LEND_MAX_STEP_S = 0.05  # lent threads only after a step shorter than this (and never for the first after idle)

_Sink = tuple[asyncio.AbstractEventLoop, asyncio.Queue]


def _timeline(req: Request) -> FirstTokenTimeline | None:
    """The request's stamps on its way to token 1, on the wall clock (None for one not added through `generate`)."""
    if req.handed_wall is None or req.intake_wall is None or req.first_token_time is None:
        return None
    to_wall = time.time() - time.monotonic()  # the scheduler's monotonic stamps -> wall clock
    admitted = req.admit_time if req.admit_time is not None else req.first_token_time
    return FirstTokenTimeline(worker_s=req.handed_wall, intake_s=req.intake_wall, admitted_s=admitted + to_wall,
                              first_token_s=req.first_token_time + to_wall)


class AsyncEngine:
    """Implements `EngineProtocol`; see the module docstring."""

    def __init__(self, config: EngineConfig | None = None, core: EngineCore | None = None,
                 hash_snapshot_depth: int | None = None, cores: NodeCores | None = None) -> None:
        """``hash_snapshot_depth``: keep `cached_hashes()` (chunk hashes above that depth) for the cluster
        index's publisher; None: not kept. ``cores``: this worker's slot among its node's workers (threads
        lent by idle ones); the engine closes it when it stops."""
        self.core = core or EngineCore(config)
        self._cores = cores
        self.step_threads = torch.get_num_threads()  # the threads of the last step (the engine thread's)
        # Cached chain hashes, as an immutable tuple the engine thread takes when a reader asks for it (between
        # steps): other threads read this snapshot, never the live tree, and no step pays for one nobody reads.
        self._hash_depth = hash_snapshot_depth
        self._hashes: tuple[int, ...] = ()
        if hash_snapshot_depth is not None:
            self._hashes = tuple(self.core.cache.cached_hashes(hash_snapshot_depth))
        self.tokenizer = self.core.tokenizer
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._sinks: dict[str, _Sink] = {}
        self._lock = threading.Lock()
        self._stats = EngineStats.from_dict(self.core.stats())
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._on_cache_events: Callable[[], None] | None = None  # called on the engine thread (see below)
        self._stats_time = 0.0
        self._dead: str | None = None  # why the engine no longer takes requests
        self.forest_usage = ForestUsage()  # per-chunk hits / tenants for the dashboard (engine thread)
        self._tenants: dict[str, str] = {}  # request id -> tenant, until its first token (engine thread)
        self._streaming = 0  # requests that got a token in the last step (the engine thread writes it)
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chunkserve-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ public API
    async def generate(self, request: GenerateRequest, batching: StreamBatching | None = None
                       ) -> AsyncGenerator[GenerateDelta, None]:
        """Stream token deltas for one request; the last delta has a finish_reason. With ``batching``
        the deltas are coalesced (the first alone, then at most one item per interval)."""
        loop = asyncio.get_running_loop()
        sink: asyncio.Queue = asyncio.Queue()
        rid = request.request_id
        with self._lock:
            if self._dead is not None:
                raise EngineDeadError(self._dead)
            if rid in self._sinks:
                raise InvalidRequestError(f"duplicate request id {rid!r}")
            self._sinks[rid] = (loop, sink)
        self._post("add", (request, time.time()))
        finished = False
        try:
            if batching is not None and batching.enabled:
                async with aclosing(coalesce(sink, batching, lambda: self._streaming)) as items:
                    async for item in items:
                        finished = item.finish_reason is not None
                        yield item
                finished = True
                return
            while True:
                item = await sink.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                yield item
                if item.finish_reason is not None:
                    finished = True
                    return
        except EngineError:
            finished = True  # the engine already dropped the request
            raise
        finally:
            with self._lock:
                self._sinks.pop(rid, None)
            if not finished:
                self._post("abort", rid)

    async def abort(self, request_id: str) -> None:
        self._post("abort", request_id)

    def stats(self) -> EngineStats:
        """A snapshot taken by the engine thread after its last step (never blocks; immutable)."""
        return self._stats

    def check_alive(self) -> None:
        """Raises `EngineDeadError` once the engine thread no longer steps (it died, or was shut down)."""
        why = self._dead
        if why is None and not self._thread.is_alive():
            why = "the engine thread is not running"
        if why is not None:
            raise EngineDeadError(why)

    async def forest_summary(self, top_n: int = 32, max_runs: int = 400) -> dict[str, Any]:
        """A bounded summary of the prefix forest (`tree_summary.summarize_forest`), taken on the engine
        thread between steps; `EngineDeadError` once the engine thread has stopped."""
        self.check_alive()
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._post("call", (lambda: summarize_forest(self.core.cache, self.forest_usage, top_n, max_runs), fut))
        return await asyncio.wrap_future(fut)

    def cached_hashes(self, timeout_s: float = SNAPSHOT_WAIT_S) -> tuple[int, ...]:
        """The chunk hashes the cache holds, taken by the engine thread between two steps. Blocks the caller
        until then (one step at most); after ``timeout_s``, or when the engine thread has stopped, the last
        snapshot taken. For plain threads (the cluster publisher's heartbeat), never an event loop's."""
        depth = self._hash_depth
        if depth is None:
            return self._hashes
        if threading.current_thread() is self._thread:
            return self._take_hashes(depth)
        if not self._thread.is_alive() or self._stop.is_set():
            return self._hashes
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._post("call", (lambda: self._take_hashes(depth), fut))
        try:
            return fut.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            return self._hashes

    def _take_hashes(self, depth: int) -> tuple[int, ...]:
        self._hashes = tuple(self.core.cache.cached_hashes(depth))
        return self._hashes

    def on_cache_events(self, fn: Callable[[], None] | None) -> None:
        """``fn()`` runs on the engine thread after each step that queued chunk-hash events (at most once a
        step; it must be quick and thread-safe, such as ``loop.call_soon_threadsafe(event.set)``)."""
        self._on_cache_events = fn

    def has_cache_events(self) -> bool:
        return not self._events.empty()

    def drain_cache_events(self) -> list:
        """Chunk-hash events since the last call (for the cluster index)."""
        out: list = []
        while True:
            try:
                out.append(self._events.get_nowait())
            except queue.Empty:
                return out

    def shutdown(self) -> None:
        """Stops the step thread; requests still running fail with `EngineDeadError`."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=10)

    # ------------------------------------------------------------------ engine thread
    def _post(self, kind: str, payload: Any) -> None:
        self._inbox.put((kind, payload))
        self._wake.set()
        if self._dead is not None:  # nobody reads the inbox any more: answer the calls that wait on it
            self._fail_calls(self._dead)

    def _deliver(self, items: list[tuple[str, Any]]) -> None:
        """Hands (request id, delta or exception) pairs to their queues, one wake-up per event loop."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[str, asyncio.Queue, Any]]] = {}
        with self._lock:
            for rid, item in items:
                target = self._sinks.get(rid)
                if target is not None:
                    by_loop.setdefault(target[0], []).append((rid, target[1], item))
        for loop, puts in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, puts)
            except RuntimeError:  # the caller's loop is closed: its requests have nobody to go to
                for rid, _, _ in puts:
                    self._inbox.put(("abort", rid))

    def _drain_inbox(self) -> None:
        core = self.core
        replies: list[tuple[str, Any]] = []  # (request id, its error, or the last delta of an abort)
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                break
            if kind == "add":
                req: GenerateRequest = payload[0]
                try:
                    if not isinstance(req.sampling, SamplingParams):
                        raise InvalidSamplingError(f"sampling must be SamplingParams, got {type(req.sampling)}")
                    added = core.add_request(req.request_id, list(req.prompt_token_ids), req.sampling,
                                             req.cache_salt, tenant=req.tenant, weight=req.weight,
                                             cache_pin=req.cache_pin, arrival_time=req.arrival_time)
                    added.handed_wall, added.intake_wall = payload[1], time.time()
                    self._tenants[req.request_id] = req.tenant
                except EngineError as e:
                    replies.append((req.request_id, e))
                except (ValueError, TypeError) as e:  # anything else the core refuses is the request's fault
                    replies.append((req.request_id, InvalidRequestError(str(e))))
            elif kind == "abort":
                live = core.request(payload)
                if core.abort(payload) and live is not None:  # a stream still open (`abort()` called) ends
                    replies.append((payload, GenerateDelta(payload, [], "", len(live.prompt), live.num_cached or 0,
                                                          len(live.output), "abort")))
                self._tenants.pop(payload, None)
            elif kind == "call":  # (fn, concurrent future): run fn on the engine thread
                fn, fut = payload
                if not fut.set_running_or_notify_cancel():  # its caller gave up (a timeout, a cancellation)
                    continue
                try:
                    result = fn()
                except Exception as e:
                    fut.set_exception(e)
                else:
                    fut.set_result(result)
        if replies:
            self._deliver(replies)

    def _run(self) -> None:
        lower_thread_priority(self.core.config.thread_nice)  # `cpu_budget.py`: the serving path goes first
        clock = ThreadClock()  # on this thread: it reads this thread's CPU time and run-queue wait
        try:
            self._loop(clock)
        except BaseException:
            logger.exception("engine thread died")
            self._fail_all("the engine thread died")
            raise
        finally:
            clock.close()
            if self._cores is not None:
                self._cores.close()
        self._fail_all("the engine was shut down")

    def _take_threads(self, cores: NodeCores, last_step_s: float) -> None:
        """Marks the worker busy on its node and sets this thread's intra-op threads for the next step: what
        the node lends it after a short step, its own share otherwise."""
        n = cores.busy()
        if last_step_s >= LEND_MAX_STEP_S:
            n = cores.share
        if n != self.step_threads:
            torch.set_num_threads(n)  # the calling (engine) thread's OpenMP setting
            self.step_threads = n

    @staticmethod
    def _notify_cache_events(fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception:  # a listener whose loop has closed: the events wait for the next drain
            logger.debug("cache-event listener failed", exc_info=True)

    def _fail_all(self, why: str) -> None:
        with self._lock:
            self._dead = why
            rids = list(self._sinks)
        self._deliver([(rid, EngineDeadError(why)) for rid in rids])
        self._fail_calls(why)

    def _fail_calls(self, why: str) -> None:
        """Empties the inbox of a stopped engine: each queued call's future gets `EngineDeadError`."""
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "call" and not payload[1].done():
                payload[1].set_exception(EngineDeadError(why))

    def _publish_events(self) -> None:
        """Queues the cache's events of the last step for the worker's index publisher, and wakes it."""
        events = self.core.cache.drain_events()
        for ev in events:
            self._events.put(ev)
        if events and self._on_cache_events is not None:
            self._notify_cache_events(self._on_cache_events)

    def _snapshot(self, clock: ThreadClock) -> EngineStats:
        return EngineStats.from_dict({**self.core.stats(), **clock.times.as_stats()})

    def _loop(self, clock: ThreadClock) -> None:
        core = self.core
        last_step_s = float("inf")  # the step before, timed (lent threads follow short ones only)
        while not self._stop.is_set():
            self._drain_inbox()
            if not core.has_work():
                last_step_s = float("inf")
                if self._cores is not None:
                    self._cores.idle()
                self._stats = self._snapshot(clock)
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            if self._cores is not None:
                self._take_threads(self._cores, last_step_s)
            clock.begin()
            try:
                outs = core.step()
            except Exception as e:  # a bug must not kill the loop silently: fail the running requests
                clock.end()
                logger.exception("engine step failed")
                failed = []
                for rid in core.failed_requests:  # the core dropped them all (and emptied its cache)
                    self._tenants.pop(rid, None)
                    failed.append((rid, EngineStepError(f"engine step failed: {e}")))
                self._deliver(failed)
                self._publish_events()  # the emptied cache's evictions: the index must drop them now
                continue
            last_step_s = clock.end()  # the step's wall time (lent threads follow short ones only)
            self._publish_events()
            now = time.monotonic()
            deltas = []
            for out in outs:
                req = out.req
                n_out = len(req.output)
                if n_out == 1 and req.request_id in self._tenants:
                    self.forest_usage.record(core.cache, req.prompt, req.salt, req.num_cached or 0,
                                             self._tenants.pop(req.request_id))
                deltas.append((req.request_id, GenerateDelta(
                    request_id=req.request_id, token_ids=out.token_ids, text=out.text,
                    num_prompt_tokens=len(req.prompt), num_cached_tokens=req.num_cached or 0,
                    num_output_tokens=n_out, finish_reason=out.finish_reason, logprobs=out.logprobs,
                    first_token_time=req.first_token_time if n_out == 1 else None, extra={"time": now},
                    num_cache_creation_tokens=req.cache_creation_tokens,
                    timeline=_timeline(req) if n_out == 1 else None)))
            self._streaming = len(deltas)
            # before a request's last delta goes out, so that stats read after its response count it (~10 us)
            if now - self._stats_time > 0.1 or any(out.finish_reason is not None for out in outs):
                self._stats, self._stats_time = self._snapshot(clock), now
            if deltas:
                self._deliver(deltas)


def _put_all(puts: list[tuple[str, asyncio.Queue, Any]]) -> None:
    for _, q, item in puts:
        q.put_nowait(item)


__all__ = ["AsyncEngine", "EngineError"]  # EngineError: its old home, re-exported for callers
