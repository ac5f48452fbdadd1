"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds and logprobs, batched.

One pass over the step's logits [n, V], on their device. The random rows fall into (at most) three
groups, each handled by a few tensor ops over all of its rows:

    top-k rows    (0 < top_k < V)          one ``topk`` with the largest k, a per-row rank cut, then
                                           top-p over those (sorted) candidates
    nucleus rows  (top_k off, top_p < 1)   CPU: ``topk`` with a growing width until the nucleus fits
                                           (full sort only for rows whose nucleus is that wide);
                                           accelerators: one batched sort of those rows
    plain rows    (top_k off, top_p = 1)   temperature only, over the unsorted vocabulary

Every random row is then drawn by inverse CDF: one uniform u per row and the first candidate whose
cumulative (unnormalised) probability exceeds u times the kept mass. Unseeded rows take their u's
from the sampler's base generator in one draw; a row with ``params.seed`` takes its u from its own
generator (created on the logits' device), so its tokens do not depend on the rest of the batch
(up to the float rounding of its row's softmax sum, which can only matter when u lands within an
ulp of a bucket edge; exact ties in the logits are ordered by ``topk``). Greedy rows are exactly
``argmax``. Only the sampled ids (and the requested logprobs, under the unmodified distribution)
come back to the host, in one copy.

CPU specifics: ``argmax`` and ``topk`` first reduce blocks of 64 logits to their maxima (the same
result, several times faster than a scan of the vocabulary), and the [n, V] intermediates live in
reused scratch buffers (a fresh 6 MB tensor per step costs more in page faults than the math).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from chunkserve.workers.sampling import SamplingParams

_MIN_TEMPERATURE = 1e-5
_BLOCK = 64  # CPU: argmax / topk first pick the best blocks of this many logits by their maxima


def _blocked(x: torch.Tensor, k: int) -> bool:
    """Whether the two-level (blocks, then within the best blocks) search pays off for x: [n, V]."""
    vocab = x.shape[1]
    return x.device.type == "cpu" and x.is_contiguous() and vocab % _BLOCK == 0 and 4 * k * _BLOCK <= vocab


def _argmax(x: torch.Tensor) -> torch.Tensor:
    """x: [n, V] -> [n], exactly ``x.argmax(-1)`` (first index of the maximum).

    On CPU a block's max is a vectorised reduction and ``argmax`` is not: the first block holding
    the row's maximum, then the first maximum inside it, is the same index, several times faster.
    """
    if not _blocked(x, 1):
        return x.argmax(-1)
    n, vocab = x.shape
    blocks = x.view(n, vocab // _BLOCK, _BLOCK)  # [n, V/B, B]
    b = blocks.amax(-1).argmax(-1)  # [n] first block holding the maximum
    inner = blocks[torch.arange(n, device=x.device), b].argmax(-1)  # [n]
    return b * _BLOCK + inner


def _topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [n, V] -> (values, ids) [n, k] sorted descending, the row's k largest.

    On CPU: the k largest lie in the k blocks with the largest maxima (a block without any of them
    has a max below the k-th value), so topk runs over k * B candidates instead of V.
    """
    if not _blocked(x, k):
        return torch.topk(x, k, dim=-1)
    n, vocab = x.shape
    blocks = x.view(n, vocab // _BLOCK, _BLOCK)  # [n, V/B, B]
    bi = torch.topk(blocks.amax(-1), k, dim=-1).indices  # [n, k] best blocks
    cand = blocks.gather(1, bi.unsqueeze(2).expand(n, k, _BLOCK)).view(n, k * _BLOCK)  # [n, k*B]
    vals, j = torch.topk(cand, k, dim=-1)  # [n, k]
    return vals, bi.gather(1, j // _BLOCK) * _BLOCK + j % _BLOCK


def _pick(e: torch.Tensor, u: torch.Tensor, top_p: torch.Tensor | None = None,
          total: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse-CDF draw over candidates; returns the chosen column per row.

    e: [m, K] unnormalised probabilities (sorted descending when top_p is given); u: [m] in [0, 1);
    top_p: [m] nucleus mass, or None to keep every candidate; total: [m] the mass top_p is a fraction
    of (default: the candidates' sum). The top candidate is always kept; zero-probability candidates
    are never chosen. ``out``: optional [m, K] fp32 scratch for the cumulative sums.
    """
    c = torch.cumsum(e, -1, out=out) if out is not None else e.cumsum(-1)  # [m, K], non-decreasing
    if top_p is None:
        mass = c[:, -1]  # [m]
    else:
        if total is None:
            total = c[:, -1]
        prev = F.pad(c[:, :-1], (1, 0))  # [m, K] exclusive cumsum: mass strictly above each candidate
        n_keep = (prev < (top_p * total).unsqueeze(1)).sum(-1)  # [m] >= 1: prev[:, 0] = 0
        mass = c.gather(1, (n_keep - 1).unsqueeze(1)).squeeze(1)  # [m] kept mass
    target = torch.minimum(u * mass, torch.nextafter(mass, torch.zeros_like(mass)))  # [m] < mass
    return torch.searchsorted(c, target.unsqueeze(1), right=True).squeeze(1)  # [m]


class Sampler:
    """Samples one token per row of a step's logits; see the module docstring.

    ``full_sort``: how top-p rows without a top-k find their nucleus. None (default) sorts on
    accelerators and widens a ``topk`` from ``nucleus_k0`` candidates on CPU (a full-vocabulary sort
    is slow there); True / False force one or the other (the same distribution either way).
    """

    def __init__(self, seed: int = 0, *, full_sort: bool | None = None, nucleus_k0: int = 32) -> None:
        if nucleus_k0 < 1:
            raise ValueError(f"nucleus_k0 must be >= 1, got {nucleus_k0}")
        self.seed = seed
        self.full_sort = full_sort
        self.nucleus_k0 = nucleus_k0
        self._base: dict[str, torch.Generator] = {}  # device -> generator of the unseeded rows
        self._gens: dict[str, torch.Generator] = {}  # request id -> generator of a seeded request
        # (slot, device) -> reused fp32 scratch: a fresh [n, V] tensor per step costs page faults on CPU
        self._scratch: dict[tuple[int, str], torch.Tensor] = {}

    def forget(self, request_id: str) -> None:
        self._gens.pop(request_id, None)

    def _buf(self, slot: int, rows: int, cols: int, device: torch.device) -> torch.Tensor:
        """A [rows, cols] fp32 view of scratch buffer `slot` on `device` (contents undefined)."""
        key = (slot, str(device))
        b = self._scratch.get(key)
        if b is None or b.numel() < rows * cols:
            b = self._scratch[key] = torch.empty(rows * cols, dtype=torch.float32, device=device)
        return b[:rows * cols].view(rows, cols)

    def _rows(self, logits: torch.Tensor, idx: torch.Tensor, slot: int) -> torch.Tensor:
        """fp32 copy of logits[idx] in scratch `slot`: [m, V]."""
        out = self._buf(slot, len(idx), logits.shape[1], logits.device)
        if logits.dtype == torch.float32:
            return torch.index_select(logits, 0, idx, out=out)
        return out.copy_(logits.index_select(0, idx))

    def _probs(self, logits: torch.Tensor, idx: torch.Tensor | None, temp: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Tempered unnormalised probabilities of the rows (all if idx is None), in scratch slot 0.

        -> (e [m, V] with each row's max = 1, their sums Z [m]).
        """
        if idx is None:
            x = torch.div(logits, temp.unsqueeze(1), out=self._buf(0, *logits.shape, logits.device))
        else:
            x = self._rows(logits, idx, 0).div_(temp.unsqueeze(1))
        e = x.sub_(x.amax(-1, keepdim=True)).exp_()  # [m, V]
        return e, e.sum(-1)

    def _base_gen(self, device: torch.device) -> torch.Generator:
        g = self._base.get(str(device))
        if g is None:
            g = self._base[str(device)] = torch.Generator(device=device).manual_seed(self.seed)
        return g

    def _uniforms(self, rows: list[int], request_ids: list[str], params: list[SamplingParams],
                  device: torch.device) -> torch.Tensor:
        """u: [len(rows)] in [0, 1): seeded rows from their own generator, the others in one base draw."""
        u = torch.rand(len(rows), generator=self._base_gen(device), device=device)  # [m]
        seeded = [j for j, i in enumerate(rows) if params[i].seed is not None]
        if seeded:
            draws = []
            for j in seeded:
                rid = request_ids[rows[j]]
                g = self._gens.get(rid)
                if g is None:
                    g = self._gens[rid] = torch.Generator(device=device).manual_seed(params[rows[j]].seed)
                    for _ in range(params[rows[j]].seed_offset):  # a resumed stream: skip the draws made
                        torch.rand(1, generator=g, device=device)
                draws.append(torch.rand(1, generator=g, device=device))
            u[torch.tensor(seeded, device=device)] = torch.cat(draws)
        return u

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, request_ids: list[str], params: list[SamplingParams]
               ) -> tuple[list[int], list[float]]:
        """logits: [n, V] -> (token ids [n], their logprobs [n] under the unmodified distribution).

        Logprobs are computed only for rows whose params ask for them (0.0 for the others).
        """
        if logits.dim() != 2:
            raise ValueError(f"logits must be [n, V], got shape {tuple(logits.shape)}")
        n, vocab = logits.shape
        if len(request_ids) != n or len(params) != n:
            raise ValueError(f"{n} logits rows but {len(request_ids)} request ids and {len(params)} params")
        if n == 0:
            return [], []
        dev = logits.device
        rand = [i for i in range(n) if not params[i].greedy]
        if len(rand) < n:
            tokens = _argmax(logits)  # [n] greedy rows exact; random rows overwritten below
        else:
            tokens = torch.empty(n, dtype=torch.long, device=dev)
        groups = ([i for i in rand if 0 < params[i].top_k < vocab],
                  [i for i in rand if not 0 < params[i].top_k < vocab and params[i].top_p < 1.0],
                  [i for i in rand if not 0 < params[i].top_k < vocab and params[i].top_p >= 1.0])
        for group, rows in enumerate(groups):
            if not rows:
                continue
            idx = torch.tensor(rows, device=dev)  # [m]
            knobs = torch.tensor([[max(params[i].temperature, _MIN_TEMPERATURE) for i in rows],
                                  [params[i].top_p for i in rows],
                                  [params[i].top_k for i in rows]], dtype=torch.float32).to(dev)  # [3, m]
            temp, top_p, top_k = knobs[0], knobs[1], knobs[2]  # [m] each
            u = self._uniforms(rows, request_ids, params, dev)  # [m]
            sub = None if len(rows) == n else idx
            if group == 0:
                x = logits.float() if sub is None else self._rows(logits, idx, 0)  # [m, V]
                ids = self._sample_top_k(x, temp, top_p, top_k, u, max(params[i].top_k for i in rows))
            elif group == 1:
                ids = self._sample_nucleus(*self._probs(logits, sub, temp), top_p, u)
            else:
                e = self._probs(logits, sub, temp)[0]  # [m, V]
                ids = _pick(e, u, out=self._buf(1, *e.shape, dev))  # over the unsorted vocabulary
            tokens.index_copy_(0, idx, ids)
        want = [i for i in range(n) if params[i].logprobs]
        if not want:
            return tokens.tolist(), [0.0] * n
        widx = torch.tensor(want, device=dev)  # [w]
        tw = tokens.index_select(0, widx)  # [w]
        x = self._rows(logits, widx, 0)  # [w, V]
        picked = x.gather(1, tw.unsqueeze(1)).squeeze(1)  # [w]
        mx = x.amax(-1, keepdim=True)  # [w, 1]
        lp = picked - mx.squeeze(1) - x.sub_(mx).exp_().sum(-1).log_()  # [w] log_softmax at the token
        host = torch.cat([tokens.double(), lp.double()]).tolist()  # the step's one device -> host copy
        lps = [0.0] * n
        for j, i in enumerate(want):
            lps[i] = host[n + j]
        return [int(t) for t in host[:n]], lps

    @staticmethod
    def _sample_top_k(x: torch.Tensor, temp: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor,
                      u: torch.Tensor, k_max: int) -> torch.Tensor:
        """x: [m, V] fp32 logits; temp/top_p/top_k/u: [m]; k_max = max(top_k) -> token ids [m]."""
        vals, ids = _topk(x, k_max)  # [m, K] sorted descending (the order does not depend on T)
        rank = torch.arange(k_max, device=x.device)  # [K]
        vals = (vals / temp.unsqueeze(1)).masked_fill_(rank >= top_k.unsqueeze(1), float("-inf"))
        e = (vals - vals[:, :1]).exp_()  # [m, K], top candidate = 1
        pos = _pick(e, u, top_p)  # [m]
        return ids.gather(1, pos.unsqueeze(1)).squeeze(1)

    def _sample_nucleus(self, e: torch.Tensor, z: torch.Tensor, top_p: torch.Tensor,
                        u: torch.Tensor) -> torch.Tensor:
        """Top-p over the whole vocabulary. e: [m, V] unnormalised probabilities, z: [m] their sums;
        top_p/u: [m] -> token ids [m]."""
        m, vocab = e.shape
        mass = top_p * z  # [m] the nucleus holds this much
        full_sort = self.full_sort if self.full_sort is not None else e.device.type != "cpu"
        if full_sort:
            vals, ids = torch.sort(e, dim=-1, descending=True, stable=True)  # [m, V]
            return ids.gather(1, _pick(vals, u, top_p, z).unsqueeze(1)).squeeze(1)
        # Widen a topk until the candidates hold top_p of the mass: then the nucleus lies within them
        # (every later token has at least top_p above it). Each row's width depends only on that row.
        out = torch.empty(m, dtype=torch.long, device=e.device)
        left = torch.arange(m, device=e.device)  # [r] rows still to draw
        k = min(self.nucleus_k0, vocab)
        while True:
            if len(left) == m:
                er = e
            else:
                er = torch.index_select(e, 0, left, out=self._buf(1, len(left), vocab, e.device))  # [r, V]
            if k >= vocab:
                vals, ids = torch.sort(er, dim=-1, descending=True, stable=True)  # [r, V]
                fits = torch.ones(len(left), dtype=torch.bool, device=e.device)
            else:
                vals, ids = _topk(er, k)  # [r, k]
                fits = vals.sum(-1) >= mass[left]  # [r]
            if bool(fits.all()):
                pos = _pick(vals, u[left], top_p[left], z[left])
                out[left] = ids.gather(1, pos.unsqueeze(1)).squeeze(1)
                return out
            sel = fits.nonzero().squeeze(1)  # [f]
            if len(sel):
                rows = left[sel]
                pos = _pick(vals[sel], u[rows], top_p[rows], z[rows])
                out[rows] = ids[sel].gather(1, pos.unsqueeze(1)).squeeze(1)
            left = left[~fits]
            k = min(k * 8, vocab)
