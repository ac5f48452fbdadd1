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
cumulative (unnormalised) probability exceeds u times the kept mass. The u's are counter-based
hashes computed on the host while the step is planned (`plan`), no generator objects: a row with
``params.seed`` takes its i-th draw H(seed, i), so its tokens do not depend on the rest of the batch
(up to the float rounding of its row's softmax sum, which can only matter when u lands within an
ulp of a bucket edge; exact ties in the logits are ordered by ``topk``) and ``seed_offset`` resumes
a stream in O(1); unseeded rows take H(sampler seed, running counter). The row groups, knobs and
u's travel with the engine's step copy (`stage`), so the device pass reads nothing back; greedy
rows are exactly ``argmax``. Only the sampled ids (and the requested logprobs, under the
unmodified distribution) come back to the host, in one copy.

CPU specifics: ``argmax`` and ``topk`` first reduce blocks of 64 logits to their maxima (the same
result, several times faster than a scan of the vocabulary), and the [n, V] intermediates live in
reused scratch buffers (a fresh 6 MB tensor per step costs more in page faults than the math).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from chunkserve.workers.sampling import SamplingParams
from chunkserve.workers.staging import Staging

_MIN_TEMPERATURE = 1e-5
_MASK64 = (1 << 64) - 1


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser over uint64 arrays (wrapping arithmetic): a bijective 64-bit mix."""
    z = x + np.uint64(0x9E3779B97F4A7C15)  # array arithmetic wraps silently
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _mix_int(x: int) -> int:
    """`_mix` of one Python int (the same bits; faster than numpy for a few values)."""
    z = (x + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def uniform_hash(keys: np.ndarray, counters: np.ndarray) -> np.ndarray:
    """Counter-based uniforms: [m] uint64 keys and counters -> [m] float32 in [0, 1) (24 random bits).

    The same (key, counter) gives the same u on every device and in any batch.
    """
    if len(keys) <= 16:
        vals = [(_mix_int(int(k) ^ _mix_int((int(c) * 0xD1B54A32D192ED03) & _MASK64)) >> 40) * 2.0 ** -24
                for k, c in zip(keys.tolist(), counters.tolist(), strict=True)]
        return np.asarray(vals, dtype=np.float32)
    z = _mix(keys ^ _mix(counters * np.uint64(0xD1B54A32D192ED03)))
    return ((z >> np.uint64(40)).astype(np.float32) * np.float32(2.0 ** -24)).astype(np.float32)


@dataclass
class SamplePlan:
    """A step's sampling, planned on the host: per group (0 top-k, 1 nucleus, 2 plain) its kind, rows,
    largest k and host arrays (rows [m] int64, knobs [3, m] = temperature / top-p / top-k, u [m]); the
    rows that want logprobs. ``dev``: their device tensors once bound (idx, knobs, u per group, then
    the logprob rows)."""

    n: int
    vocab: int
    any_greedy: bool
    groups: list[tuple[int, list[int], int, np.ndarray, np.ndarray, np.ndarray]] = field(default_factory=list)
    want: list[int] = field(default_factory=list)
    dev: list[torch.Tensor] = field(default_factory=list)
    bound: bool = False

    def stage(self, staging: Staging) -> list[int]:
        idx = []
        for _kind, _rows, _k, rows, knobs, u in self.groups:
            idx += [staging.add(rows, np.int64), staging.add(knobs, np.float32), staging.add(u, np.float32)]
        if self.want:
            idx.append(staging.add(self.want, np.int64))
        return idx

    def bind(self, tensors: list[torch.Tensor], idx: list[int]) -> None:
        self.dev = [tensors[i] for i in idx]
        self.bound = True
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
        # [m] >= 1: the top candidate is kept even when top_p * total underflows to 0 (top_p = 1e-81)
        n_keep = (prev < (top_p * total).unsqueeze(1)).sum(-1).clamp_min_(1)
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
        self.full_sort = full_sort
        self.nucleus_k0 = nucleus_k0
        self.reseed(seed)
        self._gens: dict[str, int] = {}  # request id -> draws made by that seeded request
        self._staging: dict[str, Staging] = {}  # device -> staging of sample() calls without a plan
        # (slot, device) -> reused fp32 scratch: a fresh [n, V] tensor per step costs page faults on CPU
        self._scratch: dict[tuple[int, str], torch.Tensor] = {}

    def reseed(self, seed: int) -> None:
        """Start the unseeded rows' draws over from ``seed`` (seeded requests are unaffected)."""
        self.seed = seed
        self._base_key = _mix_int((seed & _MASK64) ^ 0x5EED)
        self._base_draws = 0  # draws made for unseeded rows

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
            x = torch.div(logits, temp.unsqueeze(1), out=self._buf(0, logits.shape[0], logits.shape[1], logits.device))
        else:
            x = self._rows(logits, idx, 0).div_(temp.unsqueeze(1))
        e = x.sub_(x.amax(-1, keepdim=True)).exp_()  # [m, V]
        return e, e.sum(-1)

    def _draws(self, rows: list[int], request_ids: list[str], params: list[SamplingParams]) -> np.ndarray:
        """u: [len(rows)] float32 in [0, 1), on the host: a seeded row's i-th draw is H(seed, i) (so it
        does not depend on its neighbours, and ``seed_offset`` skips draws in O(1)); the other rows take
        H(sampler seed, running counter)."""
        m = len(rows)
        keys = np.full(m, self._base_key, dtype=np.uint64)
        ctrs = np.empty(m, dtype=np.uint64)
        seeded: list[int] = []
        seeds: list[int] = []
        for j, i in enumerate(rows):
            p = params[i]
            if p.seed is None:
                ctrs[j] = self._base_draws
                self._base_draws += 1
            else:
                rid = request_ids[i]
                k = self._gens.get(rid, p.seed_offset)
                self._gens[rid] = k + 1
                ctrs[j] = k
                seeded.append(j)
                seeds.append(p.seed & _MASK64)
        if seeded:
            keys[seeded] = [_mix_int(x) for x in seeds]
        return uniform_hash(keys, ctrs)

    def plan(self, request_ids: list[str], params: list[SamplingParams], vocab: int) -> SamplePlan:
        """Everything about a step's sampling that the host knows before the logits exist: the row
        groups, their knobs and their uniforms (host arrays)."""
        n = len(params)
        if len(request_ids) != n:
            raise ValueError(f"{len(request_ids)} request ids but {n} params")
        rand = [i for i in range(n) if not params[i].greedy]
        groups = ([i for i in rand if 0 < params[i].top_k < vocab],
                  [i for i in rand if not 0 < params[i].top_k < vocab and params[i].top_p < 1.0],
                  [i for i in rand if not 0 < params[i].top_k < vocab and params[i].top_p >= 1.0])
        out = SamplePlan(n, vocab, len(rand) < n)
        for kind, rows in enumerate(groups):
            if not rows:
                continue
            knobs = np.asarray([[max(params[i].temperature, _MIN_TEMPERATURE) for i in rows],
                                [params[i].top_p for i in rows],
                                [params[i].top_k for i in rows]], dtype=np.float32)  # [3, m]
            out.groups.append((kind, rows, max(params[i].top_k for i in rows),
                               np.asarray(rows, dtype=np.int64), knobs, self._draws(rows, request_ids, params)))
        out.want = [i for i in range(n) if params[i].logprobs]
        return out

    def stage(self, staging: Staging, request_ids: list[str], params: list[SamplingParams], vocab: int
              ) -> Callable[[list[torch.Tensor]], SamplePlan]:
        """Plan, and queue the plan's arrays on ``staging`` (the engine's step copy); returns the bind
        function that takes the flushed tensors and gives the plan with its device tensors."""
        sp = self.plan(request_ids, params, vocab)
        idx = sp.stage(staging)

        def bind(tensors: list[torch.Tensor]) -> SamplePlan:
            sp.bind(tensors, idx)
            return sp

        return bind

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, request_ids: list[str], params: list[SamplingParams],
               plan: SamplePlan | None = None) -> tuple[list[int], list[float]]:
        """logits: [n, V] -> (token ids [n], their logprobs [n] under the unmodified distribution).

        Logprobs are computed only for rows whose params ask for them (0.0 for the others). ``plan``: a
        bound `stage` result for these rows (the engine's step); None plans and moves the knobs here.
        The step's one device -> host read is the copy of the ids (and the logprobs asked for).
        """
        ids, lps = self.sample_device(logits, request_ids, params, plan)
        n = logits.shape[0]
        if lps is None:
            return ids.tolist(), [0.0] * n
        want = [i for i in range(n) if params[i].logprobs]
        host = torch.cat([ids.double(), lps.double()]).tolist()  # the step's one device -> host copy
        out = [0.0] * n
        for j, i in enumerate(want):
            out[i] = host[n + j]
        return [int(t) for t in host[:n]], out

    def sample_device(self, logits: torch.Tensor, request_ids: list[str], params: list[SamplingParams],
                      plan: SamplePlan | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The sampled ids [n] (int64) and the requested logprobs [w] (None if none), on the logits'
        device; nothing is read back."""
        if logits.dim() != 2:
            raise ValueError(f"logits must be [n, V], got shape {tuple(logits.shape)}")
        n, vocab = logits.shape
        if len(request_ids) != n or len(params) != n:
            raise ValueError(f"{n} logits rows but {len(request_ids)} request ids and {len(params)} params")
        dev = logits.device
        if n == 0:
            return torch.zeros(0, dtype=torch.long, device=dev), None
        if plan is None or plan.n != n or plan.vocab != vocab or not plan.bound:
            plan = self.plan(request_ids, params, vocab)
            staging = self._staging.get(str(dev))
            if staging is None:
                staging = self._staging[str(dev)] = Staging(dev)
            staged = plan.stage(staging)
            plan.bind(staging.flush(), staged)
        tokens = _argmax(logits) if plan.any_greedy else torch.empty(n, dtype=torch.long, device=dev)  # [n]
        for g, (kind, rows, k_max, *_host) in enumerate(plan.groups):
            idx, knobs, u = plan.dev[3 * g: 3 * g + 3]  # [m], [3, m], [m]
            temp, top_p, top_k = knobs[0], knobs[1], knobs[2]  # [m] each
            sub = None if len(rows) == n else idx
            if kind == 0:
                x = logits.float() if sub is None else self._rows(logits, idx, 0)  # [m, V]
                ids = self._sample_top_k(x, temp, top_p, top_k, u, k_max)
            elif kind == 1:
                ids = self._sample_nucleus(*self._probs(logits, sub, temp), top_p, u)
            else:
                e = self._probs(logits, sub, temp)[0]  # [m, V]
                ids = _pick(e, u, out=self._buf(1, e.shape[0], e.shape[1], dev))  # over the unsorted vocabulary
            tokens.index_copy_(0, idx, ids)
        if not plan.want:
            return tokens, None
        widx = plan.dev[-1]  # [w]
        tw = tokens.index_select(0, widx)  # [w]
        x = self._rows(logits, widx, 0)  # [w, V]
        picked = x.gather(1, tw.unsqueeze(1)).squeeze(1)  # [w]
        mx = x.amax(-1, keepdim=True)  # [w, 1]
        return tokens, picked - mx.squeeze(1) - x.sub_(mx).exp_().sum(-1).log_()  # [w] log_softmax at the token

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
