"""EngineCore: the synchronous step loop that owns the model, the prefix KV cache and the scheduler.

    plan = scheduler.schedule()                 # admit, reuse cached prefixes, chunk prefills
    logits, reqs = runner.run(plan)             # one forward over the step's tokens
    tokens, lps = sampler.sample(logits, ...)   # next token per sampling row
    return self._process(reqs, tokens, lps)     # append, detokenise, stop, free finished

Only one thread may call it; `AsyncEngine` runs it in a background thread for async callers.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from chunkserve.workers.cache_control import PinSpec
from chunkserve.workers.chunk_pool import KVCacheFull
from chunkserve.workers.config import ModelConfig
from chunkserve.workers.engine_config import EngineConfig
from chunkserve.workers.kvcache import PrefixKVCache
from chunkserve.workers.output import Detokenizer, StepOutput
from chunkserve.workers.protocol import InvalidRequestError, KVPoolTooSmallError, PromptTooLongError
from chunkserve.workers.runner import ModelRunner
from chunkserve.workers.sampler import Sampler
from chunkserve.workers.sampling import SamplingParams, is_integer
from chunkserve.workers.scheduler import Request, Scheduler, SchedulerConfig
from chunkserve.workers.weights import LoadedModel, load_model

MAX_QUEUE_AGE_S = 60.0  # a request's frontend arrival stamp counts at most this far back


class EngineCore:
    """Step loop over continuous batches; see the module docstring."""

    def __init__(self, config: EngineConfig | None = None, loaded: LoadedModel | None = None) -> None:
        self.config = cfg = config or EngineConfig()
        if cfg.num_threads is not None and cfg.device == "cpu":
            torch.set_num_threads(cfg.num_threads)
        if loaded is None:
            loaded = load_model(cfg.model, dtype=cfg.dtype, device=cfg.device, seed=cfg.seed)
        self.model, self.tokenizer, self.model_config = loaded.model, loaded.tokenizer, loaded.config
        if cfg.quantization is not None and self.model.quantization != cfg.quantization:
            self.model.quantize(cfg.quantization)  # before prepack: only what stays dense is packed
        if cfg.prepack_weights:
            self.model.prepack()  # CPU fp32/bf16: oneDNN-blocked weights (a no-op otherwise)
        mc: ModelConfig = self.model_config
        dtype = self.model.dtype
        per_chunk = 2 * mc.num_layers * mc.num_kv_heads * cfg.chunk_size * mc.head_dim * dtype.itemsize
        num_chunks = cfg.num_kv_chunks if cfg.num_kv_chunks is not None else max(4, int(cfg.kv_cache_gb * 2**30) // per_chunk)
        self.cache = PrefixKVCache(mc.num_layers, mc.num_kv_heads, mc.head_dim, cfg.chunk_size, num_chunks,
                                   dtype, cfg.device, share_prefix=cfg.share_prefix)
        self.max_model_len = mc.max_model_len if cfg.max_model_len is None else min(cfg.max_model_len, mc.max_model_len)
        self.scheduler = Scheduler(self.cache, SchedulerConfig(cfg.max_num_batched_tokens, cfg.max_num_seqs,
                                                               fair_share=cfg.fair_share,
                                                               fair_quantum=cfg.fair_quantum,
                                                               max_pinned_fraction=cfg.max_pinned_fraction,
                                                               max_model_len=self.max_model_len))
        self.runner = ModelRunner(self.model, self.cache, cfg.attention_backend, cfg.prefill_backend)
        self.sampler = Sampler(cfg.seed)
        vocab = mc.vocab_size
        self.runner.sample_stager = lambda staging, reqs: self.sampler.stage(  # knobs ride the step's copy
            staging, [r.request_id for r in reqs], [r.params for r in reqs], vocab)
        self.eos_ids = set(mc.eos_token_ids)
        self._requests: dict[str, Request] = {}
        self.failed_requests: list[str] = []  # the requests the last step dropped when it failed
        self._detok: dict[str, Detokenizer] = {}
        self.num_steps = 0
        self.prompt_tokens_total = 0
        self.cached_tokens_total = 0
        self.warmup_stats: dict[str, float] = {}
        if cfg.warmup:
            from chunkserve.workers.warmup import warm_up

            self.warmup_stats = warm_up(self)

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    salt: bytes = b"", tenant: str = "public", weight: float = 1.0,
                    cache_pin: PinSpec | None = None, arrival_time: float | None = None) -> Request:
        """Queue a request; raises ValueError (for this request only) if it can never be served.
        ``arrival_time`` (wall clock) places it in the queue by when the frontend received it (a stamp in
        the future counts as now, one more than `MAX_QUEUE_AGE_S` old as that old)."""
        if request_id in self._requests:
            raise InvalidRequestError(f"duplicate request id {request_id!r}")
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"params must be a SamplingParams, got {type(params).__name__}")
        if not isinstance(salt, bytes):
            raise InvalidRequestError(f"salt must be bytes, got {type(salt).__name__}")
        if isinstance(prompt_token_ids, str | bytes):
            raise InvalidRequestError("prompt token ids must be integers")
        ids = list(prompt_token_ids)
        if not all(type(t) is int for t in ids):  # the ingress's plain ints skip the slower general check
            if not all(is_integer(t) for t in ids):
                raise InvalidRequestError("prompt token ids must be integers")
            ids = [int(t) for t in ids]
        if not ids:
            raise InvalidRequestError("the prompt is empty")
        vocab = self.model_config.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})")
        if len(ids) + 1 > self.max_model_len:
            raise PromptTooLongError(f"prompt of {len(ids)} tokens exceeds the context length {self.max_model_len}")
        self.scheduler.pins.expire()  # pins expire in steps too, but an idle engine does not step
        c = self.cache.chunk_size
        usable = self.cache.pool.num_chunks - self.cache.num_pinned_chunks
        if -(-(len(ids) + 1) // c) - self.cache.pinned_prefix_chunks(ids, salt) > usable:  # its pinned prefix is no cost
            raise KVPoolTooSmallError(f"prompt of {len(ids)} tokens does not fit the KV pool of "  # no pin counts:
                                      f"{self.cache.pool.num_chunks * c} tokens, part of which pinned prefixes hold")
        age = 0.0 if arrival_time is None else min(max(0.0, time.time() - arrival_time), MAX_QUEUE_AGE_S)
        req = Request(request_id, ids, params, salt, arrival=time.monotonic() - age, tenant=tenant, weight=weight,
                      pin=cache_pin)
        detok = Detokenizer(self.tokenizer, params)
        self.scheduler.add(req)  # last: it may refuse the pin (PinRefusedError) before anything is kept
        self._requests[request_id] = req
        self._detok[request_id] = detok
        return req

    def abort(self, request_id: str) -> bool:
        """Drop a request; its KV chunks are released at once. Returns whether it was known."""
        req, _ = self._forget(request_id)
        if req is None:
            return False
        self.scheduler.abort(request_id)
        return True

    def request(self, request_id: str) -> Request | None:
        """The live request of that id, or None (unknown, or already ended)."""
        return self._requests.get(request_id)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # ------------------------------------------------------------------ the step
    def step(self) -> list[StepOutput]:
        """One engine step. If it raises (planning, the forward or sampling), every request is dropped (their ids
        in ``failed_requests``) and the cache is emptied before the error propagates: the step had already put the
        chunks it was to write into the prefix tree, and a later request must not reuse K/V never written."""
        self.failed_requests = []
        ended: list[StepOutput] = []
        stepped: list[str] = []  # the step's requests: some may have ended in it before it failed
        try:
            self.cache.begin_step()
            try:
                plan = self.scheduler.schedule()
                ended = [self._ended(req) for req in plan.finished]
                if plan.empty:
                    return ended
                logits, reqs = self.runner.run(plan)
            finally:
                self.cache.end_step()
            self.num_steps += 1
            if not reqs:
                return ended
            stepped = [r.request_id for r in reqs]
            tokens, lps = self.sampler.sample(logits, [r.request_id for r in reqs], [r.params for r in reqs],
                                              self.runner.sample_job)
            return ended + self._process(reqs, tokens, lps)
        except BaseException:
            self._drop_everything([out.req.request_id for out in ended] + stepped)
            raise

    def _drop_everything(self, also: list[str]) -> None:
        """After a failed step: abort every request, release every pin, evict every chunk (events included)."""
        self.failed_requests = list(dict.fromkeys([*self._requests, *also]))
        for rid in list(self._requests):
            self.abort(rid)
        self.scheduler.pins.release_all()
        self.cache.clear()

    def _forget(self, request_id: str) -> tuple[Request | None, Detokenizer | None]:
        """Drops the engine's own records of a request (not the scheduler's); -> what they were."""
        self.sampler.forget(request_id)
        return self._requests.pop(request_id, None), self._detok.pop(request_id, None)

    def _ended(self, req: Request) -> StepOutput:
        """The last output of a request the scheduler ended (no new token; the text it held back)."""
        _, detok = self._forget(req.request_id)
        return StepOutput(req, [], detok.flush() if detok is not None else "", req.finish_reason,
                          [] if req.params.logprobs else None)

    def _process(self, reqs: list[Request], tokens: list[int], lps: list[float]) -> list[StepOutput]:
        outs: list[StepOutput] = []
        now = time.monotonic()
        for req, tok, lp in zip(reqs, tokens, lps, strict=True):
            if not req.output:
                req.first_token_time = now
                self.prompt_tokens_total += len(req.prompt)
                self.cached_tokens_total += req.num_cached or 0  # None: never admitted (cannot happen here)
            req.output.append(tok)
            req.logprobs.append(lp)
            p = req.params
            reason = None
            if (tok in self.eos_ids and not p.ignore_eos) or tok in p.stop_token_ids:
                reason = "stop"
            detok = self._detok[req.request_id]
            text, stopped = detok.add(tok, final=reason is not None)
            if stopped:
                reason = "stop"
            elif reason is None and (len(req.output) >= p.max_tokens
                                     or len(req.prompt) + len(req.output) >= self.max_model_len):
                reason = "length"
                text += detok.flush()
            if reason is not None:
                self.scheduler.finish(req, reason)
                self._forget(req.request_id)
            outs.append(StepOutput(req, [tok], text, reason, [lp] if p.logprobs else None))
        return outs

    # ------------------------------------------------------------------ stats
    def stats(self) -> dict[str, Any]:
        st: dict[str, Any] = dict(self.cache.stats())
        st.update(
            num_requests_running=len(self.scheduler.running),
            num_requests_waiting=len(self.scheduler.waiting),
            num_preemptions=self.scheduler.num_preemptions,
            num_steps=self.num_steps,
            tokens_computed=self.runner.tokens_computed,
            prompt_tokens_total=self.prompt_tokens_total,
            prefix_cached_tokens=self.cached_tokens_total,
            kv_cache_usage_perc=st["kv_chunks_used"] / st["kv_chunks_total"],
            chunk_size=self.cache.chunk_size,
        )
        st.update(self.scheduler.stats())  # per-tenant fair share, queueing and pins (issue 16)
        return st


__all__ = ["EngineConfig", "EngineCore", "KVCacheFull", "torch"]
