"""Cache events and the worker-side publisher (sync redis-py; usable without Ray).

A worker's ``PrefixKVCache`` emits :class:`CacheEvent` s; once per engine step the worker hands the
step's events to :meth:`WorkerPublisher.publish`, which applies them in one Lua call (one round trip,
atomic, guarded by the worker's lease). A heartbeat renews the lease every ``lease_ttl_s / 3``; if the
lease had lapsed (or Redis restarted, or a publish failed) the next heartbeat re-acquires it and
re-publishes the worker's whole snapshot, so the index refills by itself after an outage.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from chunkserve.cluster.cache_event import DEFAULT_MAX_DEPTH, EVENT_KINDS, CacheEvent
from chunkserve.cluster.claims import SETTLE_LUA, settle_keys
from chunkserve.cluster.index import (
    DEFAULT_NAMESPACE,
    HEARTBEAT_LUA,
    PUBLISH_LUA,
    REDIS_ERRORS,
    RELEASE_LUA,
    IndexKeys,
    PrefixIndex,
    SyncRedis,
    check_worker_id,
    encode_hash,
    execute_pipeline,
    now_ms,
    redis_client,
)

logger = logging.getLogger(__name__)
__all__ = ["DEFAULT_MAX_DEPTH", "EVENT_KINDS", "CacheEvent", "WorkerPublisher"]

_OPS = {"stored": "s", "evicted": "e", "cleared": "c"}
_SNAPSHOT_BATCH = 1000


SnapshotFn = Callable[[], Iterable[int]]


class WorkerPublisher:
    """Publishes one worker's cache events and holds its lease.

    ``snapshot`` (optional) returns every chunk hash the worker currently holds (depth < ``max_depth``);
    it is used to re-publish after the lease was lost. With :meth:`start` it runs on the heartbeat
    thread, so it must tolerate concurrent cache mutation (a ``RuntimeError`` from iterating a changing
    dict is retried) or take the engine's lock. Publishes wait while a snapshot is being re-published,
    so the index converges to the cache's state. Redis errors never propagate out of
    :meth:`publish` / :meth:`heartbeat`: they are logged once and trigger a resync on recovery.
    """

    def __init__(self, client: SyncRedis | str, worker_id: str, namespace: str = DEFAULT_NAMESPACE,
                 lease_ttl_s: float = 5.0, max_depth: int = DEFAULT_MAX_DEPTH,
                 snapshot: SnapshotFn | None = None, socket_timeout_s: float = 1.0,
                 sweep_every_s: float = 30.0) -> None:
        if lease_ttl_s <= 0:
            raise ValueError(f"lease_ttl_s must be > 0, got {lease_ttl_s}")
        if max_depth <= 0:
            raise ValueError(f"max_depth must be > 0, got {max_depth}")
        self.client = client = redis_client(client, socket_timeout_s)
        self.worker_id = check_worker_id(worker_id)
        self.keys = IndexKeys(namespace)
        self.lease_ttl_s = lease_ttl_s
        self.max_depth = max_depth
        self.snapshot = snapshot
        self.token = uuid.uuid4().hex  # incarnation: a restarted worker never renews its old lease
        self._heartbeat = client.register_script(HEARTBEAT_LUA)
        self._publish = client.register_script(PUBLISH_LUA)
        self._release = client.register_script(RELEASE_LUA)
        self._settle = client.register_script(SETTLE_LUA)
        self._scripts = (self._heartbeat, self._publish, self._release, self._settle)
        self._lock = threading.Lock()
        self._io_lock = threading.Lock()
        self._needs_resync = True
        self._redis_ok = True
        self._stop = threading.Event()
        self._sweeper = PrefixIndex(client, namespace=namespace)
        self.sweep_every_s = sweep_every_s
        self._last_sweep = time.monotonic()
        self._thread: threading.Thread | None = None

    @property
    def _kv(self) -> list[str]:
        return [self.keys.lease(self.worker_id), self.keys.chunks(self.worker_id)]

    def heartbeat(self) -> bool:
        """Renew (or re-acquire) the lease. -> True when the snapshot was (re)published."""
        ttl_ms = max(1, int(self.lease_ttl_s * 1000))
        def queue(pipe: Any) -> None:
            self._heartbeat(keys=self._kv, args=[self.token, ttl_ms], client=pipe)
            pipe.zadd(self.keys.registry, {self.worker_id: now_ms()})

        try:
            fresh = int(execute_pipeline(self.client, queue, self._scripts)[0]) == 1
            with self._lock:
                resync = fresh or self._needs_resync
                self._needs_resync = False
            if resync:
                with self._io_lock:  # no publish interleaves between the snapshot read and its write
                    self._publish_snapshot(ttl_ms)
            if self.sweep_every_s > 0 and time.monotonic() - self._last_sweep > self.sweep_every_s:
                self._last_sweep = time.monotonic()
                self._sweeper.sweep()  # purge workers that died without releasing (any live worker may)
            self._note_ok()
            return resync
        except REDIS_ERRORS as e:
            self._note_error("heartbeat", e)
            with self._lock:
                self._needs_resync = True  # whatever state Redis is in, rewrite it on recovery
            return False

    def _read_snapshot(self) -> list[int]:
        if self.snapshot is None:
            return []
        for attempt in range(3):  # the engine may mutate its cache while we iterate it
            try:
                return [encode_hash(h) for h in self.snapshot()]
            except RuntimeError:
                if attempt == 2:
                    raise
        return []

    def _publish_snapshot(self, ttl_ms: int) -> None:
        hashes = self._read_snapshot()
        pipe = self.client.pipeline(transaction=True)  # one slot: MULTI is valid on Redis Cluster too
        pipe.delete(self._kv[1])
        for i in range(0, len(hashes), _SNAPSHOT_BATCH):
            pipe.sadd(self._kv[1], *hashes[i:i + _SNAPSHOT_BATCH])
        pipe.set(self._kv[0], self.token, px=ttl_ms)
        pipe.execute()

    def publish(self, events: Sequence[CacheEvent]) -> int:
        """Apply one engine step's events in one atomic round trip. -> number of ops applied (-1: not now)."""
        args: list[str | int] = [self.token]
        stored: list[int] = []
        for ev in events:
            if ev.kind == "stored" and ev.depth >= self.max_depth:
                continue
            args.append(_OPS[ev.kind])
            args.append(encode_hash(ev.chunk_hash) if ev.kind != "cleared" else 0)
            if ev.kind == "stored":
                stored.append(encode_hash(ev.chunk_hash))
        if len(args) == 1:
            return 0
        try:
            with self._io_lock:
                if not stored:
                    n = int(self._publish(keys=self._kv, args=args))
                else:  # and settle the cold claims those chunks complete (`cluster/claims.py`): one round trip
                    def queue(pipe: Any) -> None:  # both replay safely: set ops in order, settles once
                        self._publish(keys=self._kv, args=args, client=pipe)
                        self._settle(keys=settle_keys(self.keys), args=[self.worker_id, *stored], client=pipe)

                    n = int(execute_pipeline(self.client, queue, self._scripts)[0])
        except REDIS_ERRORS as e:
            self._note_error("publish", e)
            with self._lock:
                self._needs_resync = True
            return -1
        self._note_ok()
        if n < 0:  # lease lost: the next heartbeat re-acquires it and re-publishes the snapshot
            with self._lock:
                self._needs_resync = True
        return n

    def start(self, interval_s: float | None = None) -> WorkerPublisher:
        """Heartbeat now and then every ``interval_s`` (default ``lease_ttl_s / 3``) in a daemon thread."""
        if self._thread is not None:
            return self
        interval = interval_s if interval_s is not None else self.lease_ttl_s / 3
        if interval <= 0 or interval >= self.lease_ttl_s:
            raise ValueError(f"heartbeat interval must be in (0, lease_ttl_s), got {interval}")
        self.heartbeat()
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, args=(interval,), daemon=True,
                                        name=f"chunkserve-lease-{self.worker_id}")
        self._thread.start()
        return self

    def _loop(self, interval: float) -> None:
        while not self._stop.wait(interval):
            try:
                self.heartbeat()
            except Exception:  # e.g. a failing snapshot(): keep the lease thread alive, retry next tick
                logger.exception("lease heartbeat of worker %s failed", self.worker_id)
                with self._lock:
                    self._needs_resync = True

    def stop(self, release: bool = True) -> None:
        """Stop heartbeating; with ``release`` drop the lease and entries at once (graceful shutdown)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None
        if release:
            try:
                self._release(keys=self._kv, args=[self.token])
                self.client.zrem(self.keys.registry, self.worker_id)
            except REDIS_ERRORS as e:
                self._note_error("release", e)

    def _note_error(self, what: str, e: Exception) -> None:
        if self._redis_ok:
            logger.warning("prefix index unreachable (%s for worker %s): %s; will resync on recovery",
                           what, self.worker_id, e)
        self._redis_ok = False

    def _note_ok(self) -> None:
        if not self._redis_ok:
            logger.info("prefix index reachable again for worker %s", self.worker_id)
        self._redis_ok = True
