"""Sampler microbenchmark (issue 12), and the end-to-end cost of sampling vs greedy.

    python benchmarks/bench_sampling.py                 # sampler alone: batch 1/8/32/128, vocab 49152
                                                        # prints median (min) ms per call
    python benchmarks/bench_sampling.py --threads 1 --clock cpu   # CPU time: for a shared machine
    python benchmarks/bench_sampling.py --e2e           # also LLM(): 32 prompts x 64 tokens, sampled vs greedy

On a shared machine pass --threads 1: the e2e figures then also come as tokens per process-CPU
second, which other processes' load does not inflate (wall-clock tok/s is printed too).

The sampler is timed on two kinds of logits: "lm" (Zipf-shaped and peaked like a language model's,
so a 0.9 nucleus holds tens of tokens) and "randn" (N(0, 3^2): flat, a 0.9 nucleus holds thousands
of tokens, the worst case for the widening topk). The baseline is the pre-issue-12 row loop, copied
below as `BaselineRowLoopSampler` and used only here.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable

import torch

from chunkserve.tools.bench_kernel import cpu_model
from chunkserve.workers.sampler import Sampler
from chunkserve.workers.sampling import SamplingParams

VOCAB = 49152  # SmolLM2
BATCHES = (1, 8, 32, 128)
CONFIGS = {
    "greedy": SamplingParams(temperature=0.0),
    "T0.8 top-p 0.9": SamplingParams(temperature=0.8, top_p=0.9),
    "T0.8 top-k 50": SamplingParams(temperature=0.8, top_k=50),
}


class BaselineRowLoopSampler:
    """BASELINE ONLY: workers/sampler.py as it was before issue 12 (a49c4b8), a loop over rows."""

    def __init__(self, seed: int = 0) -> None:
        self._base = torch.Generator().manual_seed(seed)
        self._gens: dict[str, torch.Generator] = {}

    def forget(self, request_id: str) -> None:
        self._gens.pop(request_id, None)

    def _gen(self, request_id: str, params: SamplingParams) -> torch.Generator:
        g = self._gens.get(request_id)
        if g is None:
            seed = params.seed if params.seed is not None else int(torch.randint(2**62, (1,), generator=self._base))
            g = self._gens[request_id] = torch.Generator().manual_seed(seed)
        return g

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, request_ids: list[str], params: list[SamplingParams]
               ) -> tuple[list[int], list[float]]:
        logits = logits.float().cpu()
        n = logits.shape[0]
        out = [0] * n
        greedy = [i for i in range(n) if params[i].greedy]
        if greedy and len(greedy) == n:
            out = logits.argmax(-1).tolist()
        elif greedy:
            picks = logits.index_select(0, torch.tensor(greedy)).argmax(-1).tolist()
            for i, t in zip(greedy, picks, strict=True):
                out[i] = t
        for i in range(n):
            p = params[i]
            if p.greedy:
                continue
            row = logits[i] / max(p.temperature, 1e-5)  # [V]
            if p.top_k > 0 and p.top_k < row.shape[0]:
                kth = torch.topk(row, p.top_k).values[-1]
                row = row.masked_fill(row < kth, float("-inf"))
            probs = torch.softmax(row, -1)
            if p.top_p < 1.0:
                sp, si = torch.sort(probs, descending=True)
                keep = torch.cumsum(sp, 0) - sp < p.top_p  # always keeps the top token
                mask = torch.zeros_like(probs, dtype=torch.bool)
                mask[si[keep]] = True
                probs = torch.where(mask, probs, torch.zeros_like(probs))
                probs = probs / probs.sum()
            out[i] = int(torch.multinomial(probs, 1, generator=self._gen(request_ids[i], p)))
        want = [i for i in range(n) if params[i].logprobs]
        lps = [0.0] * n
        if want:
            lp = torch.log_softmax(logits.index_select(0, torch.tensor(want)), -1)
            for j, i in enumerate(want):
                lps[i] = float(lp[j, out[i]])
        return out, lps


def make_logits(kind: str, n: int, vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    """[n, vocab] fp32 logits; "lm": log p ~ -1.3 log(rank) + noise, ranks shuffled per row."""
    g = torch.Generator().manual_seed(seed)
    if kind == "randn":
        return torch.randn(n, vocab, generator=g) * 3.0
    ranks = torch.arange(1, vocab + 1, dtype=torch.float32)
    base = 8.0 - 1.3 * torch.log(ranks)  # [vocab]
    rows = [base[torch.randperm(vocab, generator=g)] for _ in range(n)]
    return torch.stack(rows) + 0.3 * torch.randn(n, vocab, generator=g)  # [n, vocab]


def time_ms(fn: Callable[[], object], repeats: int, clock: Callable[[], float]) -> tuple[float, float]:
    """(median, min) ms over `repeats` calls after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = clock()
        fn()
        times.append((clock() - t0) * 1e3)
    return statistics.median(times), min(times)


def bench_sampler(kinds: list[str], repeats: int, clock: Callable[[], float]) -> list[dict[str, object]]:
    rows = []
    for kind in kinds:
        for b in BATCHES:
            logits = make_logits(kind, b)
            ids = [f"r{i}" for i in range(b)]
            for name, p in CONFIGS.items():
                params = [p] * b
                old = BaselineRowLoopSampler()
                new = Sampler()
                r = max(3, repeats // b) if name != "greedy" else repeats  # the old loop is slow at b=128
                t_old, m_old = time_ms(lambda s=old, x=logits, i=ids, p=params: s.sample(x, i, p), r, clock)
                t_new, m_new = time_ms(lambda s=new, x=logits, i=ids, p=params: s.sample(x, i, p), repeats, clock)
                rows.append(dict(logits=kind, batch=b, config=name, old_ms=t_old, new_ms=t_new,
                                 old_min_ms=m_old, new_min_ms=m_new))
                print(f"{kind:>5} b={b:<4d} {name:<15} old {t_old:9.2f} ({m_old:8.2f}) ms   "
                      f"new {t_new:7.2f} ({m_new:7.2f}) ms   x{t_old / t_new:6.1f}", flush=True)
    return rows


def bench_e2e(rounds: int, baseline: bool, batch: int = 32, max_tokens: int = 64) -> dict[str, float]:
    """LLM() on the embedded model: tok/s of `batch` prompts x `max_tokens`, sampled vs greedy."""
    from chunkserve import LLM

    llm = LLM()
    prompts = [f"Write a short story number {i} about a {w} who" for i, w in
               enumerate(["cat", "robot", "sailor", "baker"] * (batch // 4))][:batch]
    cases = {
        "greedy": SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
        "T0.8 top-p 0.9": SamplingParams(max_tokens=max_tokens, temperature=0.8, top_p=0.9, ignore_eos=True),
    }
    samplers: dict[str, object] = {"new": llm.engine.sampler}
    if baseline:
        samplers["old (baseline)"] = BaselineRowLoopSampler()
    llm.generate(prompts[:4], cases["greedy"])  # warm-up
    best: dict[str, float] = {}
    for _ in range(rounds):
        for sname, sampler in samplers.items():
            llm.engine.sampler = sampler
            for cname, p in cases.items():
                if sname != "new" and cname == "greedy":
                    continue  # greedy is the same argmax in both
                t0, c0 = time.perf_counter(), time.process_time()
                outs = llm.generate(prompts, p)
                dt, dc = time.perf_counter() - t0, time.process_time() - c0
                n_tok = sum(len(o.token_ids) for o in outs)
                for clock, d in (("wall", dt), ("cpu", dc)):
                    key = f"{cname} [{sname}] {clock}"
                    best[key] = max(best.get(key, 0.0), n_tok / d)
                print(f"  e2e {cname} [{sname}]: {n_tok} tokens in {dt:6.2f} s wall = {n_tok / dt:7.1f} tok/s; "
                      f"{dc:6.2f} s process CPU = {n_tok / dc:7.1f} tok/CPU-s", flush=True)
    llm.engine.sampler = samplers["new"]
    for key, v in best.items():
        g = best[f"greedy [new] {key.rsplit(' ', 1)[1]}"]
        print(f"e2e best {key:<36} {v:7.1f} tok/s  = {v / g:.3f}x greedy")
    return best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="cpu: this thread's CPU time (needs --threads 1; robust to other processes' load)")
    ap.add_argument("--logits", choices=["lm", "randn", "both"], default="both")
    ap.add_argument("--e2e", action="store_true", help="also time LLM() end to end")
    ap.add_argument("--e2e-only", action="store_true")
    ap.add_argument("--e2e-baseline", action="store_true", help="e2e also with the old row-loop sampler (slow)")
    ap.add_argument("--rounds", type=int, default=2, help="e2e rounds (best of)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.clock == "cpu" and torch.get_num_threads() != 1:
        raise ValueError("--clock cpu measures one thread: pass --threads 1")
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    print(f"CPU: {cpu_model()}  (os.cpu_count={os.cpu_count()}, torch threads={torch.get_num_threads()}, "
          f"torch {torch.__version__}, clock={args.clock})")
    res: dict[str, object] = {"cpu": cpu_model(), "threads": torch.get_num_threads(), "clock": args.clock}
    if not args.e2e_only:
        kinds = ["lm", "randn"] if args.logits == "both" else [args.logits]
        res["sampler"] = bench_sampler(kinds, args.repeats, clock)
    if args.e2e or args.e2e_only:
        res["e2e_tok_s"] = bench_e2e(args.rounds, args.e2e_baseline)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
