"""PrefixKVCache behaviour: sharing, retention, eviction, pinning, hashing, bad input, memory bounds."""

from __future__ import annotations

import math

import pytest
import torch

from chunkserve.cluster.hashing import hash_chain
from chunkserve.workers.chunk_pool import KVCacheFull
from chunkserve.workers.kvcache import PrefixKVCache

L, H, D = 2, 2, 8


def kv(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(L, n, H, D, generator=g), torch.randn(L, n, H, D, generator=g)


def make(num_chunks: int = 64, c: int = 16, **kw) -> PrefixKVCache:
    return PrefixKVCache(L, H, D, chunk_size=c, num_chunks=num_chunks, **kw)


def test_32_sequences_with_a_1024_token_prefix_store_it_once() -> None:
    c, prefix, suffix, b = 64, 1024, 40, 32
    cache = PrefixKVCache(1, 1, 4, chunk_size=c, num_chunks=1024)
    pk = torch.randn(1, prefix, 1, 4)
    for i in range(b):
        toks = list(range(prefix)) + [5000 + i * 100 + t for t in range(suffix)]
        k = torch.cat([pk, torch.randn(1, suffix, 1, 4)], 1)
        cache.add_sequence(toks, k, k)
    st = cache.stats()
    assert st["kv_chunks_used"] == prefix // c + b * math.ceil(suffix / c)
    # capacity multiplier = logical / physical tokens = 1 / (1 - r), within the chunk rounding
    r = st["sharing_ratio"]
    logical = b * (prefix + suffix)
    physical_chunks = st["kv_chunks_used"] * c
    measured = logical / physical_chunks
    ideal = 1 / (1 - r)
    assert st["logical_tokens"] == logical
    assert ideal == pytest.approx(logical / (prefix + b * suffix))
    # chunk rounding wastes < c slots per partly filled chunk (one per suffix here)
    assert ideal >= measured >= logical / (prefix + b * suffix + b * (c - 1))
    assert measured > 10  # 32 x 1064 tokens in 48 chunks
    assert st["shared_tokens"] == prefix


def test_fragmentation_loss_is_below_one_chunk_per_sequence() -> None:
    c = 16
    cache = make(num_chunks=256, c=c)
    lengths = [1, 15, 16, 17, 31, 33, 100, 255]
    for i, n in enumerate(lengths):
        cache.add_sequence([10_000 * (i + 1) + t for t in range(n)], *kv(n, i))
    st = cache.stats()
    slots = st["kv_chunks_used"] * c
    for n in lengths:  # per sequence, wasted slots <= c - 1, i.e. loss <= (c-1)/n
        assert math.ceil(n / c) * c - n <= c - 1
    assert slots - sum(lengths) <= len(lengths) * (c - 1)


def test_finished_prefix_stays_cached_and_is_reused_without_rewriting() -> None:
    cache = make()
    toks = list(range(40))
    k, v = kv(40)
    s = cache.add_sequence(toks, k, v)
    cache.remove_sequence(s)
    assert cache.stats()["kv_chunks_cached"] == 3
    assert cache.match(toks) == 40
    k2 = torch.full_like(k, float("nan"))  # must not be written: everything is cached
    s2 = cache.add_sequence(toks, k2, k2)
    kk, _ = cache.read_kv(s2, 1)
    assert torch.equal(kk, k[1])


def test_reserve_with_a_cap_copies_the_cached_head_of_a_chunk() -> None:
    cache = make()
    toks = list(range(32))
    k, v = kv(32)
    cache.remove_sequence(cache.add_sequence(toks, k, v))
    s, cached = cache.reserve(toks, max_cached=31)
    assert cached == 31
    chunks, offsets = cache.extend(s)
    assert offsets.tolist() == [15]
    cache.write(None, chunks, offsets, k[:, 31:], v[:, 31:])
    kk, vv = cache.read_kv(s, 0)
    assert torch.equal(kk, k[0]) and torch.equal(vv, v[0])


def test_a_finished_requests_last_chunk_serves_a_repeat_of_its_prompt_down_to_the_token() -> None:
    """Prompt 40 tokens (2 full chunks + 8), then 12 generated: the last chunk holds 8 prompt tokens and 8
    generated ones. A repeat of the prompt reuses its head (a copy), so only the last token is computed."""
    cache = make()
    prompt = list(range(100, 140))
    full = prompt + list(range(900, 912))
    k, v = kv(len(full))
    cache.remove_sequence(cache.add_sequence(full, k, v))
    assert cache.match(prompt) == 40
    assert cache.match(prompt[:37] + [7]) == 37  # the head stops where the tokens differ
    assert cache.match([100, 101, 5]) == 2  # inside the first chunk too
    s, cached = cache.reserve(prompt, max_cached=39)
    assert cached == 39
    chunks, offsets = cache.extend(s)
    assert offsets.tolist() == [7]
    cache.write(None, chunks, offsets, k[:, 39:40], v[:, 39:40])
    kk, vv = cache.read_kv(s, 1)
    assert torch.equal(kk, k[1, :40]) and torch.equal(vv, v[1, :40])
    # the original chunk is untouched and still matches the longer sequence
    assert cache.match(full) == len(full)


def test_a_partly_matching_chunk_is_copied_not_shared_so_the_original_is_never_overwritten() -> None:
    cache = make()
    a = list(range(20))
    ka, va = kv(20, 1)
    sa = cache.add_sequence(a, ka, va)  # live: chunk 2 holds tokens 16..19
    b = a[:18] + [77, 78]
    kb, vb = kv(20, 2)
    s, cached = cache.reserve(b)
    assert cached == 18
    chunks, offsets = cache.extend(s)
    cache.write(None, chunks, offsets, kb[:, 18:], vb[:, 18:])
    ka_now, _ = cache.read_kv(sa, 0)
    assert torch.equal(ka_now, ka[0])  # a's own chunk kept its tokens 18, 19
    kk, _ = cache.read_kv(s, 0)
    assert torch.equal(kk[:18], ka[0, :18]) and torch.equal(kk[18:], kb[0, 18:])


def test_eviction_is_lru_and_leaves_first() -> None:
    cache = make(num_chunks=6, c=4)
    a = cache.add_sequence(list(range(8)), *kv(8, 1))  # 2 chunks
    b = cache.add_sequence([100 + t for t in range(8)], *kv(8, 2))  # 2 chunks
    cache.remove_sequence(a)
    cache.remove_sequence(b)  # b is more recent
    cache.add_sequence([200 + t for t in range(12)], *kv(12, 3))  # needs 3: 2 free + evict 1
    assert cache.match(list(range(8))) == 4  # a's leaf went first; its root chunk remains
    assert cache.match([100 + t for t in range(8)]) == 8


def test_pool_full_of_live_data_raises_and_changes_nothing() -> None:
    cache = make(num_chunks=4, c=4)
    cache.add_sequence(list(range(16)), *kv(16))
    before = cache.stats()
    with pytest.raises(KVCacheFull):
        cache.add_sequence([99] * 5, *kv(5))
    assert cache.stats() == before


def test_pinned_prefix_survives_eviction_until_unpinned() -> None:
    cache = make(num_chunks=4, c=4)
    s = cache.add_sequence(list(range(8)), *kv(8))
    h = cache.pin(s)
    cache.remove_sequence(s)
    with pytest.raises(KVCacheFull):
        cache.add_sequence([50 + t for t in range(12)], *kv(12))
    assert cache.match(list(range(8))) == 8
    cache.unpin(h)
    cache.add_sequence([50 + t for t in range(12)], *kv(12))
    assert cache.match(list(range(8))) < 8


def test_hash_chain_matches_the_router_and_depends_on_salt() -> None:
    c = 16
    cache = make(c=c)
    toks = list(range(50))
    s = cache.add_sequence(toks, *kv(50), salt=b"tenant-a")
    assert cache.seq_hashes(s) == hash_chain(toks, c, b"tenant-a")
    assert hash_chain(toks, c, b"tenant-a") != hash_chain(toks, c, b"tenant-b")
    events = cache.drain_events()
    assert [e.chunk_hash for e in events if e.kind == "stored"] == hash_chain(toks, c, b"tenant-a")
    assert cache.match(toks, salt=b"tenant-b") == 0  # scopes never share
    cache.remove_sequence(s)
    cache.clear()
    assert sorted(e.chunk_hash for e in cache.drain_events() if e.kind == "evicted") == sorted(
        hash_chain(toks, c, b"tenant-a"))


def test_sharing_off_stores_every_sequence_separately() -> None:
    cache = make(share_prefix=False)
    k, v = kv(32)
    a = cache.add_sequence(list(range(32)), k, v)
    b = cache.add_sequence(list(range(32)), k, v)
    assert set(cache.seq_chunks(a)).isdisjoint(cache.seq_chunks(b))
    cache.remove_sequence(a)
    assert cache.stats()["kv_chunks_cached"] == 0


@pytest.mark.parametrize(
    "call",
    [
        lambda c: c.add_sequence([], torch.zeros(L, 0, H, D), torch.zeros(L, 0, H, D)),
        lambda c: c.add_sequence([1, 2], torch.zeros(L, 3, H, D), torch.zeros(L, 3, H, D)),
        lambda c: c.add_sequence([1, 2], torch.zeros(L, 2, H + 1, D), torch.zeros(L, 2, H + 1, D)),
        lambda c: c.add_sequence([1, 2], torch.zeros(L, 2, H, D, dtype=torch.long),
                                 torch.zeros(L, 2, H, D, dtype=torch.long)),
        lambda c: c.add_sequence([1.5, 2.0], torch.zeros(L, 2, H, D), torch.zeros(L, 2, H, D)),
        lambda c: c.append_token(12345, 1, torch.zeros(L, H, D), torch.zeros(L, H, D)),
        lambda c: c.append_token(0, 1, torch.zeros(L, H, D + 1), torch.zeros(L, H, D + 1)),
        lambda c: c.remove_sequence(777),
        lambda c: c.context([0, 0]),
        # sparse or meta K/V: the write raised after the chunks were indexed, or wrote nothing at all, and a
        # later sequence with the same tokens reused those never-written chunks
        lambda c: c.add_sequence([1, 2, 3, 4], torch.zeros(L, 4, H, D).to_sparse(), torch.zeros(L, 4, H, D).to_sparse()),
        lambda c: c.add_sequence([1, 2, 3, 4], torch.zeros(L, 4, H, D, device="meta"),
                                 torch.zeros(L, 4, H, D, device="meta")),
        lambda c: c.append_token(0, 1, torch.zeros(L, H, D).to_sparse(), torch.zeros(L, H, D).to_sparse()),
    ],
)
def test_bad_input_raises_a_clear_error_and_leaves_the_cache_unchanged(call) -> None:
    cache = make()
    cache.add_sequence([1, 2, 3], *kv(3))
    before, version = cache.stats(), cache.version
    with pytest.raises((ValueError, KeyError, TypeError)):
        call(cache)
    assert cache.stats() == before and cache.version == version


def test_context_rows_follow_tree_order_and_map_back_to_callers_order() -> None:
    cache = make(c=4)
    ids = [cache.add_sequence(t, *kv(len(t), i)) for i, t in enumerate(
        [[9, 9, 9, 9, 1], [1, 2, 3, 4, 5, 6], [9, 9, 9, 9, 2, 2], [1, 2, 3, 4]])]
    ctx = cache.context(ids)
    order = ctx.order.tolist()
    assert sorted(order) == [0, 1, 2, 3]
    rows = [cache.seq_chunks(ids[o]) for o in order]
    firsts = [r[0] for r in rows]
    assert firsts == sorted(firsts, key=firsts.index)  # equal first chunks are adjacent
    assert ctx.num_runs == 2 and all(j - i == 2 for i, j, *_ in ctx.runs_host)


def test_match_chunks_counts_whole_matching_chunks_and_never_more_than_match() -> None:
    """The scheduler's cheap ranking match: whole chunks (and a whole partial leaf), not the head of a chunk
    that goes on differently."""
    import numpy as np

    cache = make()
    full = list(range(100, 152))  # 3 full chunks of 16 + a partial leaf of 4
    k, v = kv(len(full))
    cache.remove_sequence(cache.add_sequence(full, k, v))
    arr = np.asarray(full, dtype=np.int64)
    assert cache.match_chunks(arr) == 52
    diverging = np.asarray(full[:40] + [7] * 12, dtype=np.int64)  # differs inside the third chunk
    assert cache.match_chunks(diverging) == 32
    assert cache.match(diverging.tolist()) == 40  # match also reuses the chunk's head
    assert cache.match_chunks(arr, b"other tenant") == 0


def test_pool_alloc_takes_the_first_run_of_consecutive_free_chunks_else_the_first_free_ones() -> None:
    from chunkserve.workers.chunk_pool import ChunkPool, KVCacheFull

    pool = ChunkPool(1, 1, 8, 4, 15, torch.float32, "cpu")
    assert pool.alloc(3) == [0, 1, 2]
    assert pool.alloc(1) == [3]
    pool.free([1, 2])
    assert pool.alloc(1) == [1]  # the lowest free id
    assert pool.alloc(4) == [4, 5, 6, 7]  # [2] alone is too short for a run of 4
    taken = pool.alloc(8)  # free: 2 and 8..14, no run of 8, so the first 8 free ids
    assert taken == [2, 8, 9, 10, 11, 12, 13, 14] and pool.num_free == 0
    with pytest.raises(KVCacheFull):
        pool.alloc(2)
    pool.free([9, 11, 12])
    assert pool.alloc(2) == [11, 12] and pool.num_free == 1


def test_the_head_match_finds_the_sibling_sharing_most_tokens_among_many_and_after_evictions() -> None:
    """Prompts that share a few leading tokens (a chat template's head) hang hundreds of full chunks under
    the root; a new prompt reuses the head of the one sharing the most tokens, exactly as a scan of them all
    would, also once some of them are evicted."""
    import random

    rng = random.Random(0)
    c = 16
    cache = make(num_chunks=700, c=c)
    firsts: list[list[int]] = []
    for i in range(300):
        toks = [1, 2, 3] + [rng.randrange(4, 12) for _ in range(c - 3)] + [1000 + i] * 4
        firsts.append(toks[:c])
        k, v = kv(len(toks), i)
        cache.remove_sequence(cache.add_sequence(toks, k, v))
    root = cache._root(b"")
    assert root.child_keys == sorted(root.children) and len(root.children) > 200

    def brute(q: list[int]) -> int:
        best = 0
        for key in root.children:
            n = 0
            while n < min(len(key), len(q)) and key[n] == q[n]:
                n += 1
            best = max(best, n)
        return best

    for _ in range(200):
        q = [1, 2, 3] + [rng.randrange(4, 12) for _ in range(c - 4)] + [5000]
        assert cache.match(q) == brute(q)
    q = firsts[7][:11] + [5000] * 5
    assert cache.match(q) == brute(q) >= 11
    cache.evict(150)
    assert root.child_keys == sorted(root.children) and len(root.children) < 300
    for _ in range(100):
        q = [1, 2, 3] + [rng.randrange(4, 12) for _ in range(c - 4)] + [5000]
        assert cache.match(q) == brute(q)
