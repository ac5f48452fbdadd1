"""Differential test of the engine against HF under cache churn: random prompts built from a few shared
prefixes cut at random points (mid-chunk included, so reuse down to the token copies chunk heads), a pool
small enough to evict and preempt, and random prefill budgets (prefills split into pieces over chunks that
are not consecutive). Every generated token's log-probability must match HF's teacher-forced forward."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from chunkserve.workers.llm import LLM
from chunkserve.workers.sampling import SamplingParams

VOCAB = 256


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, LlamaForCausalLM]:
    torch.manual_seed(1)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                      rms_norm_eps=1e-5, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).eval()
    path = tmp_path_factory.mktemp("llama-diff") / "ckpt"
    model.save_pretrained(path)
    return str(path), model


def _hf_logprobs(model: LlamaForCausalLM, prompt: list[int], out: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + out[:-1]])).logits[0, len(prompt) - 1:].double()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(out)[:, None]).squeeze(1)


@pytest.mark.parametrize(("seed", "backend"), [(s, "torch") for s in range(6)] + [(s, "paged-torch") for s in range(2)])
def test_logprobs_match_hf_under_eviction_preemption_and_token_level_reuse(model_dir, seed: int,
                                                                           backend: str) -> None:
    path, hf = model_dir
    rng = random.Random(seed)
    bases = [[rng.randrange(1, VOCAB) for _ in range(rng.randint(40, 140))] for _ in range(3)]
    llm = LLM(model=path, chunk_size=16, num_kv_chunks=rng.choice([14, 18, 24]),
              max_num_batched_tokens=rng.choice([32, 48, 512]), dtype="float32", attention_backend=backend)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=True)
    worst = 0.0
    for _round in range(4):
        batch = []
        for _ in range(rng.randint(1, 5)):
            base = rng.choice(bases)
            cut = rng.randint(0, len(base))
            batch.append(base[:cut] + [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 40))])
        for prompt, out in zip(batch, llm.generate(batch, params), strict=True):
            err = float((torch.tensor(out.logprobs, dtype=torch.float64)
                         - _hf_logprobs(hf, prompt, out.token_ids)).abs().max())
            worst = max(worst, err)
    stats = llm.stats()
    assert worst < 1e-4, (worst, stats)
    assert stats["prefix_cached_tokens"] > 0  # the rounds did reuse cached prefixes
