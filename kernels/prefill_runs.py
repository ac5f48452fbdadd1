"""Prefill over a shared cached prefix, chunk-first: TPP's phase 1 for the new tokens of a step.

When several requests of a step start with the same cached chunks (the chats of a tenant after its system
prompt), `prefill_torch` would read those chunks once per request and per GQA group, in one small SDPA call
each. Here adjacent batch rows whose tables begin with the same full chunks, cached before all of their new
tokens, form a run; every new token of the run is one query row of the CPU phase-1 kernel
(`cpu_kernel.run_attention`), so each key and value of the shared chunks is loaded once per run and the
scores are a matrix product over all of the run's tokens. The kernel returns a normalised partial and its
log-sum-exp per token; `prefill_torch` merges the rest of each row (its private chunks and its causal new
tokens) into it by online softmax. A row alone with cached full chunks is a run of one (the kernel beats
ATen's SDPA on a single row's cached prefix too).

Rows with few new tokens (at most `TAIL_MAX_TOKENS`: a chat's question after a cached system prompt) finish
without a per-row loop: each of their new tokens becomes a row of the in-place decode kernel over the keys
after its run's chunks, up to its own position (`tail_tables`: the causal mask is the valid-token count of
each chunk), and one merge per step folds the run partials in. Rows with many new tokens keep ATen's causal
SDPA for their new keys (`prefill_torch`'s loop), where its matrix form wins.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from chunkserve.kernels.cpu_kernel import CpuDecodeKernel, RunTable, load_cpu_kernel, run_attention
from chunkserve.kernels.torch_ops import Workspace, merge_into

TAIL_MAX_TOKENS = 64  # rows with at most this many new tokens go through the decode kernel, token by token


@dataclass(frozen=True)
class PrefixRuns:
    """Runs of a prefill step: batch rows [i, j) and the leading chunks they share; ``skip[b]``: how many
    leading chunks of row b its run covers (0: none)."""

    rows: list[tuple[int, int]]
    chunks: list[tuple[int, ...]]
    skip: list[int]


def find_runs(tables: list[list[int]], tokens: list[list[int]], starts: list[int], cu: list[int],
              c: int) -> PrefixRuns | None:
    """Group adjacent rows with new tokens by their common leading full chunks cached before all of those rows'
    new tokens; None when no row has such a chunk."""
    n_rows = len(starts)
    skip = [0] * n_rows
    rows: list[tuple[int, int]] = []
    chunks: list[tuple[int, ...]] = []

    def eligible(r: int) -> bool:
        return cu[r + 1] > cu[r] and starts[r] >= c and bool(tables[r]) and tokens[r][0] == c

    b = 0
    while b < n_rows:
        if not eligible(b):
            b += 1
            continue
        e = b + 1
        while e < n_rows and eligible(e) and tables[e][0] == tables[b][0]:
            e += 1
        k = 0
        while all(k < len(tables[r]) and tables[r][k] == tables[b][k] and tokens[r][k] == c
                  and (k + 1) * c <= starts[r] for r in range(b, e)):
            k += 1
        rows.append((b, e))
        chunks.append(tuple(tables[b][:k]))
        for r in range(b, e):
            skip[r] = k
        b = e
    return PrefixRuns(rows, chunks, skip) if rows else None


def run_kernel(q: torch.Tensor, pool: torch.Tensor) -> CpuDecodeKernel | None:
    """The CPU phase-1 kernel when it serves this step's queries (q: [T, Hq, D]) over ``pool``, else None."""
    if q.device.type != "cpu":
        return None
    kern = load_cpu_kernel()
    hkv, d = pool.shape[0], pool.shape[3]
    if kern is None or not kern.supports_runs(q.new_empty(0, hkv, q.shape[1] // hkv, d), pool):
        return None
    return kern


@dataclass(frozen=True)
class CpuPrefillPlan:
    """What a prefill step's every layer reuses on the CPU path: the runs and their kernel table, the rows
    with few new tokens (``small``) and their tokens' decode-kernel tables, and where a run partial folds
    into them. Built once per step (`PrefillTables.cpu_plan`)."""

    runs: PrefixRuns | None
    run_table: RunTable | None
    small: list[int]
    tail_idx: torch.Tensor | None  # int64 [n]: q rows of the small rows' new tokens
    tail_table: torch.Tensor | None  # int32 [n, P]
    tail_seen: torch.Tensor | None  # int32 [n, P]
    merge_at: torch.Tensor | None  # int64 [m]: positions among the n tokens that have a run partial
    merge_slot: torch.Tensor | None  # int64 [m]: their run
    merge_row: torch.Tensor | None  # int64 [m]: their q row

    @staticmethod
    def build(tables: list[list[int]], tokens: list[list[int]], starts: list[int], cu: list[int],
              c: int) -> CpuPrefillPlan:
        runs = find_runs(tables, tokens, starts, cu, c)
        run_table = None
        if runs is not None:
            run_table = RunTable.build([(cu[i], cu[j]) for i, j in runs.rows], runs.chunks,
                                       [(c,) * len(ch) for ch in runs.chunks])
        small = [b for b in range(len(starts)) if 0 < cu[b + 1] - cu[b] <= TAIL_MAX_TOKENS]
        if not small:
            return CpuPrefillPlan(runs, run_table, [], None, None, None, None, None, None)
        skip = runs.skip if runs is not None else [0] * len(starts)
        idx, table, seen = tail_tables(small, tables, tokens, starts, cu, skip)
        at = slots = None
        if runs is not None:
            slot = {r: i for i, (lo, hi) in enumerate(runs.rows) for r in range(lo, hi)}
            per_token = np.concatenate([np.full(cu[b + 1] - cu[b], slot[b] if skip[b] else -1) for b in small])
            at = np.flatnonzero(per_token >= 0)
            slots = per_token[at]
        some = at is not None and slots is not None and at.size > 0
        return CpuPrefillPlan(
            runs, run_table, small, torch.from_numpy(idx), torch.from_numpy(table), torch.from_numpy(seen),
            torch.from_numpy(at) if some else None, torch.from_numpy(slots) if some else None,
            torch.from_numpy(idx[at]) if some else None)


def run_partials(kern: CpuDecodeKernel, q: torch.Tensor, k_pool_l: torch.Tensor, v_pool_l: torch.Tensor,
                 plan: CpuPrefillPlan, scale: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Each run's new tokens over its shared chunks. q: [T, Hq, D] -> (o [R, T, Hkv, g, D], lse [R, T, Hkv, g])
    fp32 (slot r holds run r's tokens only), or None without runs."""
    if plan.run_table is None:
        return None
    t, hq, d = q.shape
    hkv = k_pool_l.shape[0]
    g = hq // hkv
    q4 = q.float().reshape(t, hkv, g, d)  # [T, Hkv, g, D]: query heads of a KV head together
    n_runs = plan.run_table.rows.shape[0]
    part_o = torch.empty(n_runs, t, hkv, g, d, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(n_runs, t, hkv, g, dtype=torch.float32, device=q.device)
    run_attention(kern, q4, k_pool_l, v_pool_l, plan.run_table, scale, part_o, part_lse, Workspace())
    return part_o, part_lse


def small_rows_attention(kern: CpuDecodeKernel, q: torch.Tensor, k_pool_l: torch.Tensor, v_pool_l: torch.Tensor,
                         plan: CpuPrefillPlan, run_part: tuple[torch.Tensor, torch.Tensor] | None,
                         scale: float) -> torch.Tensor:
    """Attention of the new tokens of ``plan.small`` over all their keys: o fp32 [n, Hq, D] for the q rows
    ``plan.tail_idx``."""
    if plan.tail_idx is None or plan.tail_table is None or plan.tail_seen is None:
        raise ValueError("the plan has no small rows")
    t, hq, d = q.shape
    hkv = k_pool_l.shape[0]
    g = hq // hkv
    q4 = q.float().reshape(t, hkv, g, d).index_select(0, plan.tail_idx)  # [n, Hkv, g, D]
    o = torch.empty_like(q4)
    lse = torch.empty(q4.shape[:3], dtype=torch.float32)  # [n, Hkv, g]
    kern(q4, k_pool_l, v_pool_l, plan.tail_table, plan.tail_seen, scale, o, lse, Workspace())
    if run_part is not None and plan.merge_at is not None:  # fold in the run partial (the shared chunks)
        o_m, lse_m = o.index_select(0, plan.merge_at), lse.index_select(0, plan.merge_at)
        merge_into(o_m, lse_m, run_part[0][plan.merge_slot, plan.merge_row], run_part[1][plan.merge_slot, plan.merge_row])
        o.index_copy_(0, plan.merge_at, o_m)
    return o.view(-1, hq, d)


def tail_tables(rows: list[int], tables: list[list[int]], tokens: list[list[int]], starts: list[int],
                cu: list[int], skip: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per new token of ``rows``: its row of q (int64 [n]) and the chunks after its run's ``skip`` leading
    ones with the tokens it may see (int32 [n, P]: up to its own position; 0 = none)."""
    idx: list[np.ndarray] = []
    tabs: list[np.ndarray] = []
    toks: list[np.ndarray] = []
    rows_out: list[tuple[np.ndarray, np.ndarray]] = []
    for b in rows:
        ids = np.asarray(tables[b][skip[b]:], dtype=np.int32)
        nt = np.asarray(tokens[b][skip[b]:], dtype=np.int64)
        first = np.cumsum(nt) - nt + sum(tokens[b][:skip[b]])  # first position of each chunk
        pos = np.arange(starts[b], starts[b] + cu[b + 1] - cu[b])  # [n_b] positions of the new tokens
        used = np.flatnonzero((nt > 0) & (first <= pos[-1]))
        keep = int(used[-1]) + 1 if used.size else 0  # the table's padding and chunks past the row: dropped
        ids, nt, first = ids[:keep], nt[:keep], first[:keep]
        seen = np.clip(pos[:, None] + 1 - first[None, :], 0, nt[None, :])  # [n_b, P_b]
        rows_out.append((np.broadcast_to(ids, seen.shape), seen))
        idx.append(np.arange(cu[b], cu[b + 1]))
    width = max(1, max(ids.shape[1] for ids, _ in rows_out))
    for ids, seen in rows_out:
        pad = ((0, 0), (0, width - ids.shape[1]))
        tabs.append(np.pad(ids, pad))
        toks.append(np.pad(seen, pad))
    return np.concatenate(idx), np.concatenate(tabs).astype(np.int32), np.concatenate(toks).astype(np.int32)


