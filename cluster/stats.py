"""Worker stats snapshots in Redis, so the ingress's ``/metrics`` shows the whole cluster.

Each worker writes one small JSON snapshot of its engine stats with a TTL, about once a second, from its
publishing loop (:class:`WorkerStatsWriter`, sync redis-py, called off the event loop). The ingress reads
all live snapshots (:class:`ClusterStatsReader`, redis.asyncio) when it renders ``/metrics``: cached
for ``cache_ttl_s``, never waiting more than ``timeout_s``; Redis errors give ``None`` (logged once).

Key schema (same namespace and hash-tag rules as ``cluster/index.py``; see docs/cluster-index.md):

* ``{ns:w:<worker>}:stats``  string, JSON object of numbers (``STATS_FIELDS`` + ``worker_id``, ``ts_ms``),
  ``PX`` TTL ``ttl_s`` (default 5 s). Shares the worker's hash tag, so it lives in the lease's slot.
  It also carries ``routing``: the worker's routing-prediction tallies per decision reason
  (`workers/worker_metrics.RoutingAccuracy.snapshot`), and ``tenants``: per tenant, the requests it ran and
  their cached / prefilled / decoded tokens (`TenantTokens`).
* ``{ns:w:<worker>}:forest``  string, JSON of the worker's bounded prefix-forest summary
  (`workers/tree_summary.summarize_forest`: run sizes, scopes, refcounts, tenants; never tokens or text),
  written every few seconds with the same TTL, read by the ingress's dashboard.
* Workers are discovered through the index registry ``{ns}:workers`` (zset, kept by the lease heartbeat).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Mapping
from typing import Any

from chunkserve.cluster.index import (
    DEFAULT_NAMESPACE,
    REDIS_ERRORS,
    AsyncRedis,
    IndexKeys,
    SyncRedis,
    async_redis_client,
    check_worker_id,
    now_ms,
    redis_client,
)

logger = logging.getLogger(__name__)

DEFAULT_STATS_TTL_S = 5.0
# Engine stats copied into a snapshot (numbers only; cumulative ones are counters).
STATS_FIELDS = ("kv_cache_usage_perc", "kv_chunks_used", "kv_chunks_cached", "kv_chunks_total",
                "num_requests_running", "num_requests_waiting", "num_preemptions",
                "prompt_tokens_total", "prefix_cached_tokens", "step_busy_s", "step_cpu_s", "step_runqueue_s")


def stats_key(namespace: str, worker_id: str) -> str:
    """``{ns:w:<worker>}:stats`` (the worker's hash tag, as for its lease and chunk set)."""
    IndexKeys(namespace)  # validates the namespace
    return f"{{{namespace}:w:{check_worker_id(worker_id)}}}:stats"


def forest_key(namespace: str, worker_id: str) -> str:
    """``{ns:w:<worker>}:forest`` (the worker's hash tag)."""
    IndexKeys(namespace)
    return f"{{{namespace}:w:{check_worker_id(worker_id)}}}:forest"


def snapshot_of(stats: Mapping[str, Any], worker_id: str) -> dict[str, Any]:
    """The snapshot written for ``stats`` (an engine ``stats()`` dict): numeric ``STATS_FIELDS`` only,
    plus the ``routing`` tallies when present."""
    snap: dict[str, Any] = {"worker_id": worker_id, "ts_ms": now_ms()}
    for f in STATS_FIELDS:
        v = stats.get(f)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            snap[f] = v
    for f in ("routing", "tenants", "tenant_sched"):  # per-reason and per-tenant tallies (workers/worker_metrics.py;
        # tenant_sched: the scheduler's fair share, queueing and pins, router/tenant_metrics.py)
        if isinstance(stats.get(f), Mapping):
            snap[f] = dict(stats[f])
    return snap


class WorkerStatsWriter:
    """Writes one worker's stats snapshot (``SET key json PX ttl``); never raises on Redis errors."""

    def __init__(self, client: SyncRedis | str, worker_id: str, namespace: str = DEFAULT_NAMESPACE,
                 ttl_s: float = DEFAULT_STATS_TTL_S, socket_timeout_s: float = 1.0) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        self.client = redis_client(client, socket_timeout_s)
        self.worker_id = check_worker_id(worker_id)
        self.key = stats_key(namespace, worker_id)
        self.forest_key = forest_key(namespace, worker_id)
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self._ok = True

    def write(self, stats: Mapping[str, Any]) -> bool:
        """Write the snapshot of ``stats``. -> False when Redis is unreachable (logged once)."""
        try:
            self.client.set(self.key, json.dumps(snapshot_of(stats, self.worker_id)), px=self.ttl_ms)
        except REDIS_ERRORS as e:
            if self._ok:
                logger.warning("worker %s: cannot write stats to Redis: %s", self.worker_id, e)
            self._ok = False
            return False
        if not self._ok:
            logger.info("worker %s: stats reach Redis again", self.worker_id)
        self._ok = True
        return True

    def write_forest(self, summary: Mapping[str, Any]) -> bool:
        """Write the forest summary (same TTL). -> False when Redis is unreachable."""
        try:
            self.client.set(self.forest_key, json.dumps({**summary, "ts_ms": now_ms()}), px=self.ttl_ms)
        except REDIS_ERRORS as e:
            logger.debug("worker %s: cannot write the forest summary: %s", self.worker_id, e)
            return False
        return True

    def delete(self) -> None:
        """Drop the snapshot at once (graceful shutdown)."""
        try:
            self.client.delete(self.key, self.forest_key)
        except REDIS_ERRORS as e:
            logger.debug("worker %s: stats delete failed: %s", self.worker_id, e)


class ClusterStatsReader:
    """The live workers' snapshots for the ingress; create and use it on one event loop.

    A fetch is two round trips (registry, then one pipelined ``GET`` per worker), at most once per
    ``cache_ttl_s``; concurrent callers share it. A caller waits at most ``timeout_s``: a slower fetch
    keeps running in the background (bounded by the socket timeout) for the next caller, and this one gets
    the previous result if it is younger than ``stale_s``, else None. A Redis error gives None, logged
    once until Redis answers again.
    """

    def __init__(self, url: str, namespace: str = DEFAULT_NAMESPACE, cache_ttl_s: float = 1.0,
                 timeout_s: float = 0.5, stale_s: float = 10.0, socket_timeout_s: float = 2.0) -> None:
        if cache_ttl_s < 0 or timeout_s <= 0 or stale_s < 0 or socket_timeout_s <= 0:
            raise ValueError("cache_ttl_s and stale_s must be >= 0, timeout_s and socket_timeout_s > 0")
        self.url = url
        self.keys = IndexKeys(namespace)
        self.namespace = namespace
        self.cache_ttl_s = cache_ttl_s
        self.timeout_s = timeout_s
        self.stale_s = stale_s
        self.socket_timeout_s = socket_timeout_s
        self._client: AsyncRedis | None = None
        self._last: list[dict[str, Any]] | None = None  # result of the last finished fetch (None: failed)
        self._last_at = -float("inf")
        self._good_at = -float("inf")  # when a fetch last succeeded
        self._inflight: asyncio.Task | None = None
        self._ok = True

    def _redis(self) -> AsyncRedis:
        if self._client is None:  # created lazily, inside the loop that uses it
            self._client = async_redis_client(self.url, self.socket_timeout_s)
        return self._client

    async def _fetch(self) -> list[dict[str, Any]]:
        client = self._redis()
        ids = [w.decode() if isinstance(w, bytes) else str(w)
               for w in await client.zrange(self.keys.registry, 0, -1)]
        if not ids:
            return []
        pipe = client.pipeline(transaction=False)
        for w in ids:
            pipe.get(stats_key(self.namespace, w))
        out: list[dict[str, Any]] = []
        for w, raw in zip(ids, await pipe.execute(), strict=True):
            if raw is None:  # expired: the worker is gone or not reporting
                continue
            try:
                snap = json.loads(raw)
            except ValueError:
                logger.debug("bad stats snapshot for worker %s", w)
                continue
            if isinstance(snap, dict):
                snap["worker_id"] = w
                out.append(snap)
        return out

    async def _refresh(self) -> list[dict[str, Any]] | None:
        try:
            snaps: list[dict[str, Any]] | None = await self._fetch()
        except REDIS_ERRORS as e:
            if self._ok:
                logger.warning("cluster stats unavailable from Redis (%s); /metrics shows the ingress only",
                               e or type(e).__name__)
            self._ok = False
            snaps = None
        else:
            if not self._ok:
                logger.info("cluster stats available from Redis again")
            self._ok = True
            self._good_at = time.monotonic()
        self._last, self._last_at = snaps, time.monotonic()
        return snaps

    async def snapshots(self) -> list[dict[str, Any]] | None:
        """The live workers' snapshots (cached), or None when Redis did not answer."""
        if time.monotonic() - self._last_at < self.cache_ttl_s:
            return self._last
        if self._inflight is None or self._inflight.done():
            self._inflight = asyncio.get_running_loop().create_task(self._refresh())
        try:
            return await asyncio.wait_for(asyncio.shield(self._inflight), self.timeout_s)
        except TimeoutError:  # slow Redis: answer now, the fetch finishes for the next caller
            if self._last is not None and time.monotonic() - self._good_at < self.stale_s:
                return self._last
            return None

    async def forests(self) -> dict[str, dict[str, Any]] | None:
        """The live workers' forest summaries (worker id -> summary; one pipelined round trip after the
        registry), or None when Redis did not answer within ``timeout_s``."""
        async def fetch() -> dict[str, dict[str, Any]]:
            client = self._redis()
            ids = [w.decode() if isinstance(w, bytes) else str(w)
                   for w in await client.zrange(self.keys.registry, 0, -1)]
            if not ids:
                return {}
            pipe = client.pipeline(transaction=False)
            for w in ids:
                pipe.get(forest_key(self.namespace, w))
            out: dict[str, dict[str, Any]] = {}
            for w, raw in zip(ids, await pipe.execute(), strict=True):
                try:
                    val = json.loads(raw) if raw is not None else None
                except ValueError:
                    val = None
                if isinstance(val, dict):
                    out[w] = val
            return out

        try:
            return await asyncio.wait_for(fetch(), self.timeout_s)
        except REDIS_ERRORS as e:
            logger.debug("forest summaries unavailable: %s", e)
            return None

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None
