"""The engine threads' step clock of a chunkserve endpoint, read from its ``/metrics`` around a benchmark run:
wall time in steps, CPU time, and run-queue wait (ready to step while another process held the core; Linux),
summed over the workers (`workers/thread_clock.py`). Another server has no such series: the reading is None.
Torch-free (aiohttp)."""

from __future__ import annotations

import re
from typing import Any

SERIES = {"chunkserve:worker_engine_step_seconds_total": "busy_s",
          "chunkserve:worker_engine_step_cpu_seconds_total": "cpu_s",
          "chunkserve:worker_engine_step_runqueue_seconds_total": "runqueue_s"}
# a cluster's workers write their stats about once a second and the ingress caches them for a second: read
# this long after a run ends, so that its last steps are counted
DEFAULT_WAIT_S = 2.5
_LINE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{[^}]*\})?\s+(\S+)")


def parse(text: str) -> dict[str, float] | None:
    """The summed step clock in a Prometheus text exposition, or None when it has none of the series."""
    out = dict.fromkeys(SERIES.values(), 0.0)
    seen = False
    for line in text.splitlines():
        m = _LINE.match(line)
        if m and m.group(1) in SERIES:
            try:
                out[SERIES[m.group(1)]] += float(m.group(2))
            except ValueError:
                continue
            seen = True
    return out if seen else None


async def read(session: Any) -> dict[str, float] | None:
    """GET ``/metrics`` on the endpoint's session; None when it fails or has no step clock."""
    import aiohttp

    try:
        async with session.get("/metrics") as resp:
            if resp.status != 200:
                return None
            return parse(await resp.text())
    except (aiohttp.ClientError, OSError, TimeoutError, UnicodeDecodeError):
        return None


def delta(before: dict[str, float], after: dict[str, float] | None) -> dict[str, float | None] | None:
    """What a run added, and the run-queue wait as a share of the steps' wall time; None when a counter went
    back (a worker restarted during the run) or the second reading failed."""
    if after is None or any(after[k] < before[k] for k in SERIES.values()):
        return None
    d: dict[str, float | None] = {k: round(after[k] - before[k], 3) for k in SERIES.values()}
    busy, runq = after["busy_s"] - before["busy_s"], after["runqueue_s"] - before["runqueue_s"]
    d["runqueue_share"] = round(runq / busy, 3) if busy > 0 else None
    return d


__all__ = ["DEFAULT_WAIT_S", "delta", "parse", "read"]
