"""The prefix tree of the KV cache: scopes, refcounts, LRU eviction of unreferenced chunks, pins.

`PrefixKVCache` builds on it. Chunks whose refcount drops to 0 stay cached (matchable) and are
evicted least-recently-used, leaves first, when the pool needs room; pinned chunks never are.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence as Seq

import numpy as np
import torch

from chunkserve.cluster.cache_event import CacheEvent
from chunkserve.cluster.hashing import chunk_hash
from chunkserve.workers.chunk_pool import ChunkPool, KVCacheFull
from chunkserve.workers.kvtree import Node, common_prefix


def check_tokens(token_ids: Seq[int] | np.ndarray | torch.Tensor) -> np.ndarray:
    """Validate a token list; returns it as int64."""
    if isinstance(token_ids, torch.Tensor):
        token_ids = token_ids.tolist()
    arr = np.asarray(token_ids)
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError("token_ids must be a non-empty 1-D list of ints")
    if arr.dtype.kind not in "iu":
        raise ValueError(f"token_ids must be integers, got dtype {arr.dtype}")
    if (arr < 0).any():
        raise ValueError("token_ids must be non-negative")
    return arr.astype(np.int64, copy=False)



class PrefixTree:
    """Chunk nodes per cache scope over a `ChunkPool`, with refcounts, LRU eviction and pins."""

    def __init__(self, pool: ChunkPool, share_prefix: bool = True) -> None:
        self.pool = pool
        self.chunk_size = pool.chunk_size
        self.share_prefix = share_prefix
        self._roots: dict[bytes, Node] = {}
        self._nodes: dict[int, Node] = {}  # chunk id -> node, for every chunk in the tree
        self._tick = 0
        self._evictable: list[tuple[int, int, Node]] = []  # heap of (last_access, chunk, node)
        self._num_cached = 0  # nodes with ref == 0
        self._num_pinned_cached = 0
        self.num_pinned_chunks = 0  # nodes with at least one pin (never evictable)
        self._pins: dict[int, list[Node]] = {}
        self._next_pin = 0
        self.version = 0  # bumped on every structural change
        self.events: list[CacheEvent] = []

    def _root(self, salt: bytes) -> Node:
        root = self._roots.get(salt)
        if root is None:
            root = self._roots[salt] = Node(-1, [], None, -1)
            root.hash = 0
        return root

    def _walk(self, tokens: np.ndarray, salt: bytes) -> tuple[list[Node], Node | None]:
        """Full chunks matching the leading tokens, then the longest partial leaf matching the tail."""
        c = self.chunk_size
        node = self._root(salt)
        path: list[Node] = []
        if not self.share_prefix:
            return path, None
        n_full = len(tokens) // c
        for k in range(n_full):
            child = node.children.get(tuple(tokens[k * c:(k + 1) * c].tolist()))
            if child is None:
                return path, None
            path.append(child)
            node = child
        tail = tokens[n_full * c:].tolist()
        best: Node | None = None
        for p in node.partials:
            m = len(p.tokens)
            if m <= len(tail) and p.tokens == tail[:m] and (best is None or m > len(best.tokens)):
                best = p
        return path, best

    def match_chunks(self, tokens: np.ndarray, salt: bytes = b"") -> int:
        """Leading tokens of ``tokens`` (int64, as `check_tokens` returns) in whole matching chunks and a whole
        matching partial leaf: `match` without its search for a partly matching chunk, so the cost does not
        grow with the chunks cached under the prefix (the scheduler ranks waiting requests by it each step)."""
        path, leaf = self._walk(tokens, salt)
        return len(path) * self.chunk_size + (len(leaf.tokens) if leaf is not None else 0)

    def _walk_head(self, tokens: np.ndarray, salt: bytes) -> tuple[list[Node], Node | None, int]:
        """`_walk`'s full chunks, then the node under the last of them (full child or partial leaf) that
        shares the most leading tokens with the rest: ``(path, node, n)``, ``n`` tokens of ``node`` matching
        (0 and None when none does). A finished request's last chunk (its prompt's tail, then generated
        tokens) thus serves a repeat of that prompt down to the token, as a copy of its head."""
        path, _ = self._walk(tokens, salt)
        if not self.share_prefix:
            return path, None, 0
        c = self.chunk_size
        node = path[-1] if path else self._root(salt)
        tail = tokens[len(path) * c:(len(path) + 1) * c].tolist()
        best: Node | None = None
        best_n = 0
        for cand in node.partials:
            n = common_prefix(cand.tokens, tail)
            if n > best_n or (n == best_n and best is not None and n == len(cand.tokens) < len(best.tokens)):
                best, best_n = cand, n
        # a full child never matches whole here (`_walk` would have taken it), so it wins only by more tokens
        child, n = node.closest_child(tail)
        if n > best_n:
            best, best_n = child, n
        return path, best, best_n

    def match_held(self, token_ids: Seq[int] | np.ndarray, salt: bytes = b"") -> tuple[int, int]:
        """``(cached tokens, evictable chunks among them)``: the cached prefix a new sequence would reuse, and
        how many of its chunks stop being evictable once the sequence takes refs on them (room that
        admission must not count on)."""
        tokens = check_tokens(token_ids)
        path, head, n = self._walk_head(tokens, salt)
        held = path + [head] if head is not None and n == len(head.tokens) else path
        return len(path) * self.chunk_size + n, sum(1 for node in held if node.ref == 0 and not node.pinned)

    # ------------------------------------------------------------------ refcounts and LRU
    def _touch(self) -> int:
        self._tick += 1
        return self._tick

    def _incref(self, node: Node) -> None:
        if node.ref == 0:
            self._num_cached -= 1
            if node.pinned:
                self._num_pinned_cached -= 1
        node.ref += 1

    def _decref(self, node: Node, now: int) -> None:
        node.ref -= 1
        node.last_access = now
        if node.ref == 0:
            if not node.indexed or not self.share_prefix:  # unmatchable: free it at once
                self._drop_node(node, emit=False)
                return
            self._num_cached += 1
            if node.pinned:
                self._num_pinned_cached += 1
            if node.num_children == 0:
                heapq.heappush(self._evictable, (now, node.chunk, node))

    def _drop_node(self, node: Node, emit: bool = True) -> None:
        node.detach()
        del self._nodes[node.chunk]
        self.pool.free([node.chunk])
        if emit and node.hash is not None and node.indexed:
            self.events.append(CacheEvent("evicted", node.hash, node.depth))
        self.version += 1
        parent = node.parent
        if parent is not None and parent.chunk >= 0 and parent.ref == 0 and parent.num_children == 0:
            heapq.heappush(self._evictable, (parent.last_access, parent.chunk, parent))

    def evict(self, n: int) -> int:
        """Evict up to ``n`` unreferenced, unpinned chunks, least recently used leaves first."""
        done = 0
        while done < n and self._evictable:
            stamp, chunk, node = heapq.heappop(self._evictable)
            if (self._nodes.get(chunk) is not node or node.ref or node.pinned or node.num_children
                    or node.last_access != stamp):
                continue  # stale heap entry
            self._num_cached -= 1
            self._drop_node(node)
            done += 1
        return done

    @property
    def num_evictable(self) -> int:
        return self._num_cached - self._num_pinned_cached

    def _ensure_free(self, n: int) -> None:
        if n <= self.pool.num_free:
            return
        if n > self.pool.num_free + self.num_evictable:
            raise KVCacheFull(f"need {n} chunks: {self.pool.num_free} free, {self.num_evictable} evictable")
        self.evict(n - self.pool.num_free)
        if n > self.pool.num_free:
            raise KVCacheFull(f"need {n} chunks, only {self.pool.num_free} could be freed")

    def _register(self, node: Node, salt: bytes) -> None:
        """Hang a fresh node (ref 1) under its parent and index it."""
        parent = node.parent
        assert parent is not None
        node.ref = 1
        node.last_access = self._tick
        self._nodes[node.chunk] = node
        if not parent.indexed:
            node.indexed = False
        if len(node.tokens) == self.chunk_size:
            self._index_full(node, salt)
        else:
            parent.partials.append(node)

    def _index_full(self, node: Node, salt: bytes) -> None:
        parent = node.parent
        assert parent is not None
        key = tuple(node.tokens)
        if not node.indexed or key in parent.children or not self.share_prefix:
            node.indexed = False  # the same chunk was computed twice concurrently; keep it private
            return
        parent.add_child(key, node)
        if parent.hash is not None:
            node.hash = chunk_hash(parent.hash, salt, node.tokens)
            self.events.append(CacheEvent("stored", node.hash, node.depth))

    def _fill(self, leaf: Node, toks: list[int], salt: bytes) -> None:
        """Append tokens to an owned partial leaf; index it once it is full."""
        leaf.tokens.extend(toks)
        if len(leaf.tokens) == self.chunk_size:
            assert leaf.parent is not None
            leaf.parent.partials.remove(leaf)
            self._index_full(leaf, salt)

    # ------------------------------------------------------------------ pinning
    def pin_prefix(self, token_ids: Seq[int] | np.ndarray, salt: bytes = b"") -> int:
        """Pin the cached full chunks that prefix ``token_ids`` so they are never evicted.

        Returns a handle for ``unpin``. Pins outlive the sequences that created the chunks.
        """
        path, _ = self._walk(check_tokens(token_ids), salt)
        for node in path:
            if node.ref == 0 and node.pinned == 0:
                self._num_pinned_cached += 1
            if node.pinned == 0:
                self.num_pinned_chunks += 1
            node.pinned += 1
        handle = self._next_pin
        self._next_pin += 1
        self._pins[handle] = path
        return handle

    def unpin(self, handle: int) -> None:
        path = self._pins.pop(handle, None)
        if path is None:
            raise KeyError(f"unknown pin handle {handle!r}")
        for node in path:
            node.pinned -= 1
            if node.pinned == 0:
                self.num_pinned_chunks -= 1
            if node.pinned == 0 and node.ref == 0:
                self._num_pinned_cached -= 1
                if node.num_children == 0 and self._nodes.get(node.chunk) is node:
                    heapq.heappush(self._evictable, (node.last_access, node.chunk, node))

    def pinned_prefix_chunks(self, token_ids: Seq[int] | np.ndarray, salt: bytes = b"") -> int:
        """How many of the leading full chunks of ``token_ids`` are cached and pinned (a request reuses them
        without needing room of its own)."""
        path, _ = self._walk(check_tokens(token_ids), salt)
        return sum(1 for node in path if node.pinned)

    def pinned_tokens(self) -> int:
        return sum(len(n.tokens) for n in self._nodes.values() if n.pinned)

    def clear(self) -> None:
        """Evict every unreferenced, unpinned chunk."""
        self.evict(self.pool.num_chunks)

