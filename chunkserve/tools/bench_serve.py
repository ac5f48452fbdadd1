"""`chunkserve bench serve`: a serving benchmark against OpenAI-compatible endpoints, side by side.

The workload is multi-tenant chat: ``--tenants`` tenants, each with its own system prompt of about
``--system-tokens`` tokens, send ``--requests-per-tenant`` streaming chats each (``--max-tokens`` tokens at
``--temperature``), arriving all at once or as a Poisson process of ``--rate`` requests/s. The same chats
are sent ``--passes`` times (pass 1 is the first time the server sees the system prompts: a random
``--prompt-salt`` heads them; later passes repeat them), then ``--single`` lone streams run one after
another. Endpoints run one after the other, never at once; ``--launch NAME=CMD`` starts a server just for
its endpoint's runs and stops it after, so each has the machine to itself.

Per run and endpoint it reports completion tok/s, TTFT / TPOT / end-to-end percentiles, decode tok/s and
the cached prompt tokens the server reports (``usage.prompt_tokens_details.cached_tokens``); it writes
JSON and a PNG plot. ``--vs OURS,PEER`` adds issue 12's targets (OURS against PEER) with PASS/FAIL.

    chunkserve bench serve --endpoint chunkserve=http://127.0.0.1:8000 --endpoint llama=http://127.0.0.1:8091
    chunkserve bench serve --endpoint cs=http://127.0.0.1:8000 --launch 'cs=chunkserve up --workers 2' \\
        --tenants 4 --requests-per-tenant 8 --system-tokens 1000 --max-tokens 64 --passes 2 --single 3
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from chunkserve.tools import client, engine_clock, procs, report, workload


def _pairs(values: list[str], flag: str) -> dict[str, str]:
    out = {}
    for v in values:
        name, sep, rest = v.partition("=")
        if not sep or not name or not rest:
            raise ValueError(f"{flag} takes NAME=VALUE, got {v!r}")
        out[name] = rest
    return out


def parse_endpoints(values: list[str]) -> dict[str, str]:
    """``NAME=URL`` (or a bare URL, named by its host:port) -> {name: base URL without /v1}."""
    out: dict[str, str] = {}
    for v in values:
        name, sep, url = v.partition("=")
        if not sep:
            name, url = v.split("://", 1)[-1].rstrip("/"), v
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"--endpoint {v!r}: the URL must start with http:// or https://")
        if name in out:
            raise ValueError(f"--endpoint: the name {name!r} is given twice")
        out[name] = url.rstrip("/").removesuffix("/v1")
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="chunkserve bench serve", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--endpoint", action="append", required=True, metavar="NAME=URL",
                    help="an OpenAI-compatible server's base URL (repeat for several, run in this order)")
    ap.add_argument("--launch", action="append", default=[], metavar="NAME=CMD",
                    help="start CMD for endpoint NAME's runs and stop it after (run as `bash -c 'exec CMD'`: "
                    "one command; set variables with `env VAR=value CMD`)")
    ap.add_argument("--launch-timeout", type=float, default=900.0, help="seconds for a launched server to serve")
    ap.add_argument("--model", action="append", default=[], metavar="NAME=MODEL",
                    help="model name to send to endpoint NAME (default: the first of its /v1/models)")
    ap.add_argument("--extra-body", action="append", default=[], metavar="NAME=JSON",
                    help="extra request fields for endpoint NAME, e.g. llama='{\"ignore_eos\": true}'")
    ap.add_argument("--api-key", default=None, help="bearer key sent for every tenant")
    ap.add_argument("--tenant-key", action="append", default=[], metavar="TENANT=KEY",
                    help="bearer key of one tenant (tenant names: acme, globex, initech, umbrella, tenant5, ...)")
    ap.add_argument("--tenants", type=int, default=4)
    ap.add_argument("--requests-per-tenant", type=int, default=8)
    ap.add_argument("--system-tokens", type=int, default=1000, help="system prompt length (tokens of its text)")
    ap.add_argument("--max-tokens", type=int, default=64, help="output tokens per request")
    ap.add_argument("--ignore-eos", action="store_true",
                    help="send ignore_eos (vLLM's and llama.cpp's extension, chunkserve's too) to every endpoint: "
                    "each request generates --max-tokens tokens, so servers whose greedy paths differ do the same work")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=None)
    ap.add_argument("--rate", type=float, default=float("inf"), help="arrivals per second (Poisson); inf = at once")
    ap.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most (default: all)")
    ap.add_argument("--passes", type=int, default=2, help="times the same chats are sent (1st = first time)")
    ap.add_argument("--single", type=int, default=1, help="lone streams run one after another (0 = none)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the arrival times")
    ap.add_argument("--prompt-salt", default=None, help="heads every prompt (default: random per invocation)")
    ap.add_argument("--tokenizer", default=None, help="tokenizer.json (or its folder) that sizes the prompts "
                    "(default: the embedded SmolLM2's)")
    ap.add_argument("--request-timeout", type=float, default=1800.0, help="seconds per request")
    ap.add_argument("--engine-clock-wait", type=float, default=engine_clock.DEFAULT_WAIT_S,
                    help="seconds after a run before reading a chunkserve endpoint's engine step clock from its "
                    "/metrics (wall, CPU and run-queue seconds of the engine threads; other servers: skipped)")
    ap.add_argument("--json", default="bench_serve.json", help="results file")
    ap.add_argument("--plot", default=None, help="PNG plot (default: the --json path with .png)")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--vs", default=None, metavar="OURS,PEER", help="print issue 12's targets, OURS against PEER")
    return ap


@dataclasses.dataclass
class Plan:
    chats: list[workload.ChatRequest]
    single: workload.ChatRequest
    sampling: client.Sampling
    passes: int
    singles: int
    api_keys: dict[str, str]
    max_concurrency: int | None
    request_timeout: float
    engine_clock_wait_s: float = engine_clock.DEFAULT_WAIT_S


async def warm_up(session: Any, name: str, model: str, api_key: str | None, patience_s: float = 120.0) -> None:
    """One short unmeasured request; a 503 (a server still loading) is retried for ``patience_s``."""
    req = workload.ChatRequest("warmup", [{"role": "user", "content": "Hi"}], 0.0)
    deadline = time.monotonic() + patience_s
    while True:
        rec = await client.stream_chat(session, model, req, client.Sampling(max_tokens=4), api_key)
        if rec.error is None:
            return
        if not rec.error.startswith("HTTP 503") or time.monotonic() > deadline:
            raise RuntimeError(f"{name}: the warm-up request failed: {rec.error}")
        await asyncio.sleep(1.0)


async def bench_endpoint(name: str, url: str, model: str | None, plan: Plan, pid: int | None) -> dict[str, Any]:
    """All runs against one endpoint: a warm-up request, the chat passes, the lone streams."""
    import aiohttp

    out: dict[str, Any] = {"url": url, "runs": {}}
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(url, connector=conn,
                                     timeout=aiohttp.ClientTimeout(total=plan.request_timeout)) as s:
        if model is None:
            models = await client.list_models(s)
            if not models:
                raise RuntimeError(f"{name}: {url}/v1/models lists no model; pass --model {name}=MODEL")
            model = models[0]
        out["model"] = model
        await warm_up(s, name, model, plan.api_keys.get("*") or next(iter(plan.api_keys.values()), None))
        runs: list[tuple[str, list[workload.ChatRequest], int]] = [(f"pass{p + 1}", plan.chats, 1)
                                                                  for p in range(plan.passes)]
        if plan.singles:
            runs.append(("single", [plan.single], plan.singles))
        for run, reqs, times in runs:
            cpu0 = await asyncio.to_thread(procs.cpu_by_process, pid) if pid else {}
            clock0 = await engine_clock.read(s)
            self0 = time.process_time()
            records: list[client.RequestRecord] = []
            for _ in range(times):
                records += await client.run_requests(s, model, reqs, plan.sampling, plan.api_keys,
                                                     plan.max_concurrency)
            summary = client.summarize(records)
            summary["client_cpu_s"] = round(time.process_time() - self0, 2)
            if pid:
                summary["server_cpu_s"] = procs.cpu_delta(cpu0, await asyncio.to_thread(procs.cpu_by_process, pid))
            if clock0 is not None:  # a chunkserve endpoint: what its engine threads did in this run
                await asyncio.sleep(plan.engine_clock_wait_s)
                summary["engine_clock"] = engine_clock.delta(clock0, await engine_clock.read(s))
            out["runs"][run] = summary
            print(f"  {name} {report.run_label(run)}: {json.dumps(summary)}", flush=True)
    return out


def run_endpoint(name: str, url: str, launch: str | None, model: str | None, plan: Plan, log_dir: Path,
                 launch_timeout: float) -> dict[str, Any]:
    """One endpoint's runs, its server started before and stopped after when ``launch`` is given."""
    if launch is None:
        return asyncio.run(bench_endpoint(name, url, model, plan, None))
    server = procs.LaunchedServer(name, launch, url, log_dir / f"{name}.server.log")
    with server:
        print(f"starting {name}: {launch}", flush=True)
        startup = server.start(launch_timeout)
        print(f"{name} serving after {startup:.0f} s (log: {server.log_path})", flush=True)
        res = asyncio.run(bench_endpoint(name, url, model, plan, server.proc.pid if server.proc else None))
    return {"launched": launch, "startup_s": round(startup, 1), **res}


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    try:
        endpoints = parse_endpoints(args.endpoint)
        launches, models = _pairs(args.launch, "--launch"), _pairs(args.model, "--model")
        extra = {k: json.loads(v) for k, v in _pairs(args.extra_body, "--extra-body").items()}
        keys = _pairs(args.tenant_key, "--tenant-key")
        for flag, names in (("--launch", launches), ("--model", models), ("--extra-body", extra)):
            unknown = set(names) - set(endpoints)
            if unknown:
                raise ValueError(f"{flag} names {sorted(unknown)}, which are not endpoints ({', '.join(endpoints)})")
        if any(not isinstance(v, dict) for v in extra.values()):
            raise ValueError("--extra-body takes a JSON object")
        if args.engine_clock_wait < 0:
            raise ValueError("--engine-clock-wait takes seconds >= 0")
        if args.max_concurrency is not None and args.max_concurrency < 1:
            raise ValueError("--max-concurrency takes a count >= 1 (leave it out for no limit)")
        if args.max_tokens < 1 or args.passes < 0 or args.single < 0 or (args.passes == 0 and args.single == 0):
            raise ValueError("need --max-tokens >= 1 and at least one pass or lone stream")
        if args.vs is not None and (len(args.vs.split(",")) != 2 or set(args.vs.split(",")) - set(endpoints)):
            raise ValueError(f"--vs takes OURS,PEER, two of the endpoints ({', '.join(endpoints)})")
        salt = args.prompt_salt if args.prompt_salt is not None else workload.new_salt()
        spec = workload.WorkloadSpec(args.tenants, args.requests_per_tenant, args.system_tokens, args.rate,
                                     args.seed, salt)
        count = workload.load_counter(args.tokenizer)
    except (ValueError, json.JSONDecodeError) as e:
        ap.error(str(e))
    import aiohttp

    if args.api_key:
        keys["*"] = args.api_key
    chats = workload.chat_requests(spec, count)
    sampling = client.Sampling(args.max_tokens, args.temperature, args.top_p)
    json_path = Path(args.json)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {
        "tool": "chunkserve bench serve", "started": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": {"cpu": procs.cpu_model(), "cores": os.cpu_count(), "load_avg_start": os.getloadavg()},
        "workload": workload.describe(spec, count, chats), "sampling": dataclasses.asdict(sampling),
        "ignore_eos": args.ignore_eos,
        "passes": args.passes, "single_runs": args.single, "endpoints": {}}
    print(f"workload: {json.dumps(results['workload'])}", flush=True)
    failed = False
    for name, url in endpoints.items():
        body = {**({"ignore_eos": True} if args.ignore_eos else {}), **extra.get(name, {})}
        plan = Plan(chats, workload.single_request(salt), dataclasses.replace(sampling, extra_body=body),
                    args.passes, args.single, keys, args.max_concurrency, args.request_timeout,
                    args.engine_clock_wait)
        try:
            results["endpoints"][name] = run_endpoint(name, url, launches.get(name), models.get(name), plan,
                                                      json_path.parent, args.launch_timeout)
        except (RuntimeError, TimeoutError, OSError, ValueError, aiohttp.ClientError) as e:
            msg = str(e) if str(e).startswith(f"{name}:") else f"{name}: {type(e).__name__}: {e}"
            print(msg, file=sys.stderr, flush=True)
            results["endpoints"][name] = {"url": url, "error": msg[-2000:], "runs": {}}
            failed = True
        json_path.write_text(json.dumps(results, indent=1))
    results["machine"]["load_avg_end"] = os.getloadavg()
    print(f"\nCPU: {results['machine']['cpu']} ({results['machine']['cores']} cores); load avg "
          f"{results['machine']['load_avg_start'][0]:.1f} -> {results['machine']['load_avg_end'][0]:.1f}")
    print(report.table(results))
    engines = report.engine_table(results)
    if engines:
        print("\n" + engines)
    if args.vs:
        ours, peer = args.vs.split(",")
        results["targets"] = {"ours": ours, "peer": peer, "rows": report.check_targets(results, ours, peer)}
        print(f"\nissue 12 targets, {ours} against {peer}:\n" + report.targets_table(results["targets"]["rows"],
                                                                                   ours, peer))
    json_path.write_text(json.dumps(results, indent=1))
    print(f"\nwrote {json_path}", end="")
    if not args.no_plot:
        png = Path(args.plot) if args.plot else json_path.with_suffix(".png")
        try:
            report.plot(results, png)
            print(f" and {png}", end="")
        except ImportError:
            print("; no plot: matplotlib is not installed (pip install 'chunkserve[loadtest]')", end="")
    print()
    return 1 if failed or any(r.get("failed") for ep in results["endpoints"].values()
                              for r in ep["runs"].values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
