"""Prometheus metrics of the frontends, in vLLM's style with the ``chunkserve:`` prefix.

Each ``ServerMetrics`` owns its own ``CollectorRegistry`` (no process-global state), and ``/metrics``
renders it. Labels: ``model_name`` and ``tenant`` (tenants come from the config, so the cardinality is
bounded); errors are counted by status code.

Cluster view: ``set_cluster(snapshots)`` takes the workers' stats snapshots (``cluster/stats.py``; one
``worker_id="local"`` snapshot for an in-process engine) and exposes them per worker, as
``chunkserve:worker_<name>{model_name, worker_id}`` (the gauges and counters of
``workers/worker_metrics.py``), plus ``chunkserve:kv_cache_usage_perc`` over the whole cluster
(sum of used chunks / sum of pool chunks), ``chunkserve:workers_reporting`` and
``chunkserve:cluster_stats_up`` (0 while Redis does not answer).

Routing-prediction accuracy, summed over the workers' snapshots (each worker scores the router's prediction
for the requests it ran: `workers/worker_metrics.RoutingAccuracy`), labelled ``{model_name, reason}``:
``chunkserve:routing_predictions_total``, ``chunkserve:routing_predictions_correct_total``,
``chunkserve:routing_prediction_accuracy`` (correct / predictions) and the histograms
``chunkserve:routing_predicted_chunks`` and ``chunkserve:routing_reused_chunks`` (leading chunks).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from chunkserve.router.tenant_metrics import tenant_families
from chunkserve.workers.worker_metrics import CHUNK_BUCKETS, COUNTERS, DESCRIPTIONS, GAUGES

_LEG_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                 10.0, 20.0, 40.0, 80.0)
_TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                 5.0, 10.0)
_E2E_BUCKETS = (0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                60.0, 120.0, 240.0)


def aggregate_routing(snapshots: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The workers' routing tallies summed per reason (malformed entries skipped)."""
    n = len(CHUNK_BUCKETS) + 1
    out: dict[str, dict[str, Any]] = {}
    for snap in snapshots:
        routing = snap.get("routing")
        if not isinstance(routing, dict):
            continue
        for reason, t in routing.items():
            if not isinstance(t, dict):
                continue
            a = out.setdefault(str(reason), {"requests": 0, "correct": 0, "predicted_sum": 0, "reused_sum": 0,
                                             "predicted_buckets": [0] * n, "reused_buckets": [0] * n})
            for k in ("requests", "correct", "predicted_sum", "reused_sum"):
                v = t.get(k)
                a[k] += v if isinstance(v, int) else 0
            for k in ("predicted_buckets", "reused_buckets"):
                v = t.get(k)
                if isinstance(v, list) and len(v) == n:
                    a[k] = [x + (y if isinstance(y, int) else 0) for x, y in zip(a[k], v, strict=True)]
    for a in out.values():
        a["accuracy"] = a["correct"] / a["requests"] if a["requests"] else None
    return out


def _routing_families(model_name: str, snapshots: Sequence[dict[str, Any]]) -> Iterator[Metric]:
    agg = aggregate_routing(snapshots)
    lab = ["model_name", "reason"]
    total = CounterMetricFamily("chunkserve:routing_predictions", "Routed requests scored by the worker "
                                "that ran them, by decision reason.", labels=lab)
    correct = CounterMetricFamily("chunkserve:routing_predictions_correct", "Routed requests whose predicted "
                                  "leading cached chunks equalled the chunks reused, by reason.", labels=lab)
    acc = GaugeMetricFamily("chunkserve:routing_prediction_accuracy", "Correct routing predictions / routing "
                            "predictions, by decision reason.", labels=lab)
    hists = {k: HistogramMetricFamily(f"chunkserve:routing_{k}_chunks", f"Leading chunks {what}, by reason.",
                                      labels=lab)
             for k, what in (("predicted", "the router expected the chosen worker to hold"),
                             ("reused", "the worker reused"))}
    bounds = [str(float(b)) for b in CHUNK_BUCKETS] + ["+Inf"]
    for reason, a in sorted(agg.items()):
        lv = [model_name, reason]
        total.add_metric(lv, float(a["requests"]))
        correct.add_metric(lv, float(a["correct"]))
        if a["accuracy"] is not None:
            acc.add_metric(lv, a["accuracy"])
        for k, h in hists.items():
            cum, buckets = 0, []
            for b, c in zip(bounds, a[f"{k}_buckets"], strict=True):
                cum += c
                buckets.append((b, float(cum)))
            h.add_metric(lv, buckets, float(a[f"{k}_sum"]))
    yield from (total, correct, acc, *hists.values())


class _ClusterCollector:
    """Renders the latest worker snapshots (set from the ingress before each render)."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.snapshots: list[dict[str, Any]] = []
        self.up: bool | None = None  # None: no cluster source (nothing rendered)

    def describe(self) -> list[Metric]:
        return []  # dynamic families: no registration-time collect

    def collect(self) -> Iterator[Metric]:
        if self.up is None:
            return
        up = GaugeMetricFamily("chunkserve:cluster_stats_up", "1 when the workers' stats could be read.",
                               labels=["model_name"])
        up.add_metric([self.model_name], 1.0 if self.up else 0.0)
        yield up
        n = GaugeMetricFamily("chunkserve:workers_reporting", "Workers with a fresh stats snapshot.",
                              labels=["model_name"])
        n.add_metric([self.model_name], float(len(self.snapshots)))
        yield n
        lab = ["model_name", "worker_id"]
        for family, fields in ((GaugeMetricFamily, GAUGES), (CounterMetricFamily, COUNTERS)):
            for name, field in fields.items():
                m = family(f"chunkserve:worker_{name}", DESCRIPTIONS[name], labels=lab)
                for snap in self.snapshots:
                    v = snap.get(field)
                    if isinstance(v, (int, float)):
                        m.add_metric([self.model_name, str(snap.get("worker_id"))], float(v))
                yield m
        yield from _routing_families(self.model_name, self.snapshots)
        yield from tenant_families(self.model_name, self.snapshots)  # issue 16: fair share and pins


class ServerMetrics:
    """The frontend's metrics for one model, in a registry of their own."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.model_name = model_name
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        tl = ["model_name", "tenant"]
        self.prefix_cache_queries = Counter(
            "chunkserve:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", tl, registry=r)
        self.prefix_cache_hits = Counter(
            "chunkserve:prefix_cache_hits", "Prompt tokens served from the prefix cache.", tl, registry=r)
        self.prompt_tokens = Counter("chunkserve:prompt_tokens", "Prompt tokens processed.", tl, registry=r)
        self.generation_tokens = Counter(
            "chunkserve:generation_tokens", "Tokens generated.", tl, registry=r)
        self.request_success = Counter(
            "chunkserve:request_success", "Requests that finished, by finish reason.",
            tl + ["finished_reason"], registry=r)
        self.request_errors = Counter(
            "chunkserve:request_errors", "Requests rejected or failed, by status code.",
            ["model_name", "code"], registry=r)
        self.failovers = Counter(
            "chunkserve:request_failovers", "Requests moved to another worker after theirs died, by phase "
            "(before_first_token or mid_stream).", tl + ["phase"], registry=r)
        self.num_requests_running = Gauge(
            "chunkserve:num_requests_running", "Requests generating tokens.", tl, registry=r)
        self.num_requests_waiting = Gauge(
            "chunkserve:num_requests_waiting", "Requests sent to the engine that have no first token yet.",
            tl, registry=r)
        self.kv_cache_usage_perc = Gauge(
            "chunkserve:kv_cache_usage_perc", "Fraction of KV chunks in use (1 = full).", ["model_name"],
            registry=r)
        self.time_to_first_token = Histogram(
            "chunkserve:time_to_first_token_seconds", "Time to the first token.", tl,
            buckets=_TTFT_BUCKETS, registry=r)
        self.time_per_output_token = Histogram(
            "chunkserve:time_per_output_token_seconds", "Time per output token after the first.", tl,
            buckets=_TPOT_BUCKETS, registry=r)
        self.e2e_request_latency = Histogram(
            "chunkserve:e2e_request_latency_seconds", "End-to-end request latency.", tl,
            buckets=_E2E_BUCKETS, registry=r)
        self.ttft_legs = Histogram(
            "chunkserve:ttft_leg_seconds", "Where time to first token goes, by leg (`workers.protocol.TTFT_LEGS`): "
            "ingress, route, step_wait, admission, prefill, return.", ["model_name", "leg"],
            buckets=_LEG_BUCKETS, registry=r)
        self._cluster = _ClusterCollector(model_name)
        r.register(self._cluster)
        # per tenant: cached / prompt / generated tokens seen by this ingress (for the dashboard)
        self.tenant_tokens: dict[str, dict[str, int]] = {}

    def _tally(self, tenant: str, **inc: int) -> None:
        t = self.tenant_tokens.setdefault(tenant, {"cached": 0, "prompt": 0, "generated": 0, "requests": 0})
        for k, v in inc.items():
            t[k] += v

    @property
    def cluster_snapshots(self) -> list[dict[str, Any]]:
        """The workers' snapshots last given to `set_cluster`."""
        return list(self._cluster.snapshots)

    def _l(self, tenant: str) -> dict[str, str]:
        return {"model_name": self.model_name, "tenant": tenant}

    def request_waiting(self, tenant: str) -> None:
        self.num_requests_waiting.labels(**self._l(tenant)).inc()

    def first_token(self, tenant: str, ttft_s: float, prompt_tokens: int, cached_tokens: int) -> None:
        """The request moved from waiting to running."""
        lab = self._l(tenant)
        self.num_requests_waiting.labels(**lab).dec()
        self.num_requests_running.labels(**lab).inc()
        self.time_to_first_token.labels(**lab).observe(max(0.0, ttft_s))
        self.prefix_cache_queries.labels(**lab).inc(prompt_tokens)
        self.prefix_cache_hits.labels(**lab).inc(cached_tokens)
        self.prompt_tokens.labels(**lab).inc(prompt_tokens)
        self._tally(tenant, cached=cached_tokens, prompt=prompt_tokens)

    def first_token_legs(self, legs: Mapping[str, float]) -> None:
        """One request's time to first token, split by leg (`FirstTokenTimeline.legs`)."""
        for leg, seconds in legs.items():
            self.ttft_legs.labels(model_name=self.model_name, leg=leg).observe(seconds)

    def request_done(self, tenant: str, started: bool, e2e_s: float, decode_s: float, output_tokens: int,
                     finish_reason: str) -> None:
        """The request ended (finished, aborted or failed); ``started`` says whether it had a first token."""
        lab = self._l(tenant)
        if started:
            self.num_requests_running.labels(**lab).dec()
        else:
            self.num_requests_waiting.labels(**lab).dec()
        self.generation_tokens.labels(**lab).inc(output_tokens)
        self._tally(tenant, generated=output_tokens, requests=1)
        self.e2e_request_latency.labels(**lab).observe(max(0.0, e2e_s))
        if output_tokens > 1:
            self.time_per_output_token.labels(**lab).observe(max(0.0, decode_s) / (output_tokens - 1))
        self.request_success.labels(**lab, finished_reason=finish_reason).inc()

    def failover(self, tenant: str, phase: str) -> None:
        self.failovers.labels(**self._l(tenant), phase=phase).inc()

    def error(self, status: int | str) -> None:
        self.request_errors.labels(model_name=self.model_name, code=str(status)).inc()

    def set_kv_usage(self, fraction: float) -> None:
        self.kv_cache_usage_perc.labels(model_name=self.model_name).set(fraction)

    def set_cluster(self, snapshots: Sequence[dict[str, Any]] | None) -> None:
        """The workers' latest stats snapshots; None: the source did not answer (shown as down, and no
        cluster KV usage rather than a stale one)."""
        c = self._cluster
        if snapshots is None:
            c.up, c.snapshots = False, []
            with contextlib.suppress(KeyError):
                self.kv_cache_usage_perc.remove(self.model_name)
            return
        c.up, c.snapshots = True, [dict(s) for s in snapshots]
        used = sum(float(s.get("kv_chunks_used", 0) or 0) for s in c.snapshots)
        total = sum(float(s.get("kv_chunks_total", 0) or 0) for s in c.snapshots)
        if total > 0:
            self.set_kv_usage(used / total)

    def render(self) -> bytes:
        """The Prometheus text exposition of this registry."""
        return generate_latest(self.registry)
