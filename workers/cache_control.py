"""Cache control (issue 16): what a request asks to keep pinned, as the ingress passes it to a worker.

Torch-free, so the ingress can build it. A client marks a message with Anthropic's
``cache_control: {"type": "ephemeral", "ttl": "5m" | "1h"}``; the ingress turns that into a `PinSpec`:
pin the full chunks of the prompt's first ``num_tokens`` tokens (the prompt up to the end of the marked
message) for ``ttl_s`` seconds in the tenant's cache scope, within the tenant's pinned-token quota.
"""

from __future__ import annotations

from dataclasses import dataclass

TTL_SECONDS: dict[str, float] = {"5m": 300.0, "1h": 3600.0}
ON_POOL_FULL = ("error", "unpinned")


@dataclass(frozen=True)
class PinSpec:
    """A request's pin: the prefix length, its TTL and the tenant's pin settings (per worker)."""

    num_tokens: int  # pin the full chunks within the prompt's first num_tokens tokens
    ttl_s: float
    quota_tokens: int  # the tenant's pinned-token quota on one worker
    on_pool_full: str = "error"  # pool full of pins or quota reached: "error" refuses, "unpinned" serves it unpinned

    def __post_init__(self) -> None:
        if self.num_tokens < 1:
            raise ValueError(f"pin num_tokens must be >= 1, got {self.num_tokens}")
        if not self.ttl_s > 0:
            raise ValueError(f"pin ttl_s must be > 0, got {self.ttl_s}")
        if self.quota_tokens < 0:
            raise ValueError(f"pin quota_tokens must be >= 0, got {self.quota_tokens}")
        if self.on_pool_full not in ON_POOL_FULL:
            raise ValueError(f"on_pool_full must be one of {ON_POOL_FULL}, got {self.on_pool_full!r}")
