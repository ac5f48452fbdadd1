"""The cluster-wide drain flag: ``chunkserve up`` sets it on Ctrl-C / SIGTERM, before it deletes the app.

Every ingress replica reads it (`DrainFlag`, at most once per ``interval_s``, on the request path) and refuses
new requests with 503 + Retry-After while the running ones finish. Without it, a request that reaches an
ingress after Serve has begun to stop the workers waits for a worker replica that never comes (until the
drain grace kills it), and one that reaches HAProxy after the ingress is gone gets Ray's plain-text 500.

Key: ``{<namespace>}:draining`` (string "1"), with a TTL, so that a flag left by a launcher that died
never outlives it by much on a Redis the user shares between deployments (and `clear_draining` at start).
"""

from __future__ import annotations

import logging
import time

from chunkserve.cluster.index import (
    DEFAULT_NAMESPACE,
    REDIS_ERRORS,
    AsyncRedis,
    async_redis_client,
    redis_client,
)

logger = logging.getLogger(__name__)


def drain_key(namespace: str = DEFAULT_NAMESPACE) -> str:
    return f"{{{namespace}}}:draining"


def mark_draining(url: str, namespace: str = DEFAULT_NAMESPACE, ttl_s: float = 120.0) -> bool:
    """Sets the flag for ``ttl_s`` seconds. -> False when Redis could not be reached (the drain goes on)."""
    try:
        redis_client(url).set(drain_key(namespace), "1", px=max(1, int(ttl_s * 1000)))
        return True
    except REDIS_ERRORS as e:
        logger.warning("could not set the drain flag: %s", e)
        return False


def clear_draining(url: str, namespace: str = DEFAULT_NAMESPACE) -> None:
    """Removes the flag (a deployment starting on a Redis that an earlier one drained)."""
    try:
        redis_client(url).delete(drain_key(namespace))
    except REDIS_ERRORS as e:
        logger.warning("could not clear the drain flag: %s", e)


class DrainFlag:
    """Whether the cluster is draining, as an ingress sees it: one Redis read per ``interval_s`` at most,
    the cached answer in between (and the last answer while Redis is unreachable). Once set, it stays set."""

    def __init__(self, url: str, namespace: str = DEFAULT_NAMESPACE, interval_s: float = 0.1) -> None:
        self.url = url
        self.key = drain_key(namespace)
        self.interval_s = interval_s
        self._client: AsyncRedis | None = None  # made in the event loop that uses it
        self._checked = float("-inf")
        self._set = False

    async def is_set(self) -> bool:
        now = time.monotonic()
        if self._set or now - self._checked < self.interval_s:
            return self._set
        self._checked = now  # before the await: concurrent requests reuse this read's answer
        try:
            if self._client is None:
                self._client = async_redis_client(self.url, timeout_s=0.5)
            self._set = bool(await self._client.exists(self.key))
        except REDIS_ERRORS as e:
            logger.debug("drain flag unreadable: %s", e)
        return self._set
