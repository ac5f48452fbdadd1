"""Pins with a TTL (issue 16): a tenant keeps a prefix's chunks in the pool until the pin expires.

`PinManager` sits on a `PrefixTree` (its ``pin_prefix`` / ``unpin``). A pin is keyed by (tenant, cache
scope, chain hash of its last chunk): a repeat request with the same marked prefix renews it
(the expiry becomes the later of the two). Pinned chunks are never evicted; an expired pin is
released and its chunks become ordinary cached chunks, evicted LRU like any other.

Two limits keep pins from hurting anyone else: a tenant's pins on one worker hold at most its
``quota_tokens``, and all pins together hold at most ``max_pinned_fraction`` of the pool, so the
rest of the pool always remains for running requests, whatever the tenants pin. A pin over either
limit is refused: `check` says why (the engine then fails the request or serves it unpinned, as the
tenant's ``on_pool_full`` says), and a pin that no longer fits when its prefill ends is dropped (the
request is served unpinned).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from chunkserve.workers.cache_control import PinSpec
from chunkserve.workers.prefix_tree import PrefixTree
from chunkserve.workers.sched_types import Request


@dataclass
class Pin:
    handle: int
    tenant: str
    num_tokens: int  # tokens of the pinned chunks
    expires: float


@dataclass
class TenantPins:
    pinned_tokens: int = 0
    pins: int = 0
    created: int = 0
    renewed: int = 0
    expired: int = 0
    refused: int = 0


class PinManager:
    """Pins per (tenant, scope, prefix) with expiry, quotas and a cap on the pool share of pins."""

    def __init__(self, tree: PrefixTree, max_pinned_fraction: float = 0.5,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not 0.0 <= max_pinned_fraction < 1.0:
            raise ValueError(f"max_pinned_fraction must be in [0, 1), got {max_pinned_fraction}")
        self.tree = tree
        self.clock = clock
        self.max_pinned_chunks = int(max_pinned_fraction * tree.pool.num_chunks)
        self._pins: dict[tuple[str, bytes, int], Pin] = {}
        self.tenants: dict[str, TenantPins] = {}
        self._next_expiry = float("inf")

    def _tenant(self, tenant: str) -> TenantPins:
        t = self.tenants.get(tenant)
        if t is None:
            t = self.tenants[tenant] = TenantPins()
        return t

    def _chunks(self, prompt: list[int], spec: PinSpec) -> int:
        return min(spec.num_tokens, len(prompt)) // self.tree.chunk_size

    def _existing(self, tenant: str, salt: bytes, tokens: list[int]) -> tuple[tuple[str, bytes, int] | None, int]:
        """(key of this tenant's pin on exactly this prefix if any, chunks of the prefix not pinned yet)."""
        n = len(tokens) // self.tree.chunk_size
        if n == 0:
            return None, 0
        path, _ = self.tree._walk(np.asarray(tokens, dtype=np.int64), salt)
        unpinned = sum(1 for node in path if not node.pinned) + (n - len(path))
        if len(path) == n and path[-1].hash is not None:
            key = (tenant, salt, path[-1].hash)
            if key in self._pins:
                return key, unpinned
        return None, unpinned

    def check(self, tenant: str, salt: bytes, prompt: list[int], spec: PinSpec, room_needed: int = 0) -> str | None:
        """Why this pin would be refused now (quota, pool, or it would leave fewer than ``room_needed`` chunks
        unpinned: a queued request needs them), or None if it fits (or renews a pin)."""
        n = self._chunks(prompt, spec)
        if n == 0:
            return None
        c = self.tree.chunk_size
        key, unpinned = self._existing(tenant, salt, prompt[:n * c])
        if key is not None:
            return None  # a renewal holds nothing new
        used = self._tenant(tenant).pinned_tokens
        if used + n * c > spec.quota_tokens:
            return (f"the pin of {n * c} tokens would exceed tenant {tenant!r}'s pinned-token quota "
                    f"({used} of {spec.quota_tokens} in use on this worker)")
        # the messages reach the tenant: they name its own figures and the pool's settings, never how much
        # other tenants' pins hold (a private tenant could read another's traffic from that)
        if self.tree.num_pinned_chunks + unpinned > self.max_pinned_chunks:
            return (f"the KV pool's share for pins ({self.max_pinned_chunks * c} tokens) has no room for a pin of "
                    f"{n * c} tokens now")
        if self.tree.pool.num_chunks - self.tree.num_pinned_chunks - unpinned < room_needed:
            return "the pin would leave a queued request no room in the KV pool"
        return None

    def pin(self, tenant: str, salt: bytes, prompt: list[int], spec: PinSpec, room_needed: int = 0) -> int:
        """Pin (or renew) the prefix, whose chunks must be in the tree; -> tokens pinned (0: refused; see
        `check` for ``room_needed``)."""
        n = self._chunks(prompt, spec)
        if n == 0:
            return 0
        if self.check(tenant, salt, prompt, spec, room_needed) is not None:
            self._tenant(tenant).refused += 1
            return 0
        c = self.tree.chunk_size
        tokens = prompt[:n * c]
        now = self.clock()
        expires = now + spec.ttl_s
        key, _ = self._existing(tenant, salt, tokens)
        t = self._tenant(tenant)
        if key is not None:
            pin = self._pins[key]
            pin.expires = max(pin.expires, expires)
            t.renewed += 1
            return pin.num_tokens
        path, _ = self.tree._walk(np.asarray(tokens, dtype=np.int64), salt)
        if not path or path[-1].hash is None:
            return 0
        handle = self.tree.pin_prefix(tokens[:len(path) * c], salt)
        pin = Pin(handle, tenant, len(path) * c, expires)
        self._pins[(tenant, salt, path[-1].hash)] = pin
        t.pinned_tokens += pin.num_tokens
        t.pins += 1
        t.created += 1
        self._next_expiry = min(self._next_expiry, expires)
        return pin.num_tokens

    def take(self, req: Request, waiting: Sequence[Request]) -> None:
        """``req``'s prompt chunks are all in the tree now: pin (or renew) its marked prefix once, unless that would
        leave a queued request (admitted to the queue when there were fewer pins) no room; refused, it runs
        unpinned."""
        spec = req.pin
        if spec is None or req.pinned_tokens:
            return
        room = max((r.chunks_alone(self.tree.chunk_size) for r in waiting), default=0)
        got = self.pin(req.tenant, req.salt, req.prompt, spec, room_needed=room)
        req.pinned_tokens = got
        req.cache_creation_tokens = max(0, got - (req.num_cached or 0)) if got else 0
        if not got:
            req.pin = None  # refused now (the pool's pin share filled up meanwhile): served unpinned

    def refused(self, tenant: str) -> None:
        self._tenant(tenant).refused += 1

    def expire(self) -> int:
        """Release every pin past its expiry; -> how many."""
        now = self.clock()
        if now < self._next_expiry:
            return 0
        done = 0
        nxt = float("inf")
        for key, pin in list(self._pins.items()):
            if pin.expires <= now:
                del self._pins[key]
                self.tree.unpin(pin.handle)
                t = self._tenant(pin.tenant)
                t.pinned_tokens -= pin.num_tokens
                t.pins -= 1
                t.expired += 1
                done += 1
            else:
                nxt = min(nxt, pin.expires)
        self._next_expiry = nxt
        return done

    def release_all(self) -> int:
        """Release every pin now (counted as expired); -> how many. After a failed step (`EngineCore.step`)."""
        done = len(self._pins)
        for pin in self._pins.values():
            self.tree.unpin(pin.handle)
            t = self._tenant(pin.tenant)
            t.pinned_tokens -= pin.num_tokens
            t.pins -= 1
            t.expired += 1
        self._pins.clear()
        self._next_expiry = float("inf")
        return done

    def pinned_hashes(self) -> list[int]:
        """Chain hashes of every pinned chunk (for the cluster index's pin marks)."""
        return [n.hash for n in list(self.tree._nodes.values()) if n.pinned and n.hash is not None]

    def stats(self) -> dict[str, dict[str, int]]:
        return {name: {"pinned_tokens": t.pinned_tokens, "pins": t.pins, "pins_created": t.created,
                       "pins_renewed": t.renewed, "pins_expired": t.expired, "pins_refused": t.refused}
                for name, t in self.tenants.items()}
