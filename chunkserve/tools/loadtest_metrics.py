"""What `chunkserve loadtest` samples while locust runs: the ingress's /metrics, the workers' engine
stats and the resident memory of the worker processes.

``MetricsSampler`` runs in a daemon thread and keeps one ``Sample`` per interval. Worker stats come from
the per-worker series of /metrics (``chunkserve:worker_*{worker_id}``) when the server exports them,
else (a cluster this process started) from each Serve replica's ``record_routing_stats`` (the worker deployment returns its engine's
``kv_cache_usage_perc``, ``kv_chunks_cached`` and queue lengths there); worker RSS from psutil, for the
``ray::ServeReplica:<app>:Worker`` processes under this process (a local cluster we started).
"""

from __future__ import annotations

import logging
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

# /metrics series summed over their labels (tenants) -> short names in a Sample
_COUNTERS = {
    "chunkserve:prefix_cache_hits_total": "cache_hits",
    "chunkserve:prefix_cache_queries_total": "cache_queries",
    "chunkserve:generation_tokens_total": "generation_tokens",
    "chunkserve:prompt_tokens_total": "prompt_tokens",
    "chunkserve:request_success_total": "requests_done",
    "chunkserve:request_errors_total": "request_errors",
    "chunkserve:num_requests_running": "num_requests_running",
    "chunkserve:num_requests_waiting": "num_requests_waiting",
}
_KV_GAUGE = "chunkserve:kv_cache_usage_perc"


@dataclass
class Sample:
    """One sampling tick (``t``: seconds since the sampler started)."""

    t: float
    ok: bool = True  # /metrics answered
    cache_hits: float = 0.0
    cache_queries: float = 0.0
    generation_tokens: float = 0.0
    prompt_tokens: float = 0.0
    requests_done: float = 0.0
    request_errors: float = 0.0
    num_requests_running: float = 0.0
    num_requests_waiting: float = 0.0
    kv_cache_usage_perc: float | None = None  # the ingress gauge (None when the server does not set it)
    # worker -> its `EngineStats` figures by their names (kv_cache_usage_perc, kv_chunks_used, ...)
    workers: dict[str, dict[str, float]] = field(default_factory=dict)
    rss_mb: dict[str, float] = field(default_factory=dict)  # worker pid -> resident MiB

    @property
    def kv_usage_workers(self) -> float | None:
        """Mean KV usage over the workers (from their engine stats), else the ingress gauge."""
        vals = [w["kv_cache_usage_perc"] for w in self.workers.values() if "kv_cache_usage_perc" in w]
        return sum(vals) / len(vals) if vals else self.kv_cache_usage_perc


# per-worker figures, `EngineStats` field names: from /metrics (``chunkserve:worker_<name>{worker_id=...}``,
# when the server exports them) or from each replica's ``record_routing_stats``
WORKER_FIELDS = ("kv_cache_usage_perc", "kv_chunks_used", "kv_chunks_cached", "kv_chunks_total",
                 "num_requests_running", "num_requests_waiting")
_WORKER_SERIES = {f"chunkserve:worker_{name}": name for name in WORKER_FIELDS}


def parse_metrics(text: str) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """(chunkserve series summed over their labels, per-worker series by worker id) of a Prometheus
    text exposition."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    workers: dict[str, dict[str, float]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name in _COUNTERS:
                key = _COUNTERS[s.name]
                out[key] = out.get(key, 0.0) + float(s.value)
            elif s.name == _KV_GAUGE:
                out["kv_cache_usage_perc"] = max(out.get("kv_cache_usage_perc", 0.0), float(s.value))
            elif s.name in _WORKER_SERIES and "worker_id" in s.labels:
                workers.setdefault(s.labels["worker_id"], {})[_WORKER_SERIES[s.name]] = float(s.value)
    return out, workers


def scrape(base_url: str, timeout: float = 5.0, api_key: str | None = None
           ) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """The server's /metrics, parsed; ``api_key``: an admin key (tenant mode refuses /metrics without one)."""
    req = urllib.request.Request(base_url.rstrip("/") + "/metrics",
                                 headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return parse_metrics(resp.read().decode("utf-8", "replace"))


class RayWorkers:
    """The worker replicas of a Serve app in the Ray cluster this process is connected to."""

    def __init__(self, app_name: str = "chunkserve", deployment: str = "Worker") -> None:
        self.app_name = app_name
        self.deployment = deployment
        self._handles: dict[str, Any] = {}

    def refresh(self) -> None:
        import ray

        names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                 if a.get("namespace") == "serve" and f"{self.app_name}#{self.deployment}#" in a["name"]]
        self._handles = {n.rsplit("#", 1)[-1]: ray.get_actor(n, namespace="serve") for n in names}

    def stats(self, timeout: float = 5.0) -> dict[str, dict[str, float]]:
        """replica id -> its `WORKER_FIELDS` (replicas that answered in time)."""
        import ray

        if not self._handles:
            self.refresh()
        refs = {rid: h.record_routing_stats.remote() for rid, h in self._handles.items()}
        out: dict[str, dict[str, float]] = {}
        for rid, ref in refs.items():
            try:
                st = ray.get(ref, timeout=timeout)
            except Exception as e:  # a replica restarting or busy: skip it this tick
                logger.debug("worker %s stats: %s", rid, e)
                self._handles.clear()
                continue
            out[rid] = {name: float(st[name]) for name in WORKER_FIELDS}
        return out


def worker_rss_mb(app_name: str = "chunkserve", deployment: str = "Worker") -> dict[str, float]:
    """Resident MiB of the worker replica processes under this process (by pid)."""
    import psutil

    title = f"ServeReplica:{app_name}:{deployment}"
    out: dict[str, float] = {}
    for p in psutil.Process().children(recursive=True):
        try:
            cmd = " ".join(p.cmdline())
            if title in cmd:
                out[str(p.pid)] = p.memory_info().rss / 2**20
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return out


class MetricsSampler:
    """Samples every ``interval_s`` in a daemon thread until ``stop()``."""

    def __init__(self, base_url: str, interval_s: float = 2.0, workers: RayWorkers | None = None,
                 rss: Callable[[], dict[str, float]] | None = None, api_key: str | None = None) -> None:
        if interval_s <= 0:
            raise ValueError("interval_s must be > 0")
        self.base_url = base_url
        self.interval_s = interval_s
        self.workers = workers
        self.rss = rss
        self.api_key = api_key  # admin key for /metrics in tenant mode
        self.samples: list[Sample] = []
        self._t0 = time.monotonic()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="loadtest-sampler", daemon=True)

    def start(self) -> MetricsSampler:
        self._t0 = time.monotonic()
        self._thread.start()
        return self

    def now(self) -> float:
        return time.monotonic() - self._t0

    def sample(self) -> Sample:
        """Takes one sample now (also used directly around the run)."""
        s = Sample(t=self.now())
        try:
            vals, s.workers = scrape(self.base_url, api_key=self.api_key)
            for k, v in vals.items():
                setattr(s, k, v)
        except Exception as e:
            s.ok = False
            logger.debug("scrape failed: %s", e)
        if self.workers is not None and not s.workers:  # the server does not export worker series
            try:
                s.workers = self.workers.stats()
            except Exception as e:
                logger.debug("worker stats failed: %s", e)
        if self.rss is not None:
            try:
                s.rss_mb = self.rss()
            except Exception as e:
                logger.debug("rss failed: %s", e)
        with self._lock:
            self.samples.append(s)
        return s

    def _loop(self) -> None:
        while not self._stop.is_set():
            t = time.monotonic()
            self.sample()
            self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - t)))

    def stop(self) -> list[Sample]:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)
        with self._lock:
            return list(self.samples)


def samples_to_rows(samples: list[Sample]) -> list[dict[str, Any]]:
    """Flat dicts (JSON-friendly) of the samples."""
    return [{**asdict(s), "kv_usage_workers": s.kv_usage_workers} for s in samples]
