"""Served vs offline: the served path's share of the engine's speed, and where a token's time goes.

Runs one workload through a served app and through the offline engine (`chunkserve.LLM`'s `EngineCore`,
stepped the way `LLM.generate` steps it) in the same run, one after the other (never both at once):

  (a) single: one streaming chat of 64 greedy tokens;
  (b) chat32: 32 concurrent streaming chats, 4 tenants x 8 users, a ~1000-token system prompt per
      tenant, 64 greedy tokens each.

It reports completion tok/s, TTFT p50, TPOT p50 (ms/tok), SSE events per request and, for the served runs, the CPU seconds
spent by each process (engine worker, ingress, proxy, Ray system, the client itself), plus the
served/offline ratios. Served modes: ``local`` (`LocalServer` in a child process: uvicorn + the ingress
+ an in-process engine) and ``ray`` (`chunkserve up` as a child process). Greedy decoding makes served
and offline outputs the same tokens, so the ratios compare equal work.

    .venv/bin/python benchmarks/bench_served.py                       # both modes, embedded SmolLM2
    .venv/bin/python benchmarks/bench_served.py --mode local --json served.json
    .venv/bin/python benchmarks/bench_served.py --mode ray --workers 2 --quantization int4   # int4, both sides
    .venv/bin/python benchmarks/bench_served.py --mode ray --workers 2 --front haproxy        # HAProxy in front

This file manages the processes (offline engine, local or Ray server) and prints the table; the workloads,
the streaming client and the CPU accounting are `chunkserve bench serve`'s (`chunkserve.tools`, torch-free),
and the offline process is sent the same conversations as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from chunkserve.tools import client, procs, workload
from chunkserve.tools.bench_serve import Plan, bench_endpoint
from chunkserve.tools.launcher import FRONTS

MAX_TOKENS = 64


def chat_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """Prompt ids exactly as the ingress builds them (template text, then encode without specials)."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer.encode(text, add_special_tokens=False))


def workloads() -> dict[str, list[workload.ChatRequest]]:
    """(a) single: one chat asking for a story; (b) chat32: 4 tenants x 8 users, ~1000-token system prompts."""
    count = workload.load_counter(None)
    return {"single": [workload.single_request()],
            "chat32": workload.chat_requests(workload.WorkloadSpec(4, 8, 1000), count)}


# -- offline ------------------------------------------------------------------------------------------
class Offline:
    """The offline engine of `chunkserve.LLM`, stepped as `LLM.generate` steps it, timing each request."""

    def __init__(self, model: str | None, threads: int | None, kv_cache_gb: float,
                 quantization: str | None = None) -> None:
        import torch

        from chunkserve import LLM, SamplingParams

        kw: dict[str, Any] = {"kv_cache_gb": kv_cache_gb, "quantization": quantization}
        if threads is not None:
            kw["num_threads"] = threads
        self.llm = LLM(model=model, **kw)
        self.greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
        self.torch_threads = torch.get_num_threads()
        self.llm.generate(["warm up the engine"], SamplingParams(max_tokens=8, temperature=0.0))
        self._n = 0

    def run(self, convs: list[list[dict[str, str]]]) -> dict[str, Any]:
        engine, tok = self.llm.engine, self.llm.tokenizer
        prompts = [chat_ids(tok, c) for c in convs]
        self._n += 1
        t0, mono0 = time.perf_counter(), time.monotonic()
        reqs = [engine.add_request(f"r{self._n}-{i}", p, self.greedy, salt=b"public") for i, p in enumerate(prompts)]
        ends: dict[int, float] = {}
        while engine.has_work():
            engine.step()
            now = time.perf_counter()
            for i, q in enumerate(reqs):
                if q.finish_reason is not None and i not in ends:
                    ends[i] = now
        records = [client.RequestRecord("offline", t0, first=t0 + (q.first_token_time - mono0), end=ends[i],
                                        completion_tokens=len(q.output), prompt_tokens=len(q.prompt),
                                        cached_tokens=q.num_cached, usage_reported=True)
                   for i, q in enumerate(reqs)]
        res = client.summarize(records)
        res["events_per_request"] = None
        return res


def serve_offline(model: str | None, threads: int | None, kv_cache_gb: float, quantization: str | None) -> None:
    """Child-process body of the offline side: one JSON list of conversations per stdin line, one JSON
    result per line."""
    off = Offline(model, threads, kv_cache_gb, quantization)
    print(json.dumps({"torch_threads": off.torch_threads}), flush=True)
    for line in sys.stdin:
        print(json.dumps(off.run(json.loads(line))), flush=True)


class OfflineProcess:
    """The offline engine in a child process of its own session, so that the kernel's per-session CPU
    fairness (autogroups) treats it like the served engine, which also runs in a session of its own."""

    def __init__(self, args: argparse.Namespace) -> None:
        cmd = [sys.executable, __file__, "--serve-offline", "--kv-cache-gb", str(args.kv_cache_gb)]
        if args.quantization:
            cmd += ["--quantization", args.quantization]
        if args.model:
            cmd += ["--model", args.model]
        if args.threads:
            cmd += ["--threads", str(args.threads)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     start_new_session=True)
        self.torch_threads = self._read()["torch_threads"]

    def _read(self) -> dict[str, Any]:
        while self.proc.stdout is not None:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError("the offline engine process exited")
            if line.startswith("{"):
                return json.loads(line)
        raise RuntimeError("no pipe to the offline engine process")

    def run(self, reqs: list[workload.ChatRequest]) -> dict[str, Any]:
        if self.proc.stdin is None:
            raise RuntimeError("no pipe to the offline engine process")
        self.proc.stdin.write(json.dumps([r.messages for r in reqs]) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(60)


# -- served modes -----------------------------------------------------------------------------------------
def serve_local(port: int, model: str | None, threads: int | None, kv_cache_gb: float,
                quantization: str | None) -> None:
    """Child-process body of ``--mode local``: LocalServer until stdin closes."""
    from chunkserve.router.local_server import LocalServer, local_ingress
    from chunkserve.workers.engine import EngineConfig

    cfg = EngineConfig(model=model, num_threads=threads, kv_cache_gb=kv_cache_gb, quantization=quantization)
    with LocalServer(lambda: local_ingress(cfg, model_name="bench"), http_port=port, grpc_port=None):
        import torch

        print(f"READY engine threads per worker: {torch.get_num_threads()}", flush=True)
        sys.stdin.read()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(mode: str, args: argparse.Namespace) -> tuple[subprocess.Popen, str, str, str]:
    """(process, URL, model name, what it said about its engine threads)."""
    port = _free_port()
    if mode == "local":
        cmd = [sys.executable, __file__, "--serve-local", str(port), "--kv-cache-gb", str(args.kv_cache_gb)]
        if args.quantization:
            cmd += ["--quantization", args.quantization]
        if args.model:
            cmd += ["--model", args.model]
        if args.threads:
            cmd += ["--threads", str(args.threads)]
        ready, model_name = "READY", "bench"
    else:
        cmd = [str(Path(sys.executable).with_name("chunkserve")), "up", "--workers", str(args.workers),
               "--http-port", str(port), "--grpc-port", str(_free_port()), "--front", args.front]
        if args.model:
            cmd += ["--model", args.model]
        engine: dict[str, Any] = {"kv_cache_gb": args.kv_cache_gb}
        if args.quantization:
            engine["quantization"] = args.quantization
        if args.threads:
            engine["num_threads"] = args.threads
        cmd += ["--engine", json.dumps(engine)] + (["--config", args.config] if args.config else [])
        ready, model_name = "chunkserve is up", "smollm2-135m-instruct"
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    deadline = time.monotonic() + 600
    lines: list[str] = []
    threads = "not reported (a Ray actor without num_cpus: OMP_NUM_THREADS=1)"
    while time.monotonic() < deadline:
        line = proc.stdout.readline() if proc.stdout is not None else ""
        if not line and proc.poll() is not None:
            raise RuntimeError(f"{mode} server exited:\n" + "".join(lines[-40:]))
        lines.append(line)
        if "engine threads" in line:
            threads = line.strip()
        if ready in line:
            if mode == "ray":  # `chunkserve up` prints its endpoints (and its engine threads) after this line
                while proc.stdout is not None and "Ctrl-C" not in line:
                    line = proc.stdout.readline()
                    threads = line.strip() if "engine threads" in line else threads
            break
    else:
        raise TimeoutError(f"{mode} server did not start")
    if "engine threads" in line:
        threads = line.strip()
    return proc, f"http://127.0.0.1:{port}", model_name, threads


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        if proc.stdin is not None:
            proc.stdin.close()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def served_once(label: str, url: str, model: str, reqs: list[workload.ChatRequest], pid: int) -> dict[str, Any]:
    """One workload through the server (`chunkserve bench serve`'s client: a warm-up, then all requests
    at once), with the server's CPU seconds per process role and the client's own."""
    plan = Plan(reqs, workload.single_request(), client.Sampling(MAX_TOKENS, 0.0), 1, 0, {}, None, 900.0)
    out = asyncio.run(bench_endpoint(label, url, model, plan, pid))
    res = out["runs"]["pass1"]
    if res["failed"]:
        raise RuntimeError(f"{res['failed']} requests failed: {res['errors']}")
    return res


def run_mode(mode: str, args: argparse.Namespace, convs: dict[str, list[workload.ChatRequest]],
             offline: OfflineProcess) -> dict[str, Any]:
    """Rounds of (served, offline) per workload, alternating, so that both see the same background load."""
    try:
        proc, url, model_name, threads = start_server(mode, args)
    except RuntimeError as e:  # e.g. a free port taken in between by Ray itself: once more, on new ports
        print(f"{mode} server failed to start, retrying: {str(e)[-300:]}", flush=True)
        proc, url, model_name, threads = start_server(mode, args)
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in convs}
    try:
        for _ in range(args.rounds):
            for name, reqs in convs.items():
                try:
                    served = served_once(f"{mode} {name} served", url, model_name, reqs, proc.pid)
                except (RuntimeError, OSError) as e:  # the server died (a shared machine): restart, run once more
                    print(f"{mode} server lost ({e!r}); restarting", flush=True)
                    stop_server(proc)
                    proc, url, model_name, threads = start_server(mode, args)
                    served = served_once(f"{mode} {name} served", url, model_name, reqs, proc.pid)
                off = offline.run(reqs)
                served["ratio_vs_offline"] = round(served["completion_tok_per_s"] / off["completion_tok_per_s"], 3)
                rounds[name].append({"served": served, "offline": off})
                print(f"{mode} {name}: served {json.dumps(served)}\n  offline {json.dumps(off)}", flush=True)
    finally:
        stop_server(proc)
    return {"engine_threads": threads, **rounds}


def _ms(s: dict[str, Any], key: str) -> str:
    return "-" if not s.get(key) else f"{s[key]['p50']:.1f}"


def print_table(results: dict[str, Any], modes: list[str], names: list[str]) -> None:
    print(f"{'run':<15}{'tok/s':>8}{'off tok/s':>10}{'ratio':>7}{'TTFT p50':>10}{'off TTFT':>10}"
          f"{'ms/tok':>8}{'off ms/tok':>11}{'events/req':>11}  cpu_s")
    for mode in modes:
        for name in names:
            for r in results[mode][name]:
                s_, o = r["served"], r["offline"]
                cpu = {**s_.get("server_cpu_s", {}), "client": s_.get("client_cpu_s")}
                print(f"{mode + ' ' + name:<15}{s_['completion_tok_per_s']:>8}{o['completion_tok_per_s']:>10}"
                      f"{s_['ratio_vs_offline']:>7}{_ms(s_, 'ttft_ms'):>10}{_ms(o, 'ttft_ms'):>10}"
                      f"{_ms(s_, 'tpot_ms'):>8}{_ms(o, 'tpot_ms'):>11}{s_['events_per_request']:>11}  {cpu}")
            ratios = [r["served"]["ratio_vs_offline"] for r in results[mode][name]]
            results[mode][f"{name}_ratio_median"] = statistics.median(ratios)
            print(f"{mode + ' ' + name:<15} median ratio {statistics.median(ratios):.3f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=["local", "ray", "both"], default="both")
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    ap.add_argument("--threads", type=int, default=None, help="engine threads (default: each side's own rule)")
    ap.add_argument("--workers", type=int, default=1, help="worker replicas in --mode ray")
    ap.add_argument("--front", choices=FRONTS, default="ray",
                    help="--mode ray: `chunkserve up --front` (Ray Serve's proxy or HAProxy before the ingress)")
    ap.add_argument("--quantization", choices=["int8", "int4"], default=None,
                    help="weight-only quantisation, served and offline alike (default: none)")
    ap.add_argument("--config", default=None, help="--mode ray: `chunkserve up --config` (YAML of AppConfig fields)")
    ap.add_argument("--kv-cache-gb", type=float, default=1.0, help="KV pool per engine (served and offline)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating (served, offline) rounds per workload")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--serve-local", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--serve-offline", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve_local is not None:
        serve_local(args.serve_local, args.model, args.threads, args.kv_cache_gb, args.quantization)
        return 0
    if args.serve_offline:
        serve_offline(args.model, args.threads, args.kv_cache_gb, args.quantization)
        return 0
    convs = workloads()
    offline = OfflineProcess(args)
    results: dict[str, Any] = {"cpu": procs.cpu_model(), "cores": os.cpu_count(), "model": args.model or "embedded",
                               "offline_torch_threads": offline.torch_threads, "load_avg_start": os.getloadavg()}
    modes = ["local", "ray"] if args.mode == "both" else [args.mode]
    try:
        for mode in modes:
            results[mode] = run_mode(mode, args, convs, offline)
            if args.json:
                Path(args.json).write_text(json.dumps(results, indent=1))
    finally:
        offline.close()
    results["load_avg_end"] = os.getloadavg()
    print(f"\nCPU: {results['cpu']} ({results['cores']} cores), load avg {results['load_avg_start'][0]:.1f} -> "
          f"{results['load_avg_end'][0]:.1f}; offline torch threads {offline.torch_threads}; "
          f"served: {results[modes[0]]['engine_threads']}")
    print_table(results, modes, list(convs))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
