"""Baseline request routers for comparisons with ``PrefixAwareRouter`` (tests and benchmarks).

``RoundRobinRouter`` ignores prefixes and load: request ``k`` goes to the ``k``-th replica in replica-id
order. Select it with ``AppConfig(request_router="chunkserve.router.baseline_routers.RoundRobinRouter")``;
``AppConfig(request_router=None)`` gives Ray Serve's default router (power of two choices).
"""

from __future__ import annotations

from typing import Any

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica


class RoundRobinRouter(RequestRouter):
    """Strict rotation over the candidate replicas, sorted by id (accepts and ignores router kwargs)."""

    def initialize_state(self, **kwargs: Any) -> None:  # the app passes PrefixAwareRouter's kwargs
        self._turn = 0
        self._last_request: str | None = None

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        """Rank 1: the replica whose turn it is; rank 2: the others (used only while it is full)."""
        if not candidate_replicas:
            return []
        if not hasattr(self, "_turn"):
            self.initialize_state()
        req_id = pending_request.metadata.internal_request_id if pending_request is not None else None
        if req_id is None or req_id != self._last_request:  # Serve re-asks for a request while replicas are full
            self._turn += 1
            self._last_request = req_id
        ordered = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
        i = self._turn % len(ordered)
        rest = ordered[i + 1:] + ordered[:i]
        return [[ordered[i]], rest] if rest else [[ordered[i]]]
