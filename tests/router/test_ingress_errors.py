"""Typed engine errors and coalesced streams through the real HTTP and gRPC faces (LocalServer over the real
tiny engine): the status comes from the error's type, and a streamed answer arrives in fewer events than
tokens with the same text and usage. The module's last test shuts the engine down."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator

import grpc
import httpx2
import pytest

from chunkserve.router.engine_client import engine_error_to_api
from chunkserve.router.grpc_service import grpc_status
from chunkserve.router.local_server import LocalServer, local_ingress
from chunkserve.v1 import generate_pb2 as pb
from chunkserve.v1 import generate_pb2_grpc as pb_grpc
from chunkserve.workers.engine import EngineConfig
from chunkserve.workers.protocol import (
    EngineDeadError,
    EngineError,
    EngineStepError,
    InvalidRequestError,
    InvalidSamplingError,
    KVPoolTooSmallError,
    PromptTooLongError,
)

MODEL = "tiny-errors"
CHUNK = 16
POOL_CHUNKS = 8  # 128 tokens: a 200-token prompt fits the 256-token context but never the pool


@pytest.fixture(scope="module")
def server() -> Iterator[LocalServer]:
    cfg = EngineConfig(model="random:tiny", chunk_size=CHUNK, num_kv_chunks=POOL_CHUNKS, max_model_len=256)
    batching = {"interval_s": 0.2, "max_tokens": 64}  # wide enough that a loaded CI machine still coalesces
    with LocalServer(lambda: local_ingress(cfg, model_name=MODEL, stream_batching=batching)) as srv:
        yield srv


@pytest.fixture(scope="module")
def stub(server) -> Iterator[pb_grpc.ChunkServeStub]:
    with grpc.insecure_channel(server.grpc_target) as ch:
        yield pb_grpc.ChunkServeStub(ch)


def post(server: LocalServer, body: dict) -> httpx2.Response:
    return httpx2.post(server.http_url + "/v1/completions", json={"model": MODEL, **body}, timeout=60)


def sse_events(text: str) -> list[dict]:
    data = [ln[len("data: "):] for ln in text.split("\n\n") if ln.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


@pytest.mark.parametrize("error,status,kind,code", [
    (PromptTooLongError("p"), 413, "invalid_request_error", "context_length_exceeded"),
    (KVPoolTooSmallError("p"), 413, "invalid_request_error", "context_length_exceeded"),
    (InvalidSamplingError("p"), 400, "invalid_request_error", "invalid_value"),
    (InvalidRequestError("p"), 400, "invalid_request_error", None),
    (EngineStepError("p"), 500, "server_error", "engine_error"),
    (EngineDeadError("p"), 503, "server_error", "engine_unavailable"),
    (EngineError("p"), 500, "server_error", "engine_error"),
])
def test_each_engine_error_type_maps_to_its_status_whatever_its_message(error, status, kind, code):
    api = engine_error_to_api(error)
    assert (api.status, api.type, api.code) == (status, kind, code)
    assert api.body()["error"]["message"].endswith(": p")
    assert grpc_status(status) == {400: grpc.StatusCode.INVALID_ARGUMENT, 413: grpc.StatusCode.INVALID_ARGUMENT,
                                   500: grpc.StatusCode.INTERNAL, 503: grpc.StatusCode.UNAVAILABLE}[status]


def test_ingress_modules_import_without_torch():
    mods = ("chunkserve.router.ingress", "chunkserve.router.http_app", "chunkserve.router.grpc_service",
            "chunkserve.router.engine_client", "chunkserve.router.app", "chunkserve.router.local_server")
    code = f"import sys\nfor m in {mods!r}: __import__(m)\nsys.exit(1 if 'torch' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code], timeout=300).returncode == 0


def test_the_serve_ingress_reads_its_tokenizer_and_model_shape_without_torch():
    code = ("import sys\nfrom chunkserve.router.app import _model_info\n"
            "tok, ctx, vocab = _model_info('random:tiny')\n"
            "assert ctx == 4096 and vocab == 49152 and len(tok.encode('hello world')) >= 2\n"
            "tok, ctx, vocab = _model_info(None)\nassert ctx == 8192 and vocab == 49152\n"
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code], timeout=600).returncode == 0


def test_a_prompt_the_kv_pool_cannot_hold_is_413_over_http_and_invalid_argument_over_grpc(server, stub):
    prompt = list(range(100, 300))  # 200 tokens: within the context, beyond the 128-token pool
    r = post(server, {"prompt": prompt, "max_tokens": 4})
    assert r.status_code == 413, r.text
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and "KV pool" in err["message"]
    r = post(server, {"prompt": prompt, "max_tokens": 4, "stream": True})
    assert r.status_code == 413 and r.json()["error"]["code"] == "context_length_exceeded"
    with pytest.raises(grpc.RpcError) as ei:
        list(stub.GenerateStream(pb.GenerateRequest(prompt_token_ids=prompt,
                                                    sampling=pb.SamplingParams(max_tokens=4)), timeout=60))
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "KV pool" in ei.value.details()


def test_a_streamed_answer_arrives_coalesced_with_the_same_text_and_usage(server, stub):
    body = {"prompt": [5, 6, 7, 8, 9, 10], "max_tokens": 40, "temperature": 0}
    full = post(server, body).json()
    r = post(server, {**body, "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200
    events = sse_events(r.text)
    texts = [e["choices"][0]["text"] for e in events if e["choices"]]
    n_tokens = full["usage"]["completion_tokens"]
    assert "".join(texts) == full["choices"][0]["text"]
    usage = dict(events[-1]["usage"])
    # the repeat of the prompt is served from the first request's cache, down to the token
    assert usage.pop("prompt_tokens_details")["cached_tokens"] == len(body["prompt"])
    assert usage == {k: v for k, v in full["usage"].items() if k != "prompt_tokens_details"}
    assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1] == \
        full["choices"][0]["finish_reason"]
    assert n_tokens >= 10 and len(texts) < n_tokens  # several tokens per event
    pieces = list(stub.GenerateStream(pb.GenerateRequest(prompt_token_ids=body["prompt"], sampling=pb.SamplingParams(
        max_tokens=40, temperature=0.0)), timeout=60))
    assert sum(len(p.token_ids) for p in pieces) == n_tokens and len(pieces) < n_tokens
    assert len(pieces[0].token_ids) == 1  # the first token alone
    assert "".join(p.text for p in pieces) == full["choices"][0]["text"]
    assert pieces[-1].usage.completion_tokens == n_tokens and pieces[-1].finish_reason


def test_a_failing_engine_step_is_a_500_server_error_and_the_engine_recovers(server, stub):
    core = server.ingress.engine.engine.core
    healthy = core.runner.run

    def broken(plan):
        raise RuntimeError("kernel exploded")

    core.runner.run = broken
    try:
        r = post(server, {"prompt": "hello", "max_tokens": 4})
        assert r.status_code == 500, r.text
        assert r.json()["error"]["type"] == "server_error" and "kernel exploded" in r.json()["error"]["message"]
        r = post(server, {"prompt": "hello", "max_tokens": 4, "stream": True})
        assert r.status_code == 500 and r.json()["error"]["code"] == "engine_error"
        with pytest.raises(grpc.RpcError) as ei:
            stub.Generate(pb.GenerateRequest(prompt="hello", sampling=pb.SamplingParams(max_tokens=4)), timeout=60)
        assert ei.value.code() == grpc.StatusCode.INTERNAL
    finally:
        core.runner.run = healthy
    assert post(server, {"prompt": "hello", "max_tokens": 4}).status_code == 200


def test_after_the_engine_is_gone_requests_get_503_and_unavailable(server, stub):
    server.call(server.ingress.engine.aclose())
    deadline = time.monotonic() + 10
    r = post(server, {"prompt": "hello", "max_tokens": 4})
    while r.status_code == 200 and time.monotonic() < deadline:  # a request already admitted may finish
        r = post(server, {"prompt": "hello", "max_tokens": 4})
    assert r.status_code == 503, r.text
    assert r.json()["error"]["code"] == "engine_unavailable"
    with pytest.raises(grpc.RpcError) as ei:
        list(stub.GenerateStream(pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(max_tokens=2)),
                                 timeout=60))
    assert ei.value.code() == grpc.StatusCode.UNAVAILABLE
