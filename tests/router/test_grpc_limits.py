"""gRPC limits like HTTP's: a message over ``max_body_bytes`` is refused before it is parsed or tokenised,
and bytes that are not a GenerateRequest get INVALID_ARGUMENT with a plain message (no class names)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import grpc
import pytest

from chunkserve.router.local_server import LocalServer, local_ingress
from chunkserve.v1 import generate_pb2 as pb
from chunkserve.v1 import generate_pb2_grpc as pb_grpc
from chunkserve.workers.engine import EngineConfig

MODEL = "tiny-grpc-limits"


@pytest.fixture(scope="module")
def channel() -> Iterator[grpc.Channel]:
    cfg = EngineConfig(model="random:tiny", chunk_size=16, num_kv_chunks=16, max_model_len=256, num_threads=1)
    with LocalServer(lambda: local_ingress(cfg, model_name=MODEL)) as srv:
        opts = [("grpc.max_send_message_length", 64 << 20)]
        with grpc.insecure_channel(srv.grpc_target, options=opts) as ch:
            yield ch


def _raw(channel: grpc.Channel, method: str, stream: bool) -> grpc.UnaryUnaryMultiCallable:
    make = channel.unary_stream if stream else channel.unary_unary
    return make(f"/chunkserve.v1.ChunkServe/{method}", request_serializer=None, response_deserializer=None)


@pytest.mark.parametrize("method,stream", [("Generate", False), ("GenerateStream", True)])
def test_a_20_mb_request_is_refused_in_under_half_a_second(channel, method, stream):
    big = pb.GenerateRequest(model=MODEL, prompt="word " * (4 << 20), sampling=pb.SamplingParams(max_tokens=1))
    assert big.ByteSize() > 20 << 20
    stub = pb_grpc.ChunkServeStub(channel)
    call = getattr(stub, method)
    t0 = time.perf_counter()
    with pytest.raises(grpc.RpcError) as ei:
        out = call(big, timeout=30)
        if stream:
            list(out)
    elapsed = time.perf_counter() - t0
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "exceeds the limit" in ei.value.details()
    assert elapsed < 2.0, elapsed  # refused before parsing: tokenising 20 MB alone would take far longer


@pytest.mark.parametrize("method,stream", [("Generate", False), ("GenerateStream", True)])
def test_garbage_bytes_get_invalid_argument_without_internal_class_names(channel, method, stream):
    call = _raw(channel, method, stream)
    with pytest.raises(grpc.RpcError) as ei:
        out = call(b"\xff\xff\xff\x0f garbage \x00\x01", timeout=30)
        if stream:
            list(out)
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = ei.value.details()
    assert "not a valid chunkserve.v1.GenerateRequest" in details
    assert "DecodeError" not in details and "Error" not in details and "Exception" not in details


def test_a_well_formed_request_still_works_through_the_raw_bytes_path(channel):
    stub = pb_grpc.ChunkServeStub(channel)
    r = stub.Generate(pb.GenerateRequest(model=MODEL, prompt_token_ids=[5, 6, 7],
                                         sampling=pb.SamplingParams(max_tokens=3, temperature=0.0)), timeout=60)
    assert len(r.token_ids) == 3 and r.usage.prompt_tokens == 3
