"""`chunkserve bench e2e`: the paper's end-to-end table on this machine, systems side by side.

Workload: b concurrent requests of n_p prompt tokens whose first n_s tokens are shared, each
generating n_c tokens (greedy, EOS ignored), plus a Poisson-arrival variant. Systems, in one run and in
the same dtype and torch thread count: chunkserve with TPP and prefix sharing; chunkserve with sharing
off (paged attention reading every chunk in place, no prefix reuse: vLLM without prefix caching);
Hugging Face transformers' batched `generate` (one padding-free batch) with its `StaticCache` and with
its default `DynamicCache`, its linear weights prepacked for oneDNN as ours are. Ratios use the faster.

Measured per system: decode latency (ms per step of the running batch, i.e. per output token of a
request) and decode tokens/s over pure decode steps only (steps that also ran prefill tokens are
excluded); end-to-end tokens/s; mean TTFT from each request's arrival; peak KV bytes (chunks in
use at the peak, or HF's cache size); peak decode batch.
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import os
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from chunkserve.tools.bench_util import make_prompts, prepack_hf_linears
from chunkserve.workers.engine import EngineConfig, EngineCore
from chunkserve.workers.sampling import SamplingParams
from chunkserve.workers.weights import LoadedModel, embedded_checkpoint_dir, load_model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def engine_config(loaded: LoadedModel, prompts: list[list[int]], n_c: int, share: bool, chunk: int,
                  threads: int | None) -> EngineConfig:
    """Room for every request unshared (so neither system preempts), the same budget for both."""
    kv_tokens = sum(len(p) + n_c for p in prompts)
    return EngineConfig(chunk_size=chunk, share_prefix=share, attention_backend="torch" if share else "paged-torch",
                        num_kv_chunks=kv_tokens // chunk + 2 * len(prompts) + 8, max_num_batched_tokens=2048,
                        max_num_seqs=len(prompts), num_threads=threads)


def run_engine(loaded: LoadedModel, prompts: list[list[int]], n_c: int, share: bool, chunk: int,
               rate: float | None = None, seed: int = 0, threads: int | None = None) -> dict[str, Any]:
    """Serve the prompts on a fresh engine; arrivals all at t=0, or Poisson at ``rate`` req/s."""
    core = EngineCore(engine_config(loaded, prompts, n_c, share, chunk, threads), loaded=loaded)
    params = SamplingParams(max_tokens=n_c, temperature=0.0, ignore_eos=True)
    rng = random.Random(seed)
    arrivals, t = [], 0.0
    for _ in prompts:
        arrivals.append(t)
        if rate:
            t += rng.expovariate(rate)
    start = time.perf_counter()
    added = 0
    first: dict[int, float] = {}  # request -> time to its first token
    done: dict[int, float] = {}  # request -> finish time
    decode_time, decode_tokens, decode_steps, peak_batch = 0.0, 0, 0, 0
    step_rates: list[float] = []  # tokens/s of each pure decode step (the median resists load bursts)
    while len(done) < len(prompts):
        now = time.perf_counter() - start
        while added < len(prompts) and arrivals[added] <= now:
            core.add_request(str(added), prompts[added], params)
            added += 1
        if not core.has_work():
            time.sleep(max(0.0, arrivals[added] - now))
            continue
        ran_before = core.runner.tokens_computed
        t0 = time.perf_counter()
        outs = core.step()
        dt = time.perf_counter() - t0
        ran = core.runner.tokens_computed - ran_before
        n_dec = sum(1 for o in outs if len(o.req.output) > 1)
        if outs and n_dec == len(outs) == ran:  # every row of the step was a decode row
            decode_time += dt
            decode_tokens += n_dec
            decode_steps += 1
            step_rates.append(n_dec / dt)
        peak_batch = max(peak_batch, n_dec)
        t_now = time.perf_counter() - start
        for o in outs:
            rid = int(o.req.request_id)
            first.setdefault(rid, t_now - arrivals[rid])
            if o.finish_reason:
                done[rid] = t_now
    total = time.perf_counter() - start
    st = core.stats()
    return {"total_s": total, "ttft_s": statistics.fmean(first.values()), "ttft_max_s": max(first.values()),
            "decode_ms_per_token": 1e3 * decode_time / max(1, decode_steps),
            "decode_tok_s": decode_tokens / decode_time if decode_time else 0.0,
            "decode_tok_s_median": statistics.median(step_rates) if step_rates else 0.0,
            "tok_s": len(prompts) * n_c / total, "peak_kv_bytes": st["peak_kv_bytes"], "peak_batch": peak_batch,
            "cached_tokens": st["prefix_cached_tokens"], "decode_steps": decode_steps}


class _StepClock:
    """A logits processor that timestamps every generation step of HF `generate` (after its forward)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.times.append(time.perf_counter())
        return scores


def run_hf(prompts: list[list[int]], n_c: int, dtype: torch.dtype, static: bool = False) -> dict[str, Any]:
    """One batched greedy `generate` in ``dtype``; TTFT and per-step times from the same call.

    static: HF's `StaticCache` (K/V preallocated for prompt + n_c tokens and written in place) instead of
    the default `DynamicCache`, which concatenates every layer's K/V on every step.
    """
    from transformers import AutoModelForCausalLM, LogitsProcessorList

    model = AutoModelForCausalLM.from_pretrained(embedded_checkpoint_dir(), dtype=dtype).eval()
    prepack_hf_linears(model, len(prompts))  # set up as well as ours (`bench_util.prepack_hf_linears`)
    ids = torch.tensor(prompts)
    clock = _StepClock()
    cache_kw: dict[str, Any] = {"cache_implementation": "static"} if static else {}
    with torch.inference_mode():
        model.generate(ids[:1, :8], max_new_tokens=2, do_sample=False, pad_token_id=0, **cache_kw)  # warm-up
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=n_c, min_new_tokens=n_c, do_sample=False, pad_token_id=0,
                       logits_processor=LogitsProcessorList([clock]), **cache_kw)
        total = time.perf_counter() - t0
    if len(clock.times) != n_c:
        raise RuntimeError(f"expected {n_c} generation steps from HF generate, timed {len(clock.times)}")
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv = (2 * cfg.num_hidden_layers * len(prompts) * (len(prompts[0]) + n_c) * cfg.num_key_value_heads * head_dim
          * torch.finfo(dtype).bits // 8)
    dec = clock.times[-1] - clock.times[0]
    rates = [len(prompts) / (b - a) for a, b in zip(clock.times, clock.times[1:], strict=False)]
    return {"total_s": total, "ttft_s": clock.times[0] - t0, "ttft_max_s": clock.times[0] - t0,
            "decode_ms_per_token": 1e3 * dec / (n_c - 1), "decode_tok_s": len(prompts) * (n_c - 1) / dec,
            "decode_tok_s_median": statistics.median(rates),
            "tok_s": len(prompts) * n_c / total, "peak_kv_bytes": kv, "peak_batch": len(prompts),
            "cached_tokens": 0, "decode_steps": n_c - 1}


def ttft_cached_vs_uncached(loaded: LoadedModel, n_p: int, chunk: int, threads: int | None,
                            reps: int = 3) -> dict[str, float]:
    """TTFT of one request whose n_p-token system prompt is cached, against a fresh one uncached.

    One warm engine; each repetition uses a new system prompt (so "uncached" is a true miss), and
    the medians are reported."""
    vocab = loaded.config.vocab_size
    core = EngineCore(EngineConfig(chunk_size=chunk, num_kv_chunks=4 * reps * (n_p // chunk + 4),
                                   max_num_batched_tokens=2048, num_threads=threads), loaded=loaded)
    p = SamplingParams(max_tokens=1, temperature=0.0)

    def one(rid: str, toks: list[int]) -> float:
        t0 = time.perf_counter()
        core.add_request(rid, toks, p)
        while core.has_work():
            core.step()
        return time.perf_counter() - t0

    one("warm", make_prompts(1, 256, 0, vocab, 1)[0])
    unc, cac = [], []
    for r in range(reps):
        sys_prompt = make_prompts(1, n_p, n_p, vocab, 99 + r)[0]
        unc.append(one(f"u{r}", sys_prompt + [7, 8, 9]))
        cac.append(one(f"c{r}", sys_prompt + [10, 11, 12]))
    u, c = statistics.median(unc), statistics.median(cac)
    return {"ttft_uncached_s": u, "ttft_cached_s": c, "speedup": u / c}


class HFStaticStepper:
    """HF's model driven step by step over a `StaticCache` (what `generate` does per step, minus its
    bookkeeping): prefill the whole batch, then one greedy decode step per call. Its linear weights are
    prepacked for oneDNN as ours are (`prepack_hf_linears`)."""

    def __init__(self, prompts: list[list[int]], n_c: int, dtype: torch.dtype) -> None:
        from transformers import AutoModelForCausalLM, StaticCache

        self.model = AutoModelForCausalLM.from_pretrained(embedded_checkpoint_dir(), dtype=dtype).eval()
        self.packed = prepack_hf_linears(self.model, len(prompts))
        ids = torch.tensor(prompts)  # [b, n_p]
        cache = StaticCache(config=self.model.config, max_cache_len=ids.shape[1] + n_c + 1)
        # transformers >= 5.x names the argument `cache`; earlier releases `past_key_values`
        name = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"
        self.kw: dict[str, Any] = {name: cache, "use_cache": True}
        self.pos = ids.shape[1]
        with torch.inference_mode():
            out = self.model(input_ids=ids, cache_position=torch.arange(self.pos), **self.kw)
        self.next = out.logits[:, -1].argmax(-1, keepdim=True)  # [b, 1]

    def step(self) -> None:
        with torch.inference_mode():
            out = self.model(input_ids=self.next, cache_position=torch.tensor([self.pos]), **self.kw)
        self.next = out.logits[:, -1].argmax(-1, keepdim=True)
        self.pos += 1


def interleaved_decode(loaded: LoadedModel, b: int, n_p: int, n_s: int, chunk: int, threads: int | None,
                       steps: int = 10, hf: bool = False) -> dict[str, float]:
    """Median decode step time of TPP and paged (and HF StaticCache) on the same prompts, steps alternated.

    Every system prefills first; then one decode step of each in turn, so all see the same load
    (for a noisy shared machine, where back-to-back runs see different load). Every measured step
    runs all b rows: requests that finished prefill early keep decoding (max_tokens covers the
    prefill phase), and a step with fewer rows is an error, not a figure."""
    prompts = make_prompts(b, n_p, n_s, loaded.config.vocab_size, 3)
    cfg = engine_config(loaded, prompts, steps + 2, True, chunk, threads)
    n_c = steps + 2 + -(-b * n_p // cfg.max_num_batched_tokens) + b  # decode steps while others still prefill
    stepper: dict[str, Any] = {}
    cores: dict[str, EngineCore] = {}
    for name, share in (("tpp", True), ("paged", False)):
        core = EngineCore(engine_config(loaded, prompts, n_c, share, chunk, threads), loaded=loaded)
        for i, p in enumerate(prompts):
            core.add_request(str(i), p, SamplingParams(max_tokens=n_c, temperature=0.0, ignore_eos=True))
        while core.scheduler.waiting or any(r.prefilling or not r.output for r in core.scheduler.running):
            core.step()
        stepper[name], cores[name] = core.step, core
    if hf:
        stepper["hf_static"] = HFStaticStepper(prompts, steps + 2, loaded.model.dtype).step
    times: dict[str, list[float]] = {k: [] for k in stepper}
    for _ in range(steps):
        for name, step in stepper.items():
            if name in cores and len(cores[name].scheduler.running) != b:
                raise RuntimeError(f"{name}: {len(cores[name].scheduler.running)} of {b} rows running; "
                                   "the step times would not compare like with like")
            t0 = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    res = {"b": b, "n_p": n_p, "n_s": n_s, "steps": steps, "tpp_step_ms": 1e3 * med["tpp"],
           "paged_step_ms": 1e3 * med["paged"], "tpp_speedup": med["paged"] / med["tpp"]}
    if hf:  # also the median of the per-round ratios: a slow phase of the machine hits both steps of a round
        paired = statistics.median(h / t for h, t in zip(times["hf_static"], times["tpp"], strict=True))
        res |= {"hf_static_step_ms": 1e3 * med["hf_static"], "tpp_vs_hf_static": med["hf_static"] / med["tpp"],
                "tpp_vs_hf_static_paired": paired}
    return res


def warm_up(loaded: LoadedModel, chunk: int, threads: int | None) -> None:
    """A short run of both attention paths, so one-time costs do not land on the first system."""
    prompts = make_prompts(4, 200, 128, loaded.config.vocab_size, 5)
    for share in (True, False):
        run_engine(loaded, prompts, 4, share, chunk, threads=threads)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="chunkserve bench e2e", description=__doc__)
    ap.add_argument("--quick", action="store_true", help="n_p=1024 only, b=16, n_c=32, no HF at n_s=0")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--n-c", type=int, default=64)
    ap.add_argument("--chunk-size", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads for every system (default 1: robust on a shared machine)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="dtype of the main table")
    ap.add_argument("--extra-dtype", default="bfloat16",
                    help="also run the n_s=n_p burst rows of the smallest n_p in this dtype ('' for none)")
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--hf-static-only", action="store_true", help="HF with StaticCache only (skip DynamicCache)")
    ap.add_argument("--n-p", type=int, nargs="+", default=None, help="prompt lengths (default 1024 2048)")
    ap.add_argument("--no-ttft", action="store_true", help="skip the cached-vs-uncached TTFT check")
    ap.add_argument("--no-poisson", action="store_true")
    ap.add_argument("--interleaved", type=int, nargs=2, metavar=("N_P", "N_S"),
                    help="only the interleaved decode check at (n_p, n_s), --batch rows: TPP, paged and HF StaticCache "
                         "(unless --no-hf) steps alternated")
    ap.add_argument("--steps", type=int, default=30, help="--interleaved: rounds of one step each (medians)")
    ap.add_argument("--out", default="results")
    args = ap.parse_args(argv)
    b, n_c = (16, 32) if args.quick else (args.batch, args.n_c)
    n_ps = args.n_p or ([1024] if args.quick else [1024, 2048])
    torch.set_num_threads(args.threads)
    if args.interleaved:
        n_p, n_s = args.interleaved
        res = interleaved_decode(load_model(None, dtype=args.dtype), args.batch, n_p, n_s,
                                 args.chunk_size, args.threads, args.steps, hf=not args.no_hf)
        hf_txt = (f", HF StaticCache {res['hf_static_step_ms']:.1f} ms -> TPP x{res['tpp_vs_hf_static']:.2f} over HF"
                  f" (median of per-round ratios x{res['tpp_vs_hf_static_paired']:.2f})"
                  if "hf_static_step_ms" in res else "")
        print(f"{args.dtype} b={res['b']} n_p={res['n_p']} n_s={res['n_s']} threads={args.threads}, {res['steps']} "
              f"rounds: median decode step TPP {res['tpp_step_ms']:.1f} ms, paged {res['paged_step_ms']:.1f} ms "
              f"-> TPP x{res['tpp_speedup']:.2f}{hf_txt} (load {os.getloadavg()[0]:.1f})")
        return 0
    load = os.getloadavg()
    print(f"b={b} n_c={n_c} chunk={args.chunk_size} threads={args.threads} dtype={args.dtype} "
          f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}", flush=True)
    loaded = load_model(None, dtype=args.dtype)
    warm_up(loaded, args.chunk_size, args.threads)
    rows: list[dict[str, Any]] = []
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"b": b, "n_c": n_c, "chunk_size": args.chunk_size, "threads": args.threads,
            "load_avg_start": [round(x, 2) for x in load], "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}

    def record(n_p: int, n_s: int, system: str, arrivals: str, dtype: str, res: dict[str, Any]) -> None:
        rows.append({"n_p": n_p, "n_s": n_s, "system": system, "arrivals": arrivals, "dtype": dtype,
                     "load_avg_1m": round(os.getloadavg()[0], 2), **res})
        print_row(rows[-1])
        (out / "bench_e2e.partial.json").write_text(json.dumps({"rows": rows, **meta}, indent=2))

    def burst(ld: LoadedModel, dtype: str, n_p: int, n_s: int, hf: bool) -> None:
        prompts = make_prompts(b, n_p, n_s, ld.config.vocab_size, seed=n_p + n_s)
        for name, share in (("chunkserve-tpp", True), ("sharing-off-paged", False)):
            gc.collect()
            record(n_p, n_s, name, "burst", dtype, run_engine(ld, prompts, n_c, share, args.chunk_size,
                                                               threads=args.threads))
        if hf:
            for name, static in (("hf-static", True), ("hf-dynamic", False))[: 1 if args.hf_static_only else 2]:
                gc.collect()
                record(n_p, n_s, name, "burst", dtype, run_hf(prompts, n_c, DTYPES[dtype], static=static))

    for n_p in n_ps:
        for n_s in (0, n_p):
            burst(loaded, args.dtype, n_p, n_s, not args.no_hf and not (args.quick and n_s == 0))
        if not args.no_poisson:
            prompts = make_prompts(b, n_p, n_p, loaded.config.vocab_size, seed=7)
            for name, share in (("chunkserve-tpp", True), ("sharing-off-paged", False)):
                gc.collect()
                record(n_p, n_p, name, "poisson(4/s)", args.dtype,
                       run_engine(loaded, prompts, n_c, share, args.chunk_size, rate=4.0, threads=args.threads))
    ttft: dict[str, float] = {}
    if not args.no_ttft:
        ttft = ttft_cached_vs_uncached(loaded, 1024, args.chunk_size, args.threads)
        print(f"\nTTFT, 1024-token system prompt (median of 3): uncached {ttft['ttft_uncached_s'] * 1e3:.0f} ms, "
              f"cached {ttft['ttft_cached_s'] * 1e3:.0f} ms -> {ttft['speedup']:.1f}x", flush=True)
    if args.extra_dtype and args.extra_dtype != args.dtype:
        if args.extra_dtype not in DTYPES:
            raise ValueError(f"--extra-dtype must be one of {sorted(DTYPES)} or ''")
        del loaded
        gc.collect()
        extra = load_model(None, dtype=args.extra_dtype)
        warm_up(extra, args.chunk_size, args.threads)
        burst(extra, args.extra_dtype, n_ps[0], n_ps[0], not args.no_hf)
    summarize(rows)
    meta["load_avg_end"] = [round(x, 2) for x in os.getloadavg()]
    (out / "bench_e2e.json").write_text(json.dumps({"rows": rows, "ttft": ttft, **meta}, indent=2))
    (out / "bench_e2e.partial.json").unlink(missing_ok=True)
    plot(rows, out / "bench_e2e.png")
    print(f"wrote {out / 'bench_e2e.json'}")
    return 0


def print_row(r: dict[str, Any]) -> None:
    print(f"n_p={r['n_p']:5d} n_s={r['n_s']:5d} {r['arrivals']:12s} {r['dtype']:8s} {r['system']:18s} "
          f"decode {r['decode_ms_per_token']:8.1f} ms/tok  {r['decode_tok_s']:7.1f} dec tok/s "
          f"(median step {r['decode_tok_s_median']:7.1f})  "
          f"{r['tok_s']:7.1f} tok/s  TTFT {r['ttft_s']:6.2f} s  peak KV {r['peak_kv_bytes'] / 2**20:8.1f} MiB  "
          f"batch {r['peak_batch']}  (load {r['load_avg_1m']:.1f})", flush=True)


def summarize(rows: list[dict[str, Any]]) -> None:
    def get(n_p: int, n_s: int, system: str, dtype: str) -> dict[str, Any] | None:
        for r in rows:
            if (r["n_p"], r["n_s"], r["system"], r["arrivals"], r["dtype"]) == (n_p, n_s, system, "burst", dtype):
                return r
        return None

    print("\nratios (chunkserve TPP vs sharing off / vs HF):")
    for dtype in dict.fromkeys(r["dtype"] for r in rows):
        for n_p in sorted({r["n_p"] for r in rows}):
            for n_s in (0, n_p):
                a, b_ = get(n_p, n_s, "chunkserve-tpp", dtype), get(n_p, n_s, "sharing-off-paged", dtype)
                hfs = [r for r in (get(n_p, n_s, "hf-static", dtype), get(n_p, n_s, "hf-dynamic", dtype)) if r]
                if not a or not b_:
                    continue
                line = (f"  {dtype} n_p={n_p} n_s={n_s}: decode tok/s x{_ratio(a, b_)}, "
                        f"peak KV -{100 * (1 - a['peak_kv_bytes'] / b_['peak_kv_bytes']):.1f}%")
                if hfs:  # against HF at its best on this run (StaticCache or DynamicCache)
                    h = max(hfs, key=lambda r: r["decode_tok_s"])
                    line += f", decode tok/s vs best HF ({h['system']}) x{_ratio(a, h)}"
                print(line)


def _ratio(a: dict[str, Any], b: dict[str, Any]) -> str:
    """Mean decode tok/s ratio, and in brackets the ratio of the per-step medians."""
    mean = a["decode_tok_s"] / b["decode_tok_s"] if b["decode_tok_s"] else float("nan")
    med = a["decode_tok_s_median"] / b["decode_tok_s_median"] if b["decode_tok_s_median"] else float("nan")
    return f"{mean:.2f} (median steps x{med:.2f})"


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    burst = [r for r in rows if r["arrivals"] == "burst"]
    labels = [f"{r['n_p']}/{r['n_s']} {r['dtype'][:4]}\n{r['system']}" for r in burst]
    fig, axes = plt.subplots(1, 2, figsize=(14, 4))
    axes[0].bar(range(len(burst)), [r["decode_tok_s"] for r in burst])
    axes[0].set_title("decode tokens/s")
    axes[1].bar(range(len(burst)), [r["peak_kv_bytes"] / 2**20 for r in burst])
    axes[1].set_title("peak KV MiB")
    for ax in axes:
        ax.set_xticks(range(len(burst)), labels, rotation=90, fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
