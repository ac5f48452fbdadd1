"""Iteration-level scheduler (Orca) with chunked prefill (SARATHI) over the prefix-aware KV cache.

Every step has a token budget shared by decodes (1 token each, scheduled first, so running
requests never stall) and prefill chunks. A new prompt reuses its cached leading chunks and only
the rest is prefilled. Admission is by free KV chunks; when a decode cannot get a slot the newest
running request is preempted (its chunks released, so they stay cached) and requeued for recompute.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field
from enum import Enum

from chunkserve.workers.chunk_pool import KVCacheFull
from chunkserve.workers.kvcache import PrefixKVCache
from chunkserve.workers.sampling import SamplingParams


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    """One generation request and its progress."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    salt: bytes = b""
    arrival: float = 0.0
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    status: Status = Status.WAITING
    seq_id: int | None = None
    num_cached: int = -1  # prompt tokens served from the cache at first admission (-1: not yet)
    num_computed: int = 0  # tokens of prompt+output whose K/V are in the cache
    finish_reason: str | None = None
    num_preemptions: int = 0
    order: int = 0  # admission order, for newest-first preemption
    first_token_time: float | None = None

    @property
    def all_tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def prefilling(self) -> bool:
        """Still before its first sampled token, or recomputing after a preemption."""
        return not self.output or self.num_computed < len(self.prompt) + len(self.output) - 1


@dataclass(frozen=True)
class PrefillPiece:
    req: Request
    start: int  # position of the first new token
    tokens: list[int]
    samples: bool  # this piece ends the prompt: sample the next token from its last row
    write: bool = True  # False: a fully cached prompt's last token, run for its logits only (its K/V are cached)


@dataclass
class StepPlan:
    prefills: list[PrefillPiece] = field(default_factory=list)
    decodes: list[Request] = field(default_factory=list)  # in tree order (decode_ctx rows)
    decode_ctx: object | None = None  # ChunkContext of the decode rows
    slot_chunks: list[int] = field(default_factory=list)  # per new token, in batch row order
    slot_offsets: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(p.tokens) for p in self.prefills) + len(self.decodes)

    @property
    def empty(self) -> bool:
        return not self.prefills and not self.decodes


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    max_model_len: int = 8192

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be >= 1")


class Scheduler:
    """Owns the waiting queue and the running set; plans each step against the cache."""

    def __init__(self, cache: PrefixKVCache, config: SchedulerConfig) -> None:
        self.cache = cache
        self.config = config
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._order = itertools.count()
        self.num_preemptions = 0
        self._preempted_now: set[int] = set()
        self._slots: dict[int, tuple[int, int]] = {}

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def abort(self, request_id: str) -> Request | None:
        for req in list(self.waiting):
            if req.request_id == request_id:
                self.waiting.remove(req)
                return req
        for req in self.running:
            if req.request_id == request_id:
                self.free(req)
                self.running.remove(req)
                return req
        return None

    def free(self, req: Request) -> None:
        if req.seq_id is not None:
            self.cache.remove_sequence(req.seq_id)
            req.seq_id = None

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ planning
    def schedule(self) -> StepPlan:
        plan = StepPlan()
        self._preempted_now = set()
        budget = self.config.max_num_batched_tokens
        decodes = self._schedule_decodes(budget)
        budget -= len(decodes)
        # prefill chunks of running requests first, then admit new ones
        for req in list(self.running):
            if budget <= 0:
                break
            if req.prefilling and req not in decodes:
                budget -= self._plan_prefill(req, budget, plan)
        while budget > 0 and self.waiting and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            if id(req) in self._preempted_now or not self._admit(req):
                break
            self.waiting.popleft()
            self.running.append(req)
            budget -= self._plan_prefill(req, budget, plan)
        self._plan_decode_batch(decodes, plan)
        return plan

    def _schedule_decodes(self, budget: int) -> list[Request]:
        """Give each decoding request a slot for its last sampled token, preempting on a full pool."""
        out: list[Request] = []
        self._slots = {}
        for req in list(self.running):
            # preempted in this loop (identity check: Request equality compares every field)
            if id(req) in self._preempted_now or req.prefilling or len(out) >= budget:
                continue
            while True:
                try:
                    self._slots[id(req)] = self.cache.append_slot(req.seq_id, req.output[-1])
                    break
                except KVCacheFull:
                    victim = max((r for r in self.running if r is not req), key=lambda r: r.order, default=None)
                    if victim is None or victim.order < req.order:
                        victim = req
                    self._preempt(victim)
                    if victim is req:
                        break
                    if victim in out:
                        out.remove(victim)
            if id(req) not in self._preempted_now:
                req.num_computed += 1
                out.append(req)
        return out

    def _preempt(self, req: Request) -> None:
        self._preempted_now.add(id(req))
        self.free(req)
        self.running.remove(req)
        req.status = Status.WAITING
        req.num_computed = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _admit(self, req: Request) -> bool:
        """Reserve the cached prefix; admit only if the rest of the prompt fits the free chunks."""
        tokens = req.all_tokens if not req.output else req.all_tokens[:-1]
        need_tokens = len(tokens)
        if req.output:  # a preempted request recomputes prompt + output[:-1], then decodes output[-1]
            need_tokens += 1
        cached = self.cache.match(tokens, req.salt)
        c = self.cache.chunk_size
        need_chunks = -(-(need_tokens - cached) // c) + 1
        if need_chunks + self._reserved_chunks() > self.cache.pool.num_free + self.cache.num_evictable:
            return False
        # A fully cached prompt stays shared: its last token then runs as a logits-only row (no K/V write).
        req.seq_id, got = self.cache.reserve(tokens, req.salt)
        if req.num_cached < 0:
            req.num_cached = got
        req.num_computed = got
        req.status = Status.RUNNING
        req.order = next(self._order)
        return True

    def _reserved_chunks(self) -> int:
        """Chunks that admitted requests still need to finish their prefill."""
        c = self.cache.chunk_size
        total = 0
        for r in self.running:
            if r.prefilling:
                left = len(r.prompt) + max(0, len(r.output) - 1) - r.num_computed
                total += -(-left // c)
        return total

    def _plan_prefill(self, req: Request, budget: int, plan: StepPlan) -> int:
        tokens = req.all_tokens if not req.output else req.all_tokens[:-1]
        n = min(budget, len(tokens) - req.num_computed)
        if n <= 0:
            if req.output or budget <= 0:
                return 0
            plan.prefills.append(PrefillPiece(req, len(tokens) - 1, tokens[-1:], True, write=False))
            return 1
        try:
            chunks, offsets = self.cache.extend_host(req.seq_id, n)  # host arrays: no device access
        except KVCacheFull:
            self._preempt(req)  # its computed chunks stay cached, so the retry is cheap
            return 0
        start = req.num_computed
        req.num_computed += n
        ends = req.num_computed == len(tokens)
        plan.prefills.append(PrefillPiece(req, start, tokens[start:start + n], ends and not req.output))
        plan.slot_chunks += chunks.tolist()
        plan.slot_offsets += offsets.tolist()
        return n

    def _plan_decode_batch(self, decodes: list[Request], plan: StepPlan) -> None:
        """Order decode rows by tree order and record their slots (after all structure changes)."""
        if not decodes:
            return
        ctx = self.cache.host_context([r.seq_id for r in decodes])  # host arrays; the runner moves them
        order = ctx.order.tolist()
        plan.decodes = [decodes[i] for i in order]
        plan.decode_ctx = ctx
        for req in plan.decodes:
            chunk, offset = self._slots[id(req)]
            plan.slot_chunks.append(chunk)
            plan.slot_offsets.append(offset)

    # ------------------------------------------------------------------ after the step
    def finish(self, req: Request, reason: str) -> None:
        req.finish_reason = reason
        req.status = Status.FINISHED
        self.free(req)
        if req in self.running:
            self.running.remove(req)
