"""The chunkserve.v1 gRPC service end to end: a real grpc.aio server on a loopback port serving the ingress
methods, backed by the real in-process engine (a tiny random-weight Llama)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import aclosing

import grpc
import pytest

from chunkserve.router.grpc_service import to_openai_request
from chunkserve.router.local_server import LocalServer, local_ingress
from chunkserve.router.tenants import TenantRegistry, hash_api_key, parse_tenants
from chunkserve.v1 import generate_pb2 as pb
from chunkserve.v1 import generate_pb2_grpc as pb_grpc
from chunkserve.workers.engine import EngineConfig
from chunkserve.workers.protocol import GenerateDelta

MODEL = "tiny-grpc"
CTX = 512
CHUNK = 16
SYSTEM = "You are a terse assistant for the billing department; answer with a single sentence. " * 4


def _tenants() -> TenantRegistry:
    def t(tid: str, **kw):
        return {"id": tid, "api_key_sha256": [hash_api_key(f"key-{tid}")], **kw}

    return TenantRegistry(parse_tenants({"tenants": [
        t("alpha"), t("beta"), t("limited", rate_limit={"requests_per_second": 0.05, "burst_requests": 1}),
    ]}))


@pytest.fixture(scope="module")
def server() -> Iterator[LocalServer]:
    cfg = EngineConfig(model="random:tiny", chunk_size=CHUNK, num_kv_chunks=512, max_model_len=CTX,
                       max_num_seqs=16)
    with LocalServer(lambda: local_ingress(cfg, _tenants(), model_name=MODEL, default_max_tokens=8)) as srv:
        yield srv


@pytest.fixture(scope="module")
def stub(server) -> Iterator[pb_grpc.ChunkServeStub]:
    with grpc.insecure_channel(server.grpc_target) as ch:
        yield pb_grpc.ChunkServeStub(ch)


def md(tenant: str = "alpha") -> list[tuple[str, str]]:
    return [("authorization", f"Bearer key-{tenant}")]


def req(**kw) -> pb.GenerateRequest:
    sampling = pb.SamplingParams(**kw.pop("sampling", {"max_tokens": 5, "temperature": 0.0}))
    return pb.GenerateRequest(sampling=sampling, **kw)


def chat_msgs(user: str) -> list[pb.ChatMessage]:
    return [pb.ChatMessage(role="system", content=SYSTEM), pb.ChatMessage(role="user", content=user)]


def test_unary_generate_returns_text_tokens_and_usage(stub):
    r = stub.Generate(req(model=MODEL, prompt="The weather today is"), metadata=md(), timeout=60)
    assert r.model == MODEL and r.request_id and r.finish_reason in ("stop", "length")
    assert 1 <= len(r.token_ids) <= 5 and r.usage.completion_tokens == len(r.token_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    r2 = stub.Generate(req(prompt_token_ids=[5, 6, 7, 8], request_id="mine"), metadata=md(), timeout=60)
    assert r2.request_id == "mine" and r2.usage.prompt_tokens == 4 and r2.model == MODEL


def test_ignore_eos_reaches_the_engines_sampling_params_only_when_set(server):
    for sampling, want in (({"max_tokens": 5, "ignore_eos": True}, True), ({"max_tokens": 5}, False),
                           ({"max_tokens": 5, "ignore_eos": False}, False)):
        api = to_openai_request(server.ingress, req(prompt="x", sampling=sampling), stream=False)
        assert server.ingress._sampling(api, n_prompt=3).ignore_eos is want, sampling


def test_stream_concatenates_to_the_unary_result_and_ends_with_usage(stub):
    stub.Generate(req(model=MODEL, messages=chat_msgs("stream please")), metadata=md(), timeout=60)  # warm-up
    unary = stub.Generate(req(model=MODEL, messages=chat_msgs("stream please")), metadata=md(), timeout=60)
    pieces = list(stub.GenerateStream(req(model=MODEL, messages=chat_msgs("stream please")), metadata=md(),
                                      timeout=60))
    assert "".join(p.text for p in pieces) == unary.text
    assert [t for p in pieces for t in p.token_ids] == list(unary.token_ids)
    assert pieces[-1].finish_reason == unary.finish_reason and not any(p.finish_reason for p in pieces[:-1])
    assert pieces[-1].usage.completion_tokens == len(unary.token_ids)
    assert pieces[-1].usage.cached_tokens >= CHUNK  # the unary call cached the prefix


def test_cached_tokens_stay_within_the_tenant(stub):
    msgs = chat_msgs("isolation check over grpc")
    a1 = stub.Generate(req(messages=msgs), metadata=md("alpha"), timeout=60)
    a2 = stub.Generate(req(messages=msgs), metadata=md("alpha"), timeout=60)
    b1 = stub.Generate(req(messages=msgs), metadata=md("beta"), timeout=60)
    assert a2.usage.cached_tokens >= 4 * CHUNK
    assert b1.usage.cached_tokens == 0 and a1.usage.prompt_tokens == b1.usage.prompt_tokens


def _code(call, *args, **kw) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as ei:
        out = call(*args, **kw)
        if not isinstance(out, pb.GenerateResponse):
            list(out)  # drain a stream
    return ei.value


@pytest.mark.parametrize("kind", ["unary", "stream"])
@pytest.mark.parametrize("request_kw,metadata,code,fragment", [
    ({}, md(), grpc.StatusCode.INVALID_ARGUMENT, "exactly one"),
    ({"prompt": "a", "prompt_token_ids": [1]}, md(), grpc.StatusCode.INVALID_ARGUMENT, "exactly one"),
    ({"prompt": "a", "sampling": {"max_tokens": 0}}, md(), grpc.StatusCode.INVALID_ARGUMENT, "max_tokens"),
    ({"prompt": "a", "sampling": {"temperature": 5.0}}, md(), grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
    ({"prompt": "a", "sampling": {"max_tokens": CTX + 10}}, md(), grpc.StatusCode.INVALID_ARGUMENT, "context"),
    ({"prompt": "word " * 700}, md(), grpc.StatusCode.INVALID_ARGUMENT, "prompt has"),
    ({"messages": [pb.ChatMessage(role="alien", content="x")]}, md(), grpc.StatusCode.INVALID_ARGUMENT,
     "messages"),
    ({"prompt_token_ids": [10**6]}, md(), grpc.StatusCode.INVALID_ARGUMENT, "out of range"),
    ({"prompt": "a", "model": "gpt-5"}, md(), grpc.StatusCode.NOT_FOUND, "gpt-5"),
    ({"prompt": "a"}, [], grpc.StatusCode.UNAUTHENTICATED, "missing API key"),
    ({"prompt": "a"}, md("nobody"), grpc.StatusCode.UNAUTHENTICATED, "invalid API key"),
])
def test_bad_requests_get_fitting_grpc_statuses_with_messages(stub, kind, request_kw, metadata, code, fragment):
    call = stub.Generate if kind == "unary" else stub.GenerateStream
    err = _code(call, req(**request_kw), metadata=metadata, timeout=60)
    assert err.code() == code
    assert fragment in err.details()


def test_rate_limited_tenant_gets_resource_exhausted_with_retry_after(stub):
    assert stub.Generate(req(prompt="first"), metadata=md("limited"), timeout=60).token_ids
    for call in (stub.Generate, stub.GenerateStream):
        err = _code(call, req(prompt="again"), metadata=md("limited"), timeout=60)
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "requests/s" in err.details()
        retry = dict(err.trailing_metadata() or ())
        assert int(retry["retry-after"]) >= 1


def test_cancelled_stream_aborts_the_request_and_frees_its_kv_chunks(server, stub):
    def stats() -> dict:
        return server.call(server.ingress.engine_stats())

    call = stub.GenerateStream(req(prompt="A long tale about the sea. " * 3,
                                   sampling={"max_tokens": 400, "temperature": 1.0, "seed": 5}),
                               metadata=md("beta"), timeout=60)
    it = iter(call)
    for _ in range(3):
        next(it)
    deadline = time.monotonic() + 5
    while stats()["kv_chunks_used"] == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert stats()["kv_chunks_used"] > 0
    call.cancel()
    deadline = time.monotonic() + 5
    while (stats()["num_sequences"] or stats()["kv_chunks_used"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    st = stats()
    assert st["num_sequences"] == 0 and st["kv_chunks_used"] == 0
    aborted = server.ingress.metrics.request_success.labels(model_name=MODEL, tenant="beta",
                                                            finished_reason="abort")._value.get()
    assert aborted == 1


@pytest.mark.parametrize("kind", ["unary", "stream"])
def test_an_unexpected_failure_before_the_first_message_is_internal_with_a_plain_message(server, stub, kind):
    ingress = server.ingress
    real = ingress.prepare

    async def broken(*args, **kwargs):  # type: ignore[no-untyped-def]  (a bug in admission, say)
        raise KeyError("secret_internal_name")

    ingress.prepare = broken
    try:
        call = stub.Generate if kind == "unary" else stub.GenerateStream
        err = _code(call, req(prompt="hello"), metadata=md(), timeout=60)
    finally:
        ingress.prepare = real
    assert err.code() == grpc.StatusCode.INTERNAL
    assert err.details() == "internal error" and "KeyError" not in err.details()


@pytest.mark.parametrize("kind", ["unary", "stream"])
@pytest.mark.parametrize("model", ["x" * 100_000, "é" * 5_000])
def test_grpc_very_long_model_name_is_not_found_with_a_bounded_message(stub, kind, model):
    # the details echo the model name; unbounded, they overflowed the client's metadata limit (16 KiB) and the
    # client saw RESOURCE_EXHAUSTED "received metadata size exceeds hard limit" instead of NOT_FOUND
    call = stub.Generate if kind == "unary" else stub.GenerateStream
    err = _code(call, req(prompt="a", model=model), metadata=md(), timeout=60)
    assert err.code() == grpc.StatusCode.NOT_FOUND, err.details()
    assert err.details().startswith("The model `") and len(err.details().encode()) <= 1100


@pytest.mark.parametrize("kind", ["unary", "stream"])
def test_grpc_request_id_longer_than_256_characters_is_invalid_argument(stub, kind):
    # the id comes back in every stream message: unbounded, a 4 MB id multiplied the reply by the token count
    call = stub.Generate if kind == "unary" else stub.GenerateStream
    err = _code(call, req(prompt="a", request_id="r" * 257), metadata=md(), timeout=60)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "request_id" in err.details()
    ok = stub.Generate(req(prompt="a", request_id="r" * 256), metadata=md(), timeout=60)
    assert ok.request_id == "r" * 256


def test_grpc_status_maps_http_403_to_permission_denied():
    from chunkserve.router.grpc_service import grpc_status

    assert grpc_status(403) == grpc.StatusCode.PERMISSION_DENIED


def test_a_grpc_stream_the_engine_aborts_ends_unavailable_without_a_finished_message(server, stub):
    # the engine's "abort" delta was sent as a last message with finish_reason "abort" before the status
    engine = server.ingress.engine
    real = engine.generate

    async def generate(req, *args):  # one token, then the engine's abort
        async with aclosing(real(req, *args)) as deltas:
            async for d in deltas:
                yield d
                break
        yield GenerateDelta(req.request_id, [], "", len(req.prompt_token_ids), 0, 1, "abort")

    engine.generate = generate
    errors = server.ingress.metrics.request_errors.labels(model_name=server.ingress.config.model_name, code="503")
    before = errors._value.get()
    got: list[pb.GenerateStreamResponse] = []
    try:
        with pytest.raises(grpc.RpcError) as ei:
            for m in stub.GenerateStream(req(prompt="a", sampling={"max_tokens": 20, "ignore_eos": True}),
                                         metadata=md(), timeout=60):
                got.append(m)
    finally:
        engine.generate = real
    assert ei.value.code() == grpc.StatusCode.UNAVAILABLE
    assert got and all(m.finish_reason == "" for m in got)
    assert errors._value.get() == before + 1  # counted in request_errors, as every other failed call
