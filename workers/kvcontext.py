"""Builds the kernel context (`ChunkContext`) of a decode batch from the prefix tree.

Tree order is the lexicographic order of the sequences' root-to-leaf chunk-id paths: every node
then covers one contiguous row range ``[i, j)``. The build is vectorised over a ``[b, depth]``
matrix of chunk ids (no per-token and no per-(sequence, chunk) Python loop). A context is rebuilt
only when the cache's structure version changes; in between only the leaf token counts and the
sequence lengths are refreshed in place.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from chunkserve.kernels.context import ChunkContext

if TYPE_CHECKING:
    from chunkserve.workers.kvcache import PrefixKVCache


class ContextBuilder:
    """Caches the last context per batch and refreshes it lazily."""

    def __init__(self, cache: PrefixKVCache) -> None:
        self.cache = cache
        self._key: tuple[int, ...] | None = None
        self._version = -1
        self._ctx: ChunkContext | None = None
        self._leaf_seq_idx: torch.Tensor | None = None  # [b'] positions in seq_tokens of private leaves
        self._leaf_blk_idx: torch.Tensor | None = None  # [b'] flat positions in block_tokens
        self._leaf_rows: list[int] = []  # tree-order rows whose leaf is private
        self._rows: list = []  # Sequence objects in tree order
        self.rebuilds = 0

    def get(self, seq_ids: list[int]) -> ChunkContext:
        key = tuple(seq_ids)
        if self._ctx is not None and key == self._key and self._version == self.cache.version:
            self._refresh()
            return self._ctx
        self._ctx = self.build(seq_ids)
        self._key, self._version = key, self.cache.version
        return self._ctx

    def _refresh(self) -> None:
        ctx = self._ctx
        assert ctx is not None
        lens = [s.length for s in self._rows]
        ctx.seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        if self._leaf_rows:
            fills = torch.tensor([len(self._rows[r].path[-1].tokens) for r in self._leaf_rows],
                                 dtype=torch.int32, device=ctx.seq_tokens.device)
            ctx.seq_tokens[self._leaf_seq_idx] = fills
            ctx.block_tokens.view(-1)[self._leaf_blk_idx] = fills

    def build(self, seq_ids: list[int]) -> ChunkContext:
        """Rebuild the context from scratch (also used by tests to check the lazy one)."""
        cache = self.cache
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError("seq_ids must be distinct")
        if not seq_ids:
            raise ValueError("seq_ids must be non-empty")
        seqs = [cache._seq(s) for s in seq_ids]
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
        dev = cache.pool.device

        def t32(a: np.ndarray | list) -> torch.Tensor:
            return torch.as_tensor(np.asarray(a, dtype=np.int32), device=dev)

        self._leaf_seq_idx = torch.as_tensor(seq_chunk_ptr[1:][leaf_private] - 1, device=dev)
        self._leaf_blk_idx = torch.as_tensor((np.arange(b) * depth + lens - 1)[leaf_private], device=dev)
        return ChunkContext(
            order=torch.as_tensor(np.asarray(order, dtype=np.int64), device=dev),
            seq_lens=t32([s.length for s in rows]),
            run_start=t32(run_start), run_end=t32(run_end), run_chunk_ptr=t32(run_ptr),
            run_chunks=t32([x for cl in run_chunk_lists for x in cl]),
            run_tokens=t32([x for tl in run_token_lists for x in tl]),
            run_row_offset=t32(run_off), num_partials=n_part,
            seq_chunk_ptr=t32(seq_chunk_ptr), seq_chunks=t32(seq_chunks), seq_tokens=t32(seq_tokens),
            seq_run_ptr=t32(seq_run_ptr), seq_runs=t32(seq_runs),
            block_table=t32(block_table), block_tokens=t32(T),
            runs_host=tuple(runs_host), run_chunk_lists=tuple(run_chunk_lists),
            run_token_lists=tuple(run_token_lists), chunk_size=c, version=cache.version,
        )
