"""Shared fixtures for the kernel tests: trees built through PrefixKVCache, float64 references.

Without CUDA the Triton kernels run in the interpreter, which must be switched on before the
kernel modules are imported, so it is set here (conftest loads before the test modules).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from chunkserve.kernels.testing import sdpa_reference  # noqa: E402
from chunkserve.workers.kvcache import PrefixKVCache  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


class CacheTree:
    """Sequences in a NaN-poisoned PrefixKVCache; K/V are a fixed function of (token, position)."""

    def __init__(self, seed: int, hkv: int, d: int, c: int, dtype: torch.dtype, num_chunks: int = 256,
                 device: str = DEVICE, magnitude: float = 1.0, vocab: int = 5, max_len: int = 1024) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.gen, self.dtype, self.device, self.vocab = gen, dtype, device, vocab
        self.cache = PrefixKVCache(1, hkv, d, c, num_chunks, dtype, device)
        self.cache.k_pool.fill_(float("nan"))
        self.cache.v_pool.fill_(float("nan"))
        self.k_tok = torch.randn(vocab + 100, hkv, d, generator=gen) * magnitude
        self.v_tok = torch.randn(vocab + 100, hkv, d, generator=gen)
        self.pos = torch.randn(max_len, hkv, d, generator=gen) * 0.5
        self.tokens: dict[int, list[int]] = {}

    def kv(self, toks: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v: [1, n, Hkv, D] in the cache dtype and device."""
        t = torch.tensor(toks, dtype=torch.int64)
        p = torch.arange(len(toks))
        k = (self.k_tok[t] + self.pos[p]).to(self.dtype).unsqueeze(0)
        v = (self.v_tok[t] - self.pos[p]).to(self.dtype).unsqueeze(0)
        return k.to(self.device), v.to(self.device)

    def add(self, toks: list[int]) -> int:
        k, v = self.kv(toks)
        s = self.cache.add_sequence(toks, k, v)
        self.tokens[s] = list(toks)
        return s

    def append(self, s: int, tok: int) -> None:
        self.tokens[s].append(tok)
        k, v = self.kv(self.tokens[s])
        self.cache.append_token(s, tok, k[:, -1], v[:, -1])

    def fork(self, s: int) -> int:
        f = self.cache.fork_sequence(s)
        self.tokens[f] = list(self.tokens[s])
        return f

    def remove(self, s: int) -> None:
        self.cache.remove_sequence(s)
        del self.tokens[s]

    def rint(self, lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi + 1, (1,), generator=self.gen))

    def grow(self, num_seqs: int, max_len: int, decode_steps: int = 3, scatter: bool = True) -> list[int]:
        """Random ragged tree: prefixes of earlier sequences plus tails, forks, decode appends."""
        if scatter:  # fillers added then removed leave cached chunks that new ones get allocated around
            fillers = [self.add([self.vocab + self.rint(0, 99) for _ in range(self.rint(1, max_len))])
                       for _ in range(3)]
            for f in fillers[::2]:
                self.remove(f)
        ids: list[int] = []
        for n in range(num_seqs):
            if ids and self.rint(0, 3) > 0:
                base = self.tokens[ids[self.rint(0, len(ids) - 1)]]
                if self.rint(0, 4) == 0:
                    ids.append(self.fork(ids[self.rint(0, len(ids) - 1)]))
                    continue
                keep = self.rint(max(1, len(base) // 2), len(base))
                toks = base[:keep] + [self.rint(0, self.vocab - 1) for _ in range(self.rint(0, max_len // 2))]
            else:
                toks = [self.rint(0, self.vocab - 1) for _ in range(self.rint(1, max_len))]
            ids.append(self.add(toks))
            del n
        for _ in range(decode_steps):
            for s in ids:
                if self.rint(0, 1):
                    self.append(s, self.rint(0, self.vocab - 1))
        return ids

    def reference(self, q: torch.Tensor, seq_ids: list[int], scale: float) -> torch.Tensor:
        """Float64 attention per row on the up-cast inputs. q: [b, Hq, D] -> [b, Hq, D] float64."""
        outs = []
        for i, s in enumerate(seq_ids):
            k, v = self.kv(self.tokens[s])
            outs.append(sdpa_reference(q[i].cpu(), k[0].transpose(0, 1).cpu(), v[0].transpose(0, 1).cpu(), scale))
        return torch.stack(outs)


def rel_err(o: torch.Tensor, ref: torch.Tensor) -> float:
    """Norm-wise relative error of o against a float64 reference (NaN counts as failure)."""
    o64 = o.detach().to("cpu", torch.float64)
    if not torch.isfinite(o64).all():
        return float("inf")
    return float((o64 - ref).norm() / ref.norm())


# bf16: the output's own rounding (~1.1e-3 rms) plus, where the CPU has AVX512-BF16, the phase-1 kernel's
# probabilities rounded to bf16 before P @ V (~1.1e-3 more, as ATen's and FlashAttention's bf16 kernels do)
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 3e-3}


@pytest.fixture(scope="session")
def cache_tree() -> type[CacheTree]:
    return CacheTree


@pytest.fixture(scope="session")
def check() -> object:
    class _Check:
        rel_err = staticmethod(rel_err)
        tol = TOL
        device = DEVICE

    return _Check
