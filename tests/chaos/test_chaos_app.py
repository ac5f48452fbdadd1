"""Chaos against the real app (`router/app.py`'s `build_app`, as `chunkserve up` serves it: 2 prefix-routed
``random:tiny`` workers, 2 ingress replicas, a real Redis, Ray's HTTP and gRPC proxies) under steady streaming
load: a worker replica SIGKILLed twice, an ingress replica SIGKILLed, Redis stopped for 30 s. Each asserts zero
failed requests and zero hangs (and greedy outputs equal to an undisturbed run); for the ingress kill, only the
requests that were on the killed replica may fail, and only with a clean error (503 JSON or SSE error + [DONE]). One app is shared by the module's tests, in order."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from harness import StreamLoad, failures, replica_pids, stream_completion, wait_for

from chunkserve.cluster.redis_server import RedisServer
from chunkserve.cluster.redis_server import (
    find_free_port as _free_port,  # outside Ray's and the kernel's ports
)

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

pytestmark = pytest.mark.slow

MODEL = "tiny-chaos"
APP = "chunkserve"
PROMPTS = [[(31 * k + 7 * i) % 250 + 1 for i in range(40)] for k in range(4)]
MAX_TOKENS = 16
REPLACE_TIMEOUT_S = 180.0


class Cluster:
    def __init__(self, http: str, grpc_target: str, redis: RedisServer) -> None:
        self.http, self.grpc_target, self.redis = http, grpc_target, redis
        self.reference: dict[int, str] = {}

    def load(self, clients: int = 4) -> StreamLoad:
        return StreamLoad(self.http, MODEL, PROMPTS, clients=clients, max_tokens=MAX_TOKENS)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    from ray.serve.config import HTTPOptions, gRPCOptions

    from chunkserve.router.app import GRPC_SERVICER, AppConfig, build_app
    from chunkserve.tools.launcher import ray_env_vars

    http_port, grpc_port = _free_port(), _free_port()
    redis = RedisServer().start()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": ray_env_vars(redis.url)})  # as `chunkserve up`: the proxy's ProxyGuard
    try:
        serve.start(http_options=HTTPOptions(host="127.0.0.1", port=http_port),
                    grpc_options=gRPCOptions(port=grpc_port, grpc_servicer_functions=[GRPC_SERVICER]))
        cfg = AppConfig(model="random:tiny", model_name=MODEL, workers=2, ingress_replicas=2, redis_url=redis.url,
                        lease_ttl_s=2.0, drain_grace_s=10.0,
                        engine={"chunk_size": 16, "num_kv_chunks": 64, "max_model_len": 256})
        serve.run(build_app(cfg), name=APP, route_prefix="/")
        c = Cluster(f"http://127.0.0.1:{http_port}", f"127.0.0.1:{grpc_port}", redis)
        for i in range(len(PROMPTS)):  # the undisturbed greedy outputs
            o = stream_completion(c.http, {"model": MODEL, "prompt": PROMPTS[i], "max_tokens": MAX_TOKENS,
                                           "temperature": 0.0}, i, 120.0)
            assert o.ok, o
            c.reference[i] = o.text
        yield c
    finally:
        serve.shutdown()
        ray.shutdown()
        redis.stop()


def _report(name: str, **figures: Any) -> None:
    print(f"\n[chaos] {name}: " + ", ".join(f"{k}={v}" for k, v in figures.items()), flush=True)


def _kill_and_wait(deployment: str) -> tuple[int, float]:
    """SIGKILLs one replica of ``deployment``; -> (pid, seconds until a replacement runs)."""
    before = replica_pids(APP, deployment)
    assert len(before) == 2, before
    victim = before[0]
    os.kill(victim, signal.SIGKILL)
    t0 = time.monotonic()
    wait_for(lambda: len([p for p in replica_pids(APP, deployment) if p != victim]) == 2, REPLACE_TIMEOUT_S,
             f"a replacement {deployment} replica")
    return victim, time.monotonic() - t0


def test_a_worker_replica_killed_twice_under_load_loses_no_request(cluster):
    load = cluster.load().start()
    time.sleep(3.0)
    figures = {}
    for k in (1, 2):
        t_kill = time.monotonic()
        _, replaced_s = _kill_and_wait("Worker")
        figures[f"kill{k}_replaced_s"] = round(replaced_s, 1)
        figures[f"kill{k}_t"] = t_kill
        time.sleep(2.0)
    time.sleep(2.0)
    outs = load.stop()
    for k in (1, 2):
        figures[f"kill{k}_in_flight"] = load.in_flight_at(figures.pop(f"kill{k}_t"))
    bad = failures(outs, cluster.reference)
    _report("worker SIGKILL x2", requests=len(outs), failed=len(bad), **figures,
            max_s=round(max(o.t_end - o.t_start for o in outs), 2))
    assert len(outs) >= 10
    assert not bad, bad[:3]  # no failure, no hang, greedy text identical to the undisturbed run


def test_an_ingress_replica_killed_under_load_gives_its_requests_a_clean_error_and_loses_no_other(cluster):
    load = cluster.load().start()
    time.sleep(3.0)
    t_kill = time.monotonic()
    _, replaced_s = _kill_and_wait("Ingress")
    time.sleep(2.0)
    outs = load.stop()
    in_flight = load.in_flight_at(t_kill)
    bad = failures(outs, cluster.reference)
    after = [o for o in outs if o.t_start > t_kill + 1.0]
    _report("ingress SIGKILL", requests=len(outs), in_flight=in_flight, failed=len(bad),
            clean=sum(o.clean_error for o in bad), replaced_s=round(replaced_s, 1),
            failed_got=[(o.status, o.done, str(o.error)[:80]) for o in bad][:4])
    assert all(o.t_start <= t_kill for o in bad), bad  # only requests already running at the kill
    assert len(bad) <= in_flight
    # Ray's proxy held those connections; its ProxyGuard ends them with a 503 JSON or an SSE error + [DONE]
    assert all(o.clean_error for o in bad), [(o.status, o.done, o.error) for o in bad]
    assert after and not failures(after, cluster.reference)  # the other replica took every later request


def test_redis_stopped_for_30_s_under_load_loses_no_request(cluster):
    load = cluster.load(clients=3).start()
    time.sleep(2.0)
    port = int(cluster.redis.url.rsplit(":", 1)[1].split("/")[0])
    cluster.redis.stop()
    time.sleep(30.0)
    cluster.redis = RedisServer(port=port).start()
    time.sleep(3.0)
    outs = load.stop()
    bad = failures(outs, cluster.reference)
    _report("Redis down 30 s", requests=len(outs), failed=len(bad),
            max_s=round(max(o.t_end - o.t_start for o in outs), 2))
    assert len(outs) >= 10 and not bad, bad[:3]


def test_grpc_through_rays_proxy_refuses_20_mb_fast_and_garbage_cleanly(cluster):
    from chunkserve.v1 import generate_pb2 as pb
    from chunkserve.v1 import generate_pb2_grpc as pb_grpc

    opts = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]
    with grpc.insecure_channel(cluster.grpc_target, options=opts) as ch:
        stub = pb_grpc.ChunkServeStub(ch)
        md = (("application", APP),)
        ok = stub.Generate(pb.GenerateRequest(model=MODEL, prompt_token_ids=PROMPTS[0], sampling=pb.SamplingParams(
            max_tokens=4, temperature=0.0)), metadata=md, timeout=60)
        assert len(ok.token_ids) == 4
        big = pb.GenerateRequest(model=MODEL, prompt="word " * (4 << 20))  # 20 MiB
        t0 = time.perf_counter()
        with pytest.raises(grpc.RpcError) as ei:
            stub.Generate(big, metadata=md, timeout=30)
        elapsed = time.perf_counter() - t0
        raw = ch.unary_unary("/chunkserve.v1.ChunkServe/Generate", request_serializer=None,
                             response_deserializer=None)
        with pytest.raises(grpc.RpcError) as eg:
            raw(b"\xff\xff\xff\x0f garbage", metadata=md, timeout=30)
    _report("gRPC limits", big_mb=round(big.ByteSize() / 2**20, 1), refused_s=round(elapsed, 3),
            big_code=ei.value.code().name, garbage_code=eg.value.code().name, garbage_details=eg.value.details())
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and elapsed < 2.0  # no parse of 20 MB
    assert eg.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "Error" not in eg.value.details()


def test_an_api_request_while_no_app_is_deployed_gets_503_json_not_rays_404(cluster):
    """What a client sees while the app is deleted or redeployed (the drain of `chunkserve up`): the proxy still
    runs but routes nothing; its guard answers 503 JSON with Retry-After. Last in the module: it deletes the app."""
    import httpx2

    serve.delete(APP)
    r = httpx2.post(cluster.http + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
                    timeout=30)
    _report("no app deployed", status=r.status_code, retry_after=r.headers.get("retry-after"))
    assert r.status_code == 503 and r.headers.get("retry-after")
    assert r.json()["error"]["code"] == "not_deployed"
