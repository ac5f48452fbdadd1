"""How long a stream's pending write to its client has waited (torch-free, shared by HTTP and gRPC streams).

A client that keeps its connection open but reads nothing fills its socket's (or its HTTP/2 stream's) buffers,
and from then on the server's next write waits for good: the request behind it holds its admission slot and its
KV chunks for as long as the client keeps the connection. Each stream stamps its writes (`begin` before, `end`
after: no timer armed per write), and one watcher per stream (`stalled`) wakes every quarter of the limit and
returns once a write has waited the whole limit; the caller then ends the stream its own way (the HTTP app
cancels the response, the gRPC service closes the engine stream under the suspended generator).
"""

from __future__ import annotations

import time

import anyio


class WriteWatch:
    """Stamps of one stream's writes; ``limit_s``: how long one write may wait for the client."""

    def __init__(self, limit_s: float) -> None:
        if not limit_s > 0:
            raise ValueError(f"limit_s must be > 0, got {limit_s!r}")
        self.limit_s = float(limit_s)
        self._since: float | None = None  # when the write in progress began (None: no write waits)
        self.fired = False  # `stalled` has returned: the stream is being ended

    def begin(self) -> None:
        self._since = time.monotonic()

    def end(self) -> None:
        self._since = None

    async def stalled(self) -> None:
        """Returns once a write has waited ``limit_s`` (found within a quarter of it more); sets ``fired``."""
        while True:
            await anyio.sleep(self.limit_s / 4)
            began = self._since
            if began is not None and time.monotonic() - began >= self.limit_s:
                self.fired = True
                return
