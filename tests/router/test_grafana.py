"""deploy/grafana's dashboard queries only metrics that /metrics really exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from chunkserve.router.server_metrics import ServerMetrics
from chunkserve.workers.worker_metrics import RoutingAccuracy

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "chunkserve-dashboard.json"


def test_every_grafana_query_names_an_exported_series() -> None:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    used = {m for e in exprs for m in re.findall(r"chunkserve:[a-z_]+", e)}
    m = ServerMetrics("m")
    acc = RoutingAccuracy("w", 16)
    acc.record("r", {"reason": "prefix_hit", "depth": 1, "expected": {"w": 1}}, 16)
    m.set_cluster([{"worker_id": "w", "kv_chunks_used": 1, "kv_chunks_total": 4, "kv_cache_usage_perc": 0.25,
                    "num_requests_running": 0, "num_requests_waiting": 0, "routing": acc.snapshot()}])
    m.request_waiting("t")
    m.first_token("t", 0.1, 10, 5)
    m.request_done("t", True, 0.3, 0.2, 3, "stop")
    m.error(400)
    exported = {s.name for f in text_string_to_metric_families(m.render().decode()) for s in f.samples}
    assert used <= exported, sorted(used - exported)
    assert {"chunkserve:routing_prediction_accuracy", "chunkserve:worker_kv_cache_usage_perc"} <= used
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
