"""The Ray Serve worker: one `AsyncEngine` per replica, publishing its prefix cache to the cluster index.

`WorkerServer` is the Ray-agnostic replica body (tests can run it in-process); `build_worker_deployment`
wraps it as a Serve deployment whose requests are routed by `PrefixAwareRouter`. Each replica
publishes stored/evicted chunk hashes under its Ray replica id as soon as a step queues them (then
at most once per ``PUBLISH_INTERVAL_S``, batching), and holds a
lease in Redis through the publisher's heartbeat thread. About once a second the same loop records the
engine's stats as Ray Serve metrics (`workers/worker_metrics.py`) and, with Redis, writes a stats snapshot
(`cluster/stats.py`) that the ingress's ``/metrics`` reads.

Each request's deltas leave the replica coalesced (`workers/streaming.py`): the first token alone and at
once, then at most one stream item per ``stream_batching.interval_s`` (default 50 ms; stretched with the
streams in flight by ``items_per_s``), so a fast stream pays Ray's per-item cost once per several tokens.
Engine threads: unless the engine config sets
``num_threads``, a replica takes `engine_threads(cores of its node, workers_per_node, reserved_cpus)`, and
with the rule's ``lend_idle_cores`` the shares of the node's idle workers on top (`workers/node_cores.py`), up to
the node's cores less the reserved ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import logging
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, Any

from chunkserve.heap import freeze_startup_heap
from chunkserve.workers.cpu_budget import rule_lend_cap, rule_threads
from chunkserve.workers.engine_config import EngineConfig
from chunkserve.workers.protocol import EngineDeadError, GenerateDelta, GenerateRequest
from chunkserve.workers.streaming import StreamBatching
from chunkserve.workers.worker_metrics import RoutingAccuracy, TenantTokens, WorkerMetrics

if TYPE_CHECKING:
    from chunkserve.workers.node_cores import NodeCores

logger = logging.getLogger(__name__)

PUBLISH_INTERVAL_S = 0.05  # the least time between two index publishes (a step that stores chunks wakes one)
STATS_INTERVAL_S = 1.0
FOREST_INTERVAL_S = 2.0  # forest summaries for the dashboard (`workers/tree_summary.py`)
PREFIX_ROUTER = "chunkserve.router.request_router.PrefixAwareRouter"


def _node_cores(share: int, cap: int) -> NodeCores | None:
    """This worker's slot in its node's core table (`workers/node_cores.py`), lending up to `cap` threads
    (`cpu_budget.rule_lend_cap`), or None: where lending could add nothing, or the table cannot be opened
    (logged; the worker then keeps its fixed share). On 2 cores with one reserved nothing is lent: measured
    there (2026-12-06, Zen 4, HAProxy front), a lone stream on 2 lent threads decoded 6-12 % slower than on its
    own one in 5 of 6 pairs, its OpenMP pair sharing the cores with the ingress, HAProxy and the event loop
    (docs/benchmarks.md, "Lent cores on a 2-core node")."""
    if cap <= share:
        return None
    from chunkserve.workers.node_cores import NodeCores  # numpy: only inside the replica

    try:
        return NodeCores(share, max_threads=cap)
    except (OSError, RuntimeError, ValueError) as e:
        logger.warning("engine threads stay at %d: the node's core table is unavailable (%s)", share, e)
        return None


def replica_seed(seed: int, worker_id: str) -> int:
    """A worker replica's sampler seed (for unseeded requests): the engine's ``seed`` mixed with the replica's id. With one seed for every
    replica, each drew the same stream for unseeded requests, so two replicas at the same draw count gave the same
    prompt the same sampled answer (seen: the README's request at temperature 1, sent twice, answered twice alike).
    A request's own ``seed`` still fixes its tokens on any replica."""
    digest = hashlib.blake2b(f"{seed}:{worker_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class WorkerServer:
    """An engine plus its cache-event publisher; the body of a worker replica.

    ``thread_rule`` (``{"workers_per_node": n, "reserved_cpus": r}``, optionally ``"node_cpus"``: the cores
    to count instead of this node's) sets the engine's ``num_threads`` by `cpu_budget.rule_threads`
    when the engine config leaves it unset."""

    def __init__(self, engine_config: dict[str, Any] | EngineConfig, worker_id: str,
                 redis_url: str | None = None, lease_ttl_s: float = 5.0, max_depth: int | None = None,
                 namespace: str | None = None, enable_ray_metrics: bool = True,
                 stream_batching: StreamBatching | dict[str, Any] | None = None,
                 thread_rule: dict[str, int] | None = None) -> None:
        cfg = engine_config if isinstance(engine_config, EngineConfig) else EngineConfig(**engine_config)
        cores = None
        if thread_rule is not None and cfg.num_threads is None and cfg.device == "cpu":
            cfg = dataclasses.replace(cfg, num_threads=rule_threads(thread_rule))
            if thread_rule.get("lend_idle_cores"):
                cores = _node_cores(cfg.num_threads or 1, rule_lend_cap(thread_rule))
        self.worker_id = worker_id
        self.batching = StreamBatching.from_options(stream_batching)
        from chunkserve.workers.async_engine import AsyncEngine  # torch: only inside the replica

        depth: int | None = None  # index depth of the hash snapshot the publisher re-publishes
        if redis_url:
            from chunkserve.cluster.events import DEFAULT_MAX_DEPTH

            depth = max_depth or DEFAULT_MAX_DEPTH
        self.engine = AsyncEngine(cfg, hash_snapshot_depth=depth, cores=cores)
        # before any request: EngineConfig.seed stays the random-weight seed (every replica the same model)
        self.engine.core.sampler.reseed(replica_seed(cfg.seed, worker_id))
        self.metrics = WorkerMetrics(worker_id, enable_ray=enable_ray_metrics)
        self.routing = RoutingAccuracy(worker_id, self.engine.core.cache.chunk_size)
        self.tenant_tokens = TenantTokens()
        self.publisher = None
        self._released = False  # the lease was dropped by a failed health check
        self.stats_writer = None
        self._pub_task: asyncio.Task | None = None
        self._pub_wake = asyncio.Event()  # set (through the loop) by a step that queued cache events
        if redis_url and depth is not None:
            from chunkserve.cluster.events import WorkerPublisher
            from chunkserve.cluster.index import DEFAULT_NAMESPACE
            from chunkserve.cluster.stats import WorkerStatsWriter

            ns = namespace or DEFAULT_NAMESPACE
            # the lease thread re-publishes the engine thread's hash snapshot, never reading the live tree
            self.publisher = WorkerPublisher(redis_url, worker_id, namespace=ns, lease_ttl_s=lease_ttl_s,
                                             max_depth=depth, snapshot=self.engine.cached_hashes).start()
            self.stats_writer = WorkerStatsWriter(self.publisher.client, worker_id, namespace=ns,
                                                  ttl_s=max(lease_ttl_s, 3 * STATS_INTERVAL_S))

    def start_publishing(self) -> None:
        """Start the event-publishing and stats task on the running event loop (idempotent)."""
        if self._pub_task is None:
            loop = asyncio.get_running_loop()
            if self.publisher is not None:  # a step that stores or evicts chunks wakes the publish at once
                def wake() -> None:  # on the engine thread
                    loop.call_soon_threadsafe(self._pub_wake.set)

                self.engine.on_cache_events(wake)
            self._pub_task = loop.create_task(self._publish_loop())

    async def _publish_loop(self) -> None:
        """Publishes the cache events as soon as a step queues some (then at most one publish per
        ``PUBLISH_INTERVAL_S``, batching what comes meanwhile), and the stats and forest on their intervals.
        Idle, it wakes once per stats interval. A claimed cold prefix (`cluster/claims.py`) is settled by the
        publish that stores its last chunk, so the next new prefix is placed on current load."""
        loop = asyncio.get_running_loop()
        next_stats = next_forest = 0.0
        while True:
            published = False
            try:
                if self.publisher is not None:
                    events = self.engine.drain_cache_events()
                    if events:
                        published = True
                        await asyncio.to_thread(self.publisher.publish, events)
                now = loop.time()
                if now >= next_stats:
                    next_stats = now + STATS_INTERVAL_S
                    await self.report_stats()
                if self.stats_writer is not None and now >= next_forest:
                    next_forest = now + FOREST_INTERVAL_S
                    summary = await self.engine.forest_summary()
                    await asyncio.to_thread(self.stats_writer.write_forest, summary)
            except Exception:  # never let one bad tick stop publishing
                logger.exception("worker %s: publish/stats tick failed", self.worker_id)
            if self.publisher is None:
                await asyncio.sleep(max(0.0, next_stats - loop.time()))
                continue
            if published:
                await asyncio.sleep(PUBLISH_INTERVAL_S)  # batch what the next steps store
            self._pub_wake.clear()
            if not self.engine.has_cache_events():  # events queued before the clear() already set it
                due = min(next_stats, next_forest if self.stats_writer is not None else next_stats)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._pub_wake.wait(), timeout=max(0.0, due - loop.time()))

    async def report_stats(self) -> dict[str, Any]:
        """Record the engine's stats as metrics and (with Redis) write the snapshot. -> the stats."""
        st = {**self.engine.stats(), "routing": self.routing.snapshot(), "tenants": self.tenant_tokens.snapshot()}
        self.metrics.update(st)
        if self.stats_writer is not None:
            await asyncio.to_thread(self.stats_writer.write, st)
        return st

    async def generate(self, request: GenerateRequest, chunk_hashes: list[int] | None = None,
                       routing: dict[str, Any] | None = None) -> AsyncGenerator[GenerateDelta, None]:
        """Stream the request's deltas, coalesced (``chunk_hashes`` is read by the router, not needed here;
        ``routing``, the router's prediction, is scored against the reuse on the first delta)."""
        self.start_publishing()
        first, out = True, 0
        try:
            async with contextlib.aclosing(self.engine.generate(request, self.batching)) as gen:
                async for delta in gen:
                    if first:
                        first = False
                        self.tenant_tokens.started(request.tenant, delta.num_prompt_tokens, delta.num_cached_tokens)
                        if routing is not None:
                            self.routing.record(request.request_id, routing, delta.num_cached_tokens)
                    out = delta.num_output_tokens
                    yield delta
        finally:
            self.tenant_tokens.decoded(request.tenant, out)

    def check_health(self) -> None:
        """Serve's health check: raises once the engine thread has stopped, so that Serve replaces this
        replica; the first failing check also drops its lease and index entries, so routers stop choosing it
        at once (a dead engine fails every request instantly and would otherwise look idle)."""
        try:
            self.engine.check_alive()
        except EngineDeadError:
            if self.publisher is not None and not self._released:
                self._released = True
                self.publisher.stop(release=True)
            raise

    def routing_stats(self) -> dict[str, Any]:
        """What the router reads about this replica (Serve's ``record_routing_stats``), by `EngineStats` names."""
        st = self.engine.stats()
        return {"num_requests_running": st.num_requests_running, "num_requests_waiting": st.num_requests_waiting,
                "kv_cache_usage_perc": st.kv_cache_usage_perc, "kv_chunks_used": st.kv_chunks_used,
                "kv_chunks_cached": st.kv_chunks_cached, "kv_chunks_total": st.kv_chunks_total,
                "worker_id": self.worker_id}

    def stats(self) -> dict[str, Any]:
        return {**self.engine.stats(), "worker_id": self.worker_id,
                "num_threads": self.engine.core.config.num_threads, "step_threads": self.engine.step_threads}

    def shutdown(self) -> None:
        if self._pub_task is not None:
            self._pub_task.cancel()
        if self.stats_writer is not None:
            self.stats_writer.delete()
        if self.publisher is not None:
            self.publisher.stop(release=True)
        self.engine.shutdown()


def build_worker_deployment(name: str = "Worker", num_replicas: int | str = 1,
                            ray_actor_options: dict[str, Any] | None = None,
                            router_kwargs: dict[str, Any] | None = None,
                            autoscaling_config: dict[str, Any] | None = None,
                            max_ongoing_requests: int = 64,
                            request_router_class: str | None = PREFIX_ROUTER,
                            graceful_shutdown_timeout_s: float = 30.0) -> Any:
    """A Serve deployment class for the worker, routed by ``request_router_class`` (an import path;
    default `PrefixAwareRouter`; ``None``: Ray Serve's default power-of-two-choices router, no kwargs).
    A replica being stopped takes no new requests and finishes its running ones for up to
    ``graceful_shutdown_timeout_s`` (the drain)."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    opts: dict[str, Any] = {"name": name, "max_ongoing_requests": max_ongoing_requests,
                            "ray_actor_options": ray_actor_options or {"num_cpus": 0},
                            "graceful_shutdown_timeout_s": graceful_shutdown_timeout_s,
                            "graceful_shutdown_wait_loop_s": 0.5}
    if request_router_class is not None:
        kwargs = ({"predictions": True, **(router_kwargs or {})} if request_router_class == PREFIX_ROUTER
                  else router_kwargs or {})
        router_cfg: dict[str, Any] = {"request_router_class": request_router_class, "request_router_kwargs": kwargs,
                                      "request_routing_stats_period_s": 1.0}
        opts["request_router_config"] = RequestRouterConfig(**router_cfg)  # (Ray's __init__ is typed **dict)
    if autoscaling_config:
        opts["autoscaling_config"] = autoscaling_config
    else:
        opts["num_replicas"] = num_replicas

    @serve.deployment(**opts)
    class Worker:
        def __init__(self, engine_config: dict[str, Any], redis_url: str | None = None,
                     lease_ttl_s: float = 5.0, namespace: str | None = None,
                     stream_batching: dict[str, Any] | None = None,
                     thread_rule: dict[str, int] | None = None) -> None:
            worker_id = serve.get_replica_context().replica_id.unique_id
            self.server = WorkerServer(engine_config, worker_id, redis_url, lease_ttl_s, namespace=namespace,
                                       stream_batching=stream_batching, thread_rule=thread_rule)
            # Serve runs the constructor on the replica's event loop: report from the start (without a
            # running loop the first request starts it).
            with contextlib.suppress(RuntimeError):
                self.server.start_publishing()
            freeze_startup_heap()  # the model and the modules: out of every later garbage collection

        async def generate(self, request: GenerateRequest, chunk_hashes: list[int] | None = None,
                           routing: dict[str, Any] | None = None) -> AsyncGenerator[GenerateDelta, None]:
            async for delta in self.server.generate(request, chunk_hashes, routing):
                yield delta

        def routing_log(self) -> dict[str, Any]:
            """This replica's routing-prediction outcomes (bounded, oldest first) under its worker id."""
            return {"worker_id": self.server.worker_id, "records": list(self.server.routing.log)}

        async def forest_summary(self) -> dict[str, Any]:
            return await self.server.engine.forest_summary()

        async def check_health(self) -> None:
            await asyncio.to_thread(self.server.check_health)  # a failing one joins the lease thread

        def record_routing_stats(self) -> dict[str, Any]:
            return self.server.routing_stats()

        async def stats(self) -> dict[str, Any]:
            import ray

            return {**self.server.stats(), "node_id": ray.get_runtime_context().get_node_id()}

        def __del__(self) -> None:
            with contextlib.suppress(Exception):
                self.server.shutdown()

    return Worker
