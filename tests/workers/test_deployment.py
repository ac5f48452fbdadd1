"""The worker replica body (`WorkerServer`, in-process, no Ray): the engine-thread rule and coalesced streams."""

from __future__ import annotations

import asyncio

import pytest

from chunkserve.router.app import AppConfig
from chunkserve.workers.cpu_budget import engine_threads
from chunkserve.workers.deployment import WorkerServer
from chunkserve.workers.engine import EngineConfig
from chunkserve.workers.protocol import GenerateRequest
from chunkserve.workers.sampling import SamplingParams

TINY = {"model": "random:tiny", "chunk_size": 16, "num_kv_chunks": 32, "max_model_len": 256}


@pytest.mark.parametrize("cpus,workers,reserved,expected", [
    (2, 1, 1, 1), (2, 2, 1, 1), (16, 2, 1, 7), (16, 1, 1, 15), (8, 3, 2, 2), (1, 1, 1, 1), (4, 1, 0, 4),
])
def test_engine_threads_leave_the_reserved_cores_and_split_the_rest_evenly(cpus, workers, reserved, expected):
    assert engine_threads(cpus, workers, reserved) == expected


def test_app_config_gives_the_thread_rule_unless_the_engine_fixes_threads_or_uses_gpus():
    assert AppConfig(workers=3).thread_rule() == {"workers_per_node": 3, "reserved_cpus": 1, "lend_idle_cores": 1}
    assert AppConfig(workers=3, lend_idle_cores=False).thread_rule()["lend_idle_cores"] == 0
    assert AppConfig(autoscaling={"min_replicas": 1, "max_replicas": 4}).thread_rule()["workers_per_node"] == 4
    assert AppConfig(workers=4, workers_per_node=1, node_cpus=8).thread_rule() == {
        "workers_per_node": 1, "reserved_cpus": 1, "node_cpus": 8, "lend_idle_cores": 1}
    assert AppConfig(engine={"num_threads": 2}).thread_rule() is None
    assert AppConfig(worker_num_gpus=1).thread_rule() is None


def test_worker_server_sets_engine_threads_by_the_rule_and_keeps_a_fixed_count():
    ruled = WorkerServer(TINY, "w-rule", enable_ray_metrics=False,
                         thread_rule={"workers_per_node": 2, "reserved_cpus": 1, "node_cpus": 4})
    fixed = lending = two = None
    try:
        assert ruled.engine.core.config.num_threads == 1 and ruled.stats()["num_threads"] == 1
        assert ruled.engine._cores is None  # the rule did not ask to lend idle cores
        fixed = WorkerServer({**TINY, "num_threads": 2}, "w-fixed", enable_ray_metrics=False,
                             thread_rule={"workers_per_node": 1, "reserved_cpus": 1, "node_cpus": 16,
                                          "lend_idle_cores": 1})
        assert fixed.engine.core.config.num_threads == 2 and fixed.engine._cores is None  # fixed: no lending
        lending = WorkerServer(TINY, "w-lend", enable_ray_metrics=False,
                               thread_rule={"workers_per_node": 2, "reserved_cpus": 1, "node_cpus": 8,
                                            "lend_idle_cores": 1})
        cores = lending.engine._cores
        assert cores is not None and cores.share == 3 and cores.max_threads == 7  # never the reserved core
        two = WorkerServer(TINY, "w-two", enable_ray_metrics=False,  # 2 cores, 1 reserved: nothing to lend
                           thread_rule={"workers_per_node": 2, "reserved_cpus": 1, "node_cpus": 2,
                                        "lend_idle_cores": 1})
        assert two.engine._cores is None and two.engine.core.config.num_threads == 1
    finally:
        for server in (ruled, fixed, lending, two):
            if server is not None:
                server.shutdown()


def test_worker_server_streams_coalesced_items_with_the_same_tokens_as_one_per_token():
    async def run(server: WorkerServer, rid: str) -> list:
        req = GenerateRequest(rid, (3, 4, 5, 6), SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
        out = [d async for d in server.generate(req)]
        server.shutdown()
        return out

    plain = asyncio.run(run(WorkerServer(EngineConfig(**TINY), "w-plain", enable_ray_metrics=False,
                                         stream_batching={"interval_s": 0}), "p"))
    merged = asyncio.run(run(WorkerServer(EngineConfig(**TINY), "w-merged", enable_ray_metrics=False,
                                          stream_batching={"interval_s": 0.3, "max_tokens": 64}), "m"))
    assert len(plain) == 30 and len(merged[0].token_ids) == 1
    assert len(merged) < len(plain)  # 30 tiny-model steps take far less than 0.3 s per item
    assert [t for d in merged for t in d.token_ids] == [t for d in plain for t in d.token_ids]
    assert merged[-1].finish_reason == plain[-1].finish_reason == "length"
    assert merged[-1].num_output_tokens == 30


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the engine thread's death
def test_a_worker_whose_engine_thread_died_fails_its_health_check_and_drops_its_lease():
    from chunkserve.cluster.index import PrefixIndex
    from chunkserve.cluster.redis_server import RedisServer
    from chunkserve.workers.protocol import EngineDeadError

    with RedisServer() as redis_srv:
        server = WorkerServer(TINY, "w-dies", redis_url=redis_srv.url, namespace="dies", enable_ray_metrics=False)
        index = PrefixIndex(redis_srv.url, namespace="dies")
        try:
            server.check_health()  # a live engine passes
            assert "w-dies" in index.live_workers()

            def explode(*args, **kwargs):
                raise RuntimeError("a bug outside the step")

            server.engine.core.add_request = explode  # uncaught on the engine thread: the thread dies

            async def first() -> None:
                async for _ in server.generate(GenerateRequest("doomed", (1, 2, 3), SamplingParams(max_tokens=2))):
                    pass

            with pytest.raises(EngineDeadError):
                asyncio.run(asyncio.wait_for(first(), 30))
            server.engine._thread.join(timeout=10)
            with pytest.raises(EngineDeadError):  # answered at once, not left waiting on an inbox nobody reads
                asyncio.run(asyncio.wait_for(server.engine.forest_summary(), 5))
            with pytest.raises(EngineDeadError):
                server.check_health()
            assert "w-dies" not in index.live_workers()  # routers stop choosing it before Serve replaces it
        finally:
            server.shutdown()


def test_replicas_draw_different_samples_for_the_same_unseeded_request_and_a_seed_fixes_them():
    async def first(worker_id: str, seed: int | None) -> list[int]:
        server = WorkerServer(TINY, worker_id, enable_ray_metrics=False)
        try:
            req = GenerateRequest("r", (3, 4, 5, 6), SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True,
                                                                    seed=seed))
            return [t async for d in server.generate(req) for t in d.token_ids]
        finally:
            server.shutdown()

    a, b, a_again = (asyncio.run(first(w, None)) for w in ("w-a", "w-b", "w-a"))
    assert len(a) == 12 and a != b  # each replica its own stream of draws
    assert a == a_again  # a replica's stream follows from its id (and EngineConfig.seed)
    assert asyncio.run(first("w-a", 7)) == asyncio.run(first("w-b", 7))  # a request's seed: the same on any replica
