"""Quantised (int8 and int4 block formats) against fp32 and bf16 on the embedded SmolLM2-135M: quality and speed.

    .venv/bin/python benchmarks/bench_quant.py                       # everything, 2 threads, wall clock
    .venv/bin/python benchmarks/bench_quant.py --threads 1 --clock thread --no-speed

Variants: fp32 (the reference), bf16, int8 (``EngineConfig(quantization="int8")``: Q8_0 layers and lm_head),
int8-dense-head (Q8_0 layers, the lm_head dense), int4 (``quantization="int4"``: Q4_1 layers, Q8_0 lm_head).
Both block formats quantise the activations to int8 per block of 32 inside the matmuls, as llama.cpp runs
its GGUFs (workers/quant.py); the embedded GGUF is Q4_1/Q8_0, so the "fp32" weights are already on int4's
grid. Quality, against fp32:

* greedy agreement over 16 fixed prompts x 32 tokens: the mean fraction of tokens identical up to the
  first divergence, and the share of prompts whose whole continuation is identical (noisy: a 135M model
  diverges on near-ties);
* over the fixed text below (teacher-forced, one forward over the whole text): the mean KL divergence of
  the next-token distribution from fp32's, top-1 agreement with fp32, and perplexity.

Speed: decode step time at batch 1 and 32 (the engine's step, see bench_step.py).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_step import CLOCKS, cpu_model, timed_round  # noqa: E402

from chunkserve.workers.engine import EngineConfig, EngineCore  # noqa: E402
from chunkserve.workers.model import CausalLM, DenseCausalAttention  # noqa: E402
from chunkserve.workers.sampling import SamplingParams  # noqa: E402
from chunkserve.workers.weights import LoadedModel, load_model  # noqa: E402

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "To make a cup of tea, first",
    "Photosynthesis is the process by which",
    "The best way to learn a new language is",
    "import numpy as np\n\ndef normalize(x):",
    "Water boils at a temperature of",
    "The French Revolution began in",
    "A good night's sleep helps",
    "In mathematics, a prime number is",
    "The largest planet in our solar system",
    "Dear hiring manager, I am writing to",
    "The recipe calls for two cups of flour and",
    "Machine learning models are trained by",
]
TEXT = (
    "The river had always been the town's clock. In spring it rose brown and fast with snowmelt from the "
    "hills, and the ferryman would wait for the water to settle before he took anyone across. In summer it "
    "slowed and warmed, and children spent whole afternoons on the gravel bars, building dams that the "
    "evening current quietly took apart. By autumn the leaves came down in such numbers that the surface "
    "looked solid, and in winter, in the cold years, it froze from the banks inward until only a dark "
    "channel remained in the middle.\n\n"
    "Nobody remembered exactly when the bridge was first proposed. The council minutes mention it in "
    "passing, as an idea that someone raised and nobody opposed, which in that town was the same as "
    "approval. Money was the difficulty. Stone had to be brought from the quarry upstream, and the "
    "engineers wanted piers deep enough to stand through the spring floods. It took eleven years, two "
    "changes of mayor and one very dry summer, when the river fell low enough to work in, before the "
    "first arch was finished.\n\n"
    "When the bridge opened, the ferryman was given a pension and a small plaque. He kept the boat "
    "anyway, and on quiet evenings he would row out under the new arches, as if to check that they were "
    "doing the job properly. People said he missed the work. He said the river was the same river, and "
    "somebody ought to keep an eye on it."
)


def variants() -> list[tuple[str, str, str | None, bool]]:
    """(name, dtype, quantization, lm_head quantised)."""
    return [("fp32", "float32", None, False), ("bf16", "bfloat16", None, False),
            ("int8", "float32", "int8", True), ("int8-dense-head", "float32", "int8", False),
            ("int4", "float32", "int4", True)]


def load_variant(dtype: str, quant: str | None, head: bool) -> LoadedModel:
    loaded = load_model(None, dtype=dtype, progress=False)
    if quant is not None:
        loaded.model.quantize(quant, lm_head=head)
    return loaded


def greedy(core: EngineCore, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Greedy continuations of `n` tokens (EOS ignored), all prompts batched in one engine."""
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        core.add_request(f"q{i}", p, params)
    out: dict[str, list[int]] = {}
    while core.has_work():
        for o in core.step():
            if o.finish_reason is not None:
                out[o.req.request_id] = list(o.req.output)
    return [out[f"q{i}"] for i in range(len(prompts))]


def agreement(ref: list[list[int]], got: list[list[int]]) -> tuple[float, float]:
    """(mean fraction of tokens identical up to the first divergence, share of identical sequences)."""
    fracs, whole = [], 0
    for r, g in zip(ref, got, strict=True):
        k = next((i for i, (a, b) in enumerate(zip(r, g, strict=True)) if a != b), len(r))
        fracs.append(k / len(r))
        whole += k == len(r)
    return sum(fracs) / len(fracs), whole / len(ref)


@torch.inference_mode()
def next_token_logprobs(model: CausalLM, ids: list[int]) -> torch.Tensor:
    """[T-1, V] fp32 log-probabilities of each next token of `ids`, in one teacher-forced forward."""
    x = torch.tensor(ids)
    hidden = model.forward(x, torch.arange(len(ids)), DenseCausalAttention(model.config.num_layers))
    return model.compute_logits(hidden[:-1]).float().log_softmax(-1)


def text_quality(ref: torch.Tensor, got: torch.Tensor, ids: list[int]) -> dict[str, float]:
    """Mean KL(ref || got), top-1 agreement and perplexity from [T-1, V] log-probabilities."""
    kl = (ref.exp() * (ref - got)).sum(-1).mean().item()
    top1 = (ref.argmax(-1) == got.argmax(-1)).float().mean().item()
    nll = -got.gather(1, torch.tensor(ids[1:])[:, None]).mean().item()
    return {"kl": kl, "top1": top1, "ppl": math.exp(nll)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="wall")
    ap.add_argument("--tokens", type=int, default=32, help="greedy tokens per prompt")
    ap.add_argument("--steps", type=int, default=24, help="timed decode steps per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--no-speed", action="store_true")
    ap.add_argument("--variants", nargs="+", default=None,
                    help="subset of fp32 bf16 int8 int8-dense-head int4 (fp32, the reference, always runs first)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"CPU: {cpu_model()}; torch {torch.__version__}; threads={args.threads}; clock={args.clock}; "
          f"load average {os.getloadavg()[0]:.2f}")
    ref: list[list[int]] | None = None
    ref_lp: torch.Tensor | None = None
    rows: list[dict[str, Any]] = []
    chosen = [v for v in variants() if args.variants is None or v[0] in args.variants or v[0] == "fp32"]
    for name, dtype, quant, head in chosen:
        loaded = load_variant(dtype, quant, head)
        tok = loaded.tokenizer
        prompts = [tok.encode(p) for p in PROMPTS]
        core = EngineCore(EngineConfig(dtype=dtype, num_threads=args.threads, kv_cache_gb=0.25), loaded)
        t0 = time.perf_counter()
        outs = greedy(core, prompts, args.tokens)
        row: dict[str, Any] = {"name": name, "gen_s": time.perf_counter() - t0}
        if ref is None:
            ref = outs
        row["prefix"], row["whole"] = agreement(ref, outs)
        text = tok.encode(TEXT)
        lp = next_token_logprobs(core.model, text)
        if ref_lp is None:
            ref_lp = lp
        row.update(text_quality(ref_lp, lp, text))
        if not args.no_speed:
            for b in args.batches:
                r = min((timed_round(core, b, args.steps, CLOCKS[args.clock], f"{name}{i}")
                         for i in range(args.rounds)), key=lambda x: x["step"])
                row[f"b{b}"] = r["step"]
        rows.append(row)
        speed = " ".join(f"b={b}: {row[f'b{b}']:.1f} ms/step ({1e3 * b / row[f'b{b}']:.1f} tok/s)"
                         for b in args.batches if f"b{b}" in row)
        print(f"{name:15s} greedy prefix agreement {row['prefix']:.3f}, whole-sequence match {row['whole']:.3f}, "
              f"text KL {row['kl']:.5f}, top-1 {row['top1']:.3f}, perplexity {row['ppl']:.3f}; {speed}", flush=True)
        del core, loaded
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
