"""The frontend logic shared by HTTP (OpenAI API) and gRPC, independent of Ray.

authenticate -> rate-limit -> tokenize (+ chat template) -> hash chain with the tenant's salt
-> engine client -> stream back. ``Ingress`` holds it all; ``chunkserve.router.http_app.create_app``
builds the FastAPI app on it, and its ``Generate`` / ``GenerateStream`` methods are the gRPC service
(``grpc_context`` is Ray Serve's ``RayServegRPCContext`` or a ``grpc.aio.ServicerContext``).

Under Ray Serve one deployment (`router/app.py`'s ``ServeIngress``, under ``@serve.ingress()``: the app comes
from ``__serve_build_asgi_app__``) serves both proxies, the gRPC servicer registered with ``grpc_options``.
Without Ray, ``chunkserve.router.local_server.LocalServer`` serves it with uvicorn + ``grpc.aio``.
Never give the subclass an attribute named ``app`` or a ``__call__`` (Ray's ASGI wrapper owns them).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Sequence
from contextlib import aclosing
from typing import Any, cast

from chunkserve import env
from chunkserve.cluster.drain import DrainFlag
from chunkserve.cluster.hashing import hash_chain
from chunkserve.cluster.stats import ClusterStatsReader, snapshot_of
from chunkserve.router.cache_pins import cache_pin_spec
from chunkserve.router.engine_client import EngineClient, HandleEngineClient, engine_error_to_api
from chunkserve.router.failover import ResumedText, rebased, resume_request
from chunkserve.router.grpc_service import GrpcServiceMixin
from chunkserve.router.ingress_config import IngressConfig, Prepared
from chunkserve.router.openai_api import APIError, ChatCompletionRequest, CompletionRequest, template_chars
from chunkserve.router.prompt_tokens import ChatTokenCache
from chunkserve.router.ratelimit import Admission, AdmissionLease, RateLimited, RateLimiter, RefusalMemo
from chunkserve.router.server_metrics import ServerMetrics
from chunkserve.router.tenants import AuthError, Tenant, TenantRegistry
from chunkserve.workers.protocol import (
    EngineDeadError,
    EngineError,
    GenerateDelta,
    GenerateRequest,
    KVPoolTooSmallError,
    PromptTooLongError,
)
from chunkserve.workers.sampling import SamplingParams

logger = logging.getLogger(__name__)

_THREAD_TOKENIZE_CHARS = 4096  # longer texts are tokenised in a worker thread, off the event loop
REDIS_URL_ENV = env.REDIS_URL  # where a Serve ingress finds the workers' stats by default


def _rate_limited(e: RateLimited) -> APIError:
    return APIError(429, e.message, type="rate_limit_error", code="rate_limit_exceeded",
                    headers={"Retry-After": e.retry_after_header})


class Ingress(GrpcServiceMixin):
    """Authentication, admission, tokenisation, hashing and streaming for HTTP and gRPC."""

    def __init__(self, engine: EngineClient, tokenizer: Any, tenants: TenantRegistry, config: IngressConfig,
                 metrics: ServerMetrics | None = None, cluster_stats: ClusterStatsReader | None = None,
                 limiter: Admission | None = None) -> None:
        """``cluster_stats``: where ``/metrics`` reads the workers' stats; by default, behind Ray (a
        ``HandleEngineClient``) a reader of ``$CHUNKSERVE_REDIS_URL`` when set. An in-process engine
        reports its own stats. ``limiter``: the tenants' admission; by default this replica's own
        `RateLimiter` (pass a `ClusterRateLimiter` to share the limits between replicas)."""
        self.engine = engine
        self.tokenizer = tokenizer
        self.chat_tokens = ChatTokenCache(tokenizer)  # a shared system prompt is tokenised once
        self.tenants = tenants
        self.config = config
        self.limiter: Admission = limiter if limiter is not None else RateLimiter(tenants.tenants)
        self.refusals = RefusalMemo()  # tenants just refused: `admit` refuses them again without a Redis trip
        self.metrics = metrics if metrics is not None else ServerMetrics(config.model_name)
        self.created = int(time.time())
        self._vocab = config.vocab_size or len(tokenizer)
        self._app: Any = None
        self._inflight = 0  # streams running through this ingress
        self.draining = False  # set by drain(): new requests get 503 + Retry-After
        self.drain_flag: DrainFlag | None = None  # the cluster's drain flag (`chunkserve up`'s Ctrl-C), if any
        url = env.redis_url()
        if cluster_stats is None and isinstance(engine, HandleEngineClient) and url:
            cluster_stats = ClusterStatsReader(url)
        self.cluster_stats = cluster_stats

    # ---- Ray Serve hook ------------------------------------------------------------------------------
    def __serve_build_asgi_app__(self) -> Any:
        """The FastAPI app (Ray Serve calls this after ``__init__`` under ``@serve.ingress()``)."""
        if self._app is None:
            from chunkserve.router.http_app import create_app

            self._app = create_app(self)
        return self._app

    # ---- checks --------------------------------------------------------------------------------------
    def authenticate(self, authorization: str | None) -> Tenant:
        try:
            return self.tenants.authenticate_header(authorization)
        except AuthError as e:
            raise APIError(401, str(e), type="authentication_error", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"}) from None

    def authenticate_metadata(self, metadata: Sequence[tuple[str, Any]]) -> Tenant:
        try:
            return self.tenants.authenticate_metadata(metadata)
        except AuthError as e:
            raise APIError(401, str(e), type="authentication_error", code="invalid_api_key") from None

    def check_model(self, model: str) -> str:
        if model != self.config.model_name:
            raise APIError(404, f"The model `{model}` does not exist; this server serves "
                                f"`{self.config.model_name}`", param="model", code="model_not_found")
        return model

    def _encode_text(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text))

    def _encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        return self.chat_tokens.encode_chat(messages)

    async def tokenize(self, req: CompletionRequest | ChatCompletionRequest) -> list[int]:
        """Prompt token ids (chat requests go through the tokenizer's chat template)."""
        fn: Callable[[Any], list[int]]
        arg: Any
        try:
            if isinstance(req, ChatCompletionRequest):
                msgs = req.template_messages()
                size = template_chars(msgs)
                fn, arg = self._encode_chat, msgs
            elif isinstance(req.prompt, str):
                size, fn, arg = len(req.prompt), self._encode_text, req.prompt
            else:
                ids = cast(list[int], list(req.prompt))  # validated as token ids by the request schema
                bad = [t for t in ids if t >= self._vocab]
                if bad:
                    raise APIError(400, f"prompt token id {bad[0]} is out of range for a vocabulary of "
                                        f"{self._vocab}", param="prompt", code="invalid_value")
                return ids
            if size > _THREAD_TOKENIZE_CHARS:
                return await asyncio.to_thread(fn, arg)
            return fn(arg)
        except APIError:
            raise
        except Exception as e:  # e.g. a chat template that rejects the roles given
            raise APIError(400, f"could not tokenize the input: {e}", param=None, code="invalid_value") from None

    def _sampling(self, req: CompletionRequest | ChatCompletionRequest, n_prompt: int) -> SamplingParams:
        ctx = self.config.max_model_len
        if n_prompt >= ctx:
            raise APIError(413, f"the prompt has {n_prompt} tokens; this model's context is {ctx} tokens, "
                                f"so at most {ctx - 1} prompt tokens fit", param="messages"
                           if isinstance(req, ChatCompletionRequest) else "prompt",
                           code="context_length_exceeded")
        requested = req.requested_max_tokens()
        room = ctx - n_prompt
        param = "max_completion_tokens" if getattr(req, "max_completion_tokens", None) else "max_tokens"
        if requested is None:
            max_tokens = min(self.config.default_max_tokens, room)
        elif requested > ctx:
            raise APIError(400, f"{param}={requested} is above this model's context of {ctx} tokens",
                           param=param, code="invalid_value")
        elif requested > room:
            raise APIError(400, f"this model's context is {ctx} tokens; the prompt has {n_prompt} tokens and "
                                f"{param}={requested}, so at most {room} can be generated",
                           param=param, code="context_length_exceeded")
        else:
            max_tokens = requested
        top_k = req.top_k if req.top_k and req.top_k > 0 else 0
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0 if req.temperature is None else float(req.temperature),
                top_p=1.0 if req.top_p is None else float(req.top_p),
                top_k=top_k, seed=req.seed, stop=req.stop_list(), ignore_eos=bool(req.ignore_eos))
        except ValueError as e:
            raise APIError(400, str(e), code="invalid_value") from None

    async def admit(self, tenant: Tenant) -> AdmissionLease:
        """Admission before the body is read: every request counts, a malformed one too; a tenant over its
        limits costs no parsing, nor (just refused: `RefusalMemo`) a Redis trip. 429, or 503 when draining."""
        if self.draining or (self.drain_flag is not None and await self.drain_flag.is_set()):
            raise self.unavailable("this server is shutting down; retry on another replica")
        try:
            self.refusals.check(tenant.id)
            return self.refusals.watch(tenant.id, await self.limiter.admit(tenant.id))
        except RateLimited as e:
            self.refusals.note(tenant.id, e)
            raise _rate_limited(e) from None

    async def prepare(self, tenant: Tenant, req: CompletionRequest | ChatCompletionRequest,
                      request_id: str, received: float | None = None,
                      lease: AdmissionLease | None = None) -> Prepared:
        """Every check before the engine runs; raises APIError (4xx). Holds a lease on success (``lease``: from
        `admit`, released on failure). ``received`` (wall clock, default now): when the frontend got it; workers
        queue by it, so a request held up here (a busy replica reading its body) keeps its place."""
        t0 = time.monotonic()
        if lease is None:
            lease = await self.admit(tenant)
        try:
            self.check_model(req.model)
            ids = await self.tokenize(req)
            sampling = self._sampling(req, len(ids))
            await lease.charge(len(ids) + sampling.max_tokens)
            hashes = hash_chain(ids, self.config.chunk_size, tenant.cache_salt, self.config.max_hashed_chunks)
            pin = await cache_pin_spec(tenant, req, ids, self.chat_tokens.encode_prefix)
        except RateLimited as e:
            raise _rate_limited(e) from None
        except BaseException:
            await lease.finish()
            raise
        greq = GenerateRequest(request_id=request_id, prompt_token_ids=tuple(ids), sampling=sampling,
                               cache_salt=tenant.cache_salt, tenant=tenant.id, weight=tenant.weight,
                               cache_pin=pin, arrival_time=time.time() if received is None else received)
        return Prepared(tenant=tenant, lease=lease, request=greq, chunk_hashes=hashes, model=req.model,
                        created=int(time.time()), t0=t0, include_usage=req.include_usage)

    # ---- running ---------------------------------------------------------------------------------------
    def unavailable(self, message: str, code: str = "engine_unavailable") -> APIError:
        """503 with Retry-After: no worker can take the request now (or this ingress is draining)."""
        return APIError(503, message, type="server_error", code=code,
                        headers={"Retry-After": str(self.config.retry_after_s)})

    async def stream(self, prep: Prepared) -> AsyncGenerator[GenerateDelta, None]:
        """The engine's deltas for a prepared request. Closing this iterator early aborts the request;
        the lease is released and the metrics recorded whatever happens (finished_reason "stop",
        "length", "abort" or "error"). Engine errors become APIError.

        Failover: when the worker dies (`EngineDeadError`) the request goes to another worker, before its
        first token as it was, mid-stream as `resume_request` (prompt + the tokens already yielded), at most
        ``config.max_failovers`` times; the caller sees one unbroken stream, or a 503 with Retry-After."""
        tenant = prep.tenant.id
        n_prompt = len(prep.request.prompt_token_ids)
        self.metrics.request_waiting(tenant)
        started, reason, t_first = False, "abort", prep.t0
        sent: list[int] = []  # tokens yielded so far (over all attempts)
        texts: list[str] = []  # and their text
        n_cached, attempt = 0, 0
        self._inflight += 1
        try:
            while True:
                req = prep.request if attempt == 0 else resume_request(prep.request, sent, attempt)
                base = len(sent)
                # mid-stream, the resumed deltas are counted as the original request's; before the first token the
                # new attempt is the request itself, with its own cached tokens and first-token time
                resumed = ResumedText(self.tokenizer, req.sampling.stop, "".join(texts), sent) if sent else None
                called = time.time()
                try:
                    async with aclosing(self.engine.generate(req, prep.chunk_hashes)) as agen:
                        async for d in agen:
                            if resumed is not None:
                                text, stopped = resumed.add(d.token_ids, d.finish_reason is not None)
                                d = rebased(d, n_prompt, base, n_cached, text, "stop" if stopped else d.finish_reason)
                            texts.append(d.text)
                            if not started and (d.token_ids or d.finish_reason is not None):
                                started, t_first = True, time.monotonic()
                                n_cached = d.num_cached_tokens
                                self.metrics.first_token(tenant, t_first - prep.t0, n_prompt, n_cached)
                                if d.timeline is not None and req.arrival_time is not None:
                                    self.metrics.first_token_legs(d.timeline.legs(req.arrival_time, called,
                                                                                  time.time()))
                            sent.extend(d.token_ids)
                            if d.finish_reason is not None:
                                reason = d.finish_reason
                            yield d
                            if d.finish_reason is not None:
                                return
                    return  # the engine ended the stream without a finish reason (the caller reports it)
                except EngineDeadError as e:
                    if attempt >= self.config.max_failovers:
                        raise self.unavailable(f"no worker could finish the request after {attempt} "
                                               f"failover(s): {e}") from None
                    attempt += 1
                    phase = "mid_stream" if sent else "before_first_token"
                    self.metrics.failover(tenant, phase)
                    logger.warning("request %s: worker lost (%s), failover %d %s after %d tokens",
                                   prep.request.request_id, e, attempt, phase, len(sent))
                    await asyncio.sleep(self.config.failover_backoff_s * attempt)
                except (PromptTooLongError, KVPoolTooSmallError) as e:
                    if resumed is None:
                        raise engine_error_to_api(e) from None
                    # mid-stream, the survivor cannot hold prompt + output: the output ends here, as it would
                    # have on a worker whose context or pool ran out
                    text, stopped = resumed.add([], True)
                    reason = "stop" if stopped else "length"
                    yield GenerateDelta(prep.request.request_id, [], text, n_prompt, n_cached, len(sent), reason)
                    return
                except EngineError as e:
                    raise engine_error_to_api(e) from None
        except Exception:
            reason = "error"  # the engine rejected or failed it (client disconnects stay "abort")
            raise
        finally:
            self._inflight -= 1
            await prep.lease.finish(n_prompt + len(sent))  # also a release for `refusals` (`RefusalMemo.watch`)
            now = time.monotonic()
            self.metrics.request_done(tenant, started, now - prep.t0, now - t_first, len(sent), reason)

    async def collect(self, prep: Prepared) -> tuple[str, list[int], GenerateDelta]:
        """Runs a prepared request to the end: (text, token ids, last delta)."""
        texts: list[str] = []
        tokens: list[int] = []
        last: GenerateDelta | None = None
        async with aclosing(self.stream(prep)) as s:
            async for d in s:
                texts.append(d.text)
                tokens.extend(d.token_ids)
                last = d
        if last is None or last.finish_reason is None or last.finish_reason == "abort":
            raise self.unavailable("the engine ended the request before it finished", code="engine_aborted")
        return "".join(texts), tokens, last

    async def engine_stats(self) -> dict | None:
        """The engine's stats when the engine client offers them (and the KV-usage gauge refreshed)."""
        fn = getattr(self.engine, "stats", None)
        if fn is None:
            return None
        try:
            stats = fn()
            if asyncio.iscoroutine(stats):
                stats = await stats
        except Exception:  # metrics must never fail a scrape
            logger.exception("engine stats failed")
            return None
        used, total = stats.get("kv_chunks_used"), stats.get("kv_chunks_total")
        if "kv_cache_usage_perc" in stats:
            self.metrics.set_kv_usage(float(stats["kv_cache_usage_perc"]))
        elif used is not None and total:
            self.metrics.set_kv_usage(float(used) / float(total))
        return stats

    async def refresh_metrics(self) -> None:
        """Bring the cluster view of the metrics up to date before a render: the workers' snapshots from
        Redis (cached ~1 s, bounded wait; shown as down when Redis does not answer), or the in-process
        engine's stats as worker "local". Never raises."""
        if self.cluster_stats is not None:
            try:
                snaps = await self.cluster_stats.snapshots()
            except Exception:  # metrics must never fail a scrape
                logger.exception("cluster stats failed")
                snaps = None
            self.metrics.set_cluster(snaps)
            return
        stats = await self.engine_stats()
        if stats is not None:
            self.metrics.set_cluster([snapshot_of(stats, "local")])

    @property
    def inflight(self) -> int:
        return self._inflight

    async def drain(self, grace_s: float) -> int:
        """Stop taking new requests and wait up to ``grace_s`` for the running ones. -> those still running."""
        self.draining = True
        deadline = time.monotonic() + grace_s
        while self._inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return self._inflight

    @staticmethod
    def new_request_id(prefix: str) -> str:
        return f"{prefix}-{uuid.uuid4().hex}"

