"""Hand-built kernel contexts and random chunk trees, for tests and benchmarks of the kernels alone.

``context_from_paths`` builds a ``ChunkContext`` straight from each row's chunk path (chunk ids and
valid token counts); it can express trees the cache never makes (partly filled chunks in the
middle of a path), so the kernels are tested on every shape the context contract allows.
``ChunkTree`` keeps the K/V it wrote per node so a reference can be computed without the pool.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from chunkserve.kernels.context import ChunkContext

Path = list[tuple[int, int]]  # [(chunk_id, valid_tokens)] root first


def _i32(x: list[int] | list[list[int]], device: torch.device) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.int32, device=device)


def context_from_paths(paths: list[Path], chunk_size: int, device: str | torch.device = "cpu") -> ChunkContext:
    """Build the kernel context of rows whose chunk paths are ``paths`` (caller order).

    Rows sharing a chunk id at the same depth share that tree node (and its whole prefix).
    """
    dev = torch.device(device)
    order = sorted(range(len(paths)), key=lambda s: [ch for ch, _ in paths[s]])
    rows = [paths[s] for s in order]
    b = len(rows)
    span: dict[tuple[int, int], list[int]] = {}
    for r, path in enumerate(rows):
        for depth, (ch, _nt) in enumerate(path):
            lo_hi = span.setdefault((depth, ch), [r, r + 1])
            lo_hi[1] = r + 1
    runs: dict[tuple[int, ...], tuple[int, int, list[int], list[int]]] = {}
    seq_runs: list[list[tuple[int, ...]]] = []
    seq_priv: list[list[tuple[int, int]]] = []
    for path in rows:
        mine: list[tuple[int, ...]] = []
        priv: list[tuple[int, int]] = []
        cur: list[int] = []
        cur_rng: tuple[int, int] | None = None
        for depth, (ch, _nt) in enumerate(path):
            lo, hi = span[(depth, ch)]
            if hi - lo < 2:
                priv.append(path[depth])
                continue
            if cur_rng != (lo, hi) and cur:
                mine.append(tuple(cur))
                cur = []
            cur_rng = (lo, hi)
            cur.append(depth)
        if cur:
            mine.append(tuple(cur))
        keys = []
        for depths in mine:
            key = tuple(path[d][0] for d in depths)
            lo, hi = span[(depths[0], path[depths[0]][0])]
            runs.setdefault(key, (lo, hi, [path[d][0] for d in depths], [path[d][1] for d in depths]))
            keys.append(key)
        seq_runs.append(keys)  # type: ignore[arg-type]
        seq_priv.append(priv)
    run_keys = sorted(runs, key=lambda k: (runs[k][0], -runs[k][1], len(k)))
    run_index = {k: n for n, k in enumerate(run_keys)}
    run_start, run_end, ptr, chunks, toks, offs, host = [], [], [0], [], [], [], []
    chunk_lists, token_lists = [], []
    num_partials = 0
    for k in run_keys:
        lo, hi, chs, nts = runs[k]
        run_start.append(lo)
        run_end.append(hi)
        chunks += chs
        toks += nts
        ptr.append(len(chunks))
        offs.append(num_partials)
        num_partials += hi - lo
        contiguous = all(chs[t + 1] == chs[t] + 1 for t in range(len(chs) - 1))
        host.append((lo, hi, chs[0], len(chs), contiguous))
        chunk_lists.append(tuple(chs))
        token_lists.append(tuple(nts))
    sc_ptr, sc, st, sr_ptr, sr = [0], [], [], [0], []
    for r in range(b):
        sc += [ch for ch, _ in seq_priv[r]]
        st += [nt for _, nt in seq_priv[r]]
        sc_ptr.append(len(sc))
        sr += [run_index[k] for k in seq_runs[r]]
        sr_ptr.append(len(sr))
    width = max((len(p) for p in rows), default=1)
    table = [[ch for ch, _ in p] + [0] * (width - len(p)) for p in rows]
    btok = [[nt for _, nt in p] + [0] * (width - len(p)) for p in rows]
    return ChunkContext(
        order=torch.tensor(order, dtype=torch.int64, device=dev),
        seq_lens=_i32([sum(nt for _, nt in p) for p in rows], dev),
        run_start=_i32(run_start, dev),
        run_end=_i32(run_end, dev),
        run_chunk_ptr=_i32(ptr, dev),
        run_chunks=_i32(chunks, dev),
        run_tokens=_i32(toks, dev),
        run_row_offset=_i32(offs, dev),
        num_partials=num_partials,
        seq_chunk_ptr=_i32(sc_ptr, dev),
        seq_chunks=_i32(sc, dev),
        seq_tokens=_i32(st, dev),
        seq_run_ptr=_i32(sr_ptr, dev),
        seq_runs=_i32(sr, dev),
        block_table=_i32(table, dev).reshape(b, width),
        block_tokens=_i32(btok, dev).reshape(b, width),
        runs_host=tuple(host),
        run_chunk_lists=tuple(chunk_lists),
        run_token_lists=tuple(token_lists),
        chunk_size=chunk_size,
        version=0,
    )


@dataclass
class ChunkTree:
    """Pools plus per-row chunk paths; satisfies the ``ChunkCache`` protocol for one fixed batch."""

    k_pool: torch.Tensor  # [L, Hkv, N, c, D]
    v_pool: torch.Tensor
    paths: list[Path]
    chunk_size: int

    def context(self, seq_ids: list[int]) -> ChunkContext:
        return context_from_paths([self.paths[s] for s in seq_ids], self.chunk_size, self.k_pool.device)

    def gather(self, s: int, layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Row ``s``'s valid keys and values, [Hkv, T, D] each, read chunk by chunk."""
        ks = [self.k_pool[layer, :, ch, :nt] for ch, nt in self.paths[s]]
        vs = [self.v_pool[layer, :, ch, :nt] for ch, nt in self.paths[s]]
        return torch.cat(ks, dim=1), torch.cat(vs, dim=1)


def random_tree(
    gen: torch.Generator,
    num_seqs: int,
    hkv: int,
    d: int,
    chunk_size: int,
    dtype: torch.dtype = torch.float32,
    max_depth: int = 5,
    branch: float = 0.5,
    partial_middle: bool = True,
    poison: bool = True,
    magnitude: float = 1.0,
) -> ChunkTree:
    """A random ragged prefix tree of ``num_seqs`` rows, chunks scattered across a NaN-poisoned pool."""

    def rint(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi + 1, (1,), generator=gen))

    nodes: list[tuple[int, int]] = []  # (parent node index or -1, valid tokens)
    paths_n: list[list[int]] = []
    for s in range(num_seqs):
        if s == 0 or torch.rand((1,), generator=gen).item() > branch:
            base = paths_n[rint(0, s - 1)] if s else []
            keep = rint(0, len(base))
            path = list(base[:keep])
        else:
            path = []
        for _ in range(rint(0 if path else 1, max_depth)):
            nodes.append((path[-1] if path else -1, chunk_size))
            path.append(len(nodes) - 1)
        if not path:
            path = list(paths_n[0])
        paths_n.append(path)
    # partial chunks: every leaf may be partly filled; with partial_middle, so may inner nodes
    leaves = {p[-1] for p in paths_n}
    tokens = []
    for n in range(len(nodes)):
        full = n not in leaves and not (partial_middle and torch.rand((1,), generator=gen).item() < 0.2)
        tokens.append(chunk_size if full else rint(1, chunk_size))
    num_chunks = len(nodes) + 3
    ids = torch.randperm(num_chunks, generator=gen)[: len(nodes)].tolist()
    fill = float("nan") if poison else 0.0
    k_pool = torch.full((1, hkv, num_chunks, chunk_size, d), fill, dtype=dtype)
    v_pool = torch.full((1, hkv, num_chunks, chunk_size, d), fill, dtype=dtype)
    for n in range(len(nodes)):
        nt = tokens[n]
        k_pool[0, :, ids[n], :nt] = (torch.randn(hkv, nt, d, generator=gen) * magnitude).to(dtype)
        v_pool[0, :, ids[n], :nt] = torch.randn(hkv, nt, d, generator=gen).to(dtype)
    paths = [[(ids[n], tokens[n]) for n in p] for p in paths_n]
    return ChunkTree(k_pool, v_pool, paths, chunk_size)


def sdpa_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Float64 attention of one row. q: [Hq, D]; k, v: [Hkv, T, D] -> [Hq, D] float64."""
    g = q.shape[0] // k.shape[0]
    kk = k.double().repeat_interleave(g, dim=0)
    vv = v.double().repeat_interleave(g, dim=0)
    o = torch.nn.functional.scaled_dot_product_attention(
        q.double().unsqueeze(1), kk, vv, scale=scale
    )  # [Hq, 1, D]
    return o.squeeze(1)


def run_kv(k_pool: torch.Tensor, v_pool: torch.Tensor, chunks: Sequence[int],
           tokens: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """A run's valid keys and values in order. pools: [Hkv, N, c, D] -> two [Hkv, T, D]."""
    pairs = list(zip(chunks, tokens, strict=True))
    return (torch.cat([k_pool[:, ch, :nt] for ch, nt in pairs], 1),
            torch.cat([v_pool[:, ch, :nt] for ch, nt in pairs], 1))


def lse_reference(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """Float64 log-sum-exp of scaled scores. q: [M, D]; k: [T, D] -> [M]."""
    return torch.logsumexp((q.double() @ k.double().T) * scale, -1)


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch's intra-op thread count set to ``n`` inside the block, restored after it."""
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)
