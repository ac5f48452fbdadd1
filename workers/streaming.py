"""Coalesced token streams: fewer, larger stream items between the engine and the frontends.

Behind Ray Serve every stream item costs a serialisation, an RPC and a wake-up in the worker, the ingress
and the proxy, so a served request pays that per token unless its tokens travel together. `coalesce`
reads one request's deltas from the queue the engine thread fills and yields merged deltas:

* the first delta goes out at once, alone (time to first token is never delayed);
* after that, items are paced: a delta that arrives at least ``interval_s`` after the previous item went
  out is sent at once; one that arrives sooner waits, collecting more deltas, until ``interval_s`` after
  the previous item, ``max_tokens`` tokens, or the request's last delta, whichever comes first;
* deltas already queued (a consumer that fell behind) are drained into one item without waiting.

A stream whose tokens come slower than ``interval_s`` is therefore never delayed; a fast one is sent at
most once per interval. With ``items_per_s`` set, the interval grows with the worker's streams in flight
(``streams / items_per_s``, between ``interval_s`` and ``max_interval_s``), so that the items all its
streams send stay within that budget: every item costs the same CPU in the worker, the ingress and the
proxy whatever it carries, and on a small node that CPU is taken from the engine. Torch-free, like
`protocol.py`.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from chunkserve.workers.protocol import GenerateDelta


@dataclass(frozen=True)
class StreamBatching:
    """How a request's deltas are coalesced into stream items (``interval_s=0``: one item per delta)."""

    interval_s: float = 0.05  # Ray Serve LLM batches stream items over 50 ms by default too
    max_tokens: int = 16
    items_per_s: float = 0.0  # the worker's stream-item budget over all its streams; 0: a fixed interval
    max_interval_s: float = 0.2  # the longest the budget may stretch the interval

    def __post_init__(self) -> None:
        if not 0.0 <= float(self.interval_s) <= 1.0:
            raise ValueError(f"interval_s must be in [0, 1] seconds, got {self.interval_s!r}")
        if not 0.0 <= float(self.max_interval_s) <= 1.0:
            raise ValueError(f"max_interval_s must be in [0, 1] seconds, got {self.max_interval_s!r}")
        if not 0.0 <= float(self.items_per_s) < float("inf"):
            raise ValueError(f"items_per_s must be a finite number >= 0, got {self.items_per_s!r}")
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")

    @property
    def enabled(self) -> bool:
        return self.interval_s > 0.0 and self.max_tokens > 1

    def interval_for(self, streams: int) -> float:
        """The pacing interval while ``streams`` requests of the worker are producing tokens."""
        if self.items_per_s <= 0.0:
            return self.interval_s
        return max(self.interval_s, min(streams / self.items_per_s, self.max_interval_s))

    @classmethod
    def from_options(cls, options: StreamBatching | dict[str, Any] | None) -> StreamBatching:
        if isinstance(options, StreamBatching):
            return options
        return cls(**(options or {}))


def merge_deltas(deltas: Sequence[GenerateDelta]) -> GenerateDelta:
    """One delta equal to ``deltas`` in order: tokens, text and logprobs concatenated, counters (prompt, cached,
    cache-written, output tokens), the finish reason and ``extra`` of the last, the first token's time and
    timeline of the first that has them."""
    if len(deltas) == 1:
        return deltas[0]
    last = deltas[-1]
    tokens: list[int] = []
    for d in deltas:
        tokens += d.token_ids
    logprobs: list[float] | None = None
    if any(d.logprobs is not None for d in deltas):
        logprobs = [lp for d in deltas for lp in (d.logprobs or ())]
    first_time = next((d.first_token_time for d in deltas if d.first_token_time is not None), None)
    timeline = next((d.timeline for d in deltas if d.timeline is not None), None)
    # every counter (cached and cache-written tokens included) and the finish reason are the last delta's
    return dataclasses.replace(last, token_ids=tokens, text="".join(d.text for d in deltas), logprobs=logprobs,
                               first_token_time=first_time, timeline=timeline)


async def coalesce(queue: asyncio.Queue, batching: StreamBatching, streams: Callable[[], int] | None = None
                   ) -> AsyncGenerator[GenerateDelta, None]:
    """The deltas put on ``queue`` (an exception put there is raised, after the tokens before it), merged
    as the module docstring says; ends after the delta with a finish reason. ``streams()``: the worker's
    streams producing tokens now (for ``items_per_s``; default 1)."""
    loop = asyncio.get_running_loop()
    cap = batching.max_tokens
    last_sent: float | None = None  # loop time of the previous item; None before the first
    while True:
        item = await queue.get()
        if isinstance(item, BaseException):
            raise item
        batch = [item]
        n, done, error = len(item.token_ids), item.finish_reason is not None, None
        if last_sent is not None:
            deadline = last_sent + batching.interval_for(streams() if streams is not None else 1)
            while n < cap and not done:
                if queue.empty():
                    remaining = deadline - loop.time()
                    if remaining <= 0:
                        break
                    try:
                        async with asyncio.timeout(remaining):
                            nxt = await queue.get()
                    except TimeoutError:
                        break
                else:
                    nxt = queue.get_nowait()
                if isinstance(nxt, BaseException):
                    error = nxt
                    break
                batch.append(nxt)
                n += len(nxt.token_ids)
                done = nxt.finish_reason is not None
        last_sent = loop.time()
        yield merge_deltas(batch)
        if done:
            return
        if error is not None:
            raise error
