"""The batched sampler: exact greedy, the tempered top-k/top-p distribution, seeds, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from chunkserve.workers.sampler import Sampler, _argmax, _topk
from chunkserve.workers.sampling import SamplingParams

V = 49152  # SmolLM2's vocabulary


def random_logits(n: int, vocab: int = V, scale: float = 3.0, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, vocab, generator=g) * scale  # [n, vocab]


def reference_probs(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The pre-batching row-by-row definition, in float64: row [V] -> probabilities [V]."""
    x = row.double() / p.temperature
    if 0 < p.top_k < x.shape[0]:
        kth = torch.topk(x, p.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, -1)
    if p.top_p < 1.0:
        sp, si = torch.sort(probs, descending=True)
        keep = torch.cumsum(sp, 0) - sp < p.top_p
        mask = torch.zeros_like(probs, dtype=torch.bool)
        mask[si[keep]] = True
        probs = torch.where(mask, probs, torch.zeros_like(probs))
        probs = probs / probs.sum()
    return probs


def chi2_upper(df: int, z: float = 3.29) -> float:
    """~99.95% quantile of chi-square(df) (Wilson-Hilferty)."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


def draw_many(sampler: Sampler, row: torch.Tensor, p: SamplingParams, n: int) -> torch.Tensor:
    """n independent draws from one logits row (n identical rows of one step): counts [V]."""
    toks, _ = sampler.sample(row.expand(n, -1), [f"r{i}" for i in range(n)], [p] * n)
    return torch.bincount(torch.tensor(toks), minlength=row.shape[0])


CONFIGS = [
    dict(temperature=0.8),
    dict(temperature=1.3, top_k=5),
    dict(temperature=0.8, top_p=0.7),
    dict(temperature=1.0, top_k=12, top_p=0.8),
]


@pytest.mark.parametrize("sampler_kwargs", [{}, {"full_sort": True}, {"nucleus_k0": 2}],
                         ids=["default", "full-sort", "widening-topk"])
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_empirical_frequencies_match_the_tempered_filtered_softmax(cfg: dict, sampler_kwargs: dict) -> None:
    row = random_logits(1, vocab=24, scale=1.5, seed=1)[0]  # [24]
    p = SamplingParams(**cfg)
    expected = reference_probs(row, p)  # [24]
    n = 40_000
    counts = draw_many(Sampler(seed=7, **sampler_kwargs), row, p, n).double()
    assert counts.sum() == n
    assert counts[expected == 0].sum() == 0  # never outside the top-k / nucleus
    exp_counts = expected * n
    big = exp_counts >= 5
    obs = torch.cat([counts[big], counts[~big].sum().view(1)])
    ex = torch.cat([exp_counts[big], exp_counts[~big].sum().view(1)])
    obs, ex = obs[ex > 0], ex[ex > 0]
    chi2 = float(((obs - ex) ** 2 / ex).sum())
    assert chi2 < chi2_upper(len(ex) - 1), (chi2, len(ex))


def test_a_wrong_distribution_fails_the_frequency_check() -> None:
    """The check above can fail: draws at temperature 1.0 do not pass for temperature 0.8."""
    row = random_logits(1, vocab=24, scale=1.5, seed=1)[0]
    n = 40_000
    counts = draw_many(Sampler(seed=7), row, SamplingParams(temperature=1.0), n).double()
    ex = reference_probs(row, SamplingParams(temperature=0.8)) * n
    chi2 = float(((counts - ex) ** 2 / ex).sum())
    assert chi2 > chi2_upper(23)


def test_top_k_never_samples_outside_the_k_best() -> None:
    logits = random_logits(64, seed=2)  # [64, V]
    ks = [2, 5, 50, 300]
    params = [SamplingParams(temperature=5.0, top_k=ks[i % 4]) for i in range(64)]
    sampler = Sampler(seed=3)
    outside_if_unfiltered = 0
    for _ in range(10):
        toks, _ = sampler.sample(logits, [f"r{i}" for i in range(64)], params)
        for i, t in enumerate(toks):
            best = set(torch.topk(logits[i], params[i].top_k).indices.tolist())
            assert t in best, (i, params[i].top_k)
        plain, _ = sampler.sample(logits, [f"r{i}" for i in range(64)], [SamplingParams(temperature=5.0)] * 64)
        outside_if_unfiltered += sum(t not in set(torch.topk(logits[i], ks[i % 4]).indices.tolist())
                                     for i, t in enumerate(plain))
    assert outside_if_unfiltered > 0  # without top-k the same logits do sample outside


@pytest.mark.parametrize("sampler_kwargs", [{}, {"full_sort": True}], ids=["widening-topk", "full-sort"])
def test_top_p_never_samples_outside_the_nucleus(sampler_kwargs: dict) -> None:
    logits = random_logits(24, vocab=8192, seed=4)  # [24, 8192]
    params = [SamplingParams(temperature=[0.7, 1.0, 1.5][i % 3], top_p=[0.3, 0.6, 0.9, 0.95][i % 4])
              for i in range(24)]
    nuclei = [set(torch.nonzero(reference_probs(logits[i], params[i])).squeeze(1).tolist()) for i in range(24)]
    sizes = [len(s) for s in nuclei]
    for lo, hi in ((1, 32), (33, 256), (257, 2048), (2049, 8192)):  # every width the widening topk tries
        assert any(lo <= z <= hi for z in sizes), (lo, hi)
    sampler = Sampler(seed=5, **sampler_kwargs)
    for _ in range(6):
        toks, _ = sampler.sample(logits, [f"r{i}" for i in range(24)], params)
        for i, t in enumerate(toks):
            assert t in nuclei[i], (i, params[i])


@pytest.mark.parametrize("vocab", [V, 8192, 1000])
def test_blocked_argmax_is_exactly_torch_argmax_with_ties_and_nan(vocab: int) -> None:
    x = torch.randint(0, 6, (16, vocab)).float()  # many ties
    x[3] = 0.0
    x[4, 777 % vocab] = float("nan")
    x[5] = float("-inf")
    assert torch.equal(_argmax(x), x.argmax(-1))
    y = random_logits(16, vocab, seed=13)
    assert torch.equal(_argmax(y), y.argmax(-1))


@pytest.mark.parametrize("k", [1, 5, 50, 192])
def test_blocked_topk_returns_the_k_largest_in_order(k: int) -> None:
    x = random_logits(8, seed=14)
    x[2, :4096] = 50.0  # the best values crowd a few blocks
    vals, ids = _topk(x, k)
    ref = torch.topk(x, k)
    assert torch.equal(vals, ref.values)
    assert torch.equal(x.gather(1, ids), vals)
    assert all(len(set(r)) == k for r in ids.tolist())


def test_top_p_always_keeps_the_top_token() -> None:
    logits = random_logits(8, seed=6)
    toks, _ = Sampler().sample(logits, [str(i) for i in range(8)], [SamplingParams(top_p=1e-6)] * 8)
    assert toks == logits.argmax(-1).tolist()


@pytest.mark.parametrize("sampler_kwargs", [{}, {"full_sort": True}], ids=["widening-topk", "full-sort"])
def test_a_top_p_whose_mass_underflows_still_keeps_the_top_token(sampler_kwargs: dict) -> None:
    """top_p = 1e-81 is valid (> 0) but top_p * mass is 0 in fp32: the draw keeps the top token instead of
    indexing column -1 (which failed the whole engine step; found by the ingress's hypothesis test)."""
    logits = random_logits(4, seed=8)
    params = [SamplingParams(temperature=1.0, top_p=1.1720572163760112e-81)] * 4
    toks, _ = Sampler(**sampler_kwargs).sample(logits, [str(i) for i in range(4)], params)
    assert toks == logits.argmax(-1).tolist()


def test_mixed_batch_keeps_greedy_rows_exactly_argmax_and_samples_the_others() -> None:
    logits = random_logits(12, scale=0.5, seed=7)  # flat: random rows rarely hit the argmax
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, top_p=0.9),
              SamplingParams(temperature=1.2, top_k=1), SamplingParams(temperature=1.0, top_k=40)] * 3
    sampler = Sampler(seed=8)
    argmax = logits.argmax(-1).tolist()
    random_hits_argmax = 0
    for _ in range(5):
        toks, _ = sampler.sample(logits, [str(i) for i in range(12)], params)
        for i, t in enumerate(toks):
            if params[i].greedy:
                assert t == argmax[i]
            else:
                random_hits_argmax += t == argmax[i]
    assert random_hits_argmax < 5  # the random rows really were sampled


CASES = {
    "top-k": SamplingParams(temperature=0.9, top_k=50, seed=42),
    "top-k-top-p": SamplingParams(temperature=0.9, top_k=50, top_p=0.8, seed=42),
    "nucleus": SamplingParams(temperature=0.9, top_p=0.9, seed=42),
    "plain": SamplingParams(temperature=0.9, seed=42),
}


def seeded_run(p: SamplingParams, neighbours: bool, steps: int = 20, **sampler_kwargs: object) -> list[int]:
    """The tokens the request "me" gets over `steps` steps, alone or amid other rows."""
    sampler = Sampler(seed=11 if neighbours else 0, **sampler_kwargs)
    others = [SamplingParams(temperature=1.0, top_k=700), SamplingParams(temperature=0.0),
              SamplingParams(temperature=1.1, top_p=0.5, seed=7), SamplingParams(temperature=0.6),
              SamplingParams(temperature=1.0, top_k=3, seed=9)]
    got = []
    for step in range(steps):
        mine = random_logits(1, vocab=8192, seed=100 + step)  # [1, 8192]
        if not neighbours:
            toks, _ = sampler.sample(mine, ["me"], [p])
            got.append(toks[0])
            continue
        at = step % (len(others) + 1)
        rest = random_logits(len(others), vocab=8192, seed=1000 + step)  # [5, 8192]
        logits = torch.cat([rest[:at], mine, rest[at:]])
        ids = [f"o{j}" for j in range(at)] + ["me"] + [f"o{j}" for j in range(at, len(others))]
        toks, _ = sampler.sample(logits, ids, others[:at] + [p] + others[at:])
        got.append(toks[at])
    return got


@pytest.mark.parametrize("case", list(CASES))
def test_same_seed_gives_the_same_tokens_whatever_the_batch_neighbours(case: str) -> None:
    p = CASES[case]
    alone = seeded_run(p, neighbours=False)
    assert seeded_run(p, neighbours=True) == alone
    if case == "nucleus":  # the sort path (accelerators' default) too
        assert seeded_run(p, neighbours=True, full_sort=True) == seeded_run(p, neighbours=False, full_sort=True)
    other_seed = seeded_run(SamplingParams(**{**p.__dict__, "seed": 43}), neighbours=False)
    assert other_seed != alone  # the seed matters: the comparison above could fail


def test_forget_restarts_a_seeded_request_from_its_seed() -> None:
    p = SamplingParams(temperature=1.0, top_k=100, seed=5)
    sampler = Sampler()
    logits = random_logits(1, seed=3)
    first = [sampler.sample(logits, ["a"], [p])[0][0] for _ in range(6)]
    sampler.forget("a")
    again = [sampler.sample(logits, ["a"], [p])[0][0] for _ in range(6)]
    assert again == first and len(set(first)) > 1


def test_logprobs_are_under_the_unmodified_distribution_for_the_rows_that_ask() -> None:
    logits = random_logits(6, seed=9)
    params = [SamplingParams(temperature=0.0, logprobs=True), SamplingParams(temperature=0.7, top_k=20),
              SamplingParams(temperature=0.7, top_p=0.9, logprobs=True), SamplingParams(temperature=1.0),
              SamplingParams(temperature=1.5, top_k=5, logprobs=True), SamplingParams(temperature=0.0)]
    toks, lps = Sampler(seed=1).sample(logits, [str(i) for i in range(6)], params)
    ref = torch.log_softmax(logits.double(), -1)
    for i, (t, lp) in enumerate(zip(toks, lps, strict=True)):
        if params[i].logprobs:
            assert lp == pytest.approx(float(ref[i, t]), abs=1e-4)
            assert lp < 0.0
        else:
            assert lp == 0.0


def test_all_rows_asking_for_logprobs_get_them() -> None:
    logits = random_logits(3, seed=10)
    params = [SamplingParams(temperature=0.8, logprobs=True)] * 3
    toks, lps = Sampler().sample(logits, ["a", "b", "c"], params)
    ref = torch.log_softmax(logits.double(), -1)
    assert lps == pytest.approx([float(ref[i, t]) for i, t in enumerate(toks)], abs=1e-4)


def test_mismatched_rows_and_params_raise_value_error() -> None:
    with pytest.raises(ValueError, match="logits rows"):
        Sampler().sample(torch.zeros(2, 8), ["a"], [SamplingParams()])
    with pytest.raises(ValueError, match=r"\[n, V\]"):
        Sampler().sample(torch.zeros(8), ["a"], [SamplingParams()])
    with pytest.raises(ValueError, match="nucleus_k0"):
        Sampler(nucleus_k0=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_logits_sample_on_the_device_with_seeds_independent_of_the_batch() -> None:
    p = CASES["nucleus"]
    sampler = Sampler()
    logits = random_logits(4, seed=12).cuda()
    params = [p, SamplingParams(temperature=0.0), SamplingParams(top_k=50), SamplingParams(temperature=0.7)]
    toks, _ = sampler.sample(logits, ["me", "g", "k", "t"], params)
    assert toks[1] == int(logits[1].argmax())
    assert toks[2] in set(torch.topk(logits[2], 50).indices.tolist())
    assert sampler._gens["me"].device.type == "cuda"
    alone, _ = Sampler().sample(logits[:1], ["me"], [p])
    assert alone[0] == toks[0]
