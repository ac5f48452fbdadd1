"""Failover in the ingress: a request whose worker dies is resent, before its first token as it was and
mid-stream as prompt + the tokens already sent, so the client sees one unbroken stream; bounded retries end
in a clean 503 with Retry-After (HTTP JSON, an SSE error event then [DONE], gRPC UNAVAILABLE).

The engines are real (``random:tiny`` AsyncEngines, in-process); a worker "dies" by its engine being shut
down mid-stream, which is what the ingress sees as `EngineDeadError` when a Ray replica dies."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator, Iterator
from contextlib import aclosing
from typing import Any

import grpc
import httpx2
import pytest
import torch

from chunkserve.router.engine_client import EngineClient, LocalEngineClient, classify_remote_error
from chunkserve.router.failover import ResumedText, resume_request
from chunkserve.router.ingress import Ingress, IngressConfig
from chunkserve.router.local_server import LocalServer
from chunkserve.router.openai_api import APIError, CompletionRequest
from chunkserve.router.tenants import load_tenants
from chunkserve.v1 import generate_pb2 as pb
from chunkserve.v1 import generate_pb2_grpc as pb_grpc
from chunkserve.workers.async_engine import AsyncEngine
from chunkserve.workers.engine import EngineConfig
from chunkserve.workers.protocol import EngineDeadError, GenerateDelta, GenerateRequest, InvalidRequestError
from chunkserve.workers.sampler import Sampler
from chunkserve.workers.sampling import SamplingParams
from chunkserve.workers.streaming import StreamBatching

MODEL = "tiny-failover"
# fp32: a resumed request is recomputed by prefill, whose sums run in another order than decode's; a seeded
# sample at temperature 1 over a random model's near-flat logits follows that exactly only in fp32
# (bf16 rounds more, and the bf16 phase 1 rounds probabilities to bf16 before P@V)
ECFG = EngineConfig(model="random:tiny", chunk_size=16, num_kv_chunks=64, max_model_len=256, num_threads=1,
                    dtype="float32")
PROMPT = [5, 17, 99, 3, 250, 41, 7, 8, 120, 33, 64, 2, 71, 90, 11, 13, 17, 19]


class DyingClient:
    """Engine clients in turn: the i-th call goes to engine ``i % n``; an engine listed in ``kill_after`` is
    shut down once it has yielded that many deltas (a worker replica killed mid-stream)."""

    def __init__(self, engines: list[AsyncEngine], kill_after: dict[int, int]) -> None:
        self.engines = engines
        self.kill_after = dict(kill_after)
        self.calls: list[GenerateRequest] = []

    async def generate(self, request: GenerateRequest, chunk_hashes: list[int]) -> AsyncIterator[GenerateDelta]:
        i = len(self.calls) % len(self.engines)
        self.calls.append(request)
        engine = self.engines[i]
        n = 0
        async with aclosing(LocalEngineClient(engine, StreamBatching(interval_s=0.0)).generate(
                request, chunk_hashes)) as agen:
            async for d in agen:
                yield d
                n += 1
                if self.kill_after.get(i) == n:
                    await asyncio.to_thread(engine.shutdown)


def _ingress(client: EngineClient, engine: AsyncEngine, **cfg: Any) -> Ingress:
    core = engine.core
    icfg = IngressConfig(MODEL, max_model_len=256, chunk_size=16, vocab_size=core.model_config.vocab_size,
                         failover_backoff_s=0.0, **cfg)
    return Ingress(client, engine.tokenizer, load_tenants(None), icfg)


async def _run(ingress: Ingress, max_tokens: int, **sampling: Any) -> tuple[list[int], GenerateDelta, str]:
    req = CompletionRequest(model=MODEL, prompt=PROMPT, max_tokens=max_tokens, **sampling)
    prep = await ingress.prepare(ingress.tenants.authenticate_key(None), req, "cmpl-t")
    tokens: list[int] = []
    texts: list[str] = []
    last = None
    async with aclosing(ingress.stream(prep)) as s:
        async for d in s:
            tokens.extend(d.token_ids)
            texts.append(d.text)
            last = d
    assert last is not None
    return tokens, last, "".join(texts)


@pytest.fixture(scope="module")
def reference() -> Iterator[AsyncEngine]:
    """An engine that never dies: the undisturbed outputs."""
    eng = AsyncEngine(ECFG)
    yield eng
    eng.shutdown()


def _failovers(ingress: Ingress, phase: str) -> float:
    return ingress.metrics.failovers.labels(model_name=MODEL, tenant="public", phase=phase)._value.get()


@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 1.0, "seed": 1234}],
                         ids=["greedy", "seeded"])
def test_a_stream_whose_worker_dies_mid_stream_resumes_with_the_same_tokens(reference, sampling):
    async def main() -> None:
        # 160 tokens: the engine thread of the dying worker must not finish the stream before the kill lands
        # (with 24, a reader that fell behind on a loaded machine could let it run to the end)
        n = 160
        want, want_last, want_text = await _run(_ingress(LocalEngineClient(reference), reference), n, **sampling)
        assert len(want) > 24
        dying = AsyncEngine(ECFG)
        survivor = AsyncEngine(ECFG)
        client = DyingClient([dying, survivor], kill_after={0: 7})
        ing = _ingress(client, survivor)
        got, last, text = await _run(ing, n, **sampling)
        survivor.shutdown()
        assert got == want and text == want_text  # one unbroken stream, token for token the undisturbed one
        k = client.calls[1].sampling.seed_offset  # tokens sent before the kill (>= 7: some may be in flight)
        assert len(client.calls) == 2 and 7 <= k < len(want)
        assert client.calls[1].prompt_token_ids == tuple(PROMPT) + tuple(want[:k])
        assert client.calls[1].sampling.max_tokens == n - k
        assert last.finish_reason == want_last.finish_reason and last.num_output_tokens == len(want)
        assert last.num_prompt_tokens == len(PROMPT)
        assert _failovers(ing, "mid_stream") == 1.0

    asyncio.run(main())


def test_a_request_whose_worker_dies_before_the_first_token_is_resent_unchanged(reference):
    async def main() -> None:
        want, _, _ = await _run(_ingress(LocalEngineClient(reference), reference), 8, temperature=0.0)
        dead = AsyncEngine(ECFG)
        dead.shutdown()  # the first worker is gone before the request reaches it
        survivor = AsyncEngine(ECFG)
        await _run(_ingress(LocalEngineClient(survivor), survivor), 1, temperature=0.0)  # the prompt is cached there
        client = DyingClient([dead, survivor], kill_after={})
        ing = _ingress(client, survivor)
        got, last, _ = await _run(ing, 8, temperature=0.0)
        survivor.shutdown()
        assert got == want
        assert last.num_cached_tokens > 0  # the survivor's reuse is what the usage reports (it read 0)
        assert client.calls[1].prompt_token_ids == tuple(PROMPT) and client.calls[1].sampling.seed_offset == 0
        assert _failovers(ing, "before_first_token") == 1.0

    asyncio.run(main())


def test_a_stream_resumed_on_a_worker_too_small_for_its_context_ends_with_length(reference):
    """Mid-stream, the survivor's pool (32 tokens) cannot hold the prompt and the tokens already sent: the
    client keeps what it got and the stream ends with finish reason "length", not a 413 after its tokens."""
    async def main() -> None:
        n = 160
        want, _, want_text = await _run(_ingress(LocalEngineClient(reference), reference), n, temperature=0.0)
        dying = AsyncEngine(ECFG)
        small = AsyncEngine(dataclasses.replace(ECFG, num_kv_chunks=2, max_model_len=32))
        client = DyingClient([dying, small], kill_after={0: 20})
        got, last, text = await _run(_ingress(client, small), n, temperature=0.0)
        small.shutdown()
        k = client.calls[1].sampling.seed_offset
        assert len(client.calls) == 2 and k >= 20
        assert got == want[:k] and want_text.startswith(text) and text
        assert last.finish_reason == "length" and last.num_output_tokens == k
        assert last.num_prompt_tokens == len(PROMPT)

    asyncio.run(main())


def test_failovers_are_bounded_then_the_request_gets_503_with_retry_after(reference):
    async def main() -> None:
        dead = AsyncEngine(ECFG)
        dead.shutdown()
        client = DyingClient([dead], kill_after={})
        ing = _ingress(client, reference, max_failovers=2)
        with pytest.raises(APIError) as ei:
            await _run(ing, 8, temperature=0.0)
        assert ei.value.status == 503 and ei.value.headers.get("Retry-After") == "2"
        assert ei.value.code == "engine_unavailable"
        assert len(client.calls) == 3  # the first try and two failovers, no more

    asyncio.run(main())


def test_a_seeded_sampler_with_a_seed_offset_continues_the_seeded_sequence():
    logits = torch.randn(1, 300, generator=torch.Generator().manual_seed(0))  # [1, V]
    p = SamplingParams(temperature=1.0, seed=99)
    full = Sampler()
    seq = [full.sample(logits, ["a"], [p])[0][0] for _ in range(8)]
    resumed = Sampler()
    p3 = SamplingParams(temperature=1.0, seed=99, seed_offset=3)
    tail = [resumed.sample(logits, ["a-f1"], [p3])[0][0] for _ in range(5)]
    assert tail == seq[3:] and len(set(seq)) > 1  # a real random sequence, continued exactly


class ByteTokenizer:
    """Token id = one UTF-8 byte (a character may be split across tokens, as with byte-level BPE)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


def test_resumed_text_completes_a_character_split_across_the_failover():
    t = ResumedText(ByteTokenizer(), (), emitted="ab", output_ids=[97, 98, 0xC3])  # first worker held 0xC3 back
    assert t.add([0xA9], final=False) == ("\u00e9", False)
    assert t.add([0xE2, 0x82], final=False) == ("", False)  # incomplete: held back
    assert t.add([0xAC], final=True) == ("\u20ac", False) and t.emitted == "ab\u00e9\u20ac"


def test_resumed_text_finds_a_stop_string_spanning_the_failover():
    t = ResumedText(ByteTokenizer(), ("XY",), emitted="a", output_ids=[97, 88])  # "X" held back: may start "XY"
    assert t.add([89, 100], final=False) == ("", True) and t.emitted == "a"


def test_resume_request_keeps_the_budget_and_advances_the_seed():
    req = GenerateRequest("r", (1, 2, 3), SamplingParams(max_tokens=10, seed=5, temperature=0.7))
    r = resume_request(req, [7, 8, 9, 10], 2)
    assert r.prompt_token_ids == (1, 2, 3, 7, 8, 9, 10) and r.request_id == "r-f2"
    assert r.sampling.max_tokens == 6 and r.sampling.seed_offset == 4 and r.sampling.seed == 5


def test_ray_failures_are_classified_worker_gone_or_worker_error():
    from ray.exceptions import ActorDiedError, RayTaskError
    from ray.serve.exceptions import DeploymentUnavailableError

    assert isinstance(classify_remote_error(ActorDiedError()), EngineDeadError)
    assert isinstance(classify_remote_error(DeploymentUnavailableError("Worker")), EngineDeadError)
    wrapped = RayTaskError("generate", "tb", ActorDiedError())
    assert isinstance(classify_remote_error(wrapped), EngineDeadError)  # RayTaskError(ActorDiedError)
    own = RayTaskError("generate", "tb", InvalidRequestError("empty prompt"))
    got = classify_remote_error(own)
    assert type(got) is InvalidRequestError and str(got) == "empty prompt"
    bug = classify_remote_error(RayTaskError("generate", "tb", KeyError("x")))
    assert type(bug).__name__ == "EngineStepError" and "KeyError" in str(bug)
    plain = ValueError("not Ray's")
    assert classify_remote_error(plain) is plain


# ---- through HTTP and gRPC -------------------------------------------------------------------------------
class AlwaysDead:
    """Every worker is gone: each call fails after ``tokens`` tokens (0: before the first)."""

    def __init__(self, engine: AsyncEngine, tokens: int) -> None:
        self.engine, self.tokens = engine, tokens

    async def generate(self, request: GenerateRequest, chunk_hashes: list[int]) -> AsyncIterator[GenerateDelta]:
        n = 0
        async for d in LocalEngineClient(self.engine, StreamBatching(interval_s=0.0)).generate(request, chunk_hashes):
            if n >= self.tokens:
                raise EngineDeadError("the worker is unavailable (ActorDiedError)")
            n += 1
            yield d
        raise EngineDeadError("the worker is unavailable (ActorDiedError)")


@pytest.fixture(scope="module")
def dead_server(reference) -> Iterator[LocalServer]:
    """mid-stream loss on every worker: SSE gets its tokens, then an error event and [DONE]."""
    def build() -> Ingress:
        return _ingress(AlwaysDead(AsyncEngine(ECFG), tokens=2), reference, max_failovers=1)

    with LocalServer(build) as srv:
        yield srv


def test_sse_stream_that_no_worker_can_finish_ends_with_an_error_event_then_done(dead_server):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 30, "temperature": 0.0, "stream": True}
    r = httpx2.post(dead_server.http_url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200
    data = [ln[len("data: "):] for ln in r.text.split("\n\n") if ln.startswith("data: ")]
    assert data[-1] == "[DONE]"
    err = json.loads(data[-2])["error"]
    assert err["code"] == "engine_unavailable" and err["type"] == "server_error"
    assert sum(1 for d in data[:-2] if json.loads(d)["choices"][0]["text"]) >= 1  # tokens came before it


def test_non_streaming_and_grpc_requests_no_worker_can_finish_get_503_and_unavailable(dead_server):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 30, "temperature": 0.0}
    r = httpx2.post(dead_server.http_url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 503 and r.headers["retry-after"] == "2"
    assert r.json()["error"]["code"] == "engine_unavailable"
    with grpc.insecure_channel(dead_server.grpc_target) as ch:
        stub = pb_grpc.ChunkServeStub(ch)
        req = pb.GenerateRequest(prompt_token_ids=PROMPT, sampling=pb.SamplingParams(max_tokens=30))
        with pytest.raises(grpc.RpcError) as ei:
            list(stub.GenerateStream(req, timeout=60))
        assert ei.value.code() == grpc.StatusCode.UNAVAILABLE
        assert dict(ei.value.trailing_metadata()).get("retry-after") == "2"


def test_readiness_waits_for_every_initial_worker_then_holds_while_one_runs() -> None:
    """``GET /ready`` of a Ray-backed ingress: a deployment still starting (1 of 2 replicas up) is not ready,
    one fully up is, and a later update or scale-down keeps it ready while a replica runs."""
    from types import SimpleNamespace

    from chunkserve.router.engine_client import HandleEngineClient

    states: list[tuple[str, int]] = [("UPDATING", 1), ("HEALTHY", 2), ("UPDATING", 1), ("UNHEALTHY", 0)]

    def status() -> Any:
        st, running = states[0]
        dep = SimpleNamespace(status=st, replica_states={"RUNNING": running} if running else {})
        return SimpleNamespace(applications={"app": SimpleNamespace(deployments={"Worker": dep})})

    handle = SimpleNamespace(app_name="app", deployment_name="Worker", options=lambda **_: None)
    client = HandleEngineClient(handle, status=status, ready_cache_s=0.0)
    seen = []
    for _ in range(len(states)):
        seen.append(asyncio.run(client.readiness())["ready"])
        states.pop(0)
    assert seen == [False, True, True, False]

    def broken() -> Any:
        raise ConnectionError("controller gone")

    down = asyncio.run(HandleEngineClient(handle, status=broken).readiness())
    assert down["ready"] is False and "controller gone" in down["error"]
