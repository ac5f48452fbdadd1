"""The Redis prefix index: which live worker holds which chunk hash.

Key schema (``ns`` is the namespace, default ``"chunkserve"``; see docs/cluster-index.md):

* ``{ns:w:<worker>}:lease``  string, the publisher's incarnation token, PX TTL (default 5 s).
* ``{ns:w:<worker>}:chunks`` set of the chunk hashes the worker holds, each as a *signed* 64-bit
  decimal integer (so small sets use Redis' compact intset encoding).
* ``{ns}:workers``           zset worker id -> last heartbeat (ms since epoch); only for discovery/sweeps.

A worker's lease and chunk set share one hash tag, so they live in one Redis Cluster slot. Different
workers hash to different slots, so the index shards across a cluster by worker. A lookup is one round
trip: on a standalone Redis one ``EVALSHA`` covering all candidate workers; with ``cluster_mode=True``
a pipeline of one ``EVALSHA`` per worker, each touching a single slot. Either returns, per worker, the
length of the longest prefix of the chain it holds, or -1 when its lease has lapsed (the script then
deletes the stale set: lazy purge).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import redis
import redis.asyncio as aredis
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.cluster import RedisCluster

DEFAULT_NAMESPACE = "chunkserve"
MAX_LOOKUP_CHUNKS = 4096  # keeps Lua's unpack() far below its stack limit
_U64 = 1 << 64
SyncRedis = redis.Redis | RedisCluster
AsyncRedis = aredis.Redis | AsyncRedisCluster
# What an unreachable or failing Redis raises: a Redis Cluster with no node up raises RedisClusterException, which is
# not a RedisError (TimeoutError is an OSError). Every caller that degrades when Redis is away catches these.
REDIS_ERRORS = (redis.RedisError, redis.exceptions.RedisClusterException, OSError)
_I64_MAX = (1 << 63) - 1

# KEYS: lease, chunks. ARGV: hashes (signed decimal). -> -1 (no lease; set purged) or prefix length.
PREFIX_LEN_LUA = """
if redis.call('EXISTS', KEYS[1]) == 0 then
  redis.call('DEL', KEYS[2])
  return -1
end
local r = redis.call('SMISMEMBER', KEYS[2], unpack(ARGV))
for i = 1, #r do
  if r[i] == 0 then return i - 1 end
end
return #r
"""

# Standalone Redis only (the keys span slots): KEYS = lease_1, chunks_1, lease_2, chunks_2, ...
# ARGV: hashes. -> one PREFIX_LEN_LUA result per worker, in one call.
PREFIX_LEN_MULTI_LUA = """
local out = {}
for w = 1, #KEYS / 2 do
  local lease, chunks = KEYS[2 * w - 1], KEYS[2 * w]
  if redis.call('EXISTS', lease) == 0 then
    redis.call('DEL', chunks)
    out[w] = -1
  else
    local r = redis.call('SMISMEMBER', chunks, unpack(ARGV))
    local m = #r
    for i = 1, #r do
      if r[i] == 0 then m = i - 1; break end
    end
    out[w] = m
  end
end
return out
"""

# KEYS: lease, chunks. ARGV: token, ttl_ms. -> 0 renewed, 1 (re)acquired (old set dropped: resync).
HEARTBEAT_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 0
end
redis.call('DEL', KEYS[2])
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
"""

# KEYS: lease, chunks. ARGV: token, then (op, hash) pairs with op in s|e|c (c ignores its hash).
# Applies the batch atomically iff the caller still holds the lease; -> #ops applied or -1.
PUBLISH_LUA = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return -1 end
local n = 0
for i = 2, #ARGV, 2 do
  local op = ARGV[i]
  if op == 's' then redis.call('SADD', KEYS[2], ARGV[i + 1])
  elseif op == 'e' then redis.call('SREM', KEYS[2], ARGV[i + 1])
  elseif op == 'c' then redis.call('DEL', KEYS[2])
  else return redis.error_reply('bad op ' .. op) end
  n = n + 1
end
return n
"""

# KEYS: lease, chunks. Drops the set of a worker whose lease lapsed. -> keys deleted, or -1 (lease alive again).
SWEEP_LUA = """
if redis.call('EXISTS', KEYS[1]) == 0 then return redis.call('DEL', KEYS[2]) end
return -1
"""

# KEYS: lease, chunks. ARGV: token, ttl_ms. Drops the lease and set iff the caller owns the lease.
RELEASE_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1], KEYS[2])
  return 1
end
return 0
"""


_PREFIX_LEN_SHA = hashlib.sha1(PREFIX_LEN_LUA.encode()).hexdigest()
_PREFIX_LEN_MULTI_SHA = hashlib.sha1(PREFIX_LEN_MULTI_LUA.encode()).hexdigest()


def encode_hash(h: int) -> int:
    """Unsigned 64-bit chunk hash -> signed 64-bit int (the stored form)."""
    if not 0 <= h < _U64:
        raise ValueError(f"chunk hash must be an unsigned 64-bit int, got {h}")
    return h - _U64 if h > _I64_MAX else h


def decode_hash(v: int | bytes | str) -> int:
    """Stored signed form (as returned by Redis) -> unsigned 64-bit chunk hash."""
    i = int(v)
    return i + _U64 if i < 0 else i


@dataclass(frozen=True)
class IndexKeys:
    """Key names for one namespace (see the module docstring for the schema)."""

    namespace: str = DEFAULT_NAMESPACE

    def __post_init__(self) -> None:
        if not self.namespace or any(c in self.namespace for c in "{}"):
            raise ValueError(f"namespace must be non-empty and free of braces, got {self.namespace!r}")

    def lease(self, worker_id: str) -> str:
        return f"{{{self.namespace}:w:{worker_id}}}:lease"

    def chunks(self, worker_id: str) -> str:
        return f"{{{self.namespace}:w:{worker_id}}}:chunks"

    @property
    def registry(self) -> str:
        return f"{{{self.namespace}}}:workers"


CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")


def is_cluster_url(url: str) -> bool:
    """Whether ``url`` names a Redis Cluster (``redis+cluster://host:port``, ``rediss+cluster://`` for TLS):
    any of its nodes; the client discovers the rest. One URL serves every process (workers, ingress, router)."""
    return url.split("://", 1)[0].lower() in CLUSTER_SCHEMES


def _node_url(url: str) -> str:
    scheme, rest = url.split("://", 1)
    return f"{scheme.lower().removesuffix('+cluster')}://{rest}"


def redis_client(client: SyncRedis | str, timeout_s: float = 1.0) -> SyncRedis:
    """``client`` itself, or a redis-py client for the URL with connect and socket timeouts: a cluster client
    for a ``redis+cluster://`` URL (`is_cluster_url`), else a plain one."""
    if isinstance(client, str):
        if is_cluster_url(client):
            return RedisCluster.from_url(_node_url(client), socket_timeout=timeout_s,
                                         socket_connect_timeout=timeout_s)
        return redis.Redis.from_url(client, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
    return client


def async_redis_client(client: AsyncRedis | str, timeout_s: float = 1.0) -> AsyncRedis:
    """As `redis_client`, for redis.asyncio (create it inside the event loop that uses it)."""
    if isinstance(client, str):
        if is_cluster_url(client):
            return AsyncRedisCluster.from_url(_node_url(client), socket_timeout=timeout_s,
                                              socket_connect_timeout=timeout_s)
        return aredis.Redis.from_url(client, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
    return client


def _is_cluster(client: SyncRedis | AsyncRedis) -> bool:
    return isinstance(client, RedisCluster | AsyncRedisCluster)


def check_worker_id(worker_id: str) -> str:
    """Validate a worker id (non-empty, no braces: it goes inside a hash tag)."""
    if not isinstance(worker_id, str) or not worker_id or any(c in worker_id for c in "{}"):
        raise ValueError(f"worker_id must be a non-empty string without braces, got {worker_id!r}")
    return worker_id


def execute_pipeline(client: SyncRedis, queue: Callable[[Any], None], scripts: Sequence[Any],
                     transaction: bool = False) -> list[Any]:
    """Queues commands with ``queue(pipe)`` on a fresh pipeline and runs it. A cluster pipeline sends its
    scripts as bare ``EVALSHA`` (redis-py loads them only for a plain one), so on ``NOSCRIPT`` (a new or
    restarted node) ``scripts`` are loaded on every primary and the pipeline runs once more: what it queues
    must be safe to run twice."""
    for attempt in range(2):
        pipe = client.pipeline(transaction=transaction)
        queue(pipe)
        try:
            return list(pipe.execute())
        except redis.exceptions.NoScriptError:
            if attempt:
                raise
            for script in scripts:
                client.script_load(script.script)
    raise AssertionError("unreachable")


def _lookup_args(chain: Sequence[int], max_chunks: int | None) -> list[int]:
    n = len(chain) if max_chunks is None else min(len(chain), max_chunks)
    if n > MAX_LOOKUP_CHUNKS:
        raise ValueError(f"chains longer than {MAX_LOOKUP_CHUNKS} chunks are not looked up; pass max_chunks")
    return [encode_hash(h) for h in chain[:n]]


def _queue_lookup(pipe: Any, keys: IndexKeys, workers: list[str], args: list[int], cluster_mode: bool) -> None:
    """Queue the lookup commands: one EVALSHA per worker (cluster-safe) or one for all (standalone)."""
    if cluster_mode:  # plain EVALSHA: redis-py's Script in a pipeline adds a SCRIPT EXISTS round trip
        for w in workers:
            pipe.evalsha(_PREFIX_LEN_SHA, 2, keys.lease(w), keys.chunks(w), *args)
    else:
        kv = [k for w in workers for k in (keys.lease(w), keys.chunks(w))]
        pipe.evalsha(_PREFIX_LEN_MULTI_SHA, len(kv), *kv, *args)


def _lookup_result(workers: list[str], results: list[Any], cluster_mode: bool) -> dict[str, int]:
    lens = results if cluster_mode else results[0]
    return {w: int(n) for w, n in zip(workers, lens, strict=True) if int(n) >= 0}


class PrefixIndex:
    """Synchronous index reader/admin (redis-py); thread-safe like the client it wraps.

    ``cluster_mode``: look up with one script call per worker (each touches one slot, as Redis Cluster
    requires); always on with a cluster client. Off (standalone Redis): one script call for all workers,
    ~3x cheaper on the client.
    """

    def __init__(self, client: SyncRedis | str, namespace: str = DEFAULT_NAMESPACE,
                 max_chunks: int | None = None, cluster_mode: bool = False) -> None:
        self.client = redis_client(client, timeout_s=5.0)
        self.keys = IndexKeys(namespace)
        self.max_chunks = max_chunks
        self.cluster_mode = cluster_mode or _is_cluster(self.client)
        self._sweep_one = self.client.register_script(SWEEP_LUA)

    def live_workers(self) -> list[str]:
        """Registered workers whose lease is alive."""
        ids = [as_str(w) for w in self.client.zrange(self.keys.registry, 0, -1)]
        if not ids:
            return []
        pipe = self.client.pipeline(transaction=False)
        for w in ids:
            pipe.exists(self.keys.lease(w))
        return [w for w, alive in zip(ids, pipe.execute(), strict=True) if alive]

    def longest_prefixes(self, chain: Sequence[int], worker_ids: Iterable[str] | None = None) -> dict[str, int]:
        """Per live worker, how many leading chunks of ``chain`` it holds (one round trip).

        Workers whose lease lapsed are left out (and their sets purged).
        """
        workers = list(worker_ids) if worker_ids is not None else self.live_workers()
        args = _lookup_args(chain, self.max_chunks)
        if not workers:
            return {}
        if not args:
            return dict.fromkeys(workers, 0) if worker_ids is None else self._alive_only(workers)
        for attempt in range(2):
            pipe = self.client.pipeline(transaction=False)
            _queue_lookup(pipe, self.keys, workers, args, self.cluster_mode)
            try:
                results = pipe.execute()
                break
            except redis.exceptions.NoScriptError:
                if attempt:
                    raise
                self.client.script_load(PREFIX_LEN_LUA)
                self.client.script_load(PREFIX_LEN_MULTI_LUA)
        return _lookup_result(workers, results, self.cluster_mode)

    def _alive_only(self, workers: list[str]) -> dict[str, int]:
        pipe = self.client.pipeline(transaction=False)
        for w in workers:
            pipe.exists(self.keys.lease(w))
        return {w: 0 for w, alive in zip(workers, pipe.execute(), strict=True) if alive}

    def worker_hashes(self, worker_id: str) -> set[int]:
        """All chunk hashes published by ``worker_id`` (ignores the lease; for tests and tools)."""
        return {decode_hash(v) for v in self.client.smembers(self.keys.chunks(check_worker_id(worker_id)))}

    def sweep(self) -> list[str]:
        """Purge workers whose lease lapsed: drop their chunk sets and registry entries. -> purged ids."""
        ids = [as_str(w) for w in self.client.zrange(self.keys.registry, 0, -1)]
        if not ids:
            return []
        pipe = self.client.pipeline(transaction=False)
        for w in ids:
            pipe.exists(self.keys.lease(w))
        dead = [w for w, alive in zip(ids, pipe.execute(), strict=True) if not alive]
        if dead:
            def queue(pipe: Any) -> None:
                for w in dead:  # re-checked inside one slot: a worker may have re-acquired its lease since the read
                    self._sweep_one(keys=[self.keys.lease(w), self.keys.chunks(w)], client=pipe)

            results = execute_pipeline(self.client, queue, [self._sweep_one])
            dead = [w for w, r in zip(dead, results, strict=True) if int(r) >= 0]
            if dead:
                self.client.zrem(self.keys.registry, *dead)
        return dead

    def close(self) -> None:
        self.client.close()


class AsyncPrefixIndex:
    """asyncio index reader (redis.asyncio) for the router; create it inside the router's event loop."""

    def __init__(self, client: AsyncRedis | str, namespace: str = DEFAULT_NAMESPACE,
                 max_chunks: int | None = None, socket_timeout_s: float = 1.0, cluster_mode: bool = False) -> None:
        self.client = async_redis_client(client, socket_timeout_s)
        self.keys = IndexKeys(namespace)
        self.max_chunks = max_chunks
        self.cluster_mode = cluster_mode or _is_cluster(self.client)

    async def longest_prefixes(self, chain: Sequence[int], worker_ids: Iterable[str]) -> dict[str, int]:
        """Per live worker among ``worker_ids``, the longest prefix of ``chain`` it holds (one round trip)."""
        workers = list(worker_ids)
        args = _lookup_args(chain, self.max_chunks)
        if not workers:
            return {}
        if not args:
            pipe = self.client.pipeline(transaction=False)
            for w in workers:
                pipe.exists(self.keys.lease(w))
            return {w: 0 for w, alive in zip(workers, await pipe.execute(), strict=True) if alive}
        for attempt in range(2):
            pipe = self.client.pipeline(transaction=False)
            _queue_lookup(pipe, self.keys, workers, args, self.cluster_mode)
            try:
                results = await pipe.execute()
                break
            except redis.exceptions.NoScriptError:
                if attempt:
                    raise
                await self.load_scripts()
        return _lookup_result(workers, results, self.cluster_mode)

    async def load_scripts(self) -> None:
        """Load the lookup scripts (every node of a Redis Cluster), so that EVALSHA finds them."""
        await self.client.script_load(PREFIX_LEN_LUA)
        await self.client.script_load(PREFIX_LEN_MULTI_LUA)

    async def ping(self) -> bool:
        """PING, on every primary of a Redis Cluster (where each has its own connection pool)."""
        if isinstance(self.client, AsyncRedisCluster):
            return bool(await self.client.ping(target_nodes=AsyncRedisCluster.PRIMARIES))
        return bool(await self.client.ping())

    async def aclose(self) -> None:
        await self.client.aclose()


def now_ms() -> int:
    return int(time.time() * 1000)


def as_str(v: object) -> str:
    """A Redis reply (bytes without ``decode_responses``) as a str."""
    return v.decode() if isinstance(v, bytes) else str(v)
