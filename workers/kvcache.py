"""PrefixKVCache: the prefix-aware KV cache (PAKV) of ChunkAttention.

K/V live in fixed-size chunks from a pool (`ChunkPool`), organised as a prefix tree per cache
scope (salt). Sequences with the same leading tokens share chunks; chunks that no live sequence
uses stay cached and are evicted least-recently-used, leaves first. The engine uses the two-step
form ``reserve`` (how much is cached) + ``extend``/``write`` (commit the rest, layer by layer);
``add_sequence`` / ``append_token`` are the one-call forms of the public contract.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import numpy as np
import torch

from chunkserve.cluster.cache_event import CacheEvent
from chunkserve.kernels.context import ChunkContext
from chunkserve.workers.chunk_pool import ChunkPool, KVCacheFull
from chunkserve.workers.kvcontext import ContextBuilder, HostContext
from chunkserve.workers.kvtree import Node, Sequence
from chunkserve.workers.prefix_tree import PrefixTree, check_tokens
from chunkserve.workers.staging import Staging

__all__ = ["KVCacheFull", "PrefixKVCache"]


class PrefixKVCache(PrefixTree):
    """Chunked K/V for many sequences, shared along common prefixes (see module docstring)."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, chunk_size: int = 64,
                 num_chunks: int = 1024, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", share_prefix: bool = True) -> None:
        super().__init__(ChunkPool(num_layers, num_kv_heads, head_dim, chunk_size, num_chunks, dtype, device),
                         share_prefix)
        self._seqs: dict[int, Sequence] = {}
        self._next_seq = 0
        self.peak_chunks_used = 0
        self._in_step = False
        self._unwritten: set[int] = set()
        self.pending_copies: list[tuple[int, int, int]] = []
        self._ctx = ContextBuilder(self)

    # ------------------------------------------------------------------ pools
    @property
    def k_pool(self) -> torch.Tensor:  # [L, Hkv, N, c, D]
        return self.pool.k_pool

    @property
    def v_pool(self) -> torch.Tensor:  # [L, Hkv, N, c, D]
        return self.pool.v_pool

    # ------------------------------------------------------------------ lookup
    def sequence(self, seq_id: int) -> Sequence:
        """A live sequence's state (its chunk path, uncommitted tokens, tree-order key), for the context builder;
        read it, never change it. KeyError for an unknown id."""
        return self._seq(seq_id)

    def _seq(self, seq_id: int) -> Sequence:
        seq = self._seqs.get(seq_id) if isinstance(seq_id, int) else None
        if seq is None:
            raise KeyError(f"unknown sequence id {seq_id!r}")
        return seq

    def match(self, token_ids: Seq[int] | np.ndarray, salt: bytes = b"") -> int:
        """Number of leading tokens of ``token_ids`` already cached (no side effects)."""
        return self.match_held(token_ids, salt)[0]

    # ------------------------------------------------------------------ two-step form
    def reserve(self, token_ids: Seq[int] | np.ndarray, salt: bytes = b"",
                max_cached: int | None = None) -> tuple[int, int]:
        """Start a sequence: take refs on its cached prefix; returns ``(seq_id, num_cached)``.

        The rest of the tokens stay pending until ``extend`` gives them slots. ``max_cached`` caps
        the reuse; a cap inside a cached chunk copies that chunk's leading tokens into a private chunk.
        Past the last matching full chunk, the chunk under it that shares the most leading tokens with
        the rest (a partial leaf, or a full chunk that goes on differently) is reused down to the token:
        a whole partial leaf is shared (copied on write), a head is copied.
        """
        tokens = check_tokens(token_ids)
        if not isinstance(salt, bytes):
            raise TypeError("salt must be bytes")
        cap = len(tokens) if max_cached is None else max(0, min(int(max_cached), len(tokens)))
        path, head, head_n = self._walk_head(tokens, salt)
        if head is not None and head_n == len(head.tokens):  # a whole partial leaf: shared (copied on write)
            path, head = path + [head], None
        keep: list[Node] = []
        copy_from: Node | None = None
        copy_n = cached = 0
        for node in path:
            n = len(node.tokens)
            if cached + n <= cap:
                keep.append(node)
                cached += n
            else:
                if cap > cached:
                    copy_from, copy_n = node, cap - cached
                break
        if head is not None and len(keep) == len(path) and min(head_n, cap - cached) > 0:
            copy_from, copy_n = head, min(head_n, cap - cached)  # the head of a chunk that goes on differently
        now = self._touch()
        for node in keep:  # take refs first so that making room below cannot evict them
            self._incref(node)
            node.last_access = now
        if copy_from is not None:
            self._incref(copy_from)
            try:
                self._ensure_free(1)
            except KVCacheFull:
                for node in [copy_from, *keep]:
                    self._decref(node, now)
                raise
        seq = Sequence(self._next_seq, salt)
        self._next_seq += 1
        seq.path = keep
        if copy_from is not None:  # private copy of a cached chunk's leading tokens
            (dst,) = self.pool.alloc(1)
            self._copy(copy_from.chunk, dst, copy_n)
            parent = keep[-1] if keep else self._root(salt)
            node = Node(dst, copy_from.tokens[:copy_n], parent, parent.depth + 1)
            self._register(node, salt)
            seq.path.append(node)
            cached += copy_n
            self._decref(copy_from, now)
        seq.length = cached
        seq.num_cached = cached
        seq.pending = tokens[cached:].copy()
        self._seqs[seq.seq_id] = seq
        self.version += 1
        self._note_peak()
        return seq.seq_id, cached

    def extend(self, seq_id: int, n: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Give the next ``n`` pending tokens (all by default) slots; returns ``(chunks, offsets)``
        as int64 tensors on the pool device. Raises KVCacheFull (leaving the cache unchanged) when no
        room can be made."""
        chunks, offsets = self.extend_host(seq_id, n)
        dev = self.pool.device
        return torch.as_tensor(chunks, device=dev), torch.as_tensor(offsets, device=dev)

    def extend_host(self, seq_id: int, n: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """`extend` with the slots in host memory (int64 numpy arrays): what the engine's step uses,
        so that planning a step never touches the device."""
        seq = self._seq(seq_id)
        n = len(seq.pending) if n is None else int(n)
        if n < 0 or n > len(seq.pending):
            raise ValueError(f"sequence {seq_id} has {len(seq.pending)} pending tokens, asked for {n}")
        if n == 0:
            empty = np.zeros(0, dtype=np.int64)
            return empty, empty
        c = self.chunk_size
        leaf = seq.leaf
        fill = len(leaf.tokens) if leaf is not None else c
        room = c - fill
        cow = leaf is not None and room > 0 and leaf.ref > 1
        new_chunks = -(-(n - min(room, n)) // c) + (1 if cow else 0)
        self._ensure_free(new_chunks)
        ids = self.pool.alloc(new_chunks)
        toks = seq.pending[:n].tolist()
        seq.pending = seq.pending[n:]
        chunks: list[int] = []
        offsets: list[int] = []
        if room > 0 and leaf is not None:
            if cow:  # copy the shared partial leaf before writing into it
                dst = ids.pop(0)
                self._copy(leaf.chunk, dst, fill)
                assert leaf.parent is not None
                node = Node(dst, list(leaf.tokens), leaf.parent, leaf.depth)
                self._decref(leaf, self._touch())
                node.ref = 1
                self._nodes[dst] = node
                leaf.parent.partials.append(node)
                seq.path[-1] = leaf = node
            m = min(room, n)
            self._fill(leaf, toks[:m], seq.salt)
            chunks += [leaf.chunk] * m
            offsets += range(fill, fill + m)
            toks = toks[m:]
        parent = seq.leaf or self._root(seq.salt)
        for k, cid in enumerate(ids):
            piece = toks[k * c:(k + 1) * c]
            node = Node(cid, piece, parent, parent.depth + 1)
            self._register(node, seq.salt)
            seq.path.append(node)
            chunks += [cid] * len(piece)
            offsets += range(len(piece))
            parent = node
        seq.length += n
        seq.invalidate()
        self.version += 1 if (ids or cow) else 0
        self._note_peak()
        if self._in_step:
            self._unwritten.update(chunks)
        return np.asarray(chunks, dtype=np.int64), np.asarray(offsets, dtype=np.int64)

    # ------------------------------------------------------------------ engine steps
    def begin_step(self) -> None:
        """Slots given out until `end_step` are written by the step's forward, layer by layer.

        Copies whose source is such an unwritten chunk (a copy-on-write of a partial leaf, or the
        head of a cached chunk, created in the same step) are deferred to `apply_copies(layer)`,
        which the forward calls right after writing that layer's K/V.
        """
        self._in_step = True

    def end_step(self) -> None:
        self._in_step = False
        self._unwritten.clear()
        self.pending_copies.clear()

    def _copy(self, src: int, dst: int, n: int) -> None:
        if src in self._unwritten:
            self.pending_copies.append((src, dst, n))
            self._unwritten.add(dst)
        else:
            self.pool.copy_chunk(src, dst, n)

    def apply_copies(self, layer: int) -> None:
        for src, dst, n in self.pending_copies:
            self.pool.k_pool[layer, :, dst, :n] = self.pool.k_pool[layer, :, src, :n]
            self.pool.v_pool[layer, :, dst, :n] = self.pool.v_pool[layer, :, src, :n]

    def write(self, layer: int | None, chunks: torch.Tensor, offsets: torch.Tensor,
              k: torch.Tensor, v: torch.Tensor) -> None:
        """Write K/V into slots from ``extend`` (layer=None: k, v [L, n, Hkv, D]; else [n, Hkv, D])."""
        self.pool.write(layer, chunks, offsets, k, v)

    # ------------------------------------------------------------------ one-call forms (public contract)
    def _check_kv(self, k: torch.Tensor, v: torch.Tensor, shape: tuple[int, ...]) -> None:
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor")
            if tuple(t.shape) != shape:
                raise ValueError(f"{name} must have shape {list(shape)}, got {list(t.shape)}")
            if not t.dtype.is_floating_point:
                raise ValueError(f"{name} must be floating point, got {t.dtype}")
            dev = self.pool.device  # "cuda" matches "cuda:0"
            if t.layout != torch.strided or t.device.type != dev.type or dev.index not in (None, t.device.index):
                raise ValueError(f"{name} must be a dense tensor on {self.pool.device}, got a {t.layout} one on "
                                 f"{t.device}")

    def add_sequence(self, token_ids: Seq[int] | np.ndarray, k: torch.Tensor, v: torch.Tensor,
                     salt: bytes = b"") -> int:
        """Add a sequence with K/V for all its tokens (k, v: [L, n, Hkv, D]); reuses cached chunks."""
        tokens = check_tokens(token_ids)
        p = self.pool
        self._check_kv(k, v, (p.num_layers, len(tokens), p.num_kv_heads, p.head_dim))
        seq_id, cached = self.reserve(tokens, salt)
        try:
            chunks, offsets = self.extend(seq_id)
        except KVCacheFull:
            self.remove_sequence(seq_id)
            raise
        if len(chunks):
            self.write(None, chunks, offsets, k[:, cached:], v[:, cached:])
        return seq_id

    def append_slot(self, seq_id: int, token_id: int) -> tuple[int, int]:
        """Give one new token a slot (the K/V are written later, layer by layer)."""
        seq = self._seq(seq_id)
        if seq.pending.size:
            raise ValueError(f"sequence {seq_id} still has {seq.pending.size} uncommitted prompt tokens")
        seq.pending = np.asarray([int(token_id)], dtype=np.int64)
        try:
            chunks, offsets = self.extend_host(seq_id, 1)
        except KVCacheFull:
            seq.pending = seq.pending[:0]
            raise
        return int(chunks[0]), int(offsets[0])

    def append_token(self, seq_id: int, token_id: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append one token with its K/V for all layers (k, v: [L, Hkv, D])."""
        p = self.pool
        self._seq(seq_id)
        self._check_kv(k, v, (p.num_layers, p.num_kv_heads, p.head_dim))
        if not isinstance(token_id, int | np.integer) or token_id < 0:
            raise ValueError(f"token_id must be a non-negative int, got {token_id!r}")
        chunk, off = self.append_slot(seq_id, int(token_id))
        dev = p.device
        idx_c = torch.tensor([chunk], device=dev)
        idx_o = torch.tensor([off], device=dev)
        self.write(None, idx_c, idx_o, k.unsqueeze(1), v.unsqueeze(1))

    def fork_sequence(self, seq_id: int) -> int:
        """A new sequence sharing every chunk of ``seq_id`` (a partial leaf is copied on write)."""
        src = self._seq(seq_id)
        if src.pending.size:
            raise ValueError("cannot fork a sequence with uncommitted prompt tokens")
        seq = Sequence(self._next_seq, src.salt, list(src.path), src.length)
        seq.num_cached = src.length
        self._next_seq += 1
        for node in seq.path:
            self._incref(node)
        self._seqs[seq.seq_id] = seq
        self.version += 1
        return seq.seq_id

    def remove_sequence(self, seq_id: int) -> None:
        """Release a sequence; its chunks stay cached until evicted (unless sharing is off)."""
        seq = self._seq(seq_id)
        del self._seqs[seq_id]
        now = self._touch()
        for node in reversed(seq.path):
            self._decref(node, now)
        self.version += 1

    def pin(self, seq_id: int) -> int:
        """Pin the full chunks of a live sequence's prefix; returns a handle for ``unpin``."""
        seq = self._seq(seq_id)
        return self.pin_prefix(seq.token_ids(), seq.salt)

    # ------------------------------------------------------------------ reading
    def context(self, seq_ids: Seq[int]) -> ChunkContext:
        """The kernel context for a decode batch (cached while the tree structure is unchanged)."""
        return self._ctx.get([int(s) for s in seq_ids])

    def host_context(self, seq_ids: Seq[int]) -> HostContext:
        """The decode batch's context in host memory (the engine moves it with its step's one copy)."""
        return self._ctx.get_host([int(s) for s in seq_ids])

    def device_context(self, host: HostContext, staging: Staging | None = None) -> ChunkContext:
        """The `ChunkContext` of a `host_context` (CPU: zero-copy views; else through ``staging``)."""
        return self._ctx.device_context(host, staging)

    def seq_len(self, seq_id: int) -> int:
        return self._seq(seq_id).length

    def seq_token_ids(self, seq_id: int) -> list[int]:
        return self._seq(seq_id).token_ids()

    def seq_chunks(self, seq_id: int) -> list[int]:
        return [n.chunk for n in self._seq(seq_id).path]

    def seq_hashes(self, seq_id: int) -> list[int]:
        """Chain hashes of the sequence's leading full, indexed chunks."""
        out = []
        for n in self._seq(seq_id).path:
            if n.hash is None:
                break
            out.append(n.hash)
        return out

    def read_kv(self, seq_id: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Gathered K/V of one sequence: ([n, Hkv, D], [n, Hkv, D])."""
        seq = self._seq(seq_id)
        ks, vs = [], []
        for node in seq.path:
            m = len(node.tokens)
            ks.append(self.k_pool[layer, :, node.chunk, :m])
            vs.append(self.v_pool[layer, :, node.chunk, :m])
        return torch.cat(ks, 1).transpose(0, 1), torch.cat(vs, 1).transpose(0, 1)

    def cached_hashes(self, max_depth: int) -> list[int]:
        """Chain hashes of every indexed full chunk above ``max_depth``. Call it on the thread that owns the
        cache: other threads read `AsyncEngine.cached_hashes()`, the snapshot the engine thread publishes."""
        return [n.hash for n in self._nodes.values() if n.hash is not None and n.indexed and n.depth < max_depth]

    def drain_events(self) -> list[CacheEvent]:
        out, self.events = self.events, []
        return out

    @property
    def sequences(self) -> list[int]:
        return list(self._seqs)

    def _note_peak(self) -> None:
        used = self.pool.num_chunks - self.pool.num_free - self._num_cached
        self.peak_chunks_used = max(self.peak_chunks_used, used)

    def stats(self) -> dict[str, float]:
        p = self.pool
        cached = self._num_cached
        used = p.num_chunks - p.num_free - cached
        logical = sum(s.length for s in self._seqs.values())
        # the nodes with ref > 0 are exactly those on live paths: walk those, not the whole tree (a server's tree
        # holds every cached prefix, up to the pool's size, and this runs whenever a request finishes)
        live = {id(n): n for s in self._seqs.values() for n in s.path}.values()
        physical = sum(len(n.tokens) for n in live)
        shared_tokens = sum(len(n.tokens) for n in live if n.ref > 1)
        return {
            "kv_chunks_total": p.num_chunks,
            "kv_chunks_used": used,
            "kv_chunks_free": p.num_free,
            "kv_chunks_cached": cached,
            "num_sequences": len(self._seqs),
            "logical_tokens": logical,
            "physical_tokens": physical,
            "shared_tokens": shared_tokens,
            "sharing_ratio": 1.0 - physical / logical if logical else 0.0,
            "kv_bytes_used": used * p.bytes_per_chunk,
            "peak_kv_bytes": self.peak_chunks_used * p.bytes_per_chunk,
            "bytes_per_chunk": p.bytes_per_chunk,
        }
