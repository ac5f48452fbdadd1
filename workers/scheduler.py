"""Iteration-level scheduler (Orca) with chunked prefill (SARATHI) over the prefix-aware KV cache.

Every step has a token budget shared by decodes (1 token each, scheduled first, so running
requests never stall) and prefill chunks. A new prompt reuses its cached leading chunks and only
the rest is prefilled. Admission is by free KV chunks, in fair-share order across tenants (the
virtual token counter of `fairness.py`; first come, first served with ``fair_share=False``), oldest
arrival first within a tenant, and never past a request that does not fit yet (no overtaking by
size). When a decode cannot get a slot a victim is preempted (its chunks released, so they stay
cached) and requeued at its arrival position: the running request with the largest (tenant counter,
arrival), never the oldest running request, so the oldest request always makes progress. Prefill
pieces run in the same priority order. ``cache_control`` pins (`pins.py`) are taken when a request's
prefill ends and released when they expire, checked at the start of each step.
"""

from __future__ import annotations

import bisect
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from chunkserve.workers.cache_control import PinSpec
from chunkserve.workers.chunk_pool import KVCacheFull
from chunkserve.workers.fairness import FairnessConfig, FairShare
from chunkserve.workers.kvcache import PrefixKVCache
from chunkserve.workers.pins import PinManager
from chunkserve.workers.protocol import PinRefusedError
from chunkserve.workers.sampling import SamplingParams


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """One generation request and its progress (compared and hashed by identity: one object per request)."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    salt: bytes = b""
    arrival: float = 0.0
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    status: Status = Status.WAITING
    seq_id: int | None = None
    num_cached: int | None = None  # prompt tokens served from the cache at first admission (None: not yet)
    num_computed: int = 0  # tokens of prompt+output whose K/V are in the cache
    finish_reason: str | None = None
    num_preemptions: int = 0
    order: int = 0  # admission order
    first_token_time: float | None = None
    tenant: str = "public"
    weight: float = 1.0  # fair-share weight of the tenant
    pin: PinSpec | None = None  # cache_control: pin the prompt's first pin.num_tokens tokens
    seq: tuple[float, int] = (0.0, -1)  # queue order: (arrival, add order), kept across preemptions
    admit_time: float | None = None  # first admission (monotonic)
    pinned_tokens: int = 0  # tokens pinned (or renewed) for this request
    cache_creation_tokens: int = 0  # pinned prefix tokens this request computed (not read from the cache)

    @property
    def all_tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def sid(self) -> int:
        """The cache sequence of an admitted request (RuntimeError before admission or after release)."""
        if self.seq_id is None:
            raise RuntimeError(f"request {self.request_id!r} holds no cache sequence")
        return self.seq_id

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
    fair_share: bool = True  # VTC order across tenants; False: first come, first served
    max_pinned_fraction: float = 0.5  # at most this share of the pool may be pinned (cache_control)

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be >= 1")
        if not 0.0 <= self.max_pinned_fraction < 1.0:
            raise ValueError(f"max_pinned_fraction must be in [0, 1), got {self.max_pinned_fraction}")


class Scheduler:
    """Owns the waiting queue and the running set; plans each step against the cache."""

    def __init__(self, cache: PrefixKVCache, config: SchedulerConfig,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.cache = cache
        self.config = config
        self.clock = clock
        self.waiting: list[Request] = []  # in arrival order (seq)
        self.running: list[Request] = []
        self._order = itertools.count()
        self._seq = itertools.count()
        self.num_preemptions = 0
        self._preempted_now: set[int] = set()
        self._slots: dict[int, tuple[int, int]] = {}
        self.fair = FairShare(FairnessConfig(enabled=config.fair_share), clock)
        self.pins = PinManager(cache, config.max_pinned_fraction, clock)

    def add(self, req: Request) -> None:
        """Queue a request. A pin over its tenant's quota or the pool's pin share raises `PinRefusedError`
        (nothing queued) when ``on_pool_full == "error"``, else the request runs unpinned."""
        if req.pin is not None:
            why = self.pins.check(req.tenant, req.salt, req.prompt, req.pin)
            if why is not None:
                self.pins.refused(req.tenant)
                if req.pin.on_pool_full == "error":
                    raise PinRefusedError(why)
                req.pin = None
        busy = {r.tenant for r in self.waiting} | {r.tenant for r in self.running}
        self.fair.arrive(req.tenant, req.weight, busy)
        req.seq = (req.arrival, next(self._seq))
        bisect.insort(self.waiting, req, key=lambda r: r.seq)  # after the queue's later arrivals: ahead of them

    def _requeue(self, req: Request) -> None:
        """Back into the waiting queue at its arrival position."""
        bisect.insort(self.waiting, req, key=lambda r: r.seq)

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
    def _priority(self, req: Request) -> tuple[float, float, tuple[float, int]]:
        """Smaller runs first: (tenant's virtual token counter, its recent service, arrival) under fair share,
        else arrival."""
        return self.fair.key(req)

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        self._preempted_now = set()
        self.pins.expire()
        first: Request | None = None  # admitted before the fair pick: a starved tenant's request
        swap = self.fair.slot_victim(self.running, self.waiting, self.config.max_num_seqs)
        if swap is not None:  # a full batch of other tenants' requests: free a slot for a starved tenant
            self._preempt(swap[0])  # type: ignore[arg-type]
            first = swap[1]  # type: ignore[assignment]
        budget = self.config.max_num_batched_tokens
        decodes = self._schedule_decodes(budget)
        budget -= len(decodes)
        for req in decodes:
            self.fair.charge(req.tenant, decode=1)
        # prefill pieces in one priority order over running prompts and admissions: a waiting request that
        # outranks a running one's remaining prompt (a light tenant's, under fair share) is admitted and
        # prefilled before it; admission stops at the first request that does not fit (no overtaking)
        in_decode = {id(r) for r in decodes}
        pending = sorted((r for r in self.running if r.prefilling and id(r) not in in_decode
                          and id(r) not in self._preempted_now), key=self._priority)
        admitting = True
        i, n_wait = -1, 0  # the waiting request next in line: picked again only when the queue changed
        while budget > 0:
            nxt: Request | None = None
            if admitting and self.waiting and len(self.running) < self.config.max_num_seqs:
                if i < 0 or n_wait != len(self.waiting):  # a preempted prefill piece requeues its request
                    n_wait = len(self.waiting)
                    i = next((k for k, r in enumerate(self.waiting) if r is first), -1)
                    i = i if i >= 0 else self.fair.pick(self.waiting)
                cand = self.waiting[i]
                if cand is first or not pending or self._priority(cand) < self._priority(pending[0]):
                    first = None
                    if id(cand) in self._preempted_now or not self._admit(cand):
                        admitting = False
                        continue
                    del self.waiting[i]
                    self.running.append(cand)
                    nxt, i = cand, -1
            if nxt is None:
                if not pending:
                    break
                nxt = pending.pop(0)
            budget -= self._plan_prefill(nxt, budget, plan)
        self._plan_decode_batch(decodes, plan)
        return plan

    def _victim(self, req: Request) -> Request:
        """Whom to preempt so that ``req`` gets a slot: the lowest-priority other running request, but
        never the oldest running one (so the oldest always makes progress); ``req`` itself when every
        other candidate outranks it."""
        oldest = min(self.running, key=lambda r: r.seq)
        cands = [r for r in self.running if r is not req and r is not oldest]
        if not cands:
            return req
        victim = max(cands, key=self._priority)
        if req is not oldest and self._priority(victim) < self._priority(req):
            return req
        return victim

    def _schedule_decodes(self, budget: int) -> list[Request]:
        """Give each decoding request a slot for its last sampled token, preempting on a full pool."""
        out: list[Request] = []
        self._slots = {}
        for req in sorted(self.running, key=lambda r: r.seq):  # oldest first
            # preempted in this loop (identity check: Request equality compares every field)
            if id(req) in self._preempted_now or req.prefilling or len(out) >= budget:
                continue
            while True:
                try:
                    self._slots[id(req)] = self.cache.append_slot(req.sid, req.output[-1])
                    break
                except KVCacheFull:
                    victim = self._victim(req)
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
        self._requeue(req)

    def _admit(self, req: Request) -> bool:
        """Reserve the cached prefix; admit only if the rest of the prompt fits the free chunks."""
        tokens = req.all_tokens if not req.output else req.all_tokens[:-1]
        need_tokens = len(tokens)
        if req.output:  # a preempted request recomputes prompt + output[:-1], then decodes output[-1]
            need_tokens += 1
        cached, held = self.cache.match_held(tokens, req.salt)
        c = self.cache.chunk_size
        # the rest of the prompt plus the first decode slot, and a copy-on-write of a partly cached chunk
        # (the same bound as the engine's KVPoolTooSmallError check, so a request that passed it is admitted
        # once the pool is otherwise empty); while others run, its own cached chunks are no room once it holds
        # them (counting them let a preempted request back in each step, to be preempted by the next decode)
        need_chunks = -(-(need_tokens - cached + 1) // c) + (1 if cached % c else 0)
        room = self.cache.pool.num_free + self.cache.num_evictable - (held if self.running else 0)
        if need_chunks + self._reserved_chunks() > room:
            return False
        # A fully cached prompt stays shared: its last token then runs as a logits-only row (no K/V write).
        req.seq_id, got = self.cache.reserve(tokens, req.salt)
        if req.num_cached is None:
            req.num_cached = got
        req.num_computed = got
        req.status = Status.RUNNING
        req.order = next(self._order)
        if req.admit_time is None:
            req.admit_time = self.clock()
            self.fair.admitted(req.tenant, req.admit_time - req.arrival)
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
            self.fair.charge(req.tenant, prefill=1)
            self._take_pin(req)
            return 1
        try:
            chunks, offsets = self.cache.extend_host(req.sid, n)  # host arrays: no device access
        except KVCacheFull:
            self._preempt(req)  # its computed chunks stay cached, so the retry is cheap
            return 0
        start = req.num_computed
        req.num_computed += n
        ends = req.num_computed == len(tokens)
        self.fair.charge(req.tenant, prefill=n)
        if ends:
            self._take_pin(req)
        plan.prefills.append(PrefillPiece(req, start, tokens[start:start + n], ends and not req.output))
        plan.slot_chunks += chunks.tolist()
        plan.slot_offsets += offsets.tolist()
        return n

    def _plan_decode_batch(self, decodes: list[Request], plan: StepPlan) -> None:
        """Order decode rows by tree order and record their slots (after all structure changes)."""
        if not decodes:
            return
        ctx = self.cache.host_context([r.sid for r in decodes])  # host arrays; the runner moves them
        order = ctx.order.tolist()
        plan.decodes = [decodes[i] for i in order]
        plan.decode_ctx = ctx
        for req in plan.decodes:
            chunk, offset = self._slots[id(req)]
            plan.slot_chunks.append(chunk)
            plan.slot_offsets.append(offset)

    def _take_pin(self, req: Request) -> None:
        """The prompt's chunks are all in the tree now: pin (or renew) the marked prefix once."""
        spec = req.pin
        if spec is None or req.pinned_tokens:
            return
        got = self.pins.pin(req.tenant, req.salt, req.prompt, spec)
        req.pinned_tokens = got
        req.cache_creation_tokens = max(0, got - (req.num_cached or 0)) if got else 0
        if not got:
            req.pin = None  # refused now (the pool's pin share filled up meanwhile): served unpinned

    def stats(self) -> dict[str, Any]:
        """Per tenant: served prefill/decode tokens, queueing time, share, pinned tokens, pins expired."""
        tenants: dict[str, dict[str, Any]] = {}
        for name, st in self.fair.stats().items():
            tenants.setdefault(name, {}).update(st)
        for name, pst in self.pins.stats().items():
            tenants.setdefault(name, {}).update(pst)
        return {"tenant_sched": tenants, "pinned_chunks": self.cache.num_pinned_chunks,
                "fair_share": self.config.fair_share}

    # ------------------------------------------------------------------ after the step
    def finish(self, req: Request, reason: str) -> None:
        req.finish_reason = reason
        req.status = Status.FINISHED
        self.free(req)
        if req in self.running:
            self.running.remove(req)
