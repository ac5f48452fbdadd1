"""The ingress's plain types: `IngressConfig` (a served model's frontend settings) and `Prepared` (a request
that passed every check). Apart from `router/ingress.py` so that modules typing against them need not import it."""

from __future__ import annotations

from dataclasses import dataclass

from chunkserve.cluster.events import DEFAULT_MAX_DEPTH
from chunkserve.router.ratelimit import AdmissionLease
from chunkserve.router.tenants import Tenant
from chunkserve.workers.protocol import GenerateRequest


@dataclass(frozen=True)
class IngressConfig:
    """Frontend settings for one served model."""

    model_name: str
    max_model_len: int  # context length in tokens (prompt + output)
    chunk_size: int  # the engine's KV chunk size, for the hash chain
    default_max_tokens: int = 256  # when a request gives none (capped by the space left in the context)
    max_body_bytes: int = 4 << 20
    vocab_size: int | None = None  # token-id bound for raw token prompts (default: len(tokenizer))
    max_hashed_chunks: int | None = DEFAULT_MAX_DEPTH  # leading chunks hashed (what the router looks up)
    # Failover: a request whose worker dies is sent again (prompt + the tokens already sent) up to this
    # many times, after a pause of failover_backoff_s * attempt; then 503 with Retry-After.
    max_failovers: int = 2
    failover_backoff_s: float = 0.2
    retry_after_s: int = 2  # the Retry-After of a 503 (no worker, or this ingress draining)
    stream_write_timeout_s: float | None = 60.0  # a stream whose client reads nothing this long is aborted

    def __post_init__(self) -> None:
        for name in ("max_model_len", "chunk_size", "default_max_tokens", "max_body_bytes", "retry_after_s"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.max_failovers < 0 or self.failover_backoff_s < 0:
            raise ValueError("max_failovers and failover_backoff_s must be >= 0")
        if self.stream_write_timeout_s is not None and not self.stream_write_timeout_s > 0:
            raise ValueError("stream_write_timeout_s must be > 0 or None")


@dataclass
class Prepared:
    """A request that passed every check and holds a rate-limit lease."""

    tenant: Tenant
    lease: AdmissionLease
    request: GenerateRequest
    chunk_hashes: list[int]
    model: str
    created: int
    t0: float
    include_usage: bool = False

