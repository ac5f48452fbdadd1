"""`EngineStats` (workers/protocol.py): one set of stats names from the engine to the metrics, the router's
load and the load-test report; a renamed or dropped field fails here instead of being skipped downstream."""

from __future__ import annotations

import dataclasses

import pytest

from chunkserve.tools.loadtest_metrics import WORKER_FIELDS
from chunkserve.workers.engine import EngineConfig, EngineCore
from chunkserve.workers.protocol import EngineStats
from chunkserve.workers.thread_clock import StepTimes
from chunkserve.workers.worker_metrics import COUNTERS, GAUGES

FIELDS = {f.name for f in dataclasses.fields(EngineStats)} - {"extra"}
CLOCK_FIELDS = set(StepTimes().as_stats())  # added by the async engine's thread, not the core


@pytest.fixture(scope="module")
def core() -> EngineCore:
    return EngineCore(EngineConfig(model="random:tiny", num_kv_chunks=64, chunk_size=16))


def test_engine_stats_declare_every_key_the_engine_reports(core: EngineCore) -> None:
    raw = core.stats()
    st = EngineStats.from_dict(raw)
    assert dict(st.extra) == {}, f"undeclared engine stats: {sorted(st.extra)}: add them to EngineStats"
    assert set(raw) == FIELDS - CLOCK_FIELDS
    # the mapping view is the engine's dict, unrenamed, with the clock's fields at their defaults
    assert dict(st) == st.as_dict() == {**raw, **dict.fromkeys(CLOCK_FIELDS, 0.0)}
    assert st.kv_chunks_total == 64 and st["chunk_size"] == 16


def test_a_missing_field_fails_loudly(core: EngineCore) -> None:
    raw = dict(core.stats())
    del raw["num_requests_waiting"]
    with pytest.raises(KeyError, match="num_requests_waiting"):
        EngineStats.from_dict(raw)


def test_unknown_keys_are_kept_apart_and_the_snapshot_is_immutable(core: EngineCore) -> None:
    st = EngineStats.from_dict({**core.stats(), "new_figure": 3})
    assert st.extra["new_figure"] == 3 and st["new_figure"] == 3 and "new_figure" in dict(st)
    with pytest.raises(dataclasses.FrozenInstanceError):
        st.num_steps = 5  # type: ignore[misc]
    with pytest.raises(TypeError):
        st.extra["x"] = 1  # type: ignore[index]


def test_metrics_and_load_test_read_engine_stats_names() -> None:
    assert set(COUNTERS.values()) | set(GAUGES.values()) <= FIELDS
    assert set(WORKER_FIELDS) <= FIELDS


def test_worker_routing_stats_use_engine_stats_names() -> None:
    from chunkserve.workers.deployment import WorkerServer

    server = WorkerServer({"model": "random:tiny", "num_kv_chunks": 32, "chunk_size": 16}, "w0",
                          enable_ray_metrics=False)
    try:
        assert isinstance(server.engine.stats(), EngineStats)
        assert set(dict(server.engine.stats())) == FIELDS  # the core's fields and the engine thread's clock
        rs = server.routing_stats()
        assert set(rs) - {"worker_id"} <= FIELDS and set(WORKER_FIELDS) <= set(rs)
    finally:
        server.shutdown()
