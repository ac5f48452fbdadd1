"""Per-tenant scheduling and pin metrics from the workers' stats snapshots (issue 16).

Each worker's scheduler reports, per tenant, its virtual-token-counter figures and its pins
(``tenant_sched`` in the engine stats: `workers/scheduler.Scheduler.stats`); the ingress renders them
with labels ``{model_name, tenant, worker_id}``:

* ``chunkserve:tenant_share``: recent weighted service over the tenant's fair share on that worker
  (1.0 = exactly fair; `workers/fairness.FairShare.share`);
* ``chunkserve:tenant_served_tokens_total{kind="prefill"|"decode"}``;
* ``chunkserve:tenant_queue_time_seconds_total`` and ``chunkserve:tenant_admitted_total`` (their ratio
  is the mean wait from the frontend's arrival stamp to admission);
* ``chunkserve:tenant_pinned_tokens`` (gauge) and ``chunkserve:tenant_pins_expired_total``,
  ``chunkserve:tenant_pins_refused_total``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

SNAPSHOT_FIELD = "tenant_sched"
_GAUGES = {
    "tenant_share": ("share", "Recent weighted service of the tenant over its fair share (1.0 = fair)."),
    "tenant_pinned_tokens": ("pinned_tokens", "Tokens the tenant holds pinned with cache_control."),
}
_COUNTERS = {
    "tenant_queue_time_seconds": ("queue_time_s", "Seconds the tenant's requests waited before admission."),
    "tenant_admitted": ("admitted", "Requests of the tenant admitted by the worker's scheduler."),
    "tenant_pins_expired": ("pins_expired", "cache_control pins of the tenant released at their TTL."),
    "tenant_pins_refused": ("pins_refused", "cache_control pins refused (quota or the pool's pin share)."),
}


def _rows(snapshots: Sequence[Mapping[str, Any]]) -> Iterator[tuple[str, str, Mapping[str, Any]]]:
    for snap in snapshots:
        per = snap.get(SNAPSHOT_FIELD)
        if not isinstance(per, Mapping):
            continue
        for tenant, st in per.items():
            if isinstance(st, Mapping):
                yield str(tenant), str(snap.get("worker_id")), st


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def tenant_families(model_name: str, snapshots: Sequence[Mapping[str, Any]]) -> Iterator[Metric]:
    """The per-tenant families above for the given worker snapshots."""
    labels = ["model_name", "tenant", "worker_id"]
    rows = list(_rows(snapshots))
    for name, (field, doc) in _GAUGES.items():
        m: GaugeMetricFamily | CounterMetricFamily = GaugeMetricFamily(f"chunkserve:{name}", doc, labels=labels)
        for tenant, worker, st in rows:
            v = _num(st.get(field))
            if v is not None:
                m.add_metric([model_name, tenant, worker], v)
        yield m
    for name, (field, doc) in _COUNTERS.items():
        m = CounterMetricFamily(f"chunkserve:{name}", doc, labels=labels)
        for tenant, worker, st in rows:
            v = _num(st.get(field))
            if v is not None:
                m.add_metric([model_name, tenant, worker], v)
        yield m
    served = CounterMetricFamily("chunkserve:tenant_served_tokens", "Prefill and decode tokens served to the "
                                 "tenant by the worker's scheduler.", labels=[*labels, "kind"])
    for tenant, worker, st in rows:
        for kind in ("prefill", "decode"):
            v = _num(st.get(f"{kind}_tokens"))
            if v is not None:
                served.add_metric([model_name, tenant, worker, kind], v)
    yield served
