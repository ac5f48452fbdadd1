"""Iteration-level scheduler (Orca) with chunked prefill (SARATHI) over the prefix-aware KV cache.

Every step has a token budget shared by decodes (1 token each, scheduled first, so running
requests never stall) and prefill chunks. A new prompt reuses its cached leading chunks and only
the rest is prefilled. Admission is by free KV chunks, in fair-share order across tenants (the
virtual token counter of `fairness.py`, shortest remaining prompt first within ``fair_quantum``; first
come, first served with ``fair_share=False``), oldest arrival first within a tenant except that a
request with at most two chunks of prompt left (a chat whose system prompt is cached) goes first, then a
prompt already being prefilled (the frontend's arrival stamps can put a request that reaches the engine
later ahead of it), and
never past the request next in that order when it does not fit yet. Going first by size is bounded: a
request overtaken by ``fair_quantum`` tokens of its tenant's later arrivals is overdue and goes first.
A step that already ends `HOLD_FIRST_TOKENS` prompts takes no piece of a prompt it cannot end, so a
burst's first tokens are not held back by the next long prompt (under fair share one such prompt is enough
when its request won the pick over another tenant's work: a light tenant's first token comes from a short
step, not one filled with the heavy tenant's prompt pieces); it passes over such prompts (up to
`HOLD_SKIPS`) to the ones it can end, so a chat whose system prompt was just computed is not left out of its
group's step because long prompts arrived before it. When a decode cannot get a slot a victim
is preempted (`preemption.py`; its chunks released, so they stay cached) and requeued at its arrival position: the running
request with the largest (tenant counter, arrival), never the oldest running request, so the oldest
request always makes progress; a request whose context outgrew the pool (no slot while it runs alone, or too long
to readmit) ends with "length" instead. Prefill pieces of running prompts and admissions share one order.
``cache_control`` pins (`pins.py`) are taken when a request's prefill ends and released when they expire,
checked at the start of each step. The records it fills (`Request`, `StepPlan`) are in `sched_types.py`.
"""

from __future__ import annotations

import bisect
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from chunkserve.workers.chunk_pool import KVCacheFull
from chunkserve.workers.fairness import FairnessConfig, FairShare
from chunkserve.workers.kvcache import PrefixKVCache
from chunkserve.workers.pins import PinManager
from chunkserve.workers.preemption import Preemption
from chunkserve.workers.protocol import PinRefusedError
from chunkserve.workers.sched_types import PrefillPiece, Request, Status, StepPlan

__all__ = ["PrefillPiece", "Request", "Scheduler", "SchedulerConfig", "Status", "StepPlan"]


HOLD_FIRST_TOKENS = 4  # a step that ends this many prompts takes no piece of a prompt it cannot end
SCAN_WAITING = 8  # waiting requests per tenant that compete for the next prefill piece (oldest first)
HOLD_SKIPS = 2 * SCAN_WAITING  # prompts a step that holds its first tokens passes over to find ones it can end


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    max_model_len: int = 8192
    fair_share: bool = True  # VTC order across tenants; False: first come, first served
    fair_quantum: float = 2048.0  # FairnessConfig.quantum: lead (weighted tokens) within which shorter work goes first
    max_pinned_fraction: float = 0.5  # at most this share of the pool may be pinned (cache_control)

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be >= 1")
        if not 0.0 <= self.max_pinned_fraction < 1.0:
            raise ValueError(f"max_pinned_fraction must be in [0, 1), got {self.max_pinned_fraction}")


class Scheduler(Preemption):
    """Owns the waiting queue and the running set; plans each step against the cache."""

    def __init__(self, cache: PrefixKVCache, config: SchedulerConfig,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.cache = cache
        self.config = config
        self.clock = clock
        self.waiting: list[Request] = []  # in arrival order (seq)
        self._waiting_by_tenant: dict[str, list[Request]] = {}  # the same requests per tenant, in arrival order
        self._step = 0
        self.running: list[Request] = []
        self._order = itertools.count()
        self._seq = itertools.count()
        self.num_preemptions = 0
        self._preempted_now: set[int] = set()
        self._ended: list[Request] = []  # ended in this step's planning ("length": the pool bounds them)
        self._slots: dict[int, tuple[int, int]] = {}
        self.fair = FairShare(FairnessConfig(enabled=config.fair_share, quantum=config.fair_quantum), clock)
        self.pins = PinManager(cache, config.max_pinned_fraction, clock)

    def add(self, req: Request) -> None:
        """Queue a request. A pin over its tenant's quota or the pool's pin share raises `PinRefusedError`
        (nothing queued) when ``on_pool_full == "error"``, else the request runs unpinned."""
        if req.pin is not None:
            self.pins.expire()  # an idle engine does not step, where pins expire otherwise
            why = self.pins.check(req.tenant, req.salt, req.prompt, req.pin)
            if why is not None:
                self.pins.refused(req.tenant)
                if req.pin.on_pool_full == "error":
                    raise PinRefusedError(why)
                req.pin = None
        busy = set(self._waiting_by_tenant) | {r.tenant for r in self.running}
        self.fair.arrive(req.tenant, req.weight, busy)
        req.seq = (req.arrival, next(self._seq))
        self._requeue(req)  # after the queue's later arrivals: ahead of them

    def _requeue(self, req: Request) -> None:
        """Into the waiting queue (and its tenant's) at its arrival position."""
        bisect.insort(self.waiting, req, key=lambda r: r.seq)
        bisect.insort(self._waiting_by_tenant.setdefault(req.tenant, []), req, key=lambda r: r.seq)

    def _unqueue(self, req: Request) -> None:
        self.waiting.remove(req)
        queue = self._waiting_by_tenant[req.tenant]
        queue.remove(req)
        if not queue:
            del self._waiting_by_tenant[req.tenant]

    def abort(self, request_id: str) -> Request | None:
        for req in list(self.waiting):
            if req.request_id == request_id:
                self._unqueue(req)
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
        # prefill pieces in one order over running prompts and admissions (`_next_prefill`): a waiting request
        # that goes before a running one's remaining prompt (a light tenant's, under fair share) is admitted
        # and prefilled first; admission stops at the first request that does not fit (no overtaking)
        in_decode = {id(r) for r in decodes}
        pending = [r for r in self.running if r.prefilling and id(r) not in in_decode
                   and id(r) not in self._preempted_now]
        admitting, ending, hold = True, 0, HOLD_FIRST_TOKENS
        skipped: set[int] = set()  # prompts this step passed over (they cannot end in it)
        self._step += 1  # `_remaining` matches a waiting request at most once per step
        while budget > 0:
            can_admit = admitting and bool(self.waiting) and len(self.running) < self.config.max_num_seqs
            nxt, passed, contested = ((first, [], True) if first is not None and can_admit
                                      else self._next_prefill(pending, can_admit, skipped))
            first = None
            if nxt is None:
                break
            if ending >= hold and self._remaining(nxt) > budget:
                # a piece that cannot end its prompt would hold back this step's many first tokens: look for
                # prompts it can end instead (a burst's late chats of a tenant whose system prompt is computed)
                if len(skipped) >= HOLD_SKIPS:
                    break
                skipped.add(id(nxt))
                continue
            if nxt.status is Status.WAITING:
                if id(nxt) in self._preempted_now or not self._admit(nxt):
                    admitting = False
                    continue
                self._unqueue(nxt)
                self.running.append(nxt)
            else:
                pending.remove(nxt)
            n = self._plan_prefill(nxt, budget, plan)
            for r in passed:  # older requests of its tenant this piece went before (the aging bound)
                r.overtaken += n
            ends = bool(plan.prefills and plan.prefills[-1].req is nxt and plan.prefills[-1].samples)
            ending += ends
            if ends and contested:  # it went before another tenant's work: its first token from a short step
                hold = 1
            budget -= n
        self._plan_decode_batch(decodes, plan)
        plan.finished, self._ended = self._ended, []
        return plan

    def _next_prefill(self, pending: list[Request], can_admit: bool, skipped: set[int] | frozenset[int] = frozenset()
                      ) -> tuple[Request | None, list[Request], bool]:
        """Whose prompt work goes next: candidates are the running requests with prompt left and, when
        ``can_admit``, each tenant's oldest `SCAN_WAITING` waiting ones. First come, first served: the oldest.
        Fair share: each tenant puts forward its oldest overdue request, else its oldest with at most two
        chunks of prompt left (a chat whose system prompt was just computed), else its oldest running one (a
        started prompt goes on), else its oldest; `FairShare.choose`
        picks among those. A request overtaken by ``fair_quantum`` tokens of its tenant's later arrivals is
        overdue, so going first by size never starves a long prompt (across tenants the quantum bounds it).
        Requests in ``skipped`` (by id) are passed over. Returns it, the older candidates of its tenant it
        goes before, and whether it won over another tenant's candidate (fair share only)."""
        if not self.config.fair_share:
            oldest = min((r for r in pending if id(r) not in skipped), key=lambda r: r.seq, default=None)
            head = next((r for r in self.waiting if id(r) not in skipped), None) if can_admit else None
            if head is not None and (oldest is None or head.seq < oldest.seq):
                oldest = head
            return oldest, [], False
        cands = [r for r in pending if id(r) not in skipped]
        if can_admit:
            for queue in self._waiting_by_tenant.values():  # each in arrival order
                cands += (queue[:SCAN_WAITING] if not skipped
                          else list(itertools.islice((r for r in queue if id(r) not in skipped), SCAN_WAITING)))
        if not cands:
            return None, [], False
        c, q = self.cache.chunk_size, self.config.fair_quantum
        by_tenant: dict[str, list[Request]] = {}
        for r in sorted(cands, key=lambda r: r.seq):
            by_tenant.setdefault(r.tenant, []).append(r)
        heads = [next((r for r in rs if r.overtaken >= q), None)
                 or next((r for r in rs if self._remaining(r) <= 2 * c), None)
                 or next((r for r in rs if r.status is Status.RUNNING), rs[0]) for rs in by_tenant.values()]
        nxt = self.fair.choose(heads, self._remaining)
        return nxt, [r for r in cands if r.tenant == nxt.tenant and r.seq < nxt.seq], len(by_tenant) > 1

    def _remaining(self, req: Request) -> int:
        """Tokens of its `prefill_len` still to compute: a waiting request's cached prefix (its whole matching
        chunks, `PrefixTree.match_chunks`) is not counted; matched once per step, so chunks planned earlier in
        the same step count from the next one."""
        tokens = req.prefill_len
        if req.status is Status.RUNNING:
            return tokens - req.num_computed
        step, left = req.remaining_at
        if step != self._step:
            arr = req.prompt_array() if not req.output else np.asarray(req.all_tokens[:tokens], dtype=np.int64)
            left = tokens - self.cache.match_chunks(arr, req.salt)
            req.remaining_at = (self._step, left)
        return left

    def _admit(self, req: Request) -> bool:
        """Reserve the cached prefix; admit only if the rest of the prompt fits the free chunks."""
        tokens = req.all_tokens[:req.prefill_len]
        need_tokens = len(tokens)
        if req.output:  # a preempted request recomputes prompt + output[:-1], then decodes output[-1]
            need_tokens += 1
        cached, held = self.cache.match_held(tokens, req.salt)
        c = self.cache.chunk_size
        # the rest of the prompt plus the first decode slot, a partly cached chunk's tokens copied into the first
        # new chunk (so never more than the engine's KVPoolTooSmallError bound: a request that passed it is
        # admitted once the pool is otherwise empty); while others run, its own cached chunks are no room once it
        # holds them (counting them let a preempted request back in each step, to be preempted by the next decode)
        need_chunks = -(-(need_tokens + 1 - cached // c * c) // c)
        if req.output and req.chunks_alone(c) > self.cache.pool.num_chunks - self.cache.num_pinned_chunks + \
                self.cache.pinned_prefix_chunks(tokens, req.salt):  # preempted past what the pool holds alone
            self._cannot_grow(req)
            return False
        room = self.cache.pool.num_free + self.cache.num_evictable - (held if self.running else 0)
        if need_chunks + self._reserved_chunks() > room:
            return False
        # A fully cached prompt stays shared: its last token then runs as a logits-only row (no K/V write).
        try:
            req.seq_id, got = self.cache.reserve(tokens, req.salt)
        except KVCacheFull:  # the partly cached chunk to copy from was the only room: reuse whole chunks only
            req.seq_id, got = self.cache.reserve(tokens, req.salt, max_cached=cached // c * c)
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
                left = r.prefill_len - r.num_computed
                total += -(-left // c)
        return total

    def _plan_prefill(self, req: Request, budget: int, plan: StepPlan) -> int:
        tokens = req.all_tokens[:req.prefill_len]
        n = min(budget, len(tokens) - req.num_computed)
        if n <= 0:
            if req.output or budget <= 0:
                return 0
            plan.prefills.append(PrefillPiece(req, len(tokens) - 1, tokens[-1:], True, write=False))
            self.fair.charge(req.tenant, prefill=1)
            self.pins.take(req, self.waiting)
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
            self.pins.take(req, self.waiting)
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
