"""Decode slots and preemption, the part of `Scheduler` (`scheduler.py`) that makes room in a full KV pool.

Each decoding request gets a slot for its last sampled token, oldest first. When the pool is full a victim is
preempted: its chunks are released (so they stay cached, and its recompute reuses them) and it is requeued at its
arrival position. The victim is the running request with the largest (tenant counter, arrival), never the oldest
running one, so the oldest always makes progress. A request that finds no slot while it runs alone has outgrown
the pool: it ends with "length", as at the context length.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from chunkserve.workers.chunk_pool import KVCacheFull
from chunkserve.workers.kvcache import PrefixKVCache
from chunkserve.workers.sched_types import Request, Status


class Preemption:
    """Mixed into `Scheduler`, whose state these methods share (declared here for the type checker)."""

    cache: PrefixKVCache
    running: list[Request]
    num_preemptions: int
    _preempted_now: set[int]
    _slots: dict[int, tuple[int, int]]
    _ended: list[Request]
    _priority: Callable[[Request], Any]
    _unqueue: Callable[[Request], None]
    _requeue: Callable[[Request], None]
    free: Callable[[Request], None]
    finish: Callable[[Request, str], None]

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
                    if victim is req and len(self.running) == 1:  # alone, and the pool cannot hold one more token
                        self._cannot_grow(req)
                        break
                    self._preempt(victim)
                    if victim is req:
                        break
                    if victim in out:
                        out.remove(victim)
            if id(req) not in self._preempted_now and req.status is not Status.FINISHED:
                req.num_computed += 1
                out.append(req)
        return out

    def _cannot_grow(self, req: Request) -> None:
        """``req``'s context does not fit the KV pool even alone: it ends with "length", as at the context length."""
        if req in self.running:
            self.running.remove(req)
        else:
            self._unqueue(req)
        self.finish(req, "length")
        self._ended.append(req)

    def _preempt(self, req: Request) -> None:
        self._preempted_now.add(id(req))
        self.free(req)
        self.running.remove(req)
        req.status = Status.WAITING
        req.num_computed = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self._requeue(req)
