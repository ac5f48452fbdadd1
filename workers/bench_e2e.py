"""`chunkserve bench e2e`: the paper's end-to-end table on this machine, systems side by side.

Workload: b concurrent requests of n_p prompt tokens whose first n_s tokens are shared, each
generating n_c tokens (greedy, EOS ignored), plus a Poisson-arrival variant. Systems, in one run:
chunkserve with TPP and prefix sharing; chunkserve with sharing off (paged attention, no prefix
reuse: vLLM without prefix caching); Hugging Face transformers' batched `generate`.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import time
from pathlib import Path
from typing import Any

import torch

from chunkserve.workers.engine import EngineConfig, EngineCore
from chunkserve.workers.sampling import SamplingParams
from chunkserve.workers.weights import LoadedModel, embedded_checkpoint_dir, load_model


def make_prompts(b: int, n_p: int, n_s: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(100, vocab) for _ in range(n_s)]
    return [shared + [rng.randrange(100, vocab) for _ in range(n_p - n_s)] for _ in range(b)]


def run_engine(loaded: LoadedModel, prompts: list[list[int]], n_c: int, share: bool, chunk: int,
               rate: float | None = None, seed: int = 0) -> dict[str, Any]:
    """Serve the prompts on a fresh engine; arrivals all at t=0, or Poisson at ``rate`` req/s."""
    kv_tokens = sum(len(p) + n_c for p in prompts)
    nbytes = 2 * loaded.config.num_layers * loaded.config.kv_size * loaded.model.lm_head.dtype.itemsize
    cfg = EngineConfig(chunk_size=chunk, share_prefix=share,
                       attention_backend="torch" if share else "paged-torch",
                       num_kv_chunks=kv_tokens // chunk + 2 * len(prompts) + 8,
                       max_num_batched_tokens=2048, max_num_seqs=len(prompts), kv_cache_gb=kv_tokens * nbytes / 2**30)
    core = EngineCore(cfg, loaded=loaded)
    params = SamplingParams(max_tokens=n_c, temperature=0.0, ignore_eos=True)
    rng = random.Random(seed)
    arrivals, t = [], 0.0
    for _ in prompts:
        arrivals.append(t)
        if rate:
            t += rng.expovariate(rate)
    start = time.perf_counter()
    added, first, done = 0, {}, {}
    decode_time, decode_tokens, decode_steps, peak_batch = 0.0, 0, 0, 0
    while len(done) < len(prompts):
        now = time.perf_counter() - start
        while added < len(prompts) and arrivals[added] <= now:
            core.add_request(str(added), prompts[added], params)
            added += 1
        if not core.has_work():
            time.sleep(max(0.0, arrivals[added] - now))
            continue
        t0 = time.perf_counter()
        outs = core.step()
        dt = time.perf_counter() - t0
        running = [r for r in core.scheduler.running if not r.prefilling]
        if outs and all(len(o.req.output) > 1 for o in outs):  # a pure decode step
            decode_time += dt
            decode_tokens += len(outs)
            decode_steps += 1
        peak_batch = max(peak_batch, len(outs), len(running))
        t_now = time.perf_counter() - start
        for o in outs:
            rid = int(o.req.request_id)
            first.setdefault(rid, t_now - arrivals[rid])
            if o.finish_reason:
                done[rid] = t_now
    total = time.perf_counter() - start
    st = core.stats()
    return {"total_s": total, "ttft_s": sum(first.values()) / len(first),
            "decode_ms_per_token": 1e3 * decode_time / max(1, decode_steps),
            "decode_tok_s": decode_tokens / decode_time if decode_time else 0.0,
            "tok_s": len(prompts) * n_c / total, "peak_kv_bytes": st["peak_kv_bytes"], "peak_batch": peak_batch,
            "cached_tokens": st["prefix_cached_tokens"]}


def run_hf(prompts: list[list[int]], n_c: int) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(embedded_checkpoint_dir(), dtype=torch.float32).eval()
    ids = torch.tensor(prompts)
    with torch.no_grad():
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, do_sample=False, pad_token_id=0)
        ttft = time.perf_counter() - t0
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=n_c, min_new_tokens=n_c, do_sample=False, pad_token_id=0)
        total = time.perf_counter() - t0
    cfg = model.config
    kv = 2 * cfg.num_hidden_layers * len(prompts) * (len(prompts[0]) + n_c) * cfg.num_key_value_heads * (
        cfg.hidden_size // cfg.num_attention_heads) * 4
    dec = max(total - ttft, 1e-9)
    return {"total_s": total, "ttft_s": ttft, "decode_ms_per_token": 1e3 * dec / (n_c - 1),
            "decode_tok_s": len(prompts) * (n_c - 1) / dec, "tok_s": len(prompts) * n_c / total,
            "peak_kv_bytes": kv, "peak_batch": len(prompts), "cached_tokens": 0}


def ttft_cached_vs_uncached(loaded: LoadedModel, n_p: int, chunk: int) -> dict[str, float]:
    """TTFT of one request whose n_p-token system prompt is cached, against the same prompt uncached."""
    sys_prompt = make_prompts(1, n_p, n_p, loaded.config.vocab_size, 99)[0]
    core = EngineCore(EngineConfig(chunk_size=chunk, num_kv_chunks=4 * (n_p // chunk + 4),
                                   max_num_batched_tokens=2048), loaded=loaded)
    p = SamplingParams(max_tokens=1, temperature=0.0)

    def one(rid: str, toks: list[int]) -> float:
        t0 = time.perf_counter()
        core.add_request(rid, toks, p)
        while core.has_work():
            core.step()
        return time.perf_counter() - t0

    uncached = one("u", sys_prompt + [7, 8, 9])
    cached = one("c", sys_prompt + [10, 11, 12])
    return {"ttft_uncached_s": uncached, "ttft_cached_s": cached, "speedup": uncached / cached}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="chunkserve bench e2e", description=__doc__)
    ap.add_argument("--quick", action="store_true", help="n_p=1024 only, b=16, n_c=32, no HF at n_s=0")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--n-c", type=int, default=64)
    ap.add_argument("--chunk-size", type=int, default=64)
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--out", default="results")
    args = ap.parse_args(argv)
    b, n_c = (16, 32) if args.quick else (args.batch, args.n_c)
    n_ps = [1024] if args.quick else [1024, 2048]
    loaded = load_model(None, dtype="float32")
    rows = []
    for n_p in n_ps:
        for n_s in (0, n_p):
            prompts = make_prompts(b, n_p, n_s, loaded.config.vocab_size, seed=n_p + n_s)
            systems = {"chunkserve-tpp": lambda p=prompts: run_engine(loaded, p, n_c, True, args.chunk_size),
                       "sharing-off-paged": lambda p=prompts: run_engine(loaded, p, n_c, False, args.chunk_size)}
            if not args.no_hf and not (args.quick and n_s == 0):
                systems["hf-generate"] = lambda p=prompts: run_hf(p, n_c)
            for name, fn in systems.items():
                gc.collect()
                res = fn()
                rows.append({"n_p": n_p, "n_s": n_s, "system": name, "arrivals": "burst", **res})
                print_row(rows[-1])
        prompts = make_prompts(b, n_p, n_p, loaded.config.vocab_size, seed=7)
        for name, share in (("chunkserve-tpp", True), ("sharing-off-paged", False)):
            res = run_engine(loaded, prompts, n_c, share, args.chunk_size, rate=4.0)
            rows.append({"n_p": n_p, "n_s": n_p, "system": name, "arrivals": "poisson(4/s)", **res})
            print_row(rows[-1])
    ttft = ttft_cached_vs_uncached(loaded, 1024, args.chunk_size)
    print(f"\nTTFT, 1024-token system prompt: uncached {ttft['ttft_uncached_s'] * 1e3:.0f} ms, cached "
          f"{ttft['ttft_cached_s'] * 1e3:.0f} ms -> {ttft['speedup']:.1f}x")
    summarize(rows)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_e2e.json").write_text(json.dumps({"rows": rows, "ttft": ttft, "b": b, "n_c": n_c}, indent=2))
    plot(rows, out / "bench_e2e.png")
    print(f"wrote {out / 'bench_e2e.json'}")
    return 0


def print_row(r: dict[str, Any]) -> None:
    print(f"n_p={r['n_p']:5d} n_s={r['n_s']:5d} {r['arrivals']:12s} {r['system']:18s} "
          f"decode {r['decode_ms_per_token']:8.1f} ms/tok  {r['decode_tok_s']:7.1f} dec tok/s  "
          f"{r['tok_s']:7.1f} tok/s  TTFT {r['ttft_s']:6.2f} s  peak KV {r['peak_kv_bytes'] / 2**20:8.1f} MiB  "
          f"batch {r['peak_batch']}", flush=True)


def summarize(rows: list[dict[str, Any]]) -> None:
    def get(n_p: int, n_s: int, system: str) -> dict[str, Any] | None:
        for r in rows:
            if (r["n_p"], r["n_s"], r["system"], r["arrivals"]) == (n_p, n_s, system, "burst"):
                return r
        return None

    print("\nratios (chunkserve TPP vs sharing off / vs HF):")
    for n_p in sorted({r["n_p"] for r in rows}):
        for n_s in (0, n_p):
            a, b_, h = get(n_p, n_s, "chunkserve-tpp"), get(n_p, n_s, "sharing-off-paged"), get(n_p, n_s, "hf-generate")
            if not a or not b_:
                continue
            line = (f"  n_p={n_p} n_s={n_s}: decode tok/s x{a['decode_tok_s'] / b_['decode_tok_s']:.2f}, "
                    f"peak KV -{100 * (1 - a['peak_kv_bytes'] / b_['peak_kv_bytes']):.1f}%")
            if h:
                line += f", decode tok/s vs HF x{a['decode_tok_s'] / h['decode_tok_s']:.2f}"
            print(line)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    burst = [r for r in rows if r["arrivals"] == "burst"]
    labels = [f"{r['n_p']}/{r['n_s']}\n{r['system']}" for r in burst]
    fig, axes = plt.subplots(1, 2, figsize=(14, 4))
    axes[0].bar(range(len(burst)), [r["decode_tok_s"] for r in burst])
    axes[0].set_title("decode tokens/s")
    axes[1].bar(range(len(burst)), [r["peak_kv_bytes"] / 2**20 for r in burst])
    axes[1].set_title("peak KV MiB")
    for ax in axes:
        ax.set_xticks(range(len(burst)), labels, rotation=90, fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
