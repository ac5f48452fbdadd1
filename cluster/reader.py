"""Router-side index reads: a short-lived local cache, a hard wait budget and Redis-down handling.

Routing never waits on Redis for more than ``timeout_s``: a lookup that is slower keeps running in
the background and fills the cache for the next request. A Redis error marks the index down for
``retry_after_s`` (logged once); during that time no Redis call is made, and the first lookup after it
probes again (recovery is logged once too).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from chunkserve.cluster.claims import CLAIM_LUA, claim_args, claim_keys
from chunkserve.cluster.index import REDIS_ERRORS, AsyncPrefixIndex, as_str

logger = logging.getLogger(__name__)

LOOKUP_STATUSES = ("ok", "cached", "timeout", "down")


@dataclass(frozen=True)
class ReaderConfig:
    """Cache TTL and wait budget of index reads (seconds)."""

    cache_ttl_s: float = 0.25
    timeout_s: float = 0.005
    # a claim is made only for a prefix nobody holds, which costs a full prefill wherever it goes: worth a
    # longer wait than a lookup: in a burst of new prompts on a busy node the answer waits behind the
    # ingress's event loop for well over 100 ms (measured), and a router that gives up places the prefix
    # by rendezvous while its claim may land elsewhere: the prompt is then computed on both workers
    claim_timeout_s: float = 1.0
    retry_after_s: float = 1.0
    max_cache_entries: int = 8192
    max_inflight: int = 64
    # connections `warm` opens ahead of traffic: a burst's concurrent lookups and claims each take one, and one
    # opened in the burst costs its connect and handshake round trips behind the busy event loop (measured: 16
    # opened at once in a 32-request burst, its first claim answered after 46 ms); 0: no warm-up
    warm_connections: int = 16

    def __post_init__(self) -> None:
        for name in ("cache_ttl_s", "timeout_s", "retry_after_s", "claim_timeout_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"ReaderConfig.{name} must be >= 0, got {getattr(self, name)}")
        if self.max_cache_entries < 1 or self.max_inflight < 1:
            raise ValueError("ReaderConfig.max_cache_entries and max_inflight must be >= 1")
        if self.warm_connections < 0:
            raise ValueError(f"ReaderConfig.warm_connections must be >= 0, got {self.warm_connections}")


@dataclass(frozen=True)
class LookupResult:
    """Per-worker longest cached prefix (chunks), or None when the index could not answer in time."""

    matches: dict[str, int] | None
    status: str  # one of LOOKUP_STATUSES


_Key = tuple[int, int, tuple[str, ...]]


class CachedIndexReader:
    """Wraps an :class:`AsyncPrefixIndex` created lazily (inside the running event loop)."""

    def __init__(self, index_factory: Callable[[], AsyncPrefixIndex] | None, config: ReaderConfig | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config or ReaderConfig()
        self._factory = index_factory
        self._index: AsyncPrefixIndex | None = None
        self._clock = clock
        self._cache: OrderedDict[_Key, tuple[float, dict[str, int]]] = OrderedDict()
        self._inflight: dict[_Key, asyncio.Task[dict[str, int]]] = {}
        self._down_until = 0.0
        self._down = False
        self._claim_script: Any = None
        self._warming: set[asyncio.Task[Any]] = set()  # warm-ups running (`aclose` cancels them)
        if index_factory is None:
            logger.warning("no prefix index configured: routing by rendezvous hashing and load only")

    @property
    def is_down(self) -> bool:
        """Whether the last Redis call failed (and the retry window may still be open)."""
        return self._down

    async def lookup(self, chain: Sequence[int], worker_ids: Sequence[str]) -> LookupResult:
        """Longest prefix per live worker among ``worker_ids``; never waits longer than ``timeout_s``."""
        if not chain or not worker_ids:
            return LookupResult({}, "ok")
        if self._factory is None:
            return LookupResult(None, "down")
        now = self._clock()
        key: _Key = (chain[-1], len(chain), tuple(sorted(worker_ids)))
        hit = self._cache.get(key)
        if hit is not None and hit[0] > now:
            self._cache.move_to_end(key)
            return LookupResult(hit[1], "cached")
        if self._down and now < self._down_until:
            return LookupResult(None, "down")
        task = self._inflight.get(key)
        if task is None:
            if len(self._inflight) >= self.config.max_inflight:
                return LookupResult(None, "timeout")
            self._open()
            task = asyncio.get_running_loop().create_task(self._fetch(key, list(chain), list(worker_ids)))
            task.add_done_callback(_consume_exception)
            self._inflight[key] = task
        done, _ = await asyncio.wait({task}, timeout=self.config.timeout_s)
        if not done:
            return LookupResult(None, "timeout")
        if task.cancelled() or task.exception() is not None:
            return LookupResult(None, "down")
        return LookupResult(task.result(), "ok")

    def _mark_down(self, e: BaseException) -> None:
        """Redis did not answer: lookups and claims skip it for ``retry_after_s``."""
        if not self._down:
            logger.warning("prefix index unreachable (%s); routing by rendezvous hashing + load until it is back", e)
        self._down = True
        self._down_until = self._clock() + self.config.retry_after_s

    async def _fetch(self, key: _Key, chain: list[int], workers: list[str]) -> dict[str, int]:
        assert self._index is not None  # set by lookup() before the task starts
        try:
            matches = await self._index.longest_prefixes(chain, workers)
        except REDIS_ERRORS as e:
            self._mark_down(e)
            raise
        finally:
            self._inflight.pop(key, None)
        if self._down:
            logger.info("prefix index reachable again; prefix-aware routing resumed")
            self._down = False
        self._cache[key] = (self._clock() + self.config.cache_ttl_s, matches)
        self._cache.move_to_end(key)
        while len(self._cache) > self.config.max_cache_entries:
            self._cache.popitem(last=False)
        return matches

    async def claim_cold(self, first_hash: int, candidates: Sequence[str], weight: int, ttl_s: float,
                         others: Sequence[str] = (), last_hash: int | None = None) -> str | None:
        """The worker a cold prefix goes to, agreed by every router through Redis (`cluster/claims.py`):
        an earlier claim if its worker is among ``candidates`` or ``others`` (live workers that may not take
        a new claim, e.g. overloaded: whether to spill from one is the caller's call), else the candidate
        with the least claimed cold work (``weight``: the prefix's chunks, until the worker stores
        ``last_hash``, the chain's last chunk), ties in ``candidates`` order. None when the index is down
        or does not answer within ``claim_timeout_s`` (the claim then still lands in the background)."""
        if self._factory is None or not candidates or (self._down and self._clock() < self._down_until):
            return None
        index = self._open()
        keys = claim_keys(index.keys, first_hash)
        args = claim_args(first_hash, candidates, weight, int(ttl_s * 1000), others, last_hash)
        task = asyncio.get_running_loop().create_task(self._claim_script(keys=keys, args=args))
        task.add_done_callback(_consume_exception)
        done, _ = await asyncio.wait({task}, timeout=self.config.claim_timeout_s)
        if not done or task.cancelled() or task.exception() is not None:
            return None
        return as_str(task.result())

    def _open(self) -> AsyncPrefixIndex:
        """The index (created on first use, inside the running loop) with its claim script registered."""
        assert self._factory is not None  # callers return early without an index
        if self._index is None:
            self._index = self._factory()
            self._claim_script = self._index.client.register_script(CLAIM_LUA)
        return self._index

    async def warm(self) -> bool:
        """Open the index ahead of traffic: ``warm_connections`` pooled connections (concurrent pings; on every
        primary of a Redis Cluster) and the lookup and claim scripts loaded, so that the first burst pays no
        handshake and no NOSCRIPT retry. False when ``warm_connections`` is 0 or Redis does not answer (then the
        index is marked down for ``retry_after_s``, as a failed lookup marks it): routing opens them on demand.
        `aclose` cancels a warm-up still running."""
        if self._factory is None or self.config.warm_connections == 0:
            return False
        index = self._open()  # this warm-up's own: aclose() may drop the reader's meanwhile
        task = asyncio.current_task()
        if task is not None:
            self._warming.add(task)
        try:
            await asyncio.gather(*(index.ping() for _ in range(self.config.warm_connections)))
            await index.load_scripts()
            await index.client.script_load(CLAIM_LUA)
        except REDIS_ERRORS as e:  # marked down, so the first burst's lookups do not each wait on it
            self._mark_down(e)
            return False
        finally:
            self._warming.discard(task)  # type: ignore[arg-type]
        return True

    def invalidate(self) -> None:
        """Drop all cached lookups (e.g. after the replica set changed)."""
        self._cache.clear()

    async def aclose(self) -> None:
        for t in list(self._inflight.values()):
            t.cancel()
        warming = [t for t in self._warming if t is not asyncio.current_task()]
        for t in warming:
            t.cancel()
        await asyncio.gather(*warming, return_exceptions=True)  # its connections are back in the pool
        if self._index is not None:
            await self._index.aclose()
            self._index = None
            self._claim_script = None


def _consume_exception(task: asyncio.Task) -> None:
    """Mark a background lookup's failure as seen (it was already logged and handled)."""
    if not task.cancelled():
        task.exception()
