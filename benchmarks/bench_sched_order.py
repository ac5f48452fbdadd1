"""Prefill order, measured on one `EngineCore` (no serving path): the scheduler's effect alone.

    python benchmarks/bench_sched_order.py burst [--fcfs] [--quantum Q] [--one-tenant] [--quantization int8]
        One worker's share of the first pass of `chunkserve bench serve --tenants 4 --requests-per-tenant 8
        --system-tokens 1000`: 2 tenants x 8 chats, all at once, embedded SmolLM2, int4 (``--quantization int8``:
        what `benchmarks/compare_llama.sh` serves), 1 thread. Prints each chat's time to first token, per tenant,
        and the mean.
    python benchmarks/bench_sched_order.py open-loop [--fcfs] [--quantum Q] [--rate R]
        A heavy tenant at 10x a light one's rate with 537- against 141-token prompts (distinct), Poisson
        arrivals on the wall clock for 30 s (`random:tiny`, max_num_seqs 8, 256-token steps, 1 thread):
        throughput, steps, the scheduler's own time, TTFT p50 / p95 per tenant.

Compare trees by running the same command on each, alternated: this machine's speed drifts.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from chunkserve.tools import workload
from chunkserve.tools.procs import cpu_model
from chunkserve.workers.engine import EngineCore
from chunkserve.workers.engine_config import EngineConfig
from chunkserve.workers.sampling import SamplingParams


def _timed_schedule(eng: EngineCore) -> list[float]:
    spent = [0.0]
    plan = eng.scheduler.schedule

    def timed():  # type: ignore[no-untyped-def]
        t = time.perf_counter()
        out = plan()
        spent[0] += time.perf_counter() - t
        return out

    eng.scheduler.schedule = timed  # type: ignore[method-assign]
    return spent


def _q(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))]


def burst(args: argparse.Namespace) -> dict:
    eng = EngineCore(EngineConfig(quantization=args.quantization, num_threads=1, fair_share=not args.fcfs,
                                  fair_quantum=args.quantum))
    spec = workload.WorkloadSpec(tenants=2, requests_per_tenant=8, system_tokens=1000, prompt_salt=args.salt)
    reqs = workload.chat_requests(spec, workload.load_counter(None))
    t0 = time.monotonic()
    rs = []
    for i, r in enumerate(reqs):
        ids = eng.tokenizer.apply_chat_template(r.messages, add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"]) if not isinstance(ids, list) else ids
        tenant = "public" if args.one_tenant else r.tenant
        rs.append((r.tenant, eng.add_request(f"r{i}", ids, SamplingParams(max_tokens=64, ignore_eos=True),
                                             salt=tenant.encode(), tenant=tenant)))
    tokens = 0
    while eng.has_work():
        tokens += len(eng.step())
    wall = time.monotonic() - t0
    ttft = {t: [round(r.first_token_time - t0, 2) for tt, r in rs if tt == t] for t, _ in rs}
    every = [x for xs in ttft.values() for x in xs]
    return {"wall_s": round(wall, 2), "tok_per_s": round(tokens / wall, 1), "ttft_mean_s": round(statistics.mean(every), 2),
            "ttft_p50_s": round(statistics.median(every), 2), "ttft_s": ttft}


def open_loop(args: argparse.Namespace) -> dict:
    eng = EngineCore(EngineConfig(model="random:tiny", num_threads=1, fair_share=not args.fcfs,
                                  fair_quantum=args.quantum, max_num_seqs=8, max_num_batched_tokens=256))
    spent = _timed_schedule(eng)
    rng = random.Random(0)
    vocab = eng.model_config.vocab_size
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    arrivals, t = [], 0.0
    for i in range(int(args.rate * 30)):
        t += rng.expovariate(args.rate)
        light = rng.random() < 1 / 11
        tenant = "light" if light else "heavy"
        arrivals.append((t, f"{tenant}{i}", [rng.randrange(5, vocab) for _ in range(141 if light else 537)], tenant))
    sent: dict[str, float] = {}
    first: dict[str, float] = {}
    t0, k, tokens = time.perf_counter(), 0, 0
    while k < len(arrivals) or eng.has_work():
        while k < len(arrivals) and arrivals[k][0] <= time.perf_counter() - t0:
            _, rid, prompt, tenant = arrivals[k]
            eng.add_request(rid, prompt, params, salt=tenant.encode(), tenant=tenant)
            sent[rid] = time.perf_counter()
            k += 1
        if not eng.has_work():
            time.sleep(0.001)
            continue
        for out in eng.step():
            tokens += 1
            first.setdefault(out.req.request_id, time.perf_counter())
    wall = time.perf_counter() - t0
    res: dict = {"wall_s": round(wall, 1), "tok_per_s": round(tokens / wall, 1), "steps": eng.num_steps,
                 "schedule_s": round(spent[0], 2)}
    for tenant in ("light", "heavy"):
        waits = [first[r] - sent[r] for r in sent if r.startswith(tenant)]
        res[f"{tenant}_ttft_ms"] = {"p50": round(_q(waits, 0.5) * 1000), "p95": round(_q(waits, 0.95) * 1000)}
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["burst", "open-loop"])
    ap.add_argument("--fcfs", action="store_true", help="first come, first served (fair_share off)")
    ap.add_argument("--quantum", type=float, default=EngineConfig().fair_quantum, help="EngineConfig.fair_quantum")
    ap.add_argument("--one-tenant", action="store_true", help="burst: every chat as tenant 'public' (open mode)")
    ap.add_argument("--salt", default="bench", help="burst: system prompt salt")
    ap.add_argument("--quantization", choices=["int4", "int8"], default="int4", help="burst: the layers' block format")
    ap.add_argument("--rate", type=float, default=30.0, help="open-loop: requests per second")
    args = ap.parse_args()
    torch.set_num_threads(1)
    res = burst(args) if args.mode == "burst" else open_loop(args)
    print(json.dumps({"mode": args.mode, "fcfs": args.fcfs, "quantum": args.quantum, "cpu": cpu_model(),
                      "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), **res}))


if __name__ == "__main__":
    main()
