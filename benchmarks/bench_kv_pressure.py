"""KV pressure (issue 14 item 4): 32 requests through a 1,152-token pool, one worker's scheduler.

The real `Scheduler` over a real `PrefixKVCache` (18 chunks of 64 tokens), driven without a model
(`workers/sched_sim.py` logic: every planned sampling row gets a token), so waits are counted in
engine steps and do not depend on the machine's load. One arrival every ``--every`` steps; prompts of
150-600 tokens with 64-192-token answers, so several requests fit at once and then their decodes
outgrow the pool and force preemptions. Per request: wait = arrival -> first token (steps), and
"overtaken" = later arrivals whose first token came first. Targets: p99 wait <= 3x the median, nobody
overtaken by more than ``max_num_seqs`` later arrivals. ``--rev REV`` runs the scheduler of a git
revision instead (the "before" row), e.g. ``--rev 87713f8``.

    python benchmarks/bench_kv_pressure.py [--rev REV] [--max-num-seqs 64 8 4] [--tenants 1]
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType

import torch

from chunkserve.workers.kvcache import PrefixKVCache
from chunkserve.workers.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[1]


def scheduler_module(rev: str | None) -> ModuleType:
    if rev is None:
        from chunkserve.workers import scheduler
        return scheduler
    src = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:workers/scheduler.py"], check=True,
                         capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "scheduler_rev.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("scheduler_rev", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["scheduler_rev"] = mod
    spec.loader.exec_module(mod)
    return mod


def run(mod: ModuleType, max_num_seqs: int, n: int = 32, every: int = 2, tenants: int = 1, seed: int = 0,
        max_steps: int = 50_000, prompt: tuple[int, int] = (150, 600), output: tuple[int, int] = (64, 192)) -> dict:
    cache = PrefixKVCache(num_layers=1, num_kv_heads=1, head_dim=8, chunk_size=64, num_chunks=18,
                          dtype=torch.float32)
    sched = mod.Scheduler(cache, mod.SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=max_num_seqs))
    has_tenant = "tenant" in {f.name for f in dataclasses.fields(mod.Request)}
    rng = random.Random(seed)
    work = [([rng.randrange(100, 40000) for _ in range(rng.randint(*prompt))], rng.randint(*output))
            for _ in range(n)]
    arrival: dict[str, int] = {}
    first: dict[str, int] = {}
    done: dict[str, int] = {}
    step = nxt = 0
    while (nxt < n or sched.has_work()) and step < max_steps:
        while nxt < n and step >= nxt * every:
            rid = f"r{nxt:02d}"
            kw = {"tenant": f"t{nxt % tenants}"} if has_tenant else {}
            prompt, max_tokens = work[nxt]
            sched.add(mod.Request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                                  f"t{nxt % tenants}".encode(), **kw))
            arrival[rid] = step
            nxt += 1
        cache.begin_step()
        try:
            plan = sched.schedule()
        finally:
            cache.end_step()
        step += 1
        for r in [p.req for p in plan.prefills if p.samples] + list(plan.decodes):
            r.output.append(7)
            first.setdefault(r.request_id, step)
            if len(r.output) >= r.params.max_tokens:
                sched.finish(r, "length")
                done[r.request_id] = step
    ids = sorted(arrival)
    waits = [first.get(r, step) - arrival[r] for r in ids]
    overtaken = [sum(1 for s in ids if arrival[s] > arrival[r] and first.get(s, step + 1) < first.get(r, step))
                 for r in ids]
    # finished before an earlier arrival finished (a request that starts but is preempted over and over)
    passed = [sum(1 for s in ids if arrival[s] > arrival[r] and done.get(s, step + 1) < done.get(r, step))
              for r in ids]
    latency = [done.get(r, step) - arrival[r] for r in ids]
    med = statistics.median(waits)
    p99 = sorted(waits)[round(0.99 * (len(waits) - 1))]
    return {"max_num_seqs": max_num_seqs, "tenants": tenants, "requests": n, "finished": len(done),
            "steps": step, "preemptions": sched.num_preemptions, "wait_median_steps": med,
            "wait_p99_steps": p99, "wait_max_steps": max(waits), "p99_over_median": p99 / med if med else 0.0,
            "max_overtaken": max(overtaken), "max_finished_after_later": max(passed),
            "latency_median_steps": statistics.median(latency), "latency_max_steps": max(latency)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rev", default=None, help="git revision whose workers/scheduler.py to run")
    ap.add_argument("--max-num-seqs", type=int, nargs="+", default=[64, 8, 4])
    ap.add_argument("--every", type=int, default=2, help="steps between arrivals")
    ap.add_argument("--tenants", type=int, default=1)
    ap.add_argument("--prompt", type=int, nargs=2, default=[150, 600], help="prompt length range")
    ap.add_argument("--output", type=int, nargs=2, default=[64, 192], help="answer length range")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    mod = scheduler_module(args.rev)
    rows = []
    print(f"scheduler: {args.rev or 'working tree'}")
    print(f"{'max_num_seqs':>12} {'finished':>8} {'preempt':>7} {'median':>7} {'p99':>6} {'max':>6} "
          f"{'p99/med':>7} {'max overtaken':>13} {'done-after-later':>16} {'lat med':>7} {'lat max':>7}")
    for m in args.max_num_seqs:
        r = run(mod, m, every=args.every, tenants=args.tenants, prompt=tuple(args.prompt),
                output=tuple(args.output))
        rows.append(r)
        print(f"{m:>12} {r['finished']:>8} {r['preemptions']:>7} {r['wait_median_steps']:>7.1f} "
              f"{r['wait_p99_steps']:>6} {r['wait_max_steps']:>6} {r['p99_over_median']:>7.2f} "
              f"{r['max_overtaken']:>13} {r['max_finished_after_later']:>16} {r['latency_median_steps']:>7.0f} "
              f"{r['latency_max_steps']:>7}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
