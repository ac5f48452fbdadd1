"""Reports of `chunkserve loadtest`: the summary JSON, the PNG plots and the soak verdict.

Inputs are the locustfile's request log (one JSON object per request: tenant, proto, start, ok,
error, ttft, tpot, e2e, prompt_tokens, cached_tokens, output_tokens) and the sampler's time series.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from chunkserve.tools.loadtest_metrics import Sample

PERCENTILES = (50, 90, 95, 99)


def read_request_log(path: str | Path) -> list[dict[str, Any]]:
    p = Path(path)
    if not p.is_file():
        return []
    return [json.loads(line) for line in p.read_text(encoding="utf-8").splitlines() if line.strip()]


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (None for no values)."""
    if not values:
        return None
    xs = sorted(values)
    k = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def dist(values: Iterable[float | None], scale: float = 1e3) -> dict[str, float | None]:
    """mean and percentiles of ``values`` (seconds -> ms with the default scale)."""
    xs = [float(v) * scale for v in values if v is not None]
    out: dict[str, float | None] = {"n": float(len(xs)), "mean": sum(xs) / len(xs) if xs else None}
    for q in PERCENTILES:
        out[f"p{q}"] = percentile(xs, q)
    return out


def _block(recs: list[dict[str, Any]], span_s: float) -> dict[str, Any]:
    ok = [r for r in recs if r.get("ok")]
    prompt = sum(r.get("prompt_tokens", 0) for r in ok)
    cached = sum(r.get("cached_tokens", 0) for r in ok)
    out_tok = sum(r.get("output_tokens", 0) for r in ok)
    return {"requests": len(recs), "failed": len(recs) - len(ok),
            "requests_per_s": len(ok) / span_s if span_s > 0 else None,
            "output_tokens_per_s": out_tok / span_s if span_s > 0 else None,
            "mean_output_tokens": out_tok / len(ok) if ok else None,
            "mean_prompt_tokens": prompt / len(ok) if ok else None,
            "cached_token_ratio": cached / prompt if prompt else None,
            "ttft_ms": dist(r.get("ttft") for r in ok), "tpot_ms": dist(r.get("tpot") for r in ok),
            "e2e_ms": dist(r.get("e2e") for r in ok),
            "normalized_latency_ms_per_token": dist(r["e2e"] / r["output_tokens"] for r in ok
                                                    if r.get("output_tokens"))}


def summarize(records: list[dict[str, Any]], samples: list[Sample], run_s: float,
              extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The run's summary: client-side figures overall, per protocol and per tenant, plus the server's
    cache hit rate and KV usage from /metrics and the workers."""
    errors: dict[str, int] = {}
    for r in records:
        if not r.get("ok"):
            key = str(r.get("error") or "failed")[:120]
            errors[key] = errors.get(key, 0) + 1
    out: dict[str, Any] = {"run_s": run_s, **_block(records, run_s), "errors": errors}
    out["by_proto"] = {p: _block([r for r in records if r.get("proto") == p], run_s)
                       for p in sorted({r.get("proto", "?") for r in records})}
    out["by_tenant"] = {t: _block([r for r in records if r.get("tenant") == t], run_s)
                        for t in sorted({r.get("tenant", "?") for r in records})}
    good = [s for s in samples if s.ok]
    if len(good) >= 2:
        first, last = good[0], good[-1]
        dq = last.cache_queries - first.cache_queries
        out["server"] = {
            "prefix_cache_hit_rate": (last.cache_hits - first.cache_hits) / dq if dq > 0 else None,
            "prefix_cache_hits": last.cache_hits - first.cache_hits, "prefix_cache_queries": dq,
            "generation_tokens": last.generation_tokens - first.generation_tokens,
            "request_errors": last.request_errors - first.request_errors,
            "peak_running": max(s.num_requests_running for s in good),
            "peak_waiting": max(s.num_requests_waiting for s in good),
            "peak_kv_usage": max((s.kv_usage_workers or 0.0) for s in good),
        }
    rss = [s.rss_mb for s in samples if s.rss_mb]
    if rss:
        out["worker_rss_mb"] = {"first": rss[0], "last": rss[-1],
                                "peak": {pid: max(r.get(pid, 0.0) for r in rss) for pid in rss[-1]}}
    if extra:
        out.update(extra)
    return out


# ----------------------------------------------------------------------------------------- soak verdict
@dataclass(frozen=True)
class SoakVerdict:
    """Resident-memory growth of each worker after the warm-up, and KV usage after the drain."""

    passed: bool
    rss_growth: dict[str, float]  # pid -> (end - baseline) / baseline
    rss_baseline_mb: dict[str, float]
    rss_end_mb: dict[str, float]
    kv_used_before: dict[str, float]  # worker -> KV chunks in use (or their fraction) before the load
    kv_used_after: dict[str, float]  # ... after the drain
    kv_ok: bool
    rss_ok: bool
    note: str

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _in_use(worker: dict[str, float]) -> float:
    """KV chunks in use (the fraction in use when the chunk count is not reported)."""
    return worker["kv_chunks_used"] if "kv_chunks_used" in worker else worker.get("kv_cache_usage_perc", 0.0)


def soak_verdict(samples: list[Sample], load_start_t: float, warmup_s: float, rss_limit: float = 0.05,
                 kv_tolerance: float = 0.0) -> SoakVerdict:
    """Compares worker RSS at ``load_start_t + warmup_s`` (baseline) with the last sample (after the
    drain), and each worker's KV chunks in use before the load with the last sample."""
    if not samples:
        return SoakVerdict(False, {}, {}, {}, {}, {}, False, False, "no samples")
    base_t = load_start_t + warmup_s
    base = next((s for s in samples if s.t >= base_t and s.rss_mb), None)
    end = next((s for s in reversed(samples) if s.rss_mb), None)
    growth: dict[str, float] = {}
    if base is not None and end is not None and end is not base:
        growth = {pid: (end.rss_mb[pid] - mb) / mb for pid, mb in base.rss_mb.items() if pid in end.rss_mb and mb}
    rss_ok = bool(growth) and all(g < rss_limit for g in growth.values())
    before = next((s.workers for s in samples if s.t <= load_start_t and s.workers), {})
    after = next((s.workers for s in reversed(samples) if s.workers), {})
    kv_before = {w: _in_use(v) for w, v in before.items()}
    kv_after = {w: _in_use(v) for w, v in after.items()}
    kv_ok = bool(kv_after) and all(kv_after[w] <= kv_before.get(w, 0.0) + kv_tolerance for w in kv_after)
    notes = []
    if not growth:
        notes.append("no RSS baseline/end pair (worker processes not found, or the run ended before the warm-up)")
    if not kv_after:
        notes.append("no worker KV stats (needs a local cluster started by this command)")
    return SoakVerdict(rss_ok and kv_ok, growth, base.rss_mb if base else {}, end.rss_mb if end else {},
                       kv_before, kv_after, kv_ok, rss_ok, "; ".join(notes))


# ------------------------------------------------------------------------------------------------ plots
def _binned(records: list[dict[str, Any]], t0: float, width: float) -> tuple[list[float], list[list[dict]]]:
    """Finished requests grouped by completion time into bins of ``width`` seconds since ``t0``."""
    ends = [(r["start"] + r.get("e2e", 0.0) - t0, r) for r in records]
    if not ends:
        return [], []
    n = int(max(t for t, _ in ends) // width) + 1
    bins: list[list[dict]] = [[] for _ in range(n)]
    for t, r in ends:
        bins[max(0, int(t // width))].append(r)
    return [(i + 0.5) * width for i in range(n)], bins


def write_plots(out_dir: str | Path, records: list[dict[str, Any]], samples: list[Sample],
                t0_unix: float, bin_s: float = 5.0) -> list[str]:
    """throughput.png, latency.png, kv_cache.png (and worker_rss.png when sampled); returns the paths.

    ``t0_unix`` is the wall-clock time of the sampler's t=0 (request times are shifted to it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    paths: list[str] = []
    ok = [r for r in records if r.get("ok")]
    xs, bins = _binned(ok, t0_unix, bin_s)

    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot(xs, [len(b) / bin_s for b in bins], label="requests/s")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("requests/s")
    ax2 = ax.twinx()
    ax2.plot(xs, [sum(r.get("output_tokens", 0) for r in b) / bin_s for b in bins], color="tab:orange",
             label="output tokens/s")
    ax2.set_ylabel("output tokens/s")
    ax.set_title(f"throughput ({len(ok)} ok, {len(records) - len(ok)} failed requests; {bin_s:.0f} s bins)")
    fig.legend(loc="upper right")
    fig.tight_layout()
    paths.append(_save(fig, out / "throughput.png"))

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, title in ((axes[0], "ttft", "time to first token"), (axes[1], "tpot", "time per output token")):
        for q, style in ((50, "-"), (90, "--"), (99, ":")):
            ax.plot(xs, [percentile([r[key] * 1e3 for r in b if r.get(key) is not None], q) for b in bins],
                    style, label=f"p{q}")
        ax.set_title(title)
        ax.set_xlabel("time (s)")
        ax.set_ylabel("ms")
        ax.legend()
    fig.tight_layout()
    paths.append(_save(fig, out / "latency.png"))

    good = [s for s in samples if s.ok]
    if len(good) >= 2:
        fig, ax = plt.subplots(figsize=(8, 4))
        ts = [s.t for s in good]
        per_worker = sorted({w for s in good for w in s.workers})
        if per_worker:
            for w in per_worker:
                ax.plot(ts, [100 * s.workers.get(w, {}).get("kv_cache_usage_perc", math.nan) for s in good],
                        label=f"KV in use, worker {w[:6]}")
        elif any(s.kv_cache_usage_perc is not None for s in good):
            ax.plot(ts, [100 * (s.kv_cache_usage_perc if s.kv_cache_usage_perc is not None else math.nan)
                         for s in good], label="KV in use")
        hit = [math.nan]
        for a, b in zip(good, good[1:], strict=False):
            dq = b.cache_queries - a.cache_queries
            hit.append(100 * (b.cache_hits - a.cache_hits) / dq if dq > 0 else math.nan)
        ax.plot(ts, hit, "k.-", label="prefix cache hit rate (interval)")
        ax.set_ylim(-2, 102)
        ax.set_xlabel("time (s)")
        ax.set_ylabel("%")
        ax.set_title("KV cache usage and prefix cache hit rate (/metrics, worker stats)")
        ax.legend(fontsize=8)
        fig.tight_layout()
        paths.append(_save(fig, out / "kv_cache.png"))
    rss = [s for s in samples if s.rss_mb]
    if rss:
        fig, ax = plt.subplots(figsize=(8, 4))
        for pid in sorted({p for s in rss for p in s.rss_mb}):
            ax.plot([s.t for s in rss], [s.rss_mb.get(pid, math.nan) for s in rss],
                    label=f"worker pid {pid}")
        ax.set_xlabel("time (s)")
        ax.set_ylabel("RSS (MiB)")
        ax.set_title("worker resident memory")
        ax.legend()
        fig.tight_layout()
        paths.append(_save(fig, out / "worker_rss.png"))
    return paths


def _save(fig: Any, path: Path) -> str:
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=100)
    plt.close(fig)
    return str(path)
