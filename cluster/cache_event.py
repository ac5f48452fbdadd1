"""The cache event a worker's prefix cache emits (no Redis needed: the KV cache imports only this).

:mod:`chunkserve.cluster.events` publishes these to Redis; a cache used without a cluster (a GPU box
with no redis-py, an offline ``LLM``) never imports redis.
"""

from __future__ import annotations

from dataclasses import dataclass

EVENT_KINDS = ("stored", "evicted", "cleared")
DEFAULT_MAX_DEPTH = 64


@dataclass(frozen=True)
class CacheEvent:
    """One change to a worker's prefix cache.

    ``kind``: "stored" (chunk ``chunk_hash`` is now cached), "evicted" (it is gone), "cleared" (the
    whole cache was dropped; ``chunk_hash`` is ignored). ``depth`` is the 0-based chunk position in its
    prompt when known (-1 otherwise); stored events at depth >= the publisher's ``max_depth`` are dropped.
    """

    kind: str
    chunk_hash: int
    depth: int = -1

    def __post_init__(self) -> None:
        if self.kind not in EVENT_KINDS:
            raise ValueError(f"CacheEvent.kind must be one of {EVENT_KINDS}, got {self.kind!r}")
        if not isinstance(self.chunk_hash, int) or not 0 <= self.chunk_hash < (1 << 64):
            raise ValueError(f"CacheEvent.chunk_hash must be an unsigned 64-bit int, got {self.chunk_hash!r}")
