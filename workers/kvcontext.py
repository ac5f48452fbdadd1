"""Builds the kernel context (`ChunkContext`) of a decode batch from the prefix tree.

Tree order is the lexicographic order of the sequences' root-to-leaf chunk-id paths: every node
then covers one contiguous row range ``[i, j)``. The build is vectorised over a ``[b, depth]``
matrix of chunk ids (no per-token and no per-(sequence, chunk) Python loop). A context is rebuilt
only when the cache's structure version changes; in between only the leaf token counts and the
sequence lengths are refreshed in place.

The context lives in host memory (`HostContext`: numpy arrays plus the host tuples); its device
tensors are made by a `Staging` (`workers/staging.py`): on the CPU, zero-copy views of the arrays;
on a GPU, views of the step's one host-to-device copy. Nothing here reads a device tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from chunkserve.kernels.context import ChunkContext
from chunkserve.workers.staging import Staging

if TYPE_CHECKING:
    from chunkserve.workers.kvcache import PrefixKVCache

# ChunkContext's tensor fields, in the order HostContext.arrays holds them (all int32 but ``order``)
TENSOR_FIELDS = ("order", "seq_lens", "run_start", "run_end", "run_chunk_ptr", "run_chunks", "run_tokens",
                 "run_row_offset", "seq_chunk_ptr", "seq_chunks", "seq_tokens", "seq_run_ptr", "seq_runs",
                 "block_table", "block_tokens")


@dataclass
class HostContext:
    """A decode batch's context in host memory; `to_device` makes the `ChunkContext` the kernels read."""

    arrays: dict[str, np.ndarray]  # TENSOR_FIELDS -> array (order int64, the rest int32)
    num_partials: int
    runs_host: tuple[tuple[int, int, int, int, bool], ...]
    run_chunk_lists: tuple[tuple[int, ...], ...]
    run_token_lists: tuple[tuple[int, ...], ...]
    chunk_size: int
    version: int

    @property
    def order(self) -> np.ndarray:  # [b] int64 tree-order row -> caller's index
        return self.arrays["order"]

    @property
    def batch_size(self) -> int:
        return int(self.arrays["order"].shape[0])

    def stage(self, staging: Staging) -> list[int]:
        """Queue the arrays on ``staging``; returns their indices for `from_tensors`."""
        return [staging.add(self.arrays[name], self.arrays[name].dtype.type) for name in TENSOR_FIELDS]

    def from_tensors(self, tensors: list, idx: list[int]) -> ChunkContext:
        """The `ChunkContext` over ``tensors[idx[k]]`` (the flushed arrays of `stage`)."""
        fields = {name: tensors[i] for name, i in zip(TENSOR_FIELDS, idx, strict=True)}
        return ChunkContext(**fields, num_partials=self.num_partials, runs_host=self.runs_host,
                            run_chunk_lists=self.run_chunk_lists, run_token_lists=self.run_token_lists,
                            chunk_size=self.chunk_size, version=self.version)

    def to_device(self, staging: Staging) -> ChunkContext:
        """Stage and flush at once (one copy of its own on a GPU)."""
        idx = self.stage(staging)
        return self.from_tensors(staging.flush(), idx)


class ContextBuilder:
    """Caches the last context per batch and refreshes it lazily."""

    def __init__(self, cache: PrefixKVCache) -> None:
        self.cache = cache
        self._key: tuple[int, ...] | None = None
        self._version = -1
        self._host: HostContext | None = None
        self._cpu_ctx: ChunkContext | None = None  # CPU: zero-copy views of self._host, made once per build
        self._leaf_seq_idx = np.zeros(0, dtype=np.int64)  # [b'] positions in seq_tokens of private leaves
        self._leaf_blk_idx = np.zeros(0, dtype=np.int64)  # [b'] flat positions in block_tokens
        self._leaf_rows: list[int] = []  # tree-order rows whose leaf is private
        self._rows: list = []  # Sequence objects in tree order
        self.rebuilds = 0

    def get_host(self, seq_ids: list[int]) -> HostContext:
        """The batch's context in host memory, rebuilt only when the structure version changed."""
        key = tuple(seq_ids)
        if self._host is not None and key == self._key and self._version == self.cache.version:
            self._refresh()
            return self._host
        self._host = self.build_host(seq_ids)
        self._cpu_ctx = None
        self._key, self._version = key, self.cache.version
        return self._host

    def get(self, seq_ids: list[int]) -> ChunkContext:
        """The batch's `ChunkContext` on the pool device (its own copy on a GPU, kept by the caller)."""
        host = self.get_host(seq_ids)
        return self.device_context(host)

    def device_context(self, host: HostContext, staging: Staging | None = None) -> ChunkContext:
        """`ChunkContext` of ``host``: on the CPU the cached zero-copy views (refreshed in place with the
        arrays); elsewhere through ``staging`` (default: a copy of its own)."""
        dev = self.cache.pool.device
        if dev.type == "cpu":
            if self._cpu_ctx is None or host is not self._host:
                ctx = host.to_device(Staging(dev))
                if host is not self._host:
                    return ctx
                self._cpu_ctx = ctx
            return self._cpu_ctx
        return host.to_device(staging or Staging(dev, reuse=False))

    def _refresh(self) -> None:
        host = self._host
        assert host is not None
        host.arrays["seq_lens"][:] = [s.length for s in self._rows]
        if self._leaf_rows:
            fills = np.fromiter((len(self._rows[r].path[-1].tokens) for r in self._leaf_rows), dtype=np.int32,
                                count=len(self._leaf_rows))
            host.arrays["seq_tokens"][self._leaf_seq_idx] = fills
            host.arrays["block_tokens"].reshape(-1)[self._leaf_blk_idx] = fills

    def build(self, seq_ids: list[int]) -> ChunkContext:
        """A fresh context from scratch, on the pool device (tests compare it with the lazy one)."""
        return self.build_host(seq_ids).to_device(Staging(self.cache.pool.device, reuse=False))

    def build_host(self, seq_ids: list[int]) -> HostContext:
        """Build the host context from scratch."""
        cache = self.cache
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError("seq_ids must be distinct")
        if not seq_ids:
            raise ValueError("seq_ids must be non-empty")
        seqs = [cache.sequence(s) for s in seq_ids]
        for s in seqs:
            if s.pending.size:
                raise ValueError(f"sequence {s.seq_id} has uncommitted tokens")
            if not s.path:
                raise ValueError(f"sequence {s.seq_id} is empty")
        self.rebuilds += 1
        c = cache.chunk_size
        b = len(seqs)
        order = sorted(range(b), key=lambda r: seqs[r].key())
        rows = [seqs[r] for r in order]
        depth = max(len(s.path) for s in rows)
        # P: [b, depth] chunk ids in tree order (-1 pad); T: valid tokens per entry
        P = np.full((b, depth), -1, dtype=np.int64)
        T = np.zeros((b, depth), dtype=np.int64)
        lens = np.fromiter((len(s.path) for s in rows), dtype=np.int64, count=b)
        for r, s in enumerate(rows):
            P[r, : lens[r]] = s.key()
        valid = np.arange(depth)[None, :] < lens[:, None]
        T[valid] = c
        leaf_fill = np.fromiter((len(s.path[-1].tokens) for s in rows), dtype=np.int64, count=b)
        T[np.arange(b), lens - 1] = leaf_fill
        # segments of equal chunk ids down each column (column-major walk)
        Pt = P.T  # [depth, b]
        start = np.ones_like(Pt, dtype=bool)
        start[:, 1:] = Pt[:, 1:] != Pt[:, :-1]
        seg_id = np.cumsum(start.ravel()) - 1
        seg_len = np.bincount(seg_id)
        flat_len = seg_len[seg_id].reshape(depth, b)
        shared = (flat_len >= 2) & (Pt >= 0)  # [depth, b]
        private = (flat_len == 1) & (Pt >= 0)
        # phase 1: one run per distinct (i, j) among shared segments, chunks in depth order
        sd, sr = np.nonzero(shared & start)  # segment heads: depth, row i
        si = sr
        sj = sr + flat_len[sd, sr]
        runs: dict[tuple[int, int], list[int]] = {}
        first_depth: dict[tuple[int, int], int] = {}
        for d, i, j in zip(sd.tolist(), si.tolist(), sj.tolist(), strict=True):
            runs.setdefault((i, j), []).append(d)
            first_depth.setdefault((i, j), d)
        run_keys = sorted(runs, key=lambda ij: (ij[0], first_depth[ij]))
        run_chunk_lists, run_token_lists, runs_host = [], [], []
        run_start, run_end, run_ptr, run_off = [], [], [0], []
        n_part = 0
        for i, j in run_keys:
            ds = runs[(i, j)]
            chunks = P[i, ds].tolist()
            toks = T[i, ds].tolist()
            contiguous = all(chunks[k + 1] == chunks[k] + 1 for k in range(len(chunks) - 1)) and all(
                t == c for t in toks[:-1])
            run_chunk_lists.append(tuple(chunks))
            run_token_lists.append(tuple(toks))
            runs_host.append((i, j, chunks[0], len(chunks), contiguous))
            run_start.append(i)
            run_end.append(j)
            run_ptr.append(run_ptr[-1] + len(chunks))
            run_off.append(n_part)
            n_part += j - i
        # phase 2: per row, its runs (root-most first) and its private chunks
        R = len(run_keys)
        if R:
            rs = np.asarray(run_start)
            re_ = np.asarray(run_end)
            cnt = re_ - rs
            entry_run = np.repeat(np.arange(R), cnt)
            entry_row = np.concatenate([np.arange(i, j) for i, j in zip(run_start, run_end, strict=True)])
            fd = np.asarray([first_depth[k] for k in run_keys])
            o = np.lexsort((fd[entry_run], entry_row))
            seq_runs = entry_run[o]
            seq_run_ptr = np.concatenate([[0], np.cumsum(np.bincount(entry_row, minlength=b))])
        else:
            seq_runs = np.zeros(0, dtype=np.int64)
            seq_run_ptr = np.zeros(b + 1, dtype=np.int64)
        priv = private.T  # [b, depth], row-major = row then depth
        seq_chunks = P[priv]
        seq_tokens = T[priv]
        seq_chunk_ptr = np.concatenate([[0], np.cumsum(priv.sum(1))])
        block_table = np.where(P >= 0, P, 0)
        # private leaves, for the in-place refresh between rebuilds
        leaf_private = priv[np.arange(b), lens - 1]
        self._leaf_rows = np.flatnonzero(leaf_private).tolist()
        self._rows = rows

        def i32(a: np.ndarray | list) -> np.ndarray:
            return np.ascontiguousarray(a, dtype=np.int32)

        self._leaf_seq_idx = (seq_chunk_ptr[1:][leaf_private] - 1).astype(np.int64)
        self._leaf_blk_idx = (np.arange(b) * depth + lens - 1)[leaf_private].astype(np.int64)
        arrays = dict(
            order=np.asarray(order, dtype=np.int64), seq_lens=i32([s.length for s in rows]),
            run_start=i32(run_start), run_end=i32(run_end), run_chunk_ptr=i32(run_ptr),
            run_chunks=i32([x for cl in run_chunk_lists for x in cl]),
            run_tokens=i32([x for tl in run_token_lists for x in tl]), run_row_offset=i32(run_off),
            seq_chunk_ptr=i32(seq_chunk_ptr), seq_chunks=i32(seq_chunks), seq_tokens=i32(seq_tokens),
            seq_run_ptr=i32(seq_run_ptr), seq_runs=i32(seq_runs), block_table=i32(block_table), block_tokens=i32(T),
        )
        return HostContext(arrays, n_part, tuple(runs_host), tuple(run_chunk_lists), tuple(run_token_lists),
                           c, cache.version)
