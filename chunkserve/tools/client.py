"""The serving benchmark's client: streaming chat requests sent on a schedule, one record per request, and
the summary of a run (throughput, TTFT / TPOT / end-to-end percentiles, cached prompt tokens). Works with
any OpenAI-compatible server that streams ``/v1/chat/completions``; torch-free (aiohttp only)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import statistics
import time
from collections.abc import Sequence
from typing import Any

from chunkserve.tools.workload import ChatRequest


@dataclasses.dataclass
class Sampling:
    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float | None = None
    extra_body: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class RequestRecord:
    """What one request saw. Times are ``time.perf_counter()`` seconds; ``first`` is the first content."""

    tenant: str
    start: float
    first: float | None = None
    end: float | None = None
    completion_tokens: int = 0
    prompt_tokens: int | None = None
    cached_tokens: int | None = None  # None: the server did not report it
    events: int = 0  # SSE events that carried content (a server may coalesce several tokens into one)
    usage_reported: bool = False
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.end is not None


async def list_models(session: Any) -> list[str]:
    async with session.get("/v1/models") as resp:
        if resp.status != 200:
            raise RuntimeError(f"GET /v1/models: HTTP {resp.status}: {(await resp.text())[:300]}")
        body = await resp.json(content_type=None)
    return [m["id"] for m in body.get("data", []) if isinstance(m, dict) and "id" in m]


def _apply_event(rec: RequestRecord, ev: dict[str, Any], now: float) -> None:
    if ev.get("error"):
        err = ev["error"]
        rec.error = str(err.get("message", err) if isinstance(err, dict) else err)[:300]
        return
    usage = ev.get("usage")
    if usage:
        rec.usage_reported = True
        rec.completion_tokens = int(usage.get("completion_tokens", 0))
        rec.prompt_tokens = usage.get("prompt_tokens")
        details = usage.get("prompt_tokens_details") or {}
        if details.get("cached_tokens") is not None:
            rec.cached_tokens = int(details["cached_tokens"])
    for choice in ev.get("choices") or ():
        if (choice.get("delta") or {}).get("content"):
            rec.events += 1
            if rec.first is None:
                rec.first = now


async def stream_chat(session: Any, model: str, req: ChatRequest, sampling: Sampling,
                      api_key: str | None = None) -> RequestRecord:
    """One streaming chat; never raises for a failed request (the record carries the error)."""
    body: dict[str, Any] = {"model": model, "messages": req.messages, "max_tokens": sampling.max_tokens,
                            "temperature": sampling.temperature, "stream": True,
                            "stream_options": {"include_usage": True}, **sampling.extra_body}
    if sampling.top_p is not None:
        body["top_p"] = sampling.top_p
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    import aiohttp

    rec = RequestRecord(req.tenant, time.perf_counter())
    try:
        async with session.post("/v1/chat/completions", json=body, headers=headers) as resp:
            if resp.status != 200:
                rec.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return rec
            async for line in resp.content:
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                _apply_event(rec, json.loads(data), time.perf_counter())
                if rec.error:
                    return rec
    except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as e:  # a refused or dropped connection, bad JSON
        rec.error = f"{type(e).__name__}: {e}"[:300]
        return rec
    rec.end = time.perf_counter()
    if not rec.usage_reported:  # count content events as tokens (one per event without coalescing)
        rec.completion_tokens = rec.events
    if rec.completion_tokens > 0 and rec.first is None:
        rec.first = rec.end
    return rec


async def run_requests(session: Any, model: str, reqs: Sequence[ChatRequest], sampling: Sampling,
                       api_keys: dict[str, str] | None = None, max_concurrency: int | None = None
                       ) -> list[RequestRecord]:
    """Sends each request at its arrival offset (from now), at most ``max_concurrency`` in flight."""
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    t0 = time.perf_counter()
    keys = api_keys or {}

    async def one(req: ChatRequest) -> RequestRecord:
        delay = t0 + req.arrival_s - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        key = keys.get(req.tenant, keys.get("*"))
        if sem is None:
            return await stream_chat(session, model, req, sampling, key)
        async with sem:
            return await stream_chat(session, model, req, sampling, key)

    return list(await asyncio.gather(*(one(r) for r in reqs)))


# -- summaries ------------------------------------------------------------------------------------------
def percentile(xs: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (``q`` in 0..100) of a non-empty sequence."""
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def dist_ms(xs: Sequence[float]) -> dict[str, float] | None:
    """mean, p50, p90, p99 of durations in seconds, in ms; None when there are none."""
    if not xs:
        return None
    ms = [1000 * x for x in xs]
    return {"mean": round(statistics.fmean(ms), 2), **{f"p{q}": round(percentile(ms, q), 2) for q in (50, 90, 99)}}


def summarize(records: Sequence[RequestRecord]) -> dict[str, Any]:
    """The figures of one run. Throughput is completion tokens over the run's wall time (first request sent
    to last one finished); TPOT is (last content - first content) / (tokens - 1) per request; decode
    tok/s is the median of its inverse over requests (the lone-stream figure); ``by_tenant``: each tenant's
    sorted TTFTs (s) and cached tokens (where a first pass waits, and which prompts were recomputed)."""
    ok = [r for r in records if r.ok]
    out: dict[str, Any] = {"requests": len(records), "failed": len(records) - len(ok),
                           "errors": sorted({r.error for r in records if r.error})[:3]}
    if not ok:
        return out
    wall = max(r.end for r in ok) - min(r.start for r in records)  # type: ignore[type-var,operator]  # ok: end set
    tokens = sum(r.completion_tokens for r in ok)
    cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
    prompt = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
    decoding = [r for r in ok if r.first is not None and r.completion_tokens > 1 and r.end > r.first]  # type: ignore[operator]
    tpots = [(r.end - r.first) / (r.completion_tokens - 1) for r in decoding]  # type: ignore[operator]
    out.update({
        "completion_tokens": tokens,
        "mean_completion_tokens": round(tokens / len(ok), 1),
        "prompt_tokens": sum(prompt) if prompt else None,
        "cached_tokens": sum(cached) if cached else None,
        "cached_fraction": round(sum(cached) / sum(prompt), 3) if cached and prompt and sum(prompt) else None,
        "wall_s": round(wall, 3),
        "requests_per_s": round(len(ok) / wall, 3),
        "completion_tok_per_s": round(tokens / wall, 2),
        "ttft_ms": dist_ms([r.first - r.start for r in ok if r.first is not None]),
        "tpot_ms": dist_ms(tpots),
        "e2e_ms": dist_ms([r.end - r.start for r in ok]),  # type: ignore[operator]
        "decode_tok_per_s": round(statistics.median(1 / t for t in tpots), 2) if tpots else None,
        "events_per_request": round(sum(r.events for r in ok) / len(ok), 1),
        "usage_reported": all(r.usage_reported for r in ok),
        "by_tenant": {t: {"ttft_s": sorted(round(r.first - r.start, 3) for r in rs if r.first is not None),
                          "cached_tokens": sum(r.cached_tokens or 0 for r in rs)}
                      for t, rs in sorted(_by_tenant(ok).items())},
    })
    return out


def _by_tenant(records: Sequence[RequestRecord]) -> dict[str, list[RequestRecord]]:
    out: dict[str, list[RequestRecord]] = {}
    for r in records:
        out.setdefault(r.tenant, []).append(r)
    return out
