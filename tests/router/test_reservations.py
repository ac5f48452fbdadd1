"""The router's own per-worker count (`router/reservations.py`): a request counts on its worker from the
decision until Serve completes it; one Serve never sent (cancelled while waiting) does not count for long."""

from __future__ import annotations

from chunkserve.router.reservations import Reservations


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_a_request_counts_on_its_worker_from_the_decision_until_it_completes():
    res = Reservations(clock=Clock())
    res.decided("r1", "a")
    res.decided("r2", "a")
    assert res.load["a"] == 2
    res.routed("r1", "a")
    res.release("r1")
    res.release("r1")  # idempotent
    assert res.load["a"] == 1 and res.worker_of("r1") is None


def test_a_fallback_to_another_rank_moves_the_count():
    res = Reservations(clock=Clock())
    res.decided("r", "a")
    res.routed("r", "b")
    assert dict(res.load) == {"b": 1}


def test_a_request_cancelled_before_serve_sent_it_stops_counting_after_the_unrouted_ttl():
    clock = Clock()
    res = Reservations(unrouted_ttl_s=30.0, routed_ttl_s=600.0, sweep_every_s=10.0, clock=clock)
    res.decided("never-sent", "a")
    res.decided("sent", "a")
    res.routed("sent", "a")
    clock.t = 20.0
    res.decided("waiting", "a")  # Serve asks again while replicas are full: refreshed each time
    clock.t = 45.0
    res.decided("waiting", "a")
    res.sweep()
    assert res.worker_of("never-sent") is None  # 45 s without being sent
    assert res.worker_of("sent") == "a" and res.worker_of("waiting") == "a"
    assert res.load["a"] == 2
    clock.t = 700.0
    res.sweep()
    assert len(res) == 0 and not res.load  # a routed request whose completion was lost, after 600 s


def test_without_routing_reports_from_serve_every_reservation_lasts_the_routed_ttl():
    clock = Clock()
    res = Reservations(unrouted_ttl_s=30.0, routed_ttl_s=600.0, sweep_every_s=10.0, clock=clock)
    res.decided("long-stream", "a")  # Serve without rejection never calls on_request_routed
    clock.t = 300.0
    res.sweep()
    assert res.worker_of("long-stream") == "a"
    clock.t = 700.0
    res.sweep()
    assert res.worker_of("long-stream") is None
