"""Tenants: who may call the frontends, with which limits, and which prefix-cache scope.

The config is YAML (see deploy/tenants.example.yaml)::

    tenants:
      - id: acme
        api_key_sha256: [<sha256 hex of a key>, ...]
        rate_limit: {requests_per_second: 20, tokens_per_minute: 200000}
        max_concurrent_requests: 16
        cache_scope: private            # or shared:<group>
        weight: 1.0                     # fair share of the workers (VTC), relative to other tenants
        cache_pins: {max_pinned_tokens: 16384, allowed_ttls: [5m, 1h], on_pool_full: error}  # cache_control

API keys are stored only as sha256 hex digests (``hash_api_key`` or ``chunkserve tenants hash-key``).
Without a config file the frontends run in open mode: one tenant, ``public``, that accepts any request.
"""

from __future__ import annotations

import argparse
import getpass
import hashlib
import hmac
import logging
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

logger = logging.getLogger(__name__)

PUBLIC_TENANT_ID = "public"
_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_HEX64_RE = re.compile(r"^[0-9a-f]{64}$")


def hash_api_key(key: str) -> str:
    """The sha256 hex digest under which an API key is stored in the tenants file."""
    if not isinstance(key, str) or not key:
        raise ValueError("an API key must be a non-empty string")
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


class AuthError(Exception):
    """The request carries no valid API key (HTTP 401 / gRPC UNAUTHENTICATED)."""


class RateLimitConfig(BaseModel):
    """Per-tenant rate limits; a missing value means unlimited."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # finite and within reason: an infinite rate broke the limiter at start, a subnormal one gave an infinite
    # Retry-After (a 500 instead of a 429)
    requests_per_second: float | None = Field(default=None, ge=1e-6, le=1e9, allow_inf_nan=False)
    burst_requests: int | None = Field(default=None, ge=1)  # default: max(1, ceil(requests_per_second))
    tokens_per_minute: int | None = Field(default=None, ge=1)

    @model_validator(mode="after")
    def _burst_needs_rate(self) -> RateLimitConfig:
        if self.burst_requests is not None and self.requests_per_second is None:
            raise ValueError("burst_requests needs requests_per_second")
        return self


class CachePinConfig(BaseModel):
    """What a tenant may pin with ``cache_control`` (issue 16). Quotas are per worker."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_pinned_tokens: int = Field(default=16384, ge=0)  # pinned tokens this tenant may hold on one worker
    allowed_ttls: tuple[Literal["5m", "1h"], ...] = ("5m", "1h")
    on_pool_full: Literal["error", "unpinned"] = "error"  # a refused pin: fail the request, or serve it unpinned


class TenantConfig(BaseModel):
    """One tenant as written in the tenants file."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str
    api_key_sha256: tuple[str, ...] = ()
    rate_limit: RateLimitConfig = RateLimitConfig()
    max_concurrent_requests: int | None = Field(default=None, ge=1)
    cache_scope: str = "private"
    weight: float = Field(default=1.0, gt=0, le=1000)  # fair-share weight in the workers' scheduler
    cache_pins: CachePinConfig = CachePinConfig()

    @field_validator("id")
    @classmethod
    def _check_id(cls, v: str) -> str:
        if not _ID_RE.fullmatch(v):  # match() let "$" accept a trailing newline
            raise ValueError(f"tenant id {v!r} must match {_ID_RE.pattern}")
        return v

    @field_validator("api_key_sha256", mode="before")
    @classmethod
    def _one_or_many(cls, v: Any) -> Any:
        return (v,) if isinstance(v, str) else v

    @field_validator("api_key_sha256")
    @classmethod
    def _check_hashes(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        out = tuple(h.lower() for h in v)
        for h in out:
            if not _HEX64_RE.fullmatch(h):
                raise ValueError("api_key_sha256 entries must be sha256 hex digests (64 hex chars), "
                                 "not raw keys; use `chunkserve tenants hash-key`")
        return out

    @field_validator("cache_scope")
    @classmethod
    def _check_scope(cls, v: str) -> str:
        if v == "private":
            return v
        if v.startswith("shared:") and _ID_RE.fullmatch(v[len("shared:"):]):
            return v
        raise ValueError(f"cache_scope must be 'private' or 'shared:<group>', got {v!r}")


class TenantsConfig(BaseModel):
    """The whole tenants file."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tenants: tuple[TenantConfig, ...] = Field(min_length=1)
    # Keys (sha256 digests) that may read /metrics in tenant mode; none: /metrics is refused (403).
    admin_api_key_sha256: tuple[str, ...] = ()

    @field_validator("admin_api_key_sha256", mode="before")
    @classmethod
    def _admin_one_or_many(cls, v: Any) -> Any:
        return (v,) if isinstance(v, str) else v

    @field_validator("admin_api_key_sha256")
    @classmethod
    def _admin_hashes(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        return TenantConfig._check_hashes(v)

    @model_validator(mode="after")
    def _unique(self) -> TenantsConfig:
        ids = [t.id for t in self.tenants]
        if len(set(ids)) != len(ids):
            raise ValueError("tenant ids must be unique")
        hashes = [h for t in self.tenants for h in t.api_key_sha256]
        if len(set(hashes)) != len(hashes):
            raise ValueError("an API key may belong to one tenant only")
        groups = {t.cache_scope[len("shared:"):] for t in self.tenants if t.cache_scope != "private"}
        clash = groups & set(ids)
        if clash:
            raise ValueError(f"shared group names may not equal a tenant id (the cache salts would collide): "
                             f"{sorted(clash)}")
        for t in self.tenants:
            if not t.api_key_sha256:
                raise ValueError(f"tenant {t.id!r} has no api_key_sha256 (it could never be authenticated)")
        return self


@dataclass(frozen=True)
class Tenant:
    """A resolved tenant: its id, limits and the salt of its prefix-cache scope."""

    id: str
    rate_limit: RateLimitConfig
    max_concurrent_requests: int | None
    cache_scope: str
    weight: float = 1.0
    cache_pins: CachePinConfig = CachePinConfig()

    @property
    def cache_salt(self) -> bytes:
        """Salt of the hash chain: the tenant id when private, the group name when shared.

        Group names may not equal a tenant id (checked by TenantsConfig), so the two never collide."""
        if self.cache_scope.startswith("shared:"):
            return self.cache_scope[len("shared:"):].encode("utf-8")
        return self.id.encode("utf-8")

    @classmethod
    def from_config(cls, cfg: TenantConfig) -> Tenant:
        return cls(id=cfg.id, rate_limit=cfg.rate_limit, max_concurrent_requests=cfg.max_concurrent_requests,
                   cache_scope=cfg.cache_scope, weight=cfg.weight, cache_pins=cfg.cache_pins)


class TenantRegistry:
    """Looks tenants up by API key. Key hashes are compared in constant time against every stored hash."""

    def __init__(self, config: TenantsConfig | None = None) -> None:
        self.open_mode = config is None
        if config is None:
            public = Tenant(id=PUBLIC_TENANT_ID, rate_limit=RateLimitConfig(), max_concurrent_requests=None,
                            cache_scope="private")
            self._tenants: dict[str, Tenant] = {public.id: public}
            self._keys: tuple[tuple[bytes, str], ...] = ()
        else:
            self._tenants = {t.id: Tenant.from_config(t) for t in config.tenants}
            self._keys = tuple((bytes.fromhex(h), t.id) for t in config.tenants for h in t.api_key_sha256)
        self._admin = tuple(bytes.fromhex(h) for h in config.admin_api_key_sha256) if config else ()

    @property
    def tenants(self) -> Mapping[str, Tenant]:
        return dict(self._tenants)

    def authenticate_key(self, key: str | None) -> Tenant:
        """The tenant owning ``key``; raises AuthError for a missing or unknown key (never in open mode)."""
        if self.open_mode:
            return self._tenants[PUBLIC_TENANT_ID]
        if not key:
            raise AuthError("missing API key: send 'Authorization: Bearer <key>'")
        digest = hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()
        found: str | None = None
        for stored, tenant_id in self._keys:  # no early exit: the time does not depend on which key matched
            if hmac.compare_digest(stored, digest):
                found = tenant_id
        if found is None:
            raise AuthError("invalid API key")
        return self._tenants[found]

    def is_admin(self, authorization: str | None) -> bool:
        """Whether an ``Authorization`` value carries an admin key (always True in open mode)."""
        if self.open_mode:
            return True
        key = bearer_key(authorization)
        if not key or not self._admin:
            return False
        digest = hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()
        return any([hmac.compare_digest(stored, digest) for stored in self._admin])  # no short circuit

    def authenticate_header(self, authorization: str | None) -> Tenant:
        """Authenticates an ``Authorization: Bearer <key>`` header value (HTTP, or gRPC metadata)."""
        return self.authenticate_key(bearer_key(authorization))

    def authenticate_metadata(self, metadata: Sequence[tuple[str, Any]]) -> Tenant:
        """Authenticates gRPC invocation metadata (its one ``authorization`` entry)."""
        values = [v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)
                  for k, v in metadata if k.lower() == "authorization"]
        return self.authenticate_header(one_authorization(values))


def one_authorization(values: Sequence[str]) -> str | None:
    """The one ``Authorization`` value of a request (None: none sent); AuthError for several (HTTP read the first
    and gRPC the last, so a request could carry two tenants' keys and be taken as either)."""
    if len(values) > 1:
        raise AuthError(f"send one Authorization header, not {len(values)}")
    return values[0] if values else None


def bearer_key(authorization: str | None) -> str | None:
    """The key of a ``Bearer <key>`` value (a bare key is accepted too), or None when absent."""
    if authorization is None:
        return None
    value = authorization.strip()
    if value[:7].lower() == "bearer ":
        value = value[7:].strip()
    return value or None


def parse_tenants(data: Any) -> TenantsConfig:
    """Validates a parsed tenants document (raises pydantic.ValidationError)."""
    return TenantsConfig.model_validate(data)


def load_tenants(path: str | Path | None) -> TenantRegistry:
    """The registry from a YAML tenants file, or open mode (a single tenant 'public') when ``path`` is None."""
    if path is None:
        logger.warning("no tenants file given: open mode, a single tenant %r accepts every request "
                       "without an API key", PUBLIC_TENANT_ID)
        return TenantRegistry(None)
    text = Path(path).read_text(encoding="utf-8")
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: not valid YAML: {e}") from e
    config = parse_tenants(data)
    logger.info("loaded %d tenants from %s", len(config.tenants), path)
    return TenantRegistry(config)


def main(argv: list[str] | None = None) -> int:
    """``chunkserve tenants hash-key [KEY]``: print the sha256 to store for an API key (read from stdin
    or a prompt when KEY is omitted), or ``chunkserve tenants check FILE``: validate a tenants file."""
    parser = argparse.ArgumentParser(prog="chunkserve tenants")
    sub = parser.add_subparsers(dest="cmd", required=True)
    hk = sub.add_parser("hash-key", help="print the sha256 hex of an API key for api_key_sha256")
    hk.add_argument("key", nargs="?", help="the key (default: read from stdin or prompt)")
    ck = sub.add_parser("check", help="validate a tenants YAML file")
    ck.add_argument("file")
    args = parser.parse_args(argv)
    if args.cmd == "hash-key":
        key = args.key
        if key is None:
            key = sys.stdin.readline().strip() if not sys.stdin.isatty() else getpass.getpass("API key: ")
        try:
            print(hash_api_key(key))
        except ValueError as e:
            print(f"chunkserve tenants hash-key: {e}", file=sys.stderr)
            return 2
        return 0
    try:
        reg = load_tenants(args.file)
    except (OSError, ValueError) as e:  # pydantic's ValidationError is a ValueError; it names the bad field
        print(f"chunkserve tenants check: {args.file}: {e}", file=sys.stderr)
        return 1
    for t in reg.tenants.values():
        print(f"{t.id}\tscope={t.cache_scope}\tmax_concurrent={t.max_concurrent_requests}\t"
              f"rps={t.rate_limit.requests_per_second}\ttpm={t.rate_limit.tokens_per_minute}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
