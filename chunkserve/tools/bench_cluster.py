"""The paper's end-to-end experiment on the cluster: normalised-latency-bound throughput, sharing on/off.

    chunkserve bench cluster                      # n = 1024, 2048; about 15 minutes
    chunkserve bench cluster --n 1024 --bound-ms 200 --max-minutes 6

For each system (prefix sharing on: share_prefix + TPP decode; off: share_prefix=False +
paged-torch, i.e. no prefix reuse and no shared attention) a local one-worker cluster serves the
embedded SmolLM2 through the whole stack (HTTP ingress, prefix-aware router, worker). For each
n_s = n_p = n, one tenant's tool-definition prompt of exactly n tokens is sent by locust users as an
open-loop Poisson process (``/v1/completions``, streaming, ``max_tokens`` = n_c, temperature 1).
Rates go up a geometric ladder (``--rate0``, ``--factor``; down it, at most ``--max-down`` steps,
while the lowest rate fails) for ``--per-rate`` seconds each (longer for low rates, so that about
``--min-arrivals`` requests arrive; plus a bounded drain); a rate is sustainable when the mean decode latency (TPOT: time per output token after
the first, per request, averaged over requests) stays under ``--bound-ms`` and no request failed,
was dropped or was left open at the drain. After the first unsustainable rate one rate between the
last good and the first bad one is tried. The result per (system, n) is the highest sustainable rate.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import platform
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from chunkserve.tools.launcher import engine_json
from chunkserve.tools.loadtest import LoadSpec, run_load
from chunkserve.tools.loadtest_cluster import ClusterSpec, local_cluster, write_tenants
from chunkserve.tools.loadtest_report import dist

logger = logging.getLogger("chunkserve.bench_cluster")

SYSTEMS: dict[str, dict[str, Any]] = {
    "sharing on (TPP)": {"share_prefix": True, "attention_backend": "torch"},
    "sharing off (paged)": {"share_prefix": False, "attention_backend": "paged-torch"},
}


@dataclass
class Point:
    """One rate of one sweep."""

    rate: float
    requests: int
    failed: int
    mean_tpot_ms: float | None
    mean_ttft_ms: float | None
    mean_norm_latency_ms: float | None
    achieved_rps: float
    mean_output_tokens: float | None
    peak_running: float
    sustainable: bool


@dataclass
class Sweep:
    system: str
    n: int
    points: list[Point] = field(default_factory=list)
    truncated: bool = False

    @property
    def best(self) -> float | None:
        ok = [p.rate for p in self.points if p.sustainable]
        return max(ok) if ok else None


def evaluate(records: list[dict[str, Any]], samples: list[Any], rate: float, run_s: float, bound_ms: float) -> Point:
    ok = [r for r in records if r.get("ok")]
    tpot = dist(r.get("tpot") for r in ok)["mean"]
    ttft = dist(r.get("ttft") for r in ok)["mean"]
    norm = dist(r["e2e"] / r["output_tokens"] for r in ok if r.get("output_tokens"))["mean"]
    failed = len(records) - len(ok)
    outs = [r["output_tokens"] for r in ok]
    peak = max((s.num_requests_running for s in samples if s.ok), default=0.0)
    good = bool(ok) and failed == 0 and tpot is not None and tpot <= bound_ms
    return Point(rate, len(records), failed, tpot, ttft, norm, len(ok) / run_s,
                 sum(outs) / len(outs) if outs else None, peak, good)


def sweep(ep: Any, system: str, n: int, a: argparse.Namespace, out: Path, deadline: float) -> Sweep:
    """The rate ladder for one (system, n) on a running cluster."""
    sw = Sweep(system, n)
    base = LoadSpec(users=a.users, duration_s=a.per_rate, arrival="poisson", rate=a.rate0, max_inflight=a.max_inflight,
                    tenants=1, prompt_tokens=str(n), sharing_ratio=1.0, max_tokens=a.max_tokens, questions=0,
                    temperature=1.0, endpoint="completions", protocols=("http",), tokenizer=a.tokenizer,
                    drain_timeout_s=a.drain, seed=a.seed)
    warm = LoadSpec(**{**base.__dict__, "users": 1, "duration_s": 1.0, "rate": 0.5, "drain_timeout_s": 120.0})
    run_load(ep, warm, out / f"{_slug(system)}-n{n}-warmup", settle_s=0.5)  # fills the prefix cache (on)

    def point(rate: float) -> Point | None:
        dur = min(a.per_rate_max, max(a.per_rate, a.min_arrivals / rate))  # low rates run longer
        if time.monotonic() + dur + a.drain / 2 > deadline:
            sw.truncated = True
            return None
        spec = LoadSpec(**{**base.__dict__, "rate": round(rate, 4), "duration_s": dur})
        res = run_load(ep, spec, out / f"{_slug(system)}-n{n}-r{rate:.3f}", settle_s=0.5)
        p = evaluate(res.records, res.samples, rate, max(1e-9, res.load_end_t - res.load_start_t), a.bound_ms)
        sw.points.append(p)
        logger.info("%s n=%d rate %.3f: TPOT %s ms, %d/%d ok -> %s", system, n, rate,
                    "-" if p.mean_tpot_ms is None else f"{p.mean_tpot_ms:.0f}", p.requests - p.failed, p.requests,
                    "sustainable" if p.sustainable else "NOT sustainable")
        return p

    last_good: float | None = None
    first_bad: float | None = None
    rate = a.rate0
    for _ in range(a.max_points):  # up the ladder until a rate fails; down it while the lowest fails
        p = point(rate)
        if p is None:
            return sw
        if p.sustainable:
            last_good = max(last_good or 0.0, rate)
            if first_bad is not None:
                break
            rate *= a.factor
        else:
            first_bad = rate if first_bad is None else min(first_bad, rate)
            if last_good is not None or rate < a.rate0 / a.factor**a.max_down * 1.001:
                break
            rate /= a.factor
    if last_good is not None and first_bad is not None and first_bad / last_good > 1.5:
        point(math.sqrt(last_good * first_bad))  # one step between the last good and the first bad rate
    return sw


def _slug(s: str) -> str:
    return "on" if "on" in s.split()[1] else "off"


def table(sweeps: list[Sweep], a: argparse.Namespace) -> str:
    """The markdown table of the results (one row per n, both systems side by side)."""
    lines = [f"| n_s = n_p | n_c | system | max rate under {a.bound_ms:.0f} ms TPOT (req/s) | rates tried: "
             "mean TPOT ms (ok/all) |", "|---|---|---|---|---|"]
    by_n: dict[int, list[Sweep]] = {}
    for sw in sweeps:
        by_n.setdefault(sw.n, []).append(sw)
    for n, sws in sorted(by_n.items()):
        for sw in sws:
            pts = "; ".join(f"{p.rate:.3g}: {'-' if p.mean_tpot_ms is None else f'{p.mean_tpot_ms:.0f}'} "
                            f"({p.requests - p.failed}/{p.requests}){'' if p.sustainable else ' x'}"
                            for p in sorted(sw.points, key=lambda p: p.rate))
            best = sw.best
            lowest = min((p.rate for p in sw.points), default=a.rate0)
            shown = f"{best:.3g}" if best is not None else f"< {lowest:.3g}"
            lines.append(f"| {n} | {a.max_tokens} | {sw.system} | {shown}{' (cut short)' if sw.truncated else ''} "
                         f"| {pts} |")
        on = next((s.best for s in sws if "on" in s.system.split()[1]), None)
        off = next((s.best for s in sws if "off" in s.system.split()[1]), None)
        if on and off:
            lines.append(f"| {n} | | **sharing on / off** | **{on / off:.2f}x** | |")
        elif on and not off:
            low = min((p.rate for s in sws if "off" in s.system.split()[1] for p in s.points), default=a.rate0)
            lines.append(f"| {n} | | **sharing on / off** | **> {on / low:.2f}x** (off sustains no tried rate) | |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="chunkserve bench cluster", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", default="1024,2048", help="n_s = n_p values, comma-separated")
    ap.add_argument("--max-tokens", type=int, default=32, help="n_c: tokens generated per request")
    ap.add_argument("--bound-ms", type=float, default=300.0, help="mean TPOT bound (ms)")
    ap.add_argument("--rate0", type=float, default=0.1, help="lowest rate of the ladder (req/s)")
    ap.add_argument("--factor", type=float, default=2.0, help="ladder step")
    ap.add_argument("--max-points", type=int, default=6, help="rates per sweep at most")
    ap.add_argument("--per-rate", type=float, default=30.0, help="seconds of arrivals per rate")
    ap.add_argument("--per-rate-max", type=float, default=60.0, help="longest run of one rate (s)")
    ap.add_argument("--min-arrivals", type=float, default=4.0, help="expected arrivals per rate at least "
                    "(low rates run longer, up to --per-rate-max)")
    ap.add_argument("--max-down", type=int, default=1, help="ladder steps below --rate0 when it fails")
    ap.add_argument("--drain", type=float, default=20.0, help="seconds open requests may take to finish")
    ap.add_argument("--users", type=int, default=4, help="locust users (Poisson sources)")
    ap.add_argument("--max-inflight", type=int, default=16, help="open requests per user at most")
    ap.add_argument("--max-minutes", type=float, default=16.0, help="stop starting new rates after this")
    ap.add_argument("--systems", default="off,on", help="on, off, both, or a comma list (default off,on)")
    ap.add_argument("--engine", default=None, help="extra EngineConfig JSON for both systems")
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    ap.add_argument("--tokenizer", default=None, help="default: the embedded model's tokenizer")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="output folder (default bench-cluster-results/<time>)")
    return ap.parse_args(argv)


def _interrupt(*_: Any) -> None:
    raise KeyboardInterrupt


def systems(spec: str) -> list[str]:
    """``--systems``: "both" or a comma list of "on" / "off" -> the keys, in order; ValueError otherwise."""
    keys = ["off", "on"] if spec == "both" else [k.strip() for k in spec.split(",") if k.strip()]
    if not keys or any(k not in ("on", "off") for k in keys):
        raise ValueError(f"--systems takes on, off or both (or a comma list of on and off), got {spec!r}")
    return keys


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    a = parse_args(argv)
    try:
        keys_wanted = systems(a.systems)
        ns = [int(x) for x in a.n.split(",") if x]
        extra = engine_json(a.engine)
    except ValueError as e:
        print(f"chunkserve bench cluster: {e}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _interrupt)  # clean up (locust, then the cluster) as on Ctrl-C
    if a.tokenizer is None:
        from chunkserve.workers.weights import embedded_checkpoint_dir

        a.tokenizer = str(embedded_checkpoint_dir())
    out = Path(a.out or f"bench-cluster-results/{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    out.mkdir(parents=True, exist_ok=True)
    tenants, keys = write_tenants(out, 1)
    t_start = time.monotonic()
    deadline = t_start + 60 * a.max_minutes
    wanted = {"on": "sharing on (TPP)", "off": "sharing off (paged)"}
    sweeps: list[Sweep] = []
    for key in keys_wanted:
        system = wanted[key]
        engine = {"chunk_size": 64, "max_num_seqs": 32, "kv_cache_gb": 1.0, **SYSTEMS[system], **extra}
        with local_cluster(ClusterSpec(workers=1, model=a.model, engine=engine), tenants, keys) as ep:
            for n in ns:
                sweeps.append(sweep(ep, system, n, a, out, deadline))
    md = table(sweeps, a)
    load = " ".join(Path("/proc/loadavg").read_text().split()[:3]) if Path("/proc/loadavg").exists() else "?"
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": platform.platform(),
            "cpus": os.cpu_count(), "loadavg_at_end": load,
            "minutes": (time.monotonic() - t_start) / 60, "args": vars(a)}
    (out / "bench_cluster.json").write_text(json.dumps(
        {"meta": meta, "sweeps": [{"system": s.system, "n": s.n, "best_rate": s.best, "truncated": s.truncated,
                                   "points": [p.__dict__ for p in s.points]} for s in sweeps]}, indent=1))
    (out / "bench_cluster.md").write_text(md + "\n")
    print(f"\n{meta['date']}, {meta['machine']}, {meta['cpus']} CPUs, load average at the end {load}, "
          f"{meta['minutes']:.1f} min\n{md}\nresults in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
