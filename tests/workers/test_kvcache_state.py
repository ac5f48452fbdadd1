"""Property-based state-machine test of PrefixKVCache: random add/append/remove/fork/evict/pin."""

from __future__ import annotations

import dataclasses

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from chunkserve.workers.chunk_pool import KVCacheFull
from chunkserve.workers.kvcache import PrefixKVCache

L, H, D, C, N = 2, 2, 3, 4, 20
PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 40, 41], [7] * 13, []]


def kv_for(salt: bytes, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V that depend only on (salt, prefix), as a real model's would: [L, n, H, D] each."""
    vals = []
    h = hash(salt) % 997
    for t in tokens:
        h = (h * 31 + t + 1) % 100_003
        vals.append(h)
    base = torch.tensor(vals, dtype=torch.float32)[None, :, None, None]
    off = torch.arange(L * H * D, dtype=torch.float32).reshape(L, 1, H, D)
    return base + off, -(base + off)


class CacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.cache = PrefixKVCache(L, H, D, chunk_size=C, num_chunks=N)
        self.live: dict[int, tuple[bytes, list[int]]] = {}
        self.pins: list[int] = []

    @rule(p=st.integers(0, len(PREFIXES) - 1), extra=st.lists(st.integers(0, 3), max_size=6),
          salt=st.sampled_from([b"", b"t2"]))
    def add(self, p: int, extra: list[int], salt: bytes) -> None:
        toks = PREFIXES[p] + extra
        if not toks:
            return
        k, v = kv_for(salt, toks)
        before = self.cache.stats()
        try:
            s = self.cache.add_sequence(toks, k, v, salt=salt)
        except KVCacheFull:
            after = self.cache.stats()
            assert after["kv_chunks_used"] == before["kv_chunks_used"]
            assert after["num_sequences"] == before["num_sequences"]
            return
        self.live[s] = (salt, toks)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), tok=st.integers(0, 3))
    def append(self, data: st.DataObject, tok: int) -> None:
        s = data.draw(st.sampled_from(sorted(self.live)))
        salt, toks = self.live[s]
        k, v = kv_for(salt, toks + [tok])
        try:
            self.cache.append_token(s, tok, k[:, -1], v[:, -1])
        except KVCacheFull:
            return
        self.live[s] = (salt, toks + [tok])

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def remove(self, data: st.DataObject) -> None:
        s = data.draw(st.sampled_from(sorted(self.live)))
        self.cache.remove_sequence(s)
        del self.live[s]

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        s = data.draw(st.sampled_from(sorted(self.live)))
        f = self.cache.fork_sequence(s)
        self.live[f] = self.live[s]

    @rule(n=st.integers(1, 4))
    def evict(self, n: int) -> None:
        self.cache.evict(n)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def pin(self, data: st.DataObject) -> None:
        s = data.draw(st.sampled_from(sorted(self.live)))
        self.pins.append(self.cache.pin(s))

    @precondition(lambda self: self.pins)
    @rule()
    def unpin(self) -> None:
        self.cache.unpin(self.pins.pop())

    @invariant()
    def refcounts_equal_live_paths(self) -> None:
        expected: dict[int, int] = {}
        for s in self.live:
            for ch in self.cache.seq_chunks(s):
                expected[ch] = expected.get(ch, 0) + 1
        for ch, node in self.cache._nodes.items():
            assert node.ref == expected.get(ch, 0), (ch, node.ref, expected.get(ch, 0))

    @invariant()
    def chunk_accounting_is_consistent(self) -> None:
        st_ = self.cache.stats()
        assert st_["kv_chunks_used"] + st_["kv_chunks_free"] + st_["kv_chunks_cached"] == N
        nodes = self.cache._nodes.values()  # stats walks the live paths only: the same sums as over the whole tree
        assert st_["physical_tokens"] == sum(len(n.tokens) for n in nodes if n.ref > 0)
        assert st_["shared_tokens"] == sum(len(n.tokens) for n in nodes if n.ref > 1)
        pool = self.cache.pool
        for ch in self.cache._nodes:
            assert not pool.is_free(ch), f"chunk {ch} is both free and in the tree"
        assert pool.num_free == N - len(self.cache._nodes)
        pinned_nodes = [n for n in self.cache._nodes.values() if n.pinned]
        assert self.cache.num_pinned_chunks == len(pinned_nodes)
        for node in pinned_nodes:  # pinned chunks are never evicted
            assert self.cache._nodes.get(node.chunk) is node

    @invariant()
    def kv_reads_back_token_by_token(self) -> None:
        for s, (salt, toks) in self.live.items():
            assert self.cache.seq_token_ids(s) == toks
            k, v = kv_for(salt, toks)
            for layer in range(L):
                kk, vv = self.cache.read_kv(s, layer)
                assert torch.equal(kk, k[layer]) and torch.equal(vv, v[layer]), f"seq {s} layer {layer}"

    @invariant()
    def nodes_cover_contiguous_rows_and_lazy_context_matches_rebuild(self) -> None:
        if not self.live:
            return
        ids = sorted(self.live)
        ctx = self.cache.context(ids)
        table = ctx.block_table
        tokens = ctx.block_tokens
        for ch in set(table[tokens > 0].tolist()):
            rows = sorted(set((table == ch).logical_and(tokens > 0).nonzero()[:, 0].tolist()))
            assert rows == list(range(rows[0], rows[-1] + 1)), f"chunk {ch} rows {rows} not contiguous"
        fresh = self.cache._ctx.build(ids)
        for f in dataclasses.fields(ctx):
            a, b = getattr(ctx, f.name), getattr(fresh, f.name)
            if isinstance(a, torch.Tensor):
                assert torch.equal(a, b), f.name
            elif f.name != "version":
                assert a == b, f.name


CacheMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None,
                                          suppress_health_check=[HealthCheck.too_slow])
TestPrefixKVCacheStateMachine = CacheMachine.TestCase
