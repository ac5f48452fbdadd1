"""Per-worker metrics through Ray Serve metrics (exported by Ray's Prometheus endpoint).

``WorkerMetrics.update(engine.stats())`` sets the gauges and adds the growth of the engine's cumulative
counters since the previous update. Inside a Serve replica Ray tags every series with ``deployment``,
``replica`` and ``application``; we add ``worker_id`` (the replica's unique id, as in the prefix index).
Exported names (Ray prefixes ``ray_`` and suffixes counters with ``_total``)::

    ray_chunkserve_worker_prefix_cache_queries_total   prompt tokens looked up in the prefix cache
    ray_chunkserve_worker_prefix_cache_hits_total      prompt tokens served from it
    ray_chunkserve_worker_num_preemptions_total        requests preempted (pool full)
    ray_chunkserve_worker_engine_step_seconds_total    wall time the engine thread spent in steps
    ray_chunkserve_worker_engine_step_cpu_seconds_total           ... its CPU time in them
    ray_chunkserve_worker_engine_step_runqueue_seconds_total      ... its wait for a core other processes held
    ray_chunkserve_worker_kv_cache_usage_perc          fraction of KV chunks in use (1 = full)
    ray_chunkserve_worker_kv_chunks_used / _cached / _total
    ray_chunkserve_worker_num_requests_running / _waiting

Without Ray (workers/ must run without it) only the local tallies (``totals``, ``gauges``) are kept.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Mapping
from typing import Any

logger = logging.getLogger(__name__)

PREFIX = "chunkserve_worker_"
# counter name -> cumulative engine-stats field
COUNTERS: dict[str, str] = {
    "prefix_cache_queries": "prompt_tokens_total",
    "prefix_cache_hits": "prefix_cached_tokens",
    "num_preemptions": "num_preemptions",
    "engine_step_seconds": "step_busy_s",
    "engine_step_cpu_seconds": "step_cpu_s",
    "engine_step_runqueue_seconds": "step_runqueue_s",
}
# gauge name -> engine-stats field
GAUGES: dict[str, str] = {
    "kv_cache_usage_perc": "kv_cache_usage_perc",
    "kv_chunks_used": "kv_chunks_used",
    "kv_chunks_cached": "kv_chunks_cached",
    "kv_chunks_total": "kv_chunks_total",
    "num_requests_running": "num_requests_running",
    "num_requests_waiting": "num_requests_waiting",
}
DESCRIPTIONS = {
    "prefix_cache_queries": "Prompt tokens looked up in the worker's prefix cache.",
    "prefix_cache_hits": "Prompt tokens served from the worker's prefix cache.",
    "num_preemptions": "Requests preempted because the KV pool was full.",
    "engine_step_seconds": "Wall seconds the worker's engine thread spent in steps.",
    "engine_step_cpu_seconds": "CPU seconds of the engine thread in its steps.",
    "engine_step_runqueue_seconds": "Seconds the engine thread was ready to step but waited for a core that "
                                    "other processes held (Linux; 0 elsewhere): the node's CPU contention.",
    "kv_cache_usage_perc": "Fraction of the worker's KV chunks in use (1 = full).",
    "kv_chunks_used": "KV chunks referenced by live sequences.",
    "kv_chunks_cached": "KV chunks kept only as prefix cache (evictable).",
    "kv_chunks_total": "KV chunks in the worker's pool.",
    "num_requests_running": "Requests the worker is running.",
    "num_requests_waiting": "Requests queued in the worker's scheduler.",
}


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


class WorkerMetrics:
    """One worker replica's Ray Serve counters and gauges, fed from engine stats snapshots."""

    def __init__(self, worker_id: str, enable_ray: bool = True) -> None:
        self.worker_id = worker_id
        self.tags = {"worker_id": worker_id}
        self.totals: dict[str, float] = dict.fromkeys(COUNTERS, 0.0)  # what the counters have been given
        self.gauges: dict[str, float] = {}
        self._seen: dict[str, float] = {}  # last cumulative value per stats field
        self._ray: dict[str, Any] = {}
        if enable_ray:
            self._ray = _ray_metrics()

    @property
    def ray_enabled(self) -> bool:
        return bool(self._ray)

    def update(self, stats: Mapping[str, Any]) -> None:
        """Record one engine ``stats()`` snapshot (never raises on exporter errors)."""
        for name, field in COUNTERS.items():
            v = _num(stats.get(field))
            if v is None:
                continue
            prev = self._seen.get(field, 0.0)
            delta = v - prev if v >= prev else v  # a reset (new engine) restarts from its value
            self._seen[field] = v
            if delta > 0:
                self.totals[name] += delta
                self._record(name, delta, counter=True)
        for name, field in GAUGES.items():
            v = _num(stats.get(field))
            if v is not None:
                self.gauges[name] = v
                self._record(name, v, counter=False)

    def _record(self, name: str, value: float, counter: bool) -> None:
        m = self._ray.get(name)
        if m is None:
            return
        try:
            if counter:
                m.inc(value, tags=self.tags)
            else:
                m.set(value, tags=self.tags)
        except Exception as e:  # pragma: no cover - exporter hiccups must not fail the worker
            logger.debug("worker metric %s update failed: %s", name, e)


def _ray_metrics() -> dict[str, Any]:
    """The Ray Serve metric objects, or {} when Ray is not importable or not connected."""
    try:
        import ray
        from ray.serve import metrics
    except ImportError:
        return {}
    if not ray.is_initialized():
        return {}
    try:
        out: dict[str, Any] = {}
        for name in COUNTERS:
            out[name] = metrics.Counter(PREFIX + name, description=DESCRIPTIONS[name], tag_keys=("worker_id",))
        for name in GAUGES:
            out[name] = metrics.Gauge(PREFIX + name, description=DESCRIPTIONS[name], tag_keys=("worker_id",))
        return out
    except Exception as e:  # metrics must never break serving
        logger.warning("worker metrics disabled: %s", e)
        return {}


# ---- routing-prediction accuracy ----------------------------------------------------------------------
# Upper bounds (le) of the chunk-count histogram buckets; the last bucket is +Inf.
CHUNK_BUCKETS: tuple[int, ...] = (0, 1, 2, 4, 8, 16, 32, 64, 128)
ROUTING_KWARG = "routing"  # what PrefixAwareRouter adds to the request's kwargs


def bucket_of(n: int) -> int:
    """Index of the first bucket whose bound is >= n (len(CHUNK_BUCKETS) for +Inf)."""
    for i, b in enumerate(CHUNK_BUCKETS):
        if n <= b:
            return i
    return len(CHUNK_BUCKETS)


class RoutingAccuracy:
    """Whether the router's prediction came true, per decision reason, as this worker saw it.

    The router sends ``routing = {"reason": r, "depth": d, "expected": {worker id: k}}``: the hash depth d
    (leading full chunks hashed) and, per candidate, the k leading chunks it expected that worker to hold.
    When the request's first delta comes out, the chunks this worker reused are ``min(cached tokens //
    chunk size, d)``; the prediction is correct when that equals this worker's k. Kept per reason: requests,
    correct ones, sums and bucket counts of predicted and reused chunks; each outcome also goes to a bounded
    log (``log``, the records an offline recomputation reads) and, when off by more than one chunk, to the
    debug log with the hash depth.
    """

    def __init__(self, worker_id: str, chunk_size: int, max_log: int = 10_000) -> None:
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        self.worker_id = worker_id
        self.chunk_size = chunk_size
        self.by_reason: dict[str, dict[str, Any]] = {}
        self.log: deque[dict[str, Any]] = deque(maxlen=max_log)

    def record(self, request_id: str, routing: Any, num_cached_tokens: int) -> dict[str, Any] | None:
        """Record one routed request; -> the outcome, or None when ``routing`` is absent or malformed."""
        if not isinstance(routing, Mapping):
            return None
        reason, depth, expected = routing.get("reason"), routing.get("depth"), routing.get("expected")
        if not isinstance(reason, str) or not isinstance(depth, int) or not isinstance(expected, Mapping):
            return None
        predicted = expected.get(self.worker_id, 0)
        if not isinstance(predicted, int):
            return None
        reused = min(max(0, int(num_cached_tokens)) // self.chunk_size, depth)
        rec: dict[str, Any] = {"request_id": request_id, "reason": reason, "depth": depth, "predicted": predicted,
               "reused": reused, "correct": predicted == reused}
        t = self.by_reason.get(reason)
        if t is None:
            n = len(CHUNK_BUCKETS) + 1
            t = self.by_reason[reason] = {"requests": 0, "correct": 0, "predicted_sum": 0, "reused_sum": 0,
                                          "predicted_buckets": [0] * n, "reused_buckets": [0] * n}
        t["requests"] += 1
        t["correct"] += int(rec["correct"])
        t["predicted_sum"] += predicted
        t["reused_sum"] += reused
        t["predicted_buckets"][bucket_of(predicted)] += 1
        t["reused_buckets"][bucket_of(reused)] += 1
        self.log.append(rec)
        if abs(predicted - reused) > 1:
            logger.debug("routing prediction off: request %s reason %s hash depth %d predicted %d reused %d "
                         "on worker %s", request_id, reason, depth, predicted, reused, self.worker_id)
        return rec

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """A JSON-able copy of the per-reason tallies."""
        return {r: {k: (list(v) if isinstance(v, list) else v) for k, v in t.items()}
                for r, t in self.by_reason.items()}


class TenantTokens:
    """Per tenant, the requests this worker ran and their cached, prefilled and decoded tokens (the tenants
    come from the tenants file, so the key set is bounded)."""

    def __init__(self) -> None:
        self.by_tenant: dict[str, dict[str, int]] = {}

    def _t(self, tenant: str) -> dict[str, int]:
        t = self.by_tenant.get(tenant)
        if t is None:
            t = self.by_tenant[tenant] = {"requests": 0, "cached": 0, "prefilled": 0, "decoded": 0}
        return t

    def started(self, tenant: str, prompt_tokens: int, cached_tokens: int) -> None:
        t = self._t(tenant)
        t["requests"] += 1
        t["cached"] += cached_tokens
        t["prefilled"] += max(0, prompt_tokens - cached_tokens)

    def decoded(self, tenant: str, tokens: int) -> None:
        self._t(tenant)["decoded"] += tokens

    def snapshot(self) -> dict[str, dict[str, int]]:
        return {k: dict(v) for k, v in self.by_tenant.items()}
