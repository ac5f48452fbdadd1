"""Fair share benchmark (issue 16): a heavy tenant (10x the request rate, 4x longer prompts) next to a light one.

Starts ``chunkserve up`` (one worker, so both tenants share one scheduler) twice: with the VTC fair share
(the default) and with first come, first served (``--engine '{"fair_share": false}'``). Under fair share
it first runs the light tenant alone, then both; under FCFS both. Open-loop Poisson arrivals, streaming
chat requests with distinct prompts (no prefix reuse hides the load). Prints per run and tenant the
TTFT p50/p95, the requests finished, and the total throughput (prompt + output tokens of the requests
finished in the window, per second), then the two targets: light TTFT p95 (both, fair) / p95 (alone)
<= 1.5 and throughput (fair) / throughput (FCFS) >= 0.95.

    python -m chunkserve.loadtests.fairness [--duration 60] [--light-rate 0.3] [--light-tokens 200]
        [--url http://127.0.0.1:8000 --tenants-keys light=key-light,heavy=key-heavy]  # an existing cluster
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx2

WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet", "kilo",
         "lima", "mike", "november", "oscar", "papa", "quebec", "romeo", "sierra", "tango")


@dataclass
class Result:
    tenant: str
    ttft: list[float] = field(default_factory=list)
    finished: int = 0
    failed: int = 0
    tokens: int = 0  # prompt + output tokens of finished requests
    errors: dict[str, int] = field(default_factory=dict)  # failure reason -> count

    def fail(self, why: str) -> None:
        self.failed += 1
        self.errors[why] = self.errors.get(why, 0) + 1


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, round(q / 100 * (len(s) - 1)))]


async def one(client: httpx2.AsyncClient, model: str, key: str, words: int, rng: random.Random, res: Result,
              deadline: float) -> None:
    prompt = " ".join(rng.choice(WORDS) + str(rng.randrange(1000)) for _ in range(words))
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 16,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.monotonic()
    first = None
    usage = None
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body,
                                 headers={"Authorization": f"Bearer {key}"}) as r:
            if r.status_code != 200:
                res.fail(f"HTTP {r.status_code}: {(await r.aread())[:120]!r}")
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ev = json.loads(line[6:])
                if first is None and ev.get("choices"):
                    first = time.monotonic()
                if ev.get("usage"):
                    usage = ev["usage"]
    except asyncio.CancelledError:
        res.fail("unfinished at the end of the drain")
        return
    except httpx2.HTTPError as e:
        res.fail(type(e).__name__)
        return
    if first is not None:
        res.ttft.append(first - t0)
    if usage is not None and time.monotonic() <= deadline:
        res.finished += 1
        res.tokens += usage["prompt_tokens"] + usage["completion_tokens"]


async def run_load(url: str, tenants: dict[str, tuple[str, float, int]], duration: float, seed: int = 0
                   ) -> tuple[dict[str, Result], float]:
    """tenants: name -> (api key, requests/s, prompt words). -> results, window seconds."""
    results = {name: Result(name) for name in tenants}
    rng = random.Random(seed)
    limits = httpx2.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx2.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        r = await client.get("/v1/models", headers={"Authorization": f"Bearer {next(iter(tenants.values()))[0]}"})
        model = r.json()["data"][0]["id"]  # the served model's name
        t0 = time.monotonic()
        deadline = t0 + duration + 30  # requests finishing in the drain count for throughput
        tasks: list[asyncio.Task] = []

        async def source(name: str, key: str, rate: float, words: int) -> None:
            local = random.Random(rng.random())
            while time.monotonic() - t0 < duration:
                await asyncio.sleep(local.expovariate(rate))
                tasks.append(asyncio.create_task(one(client, model, key, words, local, results[name], deadline)))

        await asyncio.gather(*(source(n, k, rt, w) for n, (k, rt, w) in tenants.items()))
        _, pending = await asyncio.wait(tasks, timeout=30) if tasks else (set(), set())
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        window = time.monotonic() - t0
    return results, window



def launch(tenants_file: str, fair: bool, port: int, model: str | None, engine: dict,
           max_ongoing: int) -> subprocess.Popen:
    exe = Path(sys.executable).with_name("chunkserve")
    config = Path(tenants_file).with_name("app.yaml")
    config.write_text(f"max_ongoing_requests: {max_ongoing}\n")
    cmd = [str(exe), "up", "--workers", "1", "--tenants", tenants_file, "--http-port", str(port),
           "--grpc-port", str(port + 1), "--engine", json.dumps({**engine, "fair_share": fair}),
           "--config", str(config)]
    if model:
        cmd += ["--model", model]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def wait_ready(url: str, key: str, timeout: float = 900) -> None:
    """Until the served model answers a one-token chat (the proxies answer 404 while the app deploys)."""
    t_end = time.monotonic() + timeout
    auth = {"Authorization": f"Bearer {key}"}
    while time.monotonic() < t_end:
        try:
            r = httpx2.get(url + "/v1/models", headers=auth, timeout=10)
            if r.status_code == 200:
                model = r.json()["data"][0]["id"]
                r = httpx2.post(url + "/v1/chat/completions", timeout=300, headers=auth,
                                json={"model": model, "max_tokens": 1,
                                      "messages": [{"role": "user", "content": "hi"}]})
                if r.status_code == 200:
                    return
        except (httpx2.HTTPError, ValueError, KeyError, IndexError):
            pass
        time.sleep(3)
    raise TimeoutError("chunkserve up did not become ready")


def stop(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def report(label: str, res: dict[str, Result], window: float) -> float:
    total = sum(r.tokens for r in res.values()) / window
    for r in res.values():
        print(f"{label:<14} {r.tenant:<6} ttft p50 {pct(r.ttft, 50):7.2f} s  p95 {pct(r.ttft, 95):7.2f} s  "
              f"finished {r.finished:4d}  failed {r.failed:3d} {r.errors or ''}")
    print(f"{label:<14} total throughput {total:8.1f} tokens/s over {window:.0f} s")
    return total


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=60)
    ap.add_argument("--light-rate", type=float, default=0.3)
    ap.add_argument("--light-words", type=int, default=60, help="prompt words of the light tenant (heavy: 4x)")
    ap.add_argument("--port", type=int, default=18000)
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    ap.add_argument("--max-ongoing", type=int, default=1024,
                    help="the worker deployment's max_ongoing_requests: requests beyond it wait in Ray Serve's "
                         "first-come queue, out of the fair scheduler's sight")
    ap.add_argument("--engine", default='{"max_num_seqs": 8, "max_num_batched_tokens": 256}',
                    help="EngineConfig fields (JSON) for both runs")
    args = ap.parse_args(argv)
    from chunkserve.router.tenants import hash_api_key

    keys = {"light": "key-light", "heavy": "key-heavy"}
    tmp = tempfile.mkdtemp()
    tenants_file = os.path.join(tmp, "tenants.yaml")
    Path(tenants_file).write_text("tenants:\n" + "".join(
        f"  - id: {t}\n    api_key_sha256: [{hash_api_key(k)}]\n" for t, k in keys.items()))
    light = (keys["light"], args.light_rate, args.light_words)
    heavy = (keys["heavy"], 10 * args.light_rate, 4 * args.light_words)
    url = f"http://127.0.0.1:{args.port}"
    print(f"light: {args.light_rate} req/s x {args.light_words} words; heavy: {10 * args.light_rate} req/s x "
          f"{4 * args.light_words} words; 16 output tokens; {args.duration:.0f} s per run; one worker; "
          f"model {args.model or 'embedded SmolLM2'}; engine {args.engine}; worker max_ongoing_requests "
          f"{args.max_ongoing}")
    out: dict[str, float] = {}
    for fair in (True, False):
        proc = launch(tenants_file, fair, args.port, args.model, json.loads(args.engine), args.max_ongoing)
        try:
            wait_ready(url, keys["light"])
            if fair:
                res, win = asyncio.run(run_load(url, {"light": light}, args.duration, seed=1))
                report("light alone", res, win)
                out["alone_p95"] = pct(res["light"].ttft, 95)
            res, win = asyncio.run(run_load(url, {"light": light, "heavy": heavy}, args.duration, seed=2))
            label = "VTC" if fair else "FCFS"
            out[f"{label}_tput"] = report(label, res, win)
            out[f"{label}_light_p95"] = pct(res["light"].ttft, 95)
        finally:
            stop(proc)
    print(f"light p95 / alone p95: VTC {out['VTC_light_p95'] / out['alone_p95']:.2f} (target <= 1.5), "
          f"FCFS {out['FCFS_light_p95'] / out['alone_p95']:.2f}")
    print(f"throughput VTC / FCFS: {out['VTC_tput'] / out['FCFS_tput']:.3f} (target >= 0.95)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
