"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds, and logprobs."""

from __future__ import annotations

import torch

from chunkserve.workers.sampling import SamplingParams


class Sampler:
    """Samples one token per row. Greedy rows are batched; random rows use a per-request generator."""

    def __init__(self, seed: int = 0) -> None:
        self._base = torch.Generator().manual_seed(seed)
        self._gens: dict[str, torch.Generator] = {}

    def forget(self, request_id: str) -> None:
        self._gens.pop(request_id, None)

    def _gen(self, request_id: str, params: SamplingParams) -> torch.Generator:
        g = self._gens.get(request_id)
        if g is None:
            seed = params.seed if params.seed is not None else int(torch.randint(2**62, (1,), generator=self._base))
            g = self._gens[request_id] = torch.Generator().manual_seed(seed)
        return g

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, request_ids: list[str], params: list[SamplingParams]
               ) -> tuple[list[int], list[float]]:
        """logits: [n, V] fp32 -> (token ids [n], their logprobs [n] under the unmodified distribution)."""
        logits = logits.float().cpu()
        n = logits.shape[0]
        out = [0] * n
        greedy = [i for i in range(n) if params[i].greedy]
        if greedy and len(greedy) == n:
            out = logits.argmax(-1).tolist()
        elif greedy:
            picks = logits.index_select(0, torch.tensor(greedy)).argmax(-1).tolist()
            for i, t in zip(greedy, picks, strict=True):
                out[i] = t
        for i in range(n):
            p = params[i]
            if p.greedy:
                continue
            row = logits[i] / max(p.temperature, 1e-5)  # [V]
            if p.top_k > 0 and p.top_k < row.shape[0]:
                kth = torch.topk(row, p.top_k).values[-1]
                row = row.masked_fill(row < kth, float("-inf"))
            probs = torch.softmax(row, -1)
            if p.top_p < 1.0:
                sp, si = torch.sort(probs, descending=True)
                keep = torch.cumsum(sp, 0) - sp < p.top_p  # always keeps the top token
                mask = torch.zeros_like(probs, dtype=torch.bool)
                mask[si[keep]] = True
                probs = torch.where(mask, probs, torch.zeros_like(probs))
                probs = probs / probs.sum()
            out[i] = int(torch.multinomial(probs, 1, generator=self._gen(request_ids[i], p)))
        want = [i for i in range(n) if params[i].logprobs]
        lps = [0.0] * n
        if want:
            lp = torch.log_softmax(logits.index_select(0, torch.tensor(want)), -1)
            for j, i in enumerate(want):
                lps[i] = float(lp[j, out[i]])
        return out, lps
