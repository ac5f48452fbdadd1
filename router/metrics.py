"""Router metrics (Ray Serve metrics, exported to Prometheus): routing decisions by reason."""

from __future__ import annotations

import logging

from chunkserve.router.policy import REASONS

logger = logging.getLogger(__name__)


class RouterMetrics:
    """``chunkserve_router_decisions_total{reason=...}`` plus a local tally (``counts``) for tests/benchmarks.

    The Ray counter needs a connected Ray worker; without one only the local tally is kept.
    """

    def __init__(self, enable_ray: bool = True) -> None:
        self.counts: dict[str, int] = dict.fromkeys(REASONS, 0)
        self._counter = None
        self._matched = None
        if enable_ray:
            try:
                from ray.serve import metrics

                self._counter = metrics.Counter(
                    "chunkserve_router_decisions",
                    description="Prefix-aware routing decisions, by reason.",
                    tag_keys=("reason",),
                )
                self._matched = metrics.Counter(
                    "chunkserve_router_matched_chunks",
                    description="Chunks of the routed prompts already cached on the chosen replica "
                                "(per the index and local hints).",
                )
            except Exception as e:  # metrics must never break routing
                logger.warning("router metrics disabled: %s", e)
                self._counter = self._matched = None

    def record(self, reason: str, matched_chunks: int) -> None:
        """Count one routed request."""
        if reason not in self.counts:
            raise ValueError(f"unknown routing reason {reason!r}; expected one of {REASONS}")
        self.counts[reason] += 1
        try:
            if self._counter is not None:
                self._counter.inc(1, tags={"reason": reason})
            if self._matched is not None and matched_chunks > 0:
                self._matched.inc(matched_chunks)
        except Exception as e:  # pragma: no cover - exporter hiccups must not fail requests
            logger.debug("router metric update failed: %s", e)
