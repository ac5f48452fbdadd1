"""A model-free driver of the `Scheduler` over a real `PrefixKVCache` (tests, `benchmarks/bench_kv_pressure.py`).

The scheduler's decisions depend only on token counts and the cache, never on K/V values, so this runs
the exact admission / preemption / pin logic of the engine at a fraction of its cost.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from chunkserve.workers.cache_control import PinSpec
from chunkserve.workers.kvcache import PrefixKVCache
from chunkserve.workers.sampling import SamplingParams
from chunkserve.workers.scheduler import Request, Scheduler, SchedulerConfig


@dataclass
class Sim:
    sched: Scheduler
    step: int = 0
    arrival: dict[str, int] = field(default_factory=dict)
    first: dict[str, int] = field(default_factory=dict)
    done: dict[str, int] = field(default_factory=dict)
    reqs: dict[str, Request] = field(default_factory=dict)

    def add(self, rid: str, prompt: list[int], max_tokens: int, tenant: str = "public", salt: bytes = b"",
            weight: float = 1.0, pin: PinSpec | None = None) -> Request:
        req = Request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), salt or tenant.encode(),
                      arrival=self.sched.clock(), tenant=tenant, weight=weight, pin=pin)
        self.sched.add(req)
        self.arrival[rid] = self.step
        self.reqs[rid] = req
        return req

    def run_step(self) -> list[Request]:
        s = self.sched
        s.cache.begin_step()
        try:
            plan = s.schedule()
        finally:
            s.cache.end_step()
        self.step += 1
        sampled = [p.req for p in plan.prefills if p.samples] + list(plan.decodes)
        for r in sampled:
            r.output.append(7)
            self.first.setdefault(r.request_id, self.step)
            if len(r.output) >= r.params.max_tokens:
                s.finish(r, "length")
                self.done[r.request_id] = self.step
        return sampled

    def drain(self, max_steps: int = 20_000, arrivals: Callable[[int], None] | None = None,
              arrivals_until: int = 0) -> None:
        """Step until idle; ``arrivals(step)`` is called before each of the first ``arrivals_until`` steps."""
        while self.step < max_steps:
            if arrivals is not None and self.step < arrivals_until:
                arrivals(self.step)
            if not self.sched.has_work() and self.step >= arrivals_until:
                return
            self.run_step()


def make_sim(num_chunks: int, chunk: int = 64, clock: Callable[[], float] | None = None, **cfg) -> Sim:
    cache = PrefixKVCache(num_layers=1, num_kv_heads=1, head_dim=8, chunk_size=chunk, num_chunks=num_chunks,
                          dtype=torch.float32)
    kw = {"clock": clock} if clock is not None else {}
    return Sim(Scheduler(cache, SchedulerConfig(**cfg), **kw))
