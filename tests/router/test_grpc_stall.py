"""A gRPC stream whose client stops reading is ended after the stream write timeout, as an HTTP one is: the
engine request is aborted and its KV chunks freed while the client still holds the call open."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc
import pytest

from chunkserve.router.grpc_service import GrpcStatusError
from chunkserve.router.local_server import local_ingress
from chunkserve.v1 import generate_pb2 as pb
from chunkserve.workers.engine import EngineConfig

MODEL = "tiny-grpc-stall"


class _Context:
    """The parts of a grpc.aio servicer context the service uses."""

    def __init__(self) -> None:
        self.code: grpc.StatusCode | None = None
        self.details = ""

    def invocation_metadata(self) -> list[tuple[str, str]]:
        return []

    def set_code(self, code: grpc.StatusCode) -> None:
        self.code = code

    def set_details(self, details: str) -> None:
        self.details = details

    def set_trailing_metadata(self, md: Any) -> None:
        pass


def _request(max_tokens: int) -> bytes:
    sampling = pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return pb.GenerateRequest(model=MODEL, prompt_token_ids=[5, 6, 7, 8], sampling=sampling).SerializeToString()


async def _running(engine: Any, deadline_s: float) -> dict[str, Any]:
    """The engine's stats once it runs no request (or at the deadline)."""
    end = time.monotonic() + deadline_s
    while True:
        st = dict(engine.stats())
        if st["num_requests_running"] == 0 or time.monotonic() > end:
            return st
        await asyncio.sleep(0.02)


@pytest.mark.parametrize("limit", [0.3, None])
def test_a_grpc_stream_whose_client_stops_reading_is_aborted_after_the_write_timeout(limit, caplog) -> None:
    async def main() -> None:
        cfg = EngineConfig(model="random:tiny", chunk_size=16, num_kv_chunks=512, max_model_len=4096,
                           num_threads=1)
        ingress = local_ingress(cfg, model_name=MODEL, stream_batching={"interval_s": 0.0},
                                stream_write_timeout_s=limit)
        engine = ingress.engine.engine
        try:
            ctx = _Context()
            gen = ingress.GenerateStream(_request(4000), ctx)
            first = await gen.__anext__()  # the client reads one message, then nothing
            assert first.token_ids
            await asyncio.sleep(0.6)
            st = await _running(engine, 1.0)
            if limit is None:  # no bound: the request runs on for its 4,000 tokens
                assert st["num_requests_running"] == 1
                await gen.aclose()
                return
            assert st["num_requests_running"] == 0 and st["kv_chunks_used"] == 0, st
            with pytest.raises(GrpcStatusError) as ei:  # the client reads again: the stream has ended
                while True:
                    await gen.__anext__()
            assert ei.value.code == grpc.StatusCode.DEADLINE_EXCEEDED == ctx.code
            assert "read nothing" in ei.value.details
        finally:
            await asyncio.to_thread(engine.shutdown)

    with caplog.at_level("WARNING", logger="chunkserve.router.grpc_service"):
        asyncio.run(main())
    assert any("read nothing" in r.getMessage() for r in caplog.records) == (limit is not None)
