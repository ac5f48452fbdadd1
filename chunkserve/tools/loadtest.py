"""`chunkserve loadtest`: the multi-tenant locust load test against a local (or given) cluster.

    chunkserve loadtest --workers 2 --model random:tiny --tenants 4 --duration 60
    chunkserve loadtest --host http://127.0.0.1:8000 --grpc-target 127.0.0.1:9000 --api-keys-file keys.json
    chunkserve loadtest --soak                       # 10 min near saturation, then the memory/KV verdict

Without ``--host`` it starts a local cluster (Ray, Redis, the Serve app; as ``chunkserve up``) on free
ports with generated tenants (``tenants.yaml`` holds the sha256 of each key, ``api_keys.json`` the plain
keys for locust), runs ``loadtests/locustfile.py`` headless for ``--duration`` seconds, and writes to
``--out``: locust's CSVs and HTML report, ``requests.jsonl`` (one line per request), ``metrics.json``
(/metrics and worker stats over time), ``summary.json`` and PNG plots. The cluster is shut down at the end.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from chunkserve.tools.launcher import FRONTS, engine_json
from chunkserve.tools.loadtest_cluster import ClusterSpec, Endpoints, admin_key, local_cluster, write_tenants
from chunkserve.tools.loadtest_metrics import (
    MetricsSampler,
    RayWorkers,
    Sample,
    samples_to_rows,
    worker_rss_mb,
)
from chunkserve.tools.loadtest_report import read_request_log, soak_verdict, summarize, write_plots

logger = logging.getLogger("chunkserve.loadtest")

LOCUSTFILE = Path(str(getattr(importlib.util.find_spec("chunkserve.loadtests"), "origin", ""))).parent / "locustfile.py"


@dataclass(frozen=True)
class LoadSpec:
    """One locust run: the workload and the arrival process."""

    users: int = 8
    duration_s: float = 60.0
    arrival: str = "closed"  # closed | poisson
    rate: float = 1.0  # poisson: requests/s in total
    tenant_rates: str = ""  # poisson: relative rates per tenant ("10,1"); "": equal
    think_time_s: float = 1.0  # closed: mean think time
    max_inflight: int = 8
    tenants: int = 4
    prompt_tokens: str = "1024"
    sharing_ratio: float = 1.0
    max_tokens: int = 32
    questions: int = 32
    temperature: float = 0.7
    endpoint: str = "chat"
    protocols: tuple[str, ...] = ("http", "grpc")
    tokenizer: str | None = None
    drain_timeout_s: float = 60.0
    seed: int = 0
    extra_args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.users < 1 or self.duration_s <= 0 or self.rate <= 0:
            raise ValueError(f"users, duration and rate must be positive, got {self.users}, {self.duration_s}, "
                             f"{self.rate}")
        if self.tenants < 1 or self.max_tokens < 1:
            raise ValueError(f"tenants and max_tokens must be >= 1, got {self.tenants}, {self.max_tokens}")
        if self.arrival not in ("closed", "poisson"):
            raise ValueError(f"arrival must be closed or poisson, got {self.arrival!r}")
        if not self.protocols or set(self.protocols) - {"http", "grpc"}:
            raise ValueError(f"protocols must be a subset of http,grpc, got {self.protocols}")
        if self.tenant_rates.strip():  # the locustfile's rule, checked before any cluster starts
            try:
                rates = [float(x) for x in self.tenant_rates.split(",") if x.strip()]
            except ValueError:
                rates = []
            if not rates or not all(0 <= r < math.inf for r in rates) or max(rates) <= 0:
                raise ValueError(f"tenant rates must be comma-separated finite numbers >= 0, not all 0: "
                                 f"got {self.tenant_rates!r}")


def locust_command(ep: Endpoints, spec: LoadSpec, out_dir: Path, locustfile: Path = LOCUSTFILE) -> list[str]:
    exe = Path(sys.executable).with_name("locust")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "locust"]
    cmd += ["-f", str(locustfile), "--host", ep.http_url, "--headless", "-u", str(spec.users),
            "-r", str(spec.users), "-t", f"{max(1, round(spec.duration_s))}s", "--stop-timeout", "2",
            "--csv", str(out_dir / "locust"), "--csv-full-history", "--html", str(out_dir / "locust_report.html"),
            "--only-summary", "--loglevel", "WARNING",
            "--tenants", str(spec.tenants), "--prompt-tokens", spec.prompt_tokens,
            "--sharing-ratio", str(spec.sharing_ratio), "--max-tokens", str(spec.max_tokens),
            "--questions", str(spec.questions), "--temperature", str(spec.temperature),
            "--endpoint", spec.endpoint, "--model", ep.model_name, "--workload-seed", str(spec.seed),
            "--arrival", spec.arrival, "--rate", str(spec.rate), "--tenant-rates", spec.tenant_rates,
            "--think-time", str(spec.think_time_s),
            "--max-inflight", str(spec.max_inflight), "--drain-timeout", str(spec.drain_timeout_s),
            "--request-log", str(out_dir / "requests.jsonl")]
    if ep.keys_path:
        cmd += ["--api-keys-file", ep.keys_path]
    if ep.grpc_target:
        cmd += ["--grpc-target", ep.grpc_target]
    if spec.tokenizer:
        cmd += ["--tokenizer", spec.tokenizer]
    cmd += list(spec.extra_args)
    classes = {"http": "HttpChatUser", "grpc": "GrpcChatUser"}
    cmd += [classes[p] for p in spec.protocols]
    return cmd


def wait_idle(sampler: MetricsSampler, timeout_s: float) -> bool:
    """Waits until the server reports no running or waiting request (or ``timeout_s`` passes)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        s = sampler.sample()
        busy = s.num_requests_running + s.num_requests_waiting + sum(
            w.get("num_requests_running", 0) + w.get("num_requests_waiting", 0) for w in s.workers.values())
        if s.ok and busy == 0:
            return True
        time.sleep(1.0)
    return False


@dataclass
class RunResult:
    out_dir: Path
    exit_code: int
    records: list[dict[str, Any]]
    samples: list[Sample]
    load_start_t: float  # sampler time at which locust started
    load_end_t: float
    t0_unix: float  # wall-clock time of the sampler's t=0


def run_load(ep: Endpoints, spec: LoadSpec, out_dir: Path, sample_interval_s: float = 2.0,
             settle_s: float = 5.0, locustfile: Path = LOCUSTFILE) -> RunResult:
    """One bounded locust run with the sampler around it (baseline before, drain and settle after)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "requests.jsonl").unlink(missing_ok=True)
    workers = RayWorkers() if ep.local else None
    sampler = MetricsSampler(ep.http_url, sample_interval_s, workers, worker_rss_mb if ep.local else None,
                             api_key=admin_key(ep))
    t0_unix = time.time()
    sampler.start()
    sampler.sample()  # baseline
    load_start = sampler.now()
    cmd = locust_command(ep, spec, out_dir, locustfile)
    (out_dir / "locust_cmd.txt").write_text(" ".join(cmd) + "\n")
    with open(out_dir / "locust.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            code = proc.wait(timeout=spec.duration_s + spec.drain_timeout_s + 120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            code = 124
        except BaseException:  # Ctrl-C / SIGTERM: stop locust too, then let the cluster shut down
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
            sampler.stop()
            raise
    load_end = sampler.now()
    wait_idle(sampler, timeout_s=max(10.0, spec.drain_timeout_s))
    time.sleep(settle_s)
    sampler.sample()
    samples = sampler.stop()
    return RunResult(out_dir, code, read_request_log(out_dir / "requests.jsonl"), samples, load_start, load_end,
                     t0_unix)


def report(res: RunResult, spec: LoadSpec, soak: dict[str, Any] | None = None) -> dict[str, Any]:
    """Writes metrics.json, summary.json and the plots of a run; returns the summary."""
    run_s = max(1e-9, res.load_end_t - res.load_start_t)
    (res.out_dir / "metrics.json").write_text(json.dumps(samples_to_rows(res.samples)))
    extra: dict[str, Any] = {"locust_exit_code": res.exit_code, "spec": spec.__dict__ | {"protocols": list(spec.protocols)}}
    if soak is not None:
        extra["soak"] = soak
    summary = summarize(res.records, res.samples, run_s, extra)
    try:
        summary["plots"] = write_plots(res.out_dir, res.records, res.samples, res.t0_unix)
    except Exception as e:  # plots are a nicety; the figures are in the JSON
        logger.warning("plots failed: %s", e)
    (res.out_dir / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    return summary


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="chunkserve loadtest", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    c = ap.add_argument_group("cluster (started here unless --host is given)")
    c.add_argument("--host", default=None, help="base URL of a running cluster, e.g. http://127.0.0.1:8000")
    c.add_argument("--grpc-target", default=None, help="host:port of its gRPC proxy (with --host)")
    c.add_argument("--api-keys-file", default=None, help="plain keys (with --host; none: open mode)")
    c.add_argument("--model-name", default="smollm2-135m-instruct", help="served model name")
    c.add_argument("--workers", type=int, default=2)
    c.add_argument("--model", default=None, help="local HF dir or random:<preset>; default: embedded SmolLM2")
    c.add_argument("--engine", default=None, help="JSON of EngineConfig fields")
    c.add_argument("--max-ongoing", type=int, default=None, help="worker max_ongoing_requests (AppConfig; "
                   "fair share needs it well above max_num_seqs: requests over it wait in Serve's FIFO queue)")
    c.add_argument("--num-cpus", type=int, default=None, help="CPUs for the local Ray")
    c.add_argument("--front", choices=FRONTS, default="ray", help="`chunkserve up --front`")
    c.add_argument("--startup-timeout", type=float, default=300.0)
    w = ap.add_argument_group("workload (see loadtests/locustfile.py)")
    w.add_argument("--users", type=int, default=None, help="locust users (default 8)")
    w.add_argument("--duration", type=float, default=None, help="seconds of load (default 60; soak 600)")
    w.add_argument("--arrival", choices=("closed", "poisson"), default=None)
    w.add_argument("--rate", type=float, default=1.0, help="poisson: requests/s in total")
    w.add_argument("--tenant-rates", default="", help="poisson: relative rates per tenant, e.g. 10,1 (default equal)")
    w.add_argument("--think-time", type=float, default=None, help="closed: mean think time (default 1; soak 0)")
    w.add_argument("--max-inflight", type=int, default=8)
    w.add_argument("--tenants", type=int, default=4)
    w.add_argument("--prompt-tokens", default="1024", help="system prompt length(s), comma-separated")
    w.add_argument("--sharing-ratio", type=float, default=None, help="default 1.0; soak 0.75")
    w.add_argument("--max-tokens", type=int, default=32)
    w.add_argument("--questions", type=int, default=32)
    w.add_argument("--temperature", type=float, default=0.7)
    w.add_argument("--endpoint", choices=("chat", "completions"), default="chat")
    w.add_argument("--protocols", default="http,grpc", help="user classes: http, grpc or both")
    w.add_argument("--tokenizer", default=None, help="tokenizer for exact prompt lengths")
    w.add_argument("--exact-tokens", action="store_true", help="use the embedded model's tokenizer")
    w.add_argument("--drain-timeout", type=float, default=60.0)
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--locust-arg", action="append", default=[], help="extra locust argument (repeatable)")
    o = ap.add_argument_group("output and soak")
    o.add_argument("--out", default=None, help="output folder (default loadtest-results/<time>)")
    o.add_argument("--sample-interval", type=float, default=2.0)
    o.add_argument("--soak", action="store_true", help="10 min near saturation, then check RSS and KV")
    o.add_argument("--warmup", type=float, default=None, help="soak: seconds before the RSS baseline")
    o.add_argument("--rss-limit", type=float, default=0.05, help="soak: allowed RSS growth (fraction)")
    return ap.parse_args(argv)


def spec_from_args(a: argparse.Namespace) -> LoadSpec:
    tokenizer = a.tokenizer
    if a.exact_tokens and tokenizer is None:
        from chunkserve.workers.weights import embedded_checkpoint_dir

        tokenizer = str(embedded_checkpoint_dir())
    return LoadSpec(users=8 if a.users is None else a.users,
                    duration_s=a.duration if a.duration is not None else (600.0 if a.soak else 60.0),
                    arrival=a.arrival or "closed", rate=a.rate, tenant_rates=a.tenant_rates,
                    think_time_s=a.think_time if a.think_time is not None else (0.0 if a.soak else 1.0),
                    max_inflight=a.max_inflight, tenants=a.tenants, prompt_tokens=a.prompt_tokens,
                    sharing_ratio=a.sharing_ratio if a.sharing_ratio is not None else (0.75 if a.soak else 1.0),
                    max_tokens=a.max_tokens, questions=a.questions, temperature=a.temperature,
                    endpoint=a.endpoint, protocols=tuple(p for p in a.protocols.split(",") if p),
                    tokenizer=tokenizer, drain_timeout_s=a.drain_timeout, seed=a.seed,
                    extra_args=tuple(a.locust_arg))


def _print_summary(s: dict[str, Any], out_dir: Path) -> None:
    def ms(d: dict[str, Any], k: str) -> str:
        v = d.get(k)
        return "-" if v is None else f"{v:.0f}"

    srv = s.get("server", {})
    hit = srv.get("prefix_cache_hit_rate")
    print(f"requests {s['requests']} ({s['failed']} failed) in {s['run_s']:.0f} s: "
          f"{s['requests_per_s'] or 0:.2f} req/s, {s['output_tokens_per_s'] or 0:.1f} output tok/s")
    print(f"TTFT ms mean/p50/p99 {ms(s['ttft_ms'], 'mean')}/{ms(s['ttft_ms'], 'p50')}/{ms(s['ttft_ms'], 'p99')}  "
          f"TPOT ms mean/p50/p99 {ms(s['tpot_ms'], 'mean')}/{ms(s['tpot_ms'], 'p50')}/{ms(s['tpot_ms'], 'p99')}")
    ratio = s.get("cached_token_ratio")
    print(f"cached-token ratio {ratio if ratio is None else f'{ratio:.1%}'}; server prefix cache hit rate "
          f"{hit if hit is None else f'{hit:.1%}'}; peak KV usage {srv.get('peak_kv_usage', 0):.1%}")
    if s["errors"]:
        print("errors:", json.dumps(s["errors"], indent=1))
    print(f"results in {out_dir}")


def _interrupt(*_: Any) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    a = parse_args(argv)
    try:  # every flag checked before anything is written or started
        spec = spec_from_args(a)
        engine = engine_json(a.engine)
    except ValueError as e:  # LoadSpec's checks, a bad JSON (pydantic's ValidationError is a ValueError too)
        print(f"chunkserve loadtest: {e}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _interrupt)  # SIGTERM cleans up like Ctrl-C (locust, then the cluster)
    out_dir = Path(a.out or f"loadtest-results/{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    if a.host:
        ep = Endpoints(a.host.rstrip("/"), a.grpc_target, a.api_keys_file, local=False, model_name=a.model_name)
        if "grpc" in spec.protocols and not a.grpc_target:
            spec = LoadSpec(**{**spec.__dict__, "protocols": ("http",)})
        res = run_load(ep, spec, out_dir, a.sample_interval)
    else:
        tenants_path, keys_path = write_tenants(out_dir, spec.tenants)
        cspec = ClusterSpec(workers=a.workers, model=a.model, engine=engine, num_cpus=a.num_cpus,
                            startup_timeout_s=a.startup_timeout, max_ongoing_requests=a.max_ongoing,
                            front=a.front)
        with local_cluster(cspec, tenants_path, keys_path) as ep:
            ep = Endpoints(ep.http_url, ep.grpc_target, ep.keys_path, True, a.model_name)
            res = run_load(ep, spec, out_dir, a.sample_interval, settle_s=15.0 if a.soak else 5.0)
    verdict = None
    if a.soak:
        warmup = a.warmup if a.warmup is not None else min(60.0, 0.1 * spec.duration_s)
        verdict = soak_verdict(res.samples, res.load_start_t, warmup, a.rss_limit).as_dict()
    summary = report(res, spec, verdict)
    _print_summary(summary, out_dir)
    ok = summary["failed"] == 0 and summary["requests"] > 0
    if verdict is not None:
        growth = ", ".join(f"pid {p}: {g:+.1%}" for p, g in verdict["rss_growth"].items())
        print(f"SOAK {'PASS' if verdict['passed'] else 'FAIL'}: worker RSS growth after warm-up [{growth}] "
              f"(limit {a.rss_limit:.0%}) -> {'ok' if verdict['rss_ok'] else 'FAIL'}; KV in use before "
              f"{verdict['kv_used_before']} after drain {verdict['kv_used_after']} -> "
              f"{'ok' if verdict['kv_ok'] else 'FAIL'} {verdict['note']}")
        ok = ok and verdict["passed"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
