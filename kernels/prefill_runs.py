"""Prefill attention on the CPU, chunk-first: a step's new tokens over their keys in three kernel calls.

`prefill_torch`'s loop reads each row's keys in place but makes a few small SDPA calls per row, and when
several requests of a step start with the same cached chunks (the chats of a tenant after its system
prompt) it reads those chunks once per request. Here every new token of the step is a query row of the CPU
kernels, and its keys split in three parts, each one call for the whole step:

* **shared runs**: adjacent rows whose tables begin with the same full chunks, cached before all of their
  new tokens, form a run; the run's tokens attend those chunks together in TPP's phase-1 kernel
  (`cpu_kernel`'s run kernel), so each shared key is loaded once per run (a row alone is a run of one);
* **block runs**: the new tokens of a row that lie in one chunk attend the row's chunks between its shared
  run and that chunk, again as one run (a matrix product over up to a chunk of tokens);
* **own chunk**: each token attends its own chunk up to its own position in the in-place decode kernel (the
  causal mask is the valid-token count).

Where bf16 runs go through AMX tiles (`csrc/run_amx.h`) or `vdpbf16ps` pairs (`csrc/run_bf16.h`) the block runs
and the own chunk are one **causal run** per piece of a request's tokens instead: the piece's rows against all of
the request's chunks after its shared run, each row masked at its own position inside the kernel, so (with AMX)
those chunks are packed once per piece rather than once per chunk of new tokens, and the own chunk is matrix work
too.

The kernel merges each run's partial into the token's (o, lse) by log-sum-exp as it writes it. The plan (runs
and tables) is built once per step for all layers (`PrefillTables.cpu_plan`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from chunkserve.kernels.cpu_kernel import CpuDecodeKernel, RunTable, load_cpu_kernel, run_attention
from chunkserve.kernels.torch_ops import Workspace

RUN_TOKENS = 128  # a shared run's tokens go in pieces of this many (their query rows and accumulators stay in L2)


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


def causal_runs(kern: CpuDecodeKernel, pool: torch.Tensor) -> bool:
    """Whether this step's plan takes the causal-run form: bf16 pools whose runs go through AMX tiles or `vdpbf16ps`
    pairs (there it was 2-3 % faster over a 1,026-token prefill on a Zen 5; fp32 pools gained nothing)."""
    return pool.dtype == torch.bfloat16 and (kern.amx_tiles(pool.shape[3]) or kern.bf16_pairs)


@dataclass(frozen=True)
class CpuPrefillPlan:
    """A prefill step's kernel tables on the CPU path (see the module docstring), for every layer: the shared
    runs and the block runs (over token rows of q; None when there are none), each token's own chunk (int32
    [T, 1] chunk id and the keys it may see there), and the scratch the step's layers share."""

    runs: PrefixRuns | None
    shared: RunTable | None
    blocks: RunTable | None
    own_table: torch.Tensor  # [T, 1] (no rows with causal runs, which cover the own chunks)
    own_seen: torch.Tensor
    causal: RunTable | None = None  # with ``causal=True``: the causal runs that replace blocks and own chunks
    ws: Workspace = field(default_factory=Workspace, compare=False, repr=False)

    @staticmethod
    def build(tables: list[list[int]], tokens: list[list[int]], starts: list[int], cu: list[int],
              c: int, causal: bool = False) -> CpuPrefillPlan:
        runs = find_runs(tables, tokens, starts, cu, c)
        shared = None
        if runs is not None:  # each run's tokens in pieces of at most RUN_TOKENS query rows
            pieces = [((lo, min(lo + RUN_TOKENS, cu[j])), ch) for (i, j), ch in zip(runs.rows, runs.chunks, strict=True)
                      for lo in range(cu[i], cu[j], RUN_TOKENS)]
            shared = RunTable.build([r for r, _ in pieces], [ch for _, ch in pieces],
                                    [(c,) * len(ch) for _, ch in pieces])
        skip = runs.skip if runs is not None else [0] * len(starts)
        t = cu[-1] if cu else 0
        own_table = np.zeros((0 if causal else t, 1), dtype=np.int32)
        own_seen = np.zeros((0 if causal else t, 1), dtype=np.int32)
        b_rows: list[tuple[int, int]] = []
        b_chunks: list[tuple[int, ...]] = []
        b_tokens: list[tuple[int, ...]] = []
        b_qpos: list[int] = []
        for b in range(len(starts)):
            n_b = cu[b + 1] - cu[b]
            if n_b == 0:
                continue
            nt = np.asarray(tokens[b], dtype=np.int64)
            first = np.cumsum(nt) - nt  # first position of each chunk
            pos = np.arange(starts[b], starts[b] + n_b)
            k_of = np.searchsorted(first + nt, pos, side="right")  # [n_b]: the chunk holding each position
            if causal:  # pieces of RUN_TOKENS rows over chunks [skip, chunk of the piece's last token]
                for lo in range(cu[b], cu[b + 1], RUN_TOKENS):
                    hi = min(lo + RUN_TOKENS, cu[b + 1])
                    k_end = int(k_of[hi - 1 - cu[b]]) + 1
                    b_rows.append((lo, hi))
                    b_chunks.append(tuple(tables[b][skip[b]:k_end]))
                    b_tokens.append(tuple(tokens[b][skip[b]:k_end]))
                    b_qpos.append(int(pos[lo - cu[b]] - first[skip[b]]))
                continue
            own_table[cu[b]:cu[b + 1], 0] = np.asarray(tables[b], dtype=np.int32)[k_of]
            own_seen[cu[b]:cu[b + 1], 0] = pos + 1 - first[k_of]
            lo = cu[b]
            for k in np.unique(k_of).tolist():  # new tokens by chunk: a block run over chunks [skip, k)
                n_k = int((k_of == k).sum())
                if k > skip[b]:
                    b_rows.append((lo, lo + n_k))
                    b_chunks.append(tuple(tables[b][skip[b]:k]))
                    b_tokens.append(tuple(tokens[b][skip[b]:k]))
                lo += n_k
        if causal:
            table = RunTable.build(b_rows, b_chunks, b_tokens, b_qpos) if b_rows else None
            return CpuPrefillPlan(runs, shared, None, torch.from_numpy(own_table), torch.from_numpy(own_seen), table)
        blocks = RunTable.build(b_rows, b_chunks, b_tokens) if b_rows else None
        return CpuPrefillPlan(runs, shared, blocks, torch.from_numpy(own_table), torch.from_numpy(own_seen))


def chunk_first_prefill(kern: CpuDecodeKernel, q: torch.Tensor, k_pool_l: torch.Tensor, v_pool_l: torch.Tensor,
                        plan: CpuPrefillPlan, scale: float) -> torch.Tensor:
    """Every new token of the step over all its keys. q: [T, Hq, D] -> o: [T, Hq, D] fp32."""
    t, hq, d = q.shape
    hkv = k_pool_l.shape[0]
    g = hq // hkv
    q4 = q.float().reshape(t, hkv, g, d)  # [T, Hkv, g, D]: the query heads of a KV head together
    ws = plan.ws
    o = torch.empty(t, hkv, g, d, dtype=torch.float32)
    lse = torch.empty(t, hkv, g, dtype=torch.float32)
    if plan.causal is not None:  # every token over its request's unshared chunks, masked in the kernel
        run_attention(kern, q4, k_pool_l, v_pool_l, plan.causal, scale, o.unsqueeze(0), lse.unsqueeze(0), ws,
                      one_slot=True)
    else:
        kern(q4, k_pool_l, v_pool_l, plan.own_table, plan.own_seen, scale, o, lse, ws)  # own chunk, causal
    for table in (plan.shared, plan.blocks):  # each run's partial merged into (o, lse) by the kernel
        if table is not None:
            run_attention(kern, q4, k_pool_l, v_pool_l, table, scale, o.unsqueeze(0), lse.unsqueeze(0), ws,
                          one_slot=True, accumulate=True)
    return o.view(t, hq, d)
