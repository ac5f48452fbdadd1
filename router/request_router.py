"""``PrefixAwareRouter``: a Ray Serve request router that sends a prompt to the replica caching its prefix.

Set it on the worker deployment::

    @serve.deployment(request_router_config=RequestRouterConfig(
        request_router_class="chunkserve.router.request_router.PrefixAwareRouter",
        request_router_kwargs={"redis_url": "redis://127.0.0.1:6379/0"}))

The caller passes the prompt's chunk hash chain (``chunkserve.cluster.hashing.hash_chain``) as the keyword
argument ``chunk_hashes=[...]`` or as a ``chunk_hashes`` attribute / key of the first positional argument.
A replica publishes its cache under its Ray replica id, ``serve.get_replica_context().replica_id.unique_id``,
which is what ``RunningReplica.replica_id.unique_id`` shows the router.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from numbers import Integral
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from chunkserve import env
from chunkserve.cluster.events import DEFAULT_MAX_DEPTH
from chunkserve.cluster.index import DEFAULT_NAMESPACE, AsyncPrefixIndex
from chunkserve.cluster.reader import CachedIndexReader, ReaderConfig
from chunkserve.router.metrics import RouterMetrics
from chunkserve.router.policy import PolicyConfig, PrefixPolicy, ReplicaLoad
from chunkserve.router.reservations import Reservations
from chunkserve.workers.worker_metrics import ROUTING_KWARG

logger = logging.getLogger(__name__)

REDIS_URL_ENV = env.REDIS_URL
CHAIN_KWARG = "chunk_hashes"


def extract_chain(pending_request: PendingRequest | None, max_chunks: int) -> list[int]:
    """The chunk hash chain carried by a request (empty when there is none or it is malformed: a chain hash is a
    64-bit unsigned integer, `cluster/hashing.py`)."""
    if pending_request is None:
        return []
    chain: Any = pending_request.kwargs.get(CHAIN_KWARG) if pending_request.kwargs else None
    if chain is None and pending_request.args:
        first = pending_request.args[0]
        chain = first.get(CHAIN_KWARG) if isinstance(first, dict) else getattr(first, CHAIN_KWARG, None)
    if not isinstance(chain, list | tuple) or not all(isinstance(h, Integral) and 0 <= int(h) < 1 << 64 for h in chain):
        return []
    return [int(h) for h in chain[:max_chunks]]


def _stat(r: RunningReplica, name: str) -> int:
    """A non-negative integer from the replica's latest routing stats (0 when absent or malformed)."""
    stats = getattr(r, "routing_stats", None)
    v = stats.get(name) if isinstance(stats, dict) else None
    return int(v) if isinstance(v, Integral) and int(v) > 0 else 0


def _log_warm_failure(task: asyncio.Task[bool]) -> None:
    """A warm-up's unexpected error (an unreachable Redis is not one: warm() returns False)."""
    if not task.cancelled() and task.exception() is not None:
        logger.warning("prefix index warm-up failed: %r; connections open on demand", task.exception())


class PrefixAwareRouter(RequestRouter):
    """Longest cached prefix traded against load, with spill, rendezvous for cold prefixes and Redis fallback.

    ``request_router_kwargs`` (all optional): ``redis_url`` (else env ``CHUNKSERVE_REDIS_URL``; none: no
    index), ``namespace``, ``max_chunks`` (K, chunks looked up per request), ``policy`` (dict of
    :class:`PolicyConfig` fields), ``reader`` (dict of :class:`ReaderConfig` fields), ``enable_metrics``,
    ``cluster_mode`` (one script call per worker instead of one for all; on by itself with a
    ``redis+cluster://`` URL),
    ``predictions`` (True: add the routing prediction as the keyword argument ``routing`` to each request
    that passes ``chunk_hashes`` as a keyword, for a method that accepts it, as the worker's generate does),
    ``cold_claims`` (default True: place a prefix nobody holds through a shared claim in Redis,
    `cluster/claims.py`, so that routers agree and new prefixes spread evenly; False: rendezvous alone).
    """

    def initialize_state(self, redis_url: str | None = None, namespace: str = DEFAULT_NAMESPACE,
                         max_chunks: int = DEFAULT_MAX_DEPTH, policy: dict[str, Any] | None = None,
                         reader: dict[str, Any] | None = None, enable_metrics: bool = True,
                         cluster_mode: bool = False, predictions: bool = False, cold_claims: bool = True,
                         **kwargs: Any) -> None:
        if kwargs:
            raise TypeError(f"PrefixAwareRouter got unknown request_router_kwargs: {sorted(kwargs)}")
        if max_chunks < 1:
            raise ValueError(f"max_chunks must be >= 1, got {max_chunks}")
        url = redis_url or env.redis_url()
        self._max_chunks = max_chunks
        self._predictions = bool(predictions)
        self._claims = bool(cold_claims)
        self._policy = PrefixPolicy(PolicyConfig(**(policy or {})))
        factory = (lambda: AsyncPrefixIndex(url, namespace=namespace, max_chunks=max_chunks,
                                            cluster_mode=cluster_mode)) if url else None
        self._reader = CachedIndexReader(factory, ReaderConfig(**(reader or {})))
        self._metrics = RouterMetrics(enable_ray=enable_metrics)
        # internal request id -> the worker it is counted on, from the decision on (`reservations.py`)
        self._reserved = Reservations()
        self._local_load: Counter[str] = self._reserved.load
        self._known: set[str] = set()
        self._warming: asyncio.Task[bool] | None = None
        self._start_warm()

    def _start_warm(self) -> None:
        """Open the index's connections and load its scripts in the background, once, as soon as this router
        has an event loop (Serve builds it on one; else at the first request), so that the first burst of
        requests does not open them behind its own intake."""
        if self._warming is not None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self._warming = loop.create_task(self._reader.warm())
        self._warming.add_done_callback(_log_warm_failure)

    def _ensure_state(self) -> None:
        if not hasattr(self, "_policy"):  # initialize_state() is always called by Serve; be safe anyway
            self.initialize_state()

    @property
    def decision_counts(self) -> dict[str, int]:
        """Local tally of decisions by reason (this router instance only)."""
        self._ensure_state()
        return dict(self._metrics.counts)

    def _load(self, r: RunningReplica) -> ReplicaLoad:
        """Ongoing requests (ours and Serve's count) plus the engine's waiting queue once more: a request that
        waits for KV room is a sign of a full worker, so queues do not pile up on one replica under KV
        pressure (``record_routing_stats`` reports ``num_requests_waiting`` about once a second)."""
        wid = r.replica_id.unique_id
        cached = self.replica_queue_len_cache.get(r.replica_id)
        ongoing = max(self._local_load[wid], cached or 0)
        # the waiting queue is a subset of the ongoing requests: a report up to a period old must not
        # weigh on a replica whose queue has drained since (it would repel traffic for that long)
        waiting = min(_stat(r, "num_requests_waiting"), ongoing)
        return ReplicaLoad(wid, ongoing + waiting, r.max_ongoing_requests)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        """Rank 1: the policy's choice; rank 2: everyone else (Serve takes the least loaded of a rank)."""
        self._ensure_state()
        self._start_warm()
        if not candidate_replicas:
            return []
        chain = extract_chain(pending_request, self._max_chunks)
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        matches: dict[str, int] | None = {}
        if chain:
            res = await self._reader.lookup(chain, list(by_id))
            # A slow answer (over the reader's budget) routes on local hints alone, but is not an outage:
            # only an unreachable index yields matches=None and the reason "redis_down".
            matches = {} if res.status == "timeout" else res.matches
        loads = [self._load(r) for r in candidate_replicas]
        decision = self._policy.decide(loads, chain, matches)
        req_id = pending_request.metadata.internal_request_id if pending_request is not None else None
        prev = self._reserved.worker_of(req_id) if req_id is not None else None
        if decision.reason == "cold_hash" and prev is None and self._claims and len(loads) > 1:
            # a new prefix: agree with the other routers on one worker, spreading new prefixes evenly (with
            # a single candidate there is nothing to agree on: no Redis round trip)
            # a claim made earlier is followed even onto an overloaded worker: it is computing the prefix,
            # so it counts as a holder of the whole chain under the spill rule (`follow_claim`)
            fit = self._policy.cold_candidates(loads, chain)
            owner = await self._reader.claim_cold(chain[0], fit, len(chain), self._policy.config.hint_ttl_s,
                                                  others=[r.replica_id for r in loads], last_hash=chain[-1])
            if owner is not None:
                decision = self._policy.follow_claim(loads, decision, owner, matched=len(chain))
        if self._predictions and pending_request is not None and CHAIN_KWARG in (pending_request.kwargs or {}):
            # the prediction, scored by the worker that runs it (workers/worker_metrics.RoutingAccuracy)
            pending_request.kwargs[ROUTING_KWARG] = {"reason": decision.reason, "depth": len(chain),
                                                     "expected": dict(decision.expected)}
        if prev is None:  # first decision for this request (Serve re-asks while replicas are full)
            self._metrics.record(decision.reason, decision.matched_chunks)
            if chain:
                self._policy.record(chain, decision.replica_id)
        if req_id is not None:
            self._reserved.decided(req_id, decision.replica_id)
        self._reserved.sweep()
        logger.debug("route %d chunks, matches %s -> %s", len(chain), matches, decision)
        chosen = by_id[decision.replica_id]
        rest = [by_id[rid] for rid in decision.ranking[1:] if rid in by_id]
        return [[chosen], rest] if rest else [[chosen]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        self._ensure_state()
        self._reserved.routed(pending_request.metadata.internal_request_id, replica_id.unique_id)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self._ensure_state()
        self._reserved.release(internal_request_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self._ensure_state()
        live = {r.replica_id.unique_id for r in replicas}
        for wid in self._known - live:
            self._policy.forget_replica(wid)
        self._known = live

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._ensure_state()
        self._policy.forget_replica(replica_id.unique_id)
        self._known.discard(replica_id.unique_id)
        self._reader.invalidate()
