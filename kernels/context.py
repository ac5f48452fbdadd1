"""The kernel context: what TPP needs to know about a decode batch, as flat index arrays.

A `ChunkContext` is built by the prefix tree (`chunkserve.workers.kvcache`) and read by every
attention backend. Rows are in *tree order*: the batch is sorted so that every tree node covers
one contiguous row range ``[i, j)``. ``order`` maps tree-order rows back to the caller's order.

Pool layout (owned by the cache, read here): ``k_pool, v_pool: [L, Hkv, N, c, D]``. A run of
consecutive chunk ids ``a..b`` of one layer is therefore the view ``k_pool[l, :, a:b]`` which
reshapes, without a copy, to ``[Hkv, (b-a)*c, D]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ChunkContext:
    """Flat description of a batch of sequences over the chunk pool (all int tensors on the pool device).

    Shared runs (phase 1). A *run* is a maximal chain of tree nodes that all cover the same batch
    rows ``[run_start[r], run_end[r])`` with at least two rows. Its chunks, root-most first, are
    ``run_chunks[run_chunk_ptr[r]:run_chunk_ptr[r+1]]`` holding ``run_tokens[...]`` valid tokens each.
    Phase 1 writes one partial (o, m, l) per (run, covered row) at
    ``run_row_offset[r] + row - run_start[r]``; there are ``num_partials`` in all.

    Private chunks (phase 2). The chunks used by exactly one row of the batch are, for row ``s``,
    ``seq_chunks[seq_chunk_ptr[s]:seq_chunk_ptr[s+1]]`` with ``seq_tokens[...]`` valid tokens each.
    Row ``s`` merges the partials of its runs ``seq_runs[seq_run_ptr[s]:seq_run_ptr[s+1]]``
    (root-most first) with its private chunks.

    Paged view (baselines). ``block_table: [b, max_chunks]`` lists every chunk of each row, shared
    or not, padded with 0; ``block_tokens`` gives each entry's valid tokens (0 for padding);
    ``seq_lens: [b]`` is the total token count per row.
    """

    order: torch.Tensor  # [b] int64: tree-order row -> index into the caller's seq_ids / q
    seq_lens: torch.Tensor  # [b] int32, tree order
    # phase 1: shared runs
    run_start: torch.Tensor  # [R] int32
    run_end: torch.Tensor  # [R] int32
    run_chunk_ptr: torch.Tensor  # [R+1] int32
    run_chunks: torch.Tensor  # [sum] int32 chunk ids
    run_tokens: torch.Tensor  # [sum] int32 valid tokens per chunk
    run_row_offset: torch.Tensor  # [R] int32
    num_partials: int
    # phase 2: per-row private chunks and the runs to merge
    seq_chunk_ptr: torch.Tensor  # [b+1] int32
    seq_chunks: torch.Tensor  # [sum] int32
    seq_tokens: torch.Tensor  # [sum] int32
    seq_run_ptr: torch.Tensor  # [b+1] int32
    seq_runs: torch.Tensor  # [sum] int32
    # paged view
    block_table: torch.Tensor  # [b, max_chunks] int32
    block_tokens: torch.Tensor  # [b, max_chunks] int32
    # host-side copies for the torch backend's Python loop (no device syncs on the hot path)
    runs_host: tuple[tuple[int, int, int, int, bool], ...]  # (start, end, first_chunk, n_chunks, contiguous)
    run_chunk_lists: tuple[tuple[int, ...], ...]  # chunk ids per run
    run_token_lists: tuple[tuple[int, ...], ...]  # valid tokens per chunk, per run
    chunk_size: int
    version: int  # the cache's structure version this context was built at

    @property
    def batch_size(self) -> int:
        return int(self.order.shape[0])

    @property
    def num_runs(self) -> int:
        return len(self.runs_host)
