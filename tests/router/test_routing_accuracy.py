"""Routing-prediction accuracy: the worker's scoring, and its export on the ingress's /metrics."""

from __future__ import annotations

import logging

import pytest
from prometheus_client.parser import text_string_to_metric_families

from chunkserve.router.policy import PrefixPolicy, ReplicaLoad
from chunkserve.router.server_metrics import ServerMetrics
from chunkserve.workers.worker_metrics import RoutingAccuracy


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_decision_carries_the_expected_chunks_of_every_holder() -> None:
    pol = PrefixPolicy()
    d = pol.decide([ReplicaLoad("a", 0), ReplicaLoad("b", 0)], [1, 2, 3], {"a": 3, "b": 1})
    assert (d.replica_id, d.reason) == ("a", "prefix_hit")
    assert dict(d.expected) == {"a": 3, "b": 1}


def test_worker_scores_its_own_prediction_and_logs_misses_over_one_chunk(caplog: pytest.LogCaptureFixture
                                                                          ) -> None:
    acc = RoutingAccuracy("w1", chunk_size=16)
    routing = {"reason": "prefix_hit", "depth": 4, "expected": {"w1": 4, "w2": 1}}
    assert acc.record("r1", routing, 70)["correct"] is True  # 70 // 16 = 4 chunks
    assert acc.record("r2", routing, 48)["reused"] == 3  # off by one: wrong, not logged
    with caplog.at_level(logging.DEBUG, logger="chunkserve.workers.worker_metrics"):
        rec = acc.record("r3", {"reason": "cold_hash", "depth": 4, "expected": {"w2": 4}}, 64)
    assert rec == {"request_id": "r3", "reason": "cold_hash", "depth": 4, "predicted": 0, "reused": 4,
                   "correct": False}
    assert "hash depth 4" in caplog.text and "r2" not in caplog.text
    assert acc.record("r4", {"reason": 3}, 0) is None  # malformed: ignored
    snap = acc.snapshot()
    assert snap["prefix_hit"]["requests"] == 2 and snap["prefix_hit"]["correct"] == 1
    assert snap["prefix_hit"]["predicted_sum"] == 8 and snap["prefix_hit"]["reused_sum"] == 7


def test_metrics_sum_the_workers_tallies_per_reason() -> None:
    a, b = RoutingAccuracy("a", 16), RoutingAccuracy("b", 16)
    hit = {"reason": "prefix_hit", "depth": 2, "expected": {"a": 2, "b": 2}}
    a.record("1", hit, 32)
    a.record("2", hit, 0)
    b.record("3", hit, 40)
    b.record("4", {"reason": "spill", "depth": 2, "expected": {"a": 2}}, 0)
    m = ServerMetrics("m")
    m.set_cluster([{"worker_id": "a", "routing": a.snapshot()}, {"worker_id": "b", "routing": b.snapshot()}])
    s = _samples(m.render().decode())
    hl = (("model_name", "m"), ("reason", "prefix_hit"))
    assert s[("chunkserve:routing_predictions_total", hl)] == 3
    assert s[("chunkserve:routing_predictions_correct_total", hl)] == 2
    assert s[("chunkserve:routing_prediction_accuracy", hl)] == pytest.approx(2 / 3)
    assert s[("chunkserve:routing_prediction_accuracy", (("model_name", "m"), ("reason", "spill")))] == 1.0
    assert s[("chunkserve:routing_reused_chunks_bucket", tuple(sorted((*hl, ("le", "0.0")))))] == 1
    assert s[("chunkserve:routing_reused_chunks_bucket", tuple(sorted((*hl, ("le", "2.0")))))] == 3
    assert s[("chunkserve:routing_predicted_chunks_sum", hl)] == 6
