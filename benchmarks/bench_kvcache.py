"""Times the two PAKV hot paths: a fully cached add_sequence and a context rebuild.

Targets (issue 2, on the 2-core CI machine): add_sequence of a 100%-cached 4096-token prompt
< 1 ms; a context rebuild for 256 sequences over a tree with 4 prefixes < 2 ms.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from chunkserve.workers.kvcache import PrefixKVCache


def _median_ms(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def bench_cached_add(n_tokens: int = 4096, c: int = 64, repeats: int = 50) -> float:
    L, H, D = 2, 2, 16
    cache = PrefixKVCache(L, H, D, chunk_size=c, num_chunks=n_tokens // c + 8)
    toks = list(range(n_tokens))
    k = torch.randn(L, n_tokens, H, D)
    cache.add_sequence(toks, k, k)

    def run() -> None:
        s = cache.add_sequence(toks, k, k)
        cache.remove_sequence(s)

    return _median_ms(run, repeats)


def bench_context_rebuild(b: int = 256, n_prefix: int = 4, prefix_len: int = 1024, suffix: int = 100,
                          c: int = 64, repeats: int = 30) -> float:
    L, H, D = 1, 1, 8
    per_seq = -(-suffix // c) + 1
    cache = PrefixKVCache(L, H, D, chunk_size=c, num_chunks=n_prefix * prefix_len // c + b * per_seq + 8)
    seqs = []
    for i in range(b):
        p = i % n_prefix
        toks = [p * 100_000 + t for t in range(prefix_len)] + [10_000_000 + i * 1000 + t for t in range(suffix)]
        kv = torch.zeros(L, len(toks), H, D)
        seqs.append(cache.add_sequence(toks, kv, kv))
    builder = cache._ctx
    return _median_ms(lambda: builder.build(seqs), repeats)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    res = {"add_sequence_4096_cached_ms": bench_cached_add(),
           "context_rebuild_256seq_4prefix_ms": bench_context_rebuild()}
    print(f"add_sequence, 4096 tokens, 100% cached : {res['add_sequence_4096_cached_ms']:.3f} ms (target < 1 ms)")
    print(f"context rebuild, 256 seqs, 4 prefixes  : {res['context_rebuild_256seq_4prefix_ms']:.3f} ms (target < 2 ms)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
