"""The router's load signal: ongoing requests plus the engine's waiting queue (KV pressure), so that requests
do not pile up on one worker whose pool is full."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

from chunkserve.router.policy import PolicyConfig, PrefixPolicy
from chunkserve.router.request_router import PrefixAwareRouter


def _replica(wid: str, stats: object) -> SimpleNamespace:
    return SimpleNamespace(replica_id=SimpleNamespace(unique_id=wid), routing_stats=stats, max_ongoing_requests=64)


def _router(queue: dict[str, int]) -> SimpleNamespace:
    return SimpleNamespace(_local_load=Counter(), replica_queue_len_cache=SimpleNamespace(
        get=lambda rid: queue.get(rid.unique_id)))


def test_load_counts_waiting_requests_on_top_of_the_ongoing_ones():
    router = _router({"a": 6, "b": 6})
    a = PrefixAwareRouter._load(router, _replica("a", {"num_requests_running": 2, "num_requests_waiting": 4}))  # type: ignore[arg-type]
    b = PrefixAwareRouter._load(router, _replica("b", {"num_requests_running": 6, "num_requests_waiting": 0}))  # type: ignore[arg-type]
    assert (a.ongoing, b.ongoing) == (10, 6)


def test_malformed_or_missing_routing_stats_count_as_no_waiting():
    router = _router({"a": 3})
    for stats in (None, {}, {"num_requests_waiting": "9"}, {"num_requests_waiting": -2}, ["x"]):
        assert PrefixAwareRouter._load(router, _replica("a", stats)).ongoing == 3  # type: ignore[arg-type]


def test_with_equal_ongoing_a_cold_request_goes_to_the_worker_without_a_waiting_queue():
    router = _router({"a": 5, "b": 5})
    loads = [PrefixAwareRouter._load(router, _replica("a", {"num_requests_waiting": 4})),  # type: ignore[arg-type]
             PrefixAwareRouter._load(router, _replica("b", {"num_requests_waiting": 0}))]  # type: ignore[arg-type]
    policy = PrefixPolicy(PolicyConfig())
    picks = Counter(policy.decide(loads, [], {}).replica_id for _ in range(10))
    assert picks["b"] == 10


def test_a_stale_waiting_report_does_not_weigh_on_a_replica_whose_queue_has_drained():
    """Routing stats arrive about once a second: 13 waiting reported just before the queue drained must
    not keep repelling requests from a replica that now has nothing in flight (or only 1)."""
    idle = PrefixAwareRouter._load(_router({"a": 0}), _replica("a", {"num_requests_waiting": 13}))  # type: ignore[arg-type]
    one = PrefixAwareRouter._load(_router({"a": 1}), _replica("a", {"num_requests_waiting": 13}))  # type: ignore[arg-type]
    assert (idle.ongoing, one.ongoing) == (0, 2)
