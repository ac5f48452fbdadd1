"""The router's own count of requests it has placed on each worker, ahead of Serve's reports.

`PrefixAwareRouter` counts a request on its worker from the routing decision on, so that concurrent routing
tasks see each other's choices before any request is sent; Serve's `on_request_completed` ends the count. Serve
calls that hook only for requests it sent: one cancelled while it waited for a free replica (a client that gave
up under overload) is never completed. So a reservation that Serve has not yet routed expires after
``unrouted_ttl_s`` since its last decision (Serve decides again, refreshing it, while it waits), and a routed
one after ``routed_ttl_s`` (its completion lost). Serve reports the routing (`on_request_routed`) only where it
sends with rejection (its default; not through Ray Client), so until a first report every reservation counts
as routed. Ray-free, so it is tested without Serve.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class _Entry:
    worker_id: str
    at: float  # monotonic time of the last decision (or of the routing)
    routed: bool = False


class Reservations:
    """Request id -> the worker it is counted on; ``load`` is the count per worker."""

    def __init__(self, unrouted_ttl_s: float = 30.0, routed_ttl_s: float = 600.0, max_tracked: int = 100_000,
                 sweep_every_s: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.load: Counter[str] = Counter()
        self._entries: dict[str, _Entry] = {}
        self._unrouted_ttl, self._routed_ttl = unrouted_ttl_s, routed_ttl_s
        self._max, self._every, self._clock = max_tracked, sweep_every_s, clock
        self._last_sweep = clock()
        self._reports = False  # whether Serve reports routing at all (see the module docstring)

    def __len__(self) -> int:
        return len(self._entries)

    def worker_of(self, req_id: str) -> str | None:
        e = self._entries.get(req_id)
        return None if e is None else e.worker_id

    def decided(self, req_id: str, worker_id: str) -> None:
        """A routing decision for the request (the first, or Serve asking again while replicas are full)."""
        e = self._entries.get(req_id)
        if e is not None and e.worker_id == worker_id:
            e.at = self._clock()
            return
        self._count(req_id, worker_id, routed=False)

    def routed(self, req_id: str, worker_id: str) -> None:
        """Serve sent the request to ``worker_id`` (it may have fallen back to another rank)."""
        self._reports = True
        e = self._entries.get(req_id)
        if e is None or e.worker_id != worker_id:
            self._count(req_id, worker_id, routed=True)
        else:
            e.routed, e.at = True, self._clock()

    def release(self, req_id: str) -> None:
        e = self._entries.pop(req_id, None)
        if e is not None:
            self.load[e.worker_id] -= 1
            if self.load[e.worker_id] <= 0:
                del self.load[e.worker_id]

    def sweep(self) -> None:
        """Drops expired reservations (at most once per ``sweep_every_s`` unless too many are tracked)."""
        now = self._clock()
        if now - self._last_sweep < self._every and len(self._entries) < self._max:
            return
        self._last_sweep = now
        stale = [k for k, e in self._entries.items()
                 if now - e.at > (self._routed_ttl if e.routed or not self._reports else self._unrouted_ttl)]
        for req_id in stale:
            self.release(req_id)

    def _count(self, req_id: str, worker_id: str, routed: bool) -> None:
        self.release(req_id)
        self._entries[req_id] = _Entry(worker_id, self._clock(), routed)
        self.load[worker_id] += 1
