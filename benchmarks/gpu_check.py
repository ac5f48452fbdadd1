"""The Python half of ``benchmarks/gpu_check.sh``: preflight, backend agreement, e2e decode, report.

    python benchmarks/gpu_check.py preflight OUT   # what is installed, is a GPU usable (exit 0/3..6)
    python benchmarks/gpu_check.py agree OUT       # all decode backends vs float64, Llama-8B layer shape
    python benchmarks/gpu_check.py e2e OUT         # random-weight Llama-3-8B (bf16), greedy decode per backend
    python benchmarks/gpu_check.py report OUT      # one table and a PASS/FAIL line per target

Each step writes ``OUT/<step>.json``; ``report`` reads them, the bench JSONs and ``pytest.xml``. Nothing
here downloads or installs anything.
"""

from __future__ import annotations

import importlib
import json
import math
import platform
import sys
import time
import warnings
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

# peak HBM bandwidth (bytes/s) by device name, most specific first; else the measured copy rate is used
HBM_PEAK = [("H200", 4.8e12), ("H100 NVL", 3.9e12), ("H100 PCIe", 2.0e12), ("H100", 3.35e12), ("GH200", 4.0e12),
            ("A100 80GB PCIe", 1.935e12), ("A100-SXM4-80GB", 2.039e12), ("A100", 1.555e12)]
TARGET_BW = 0.50  # TPP reads at >= 50% of HBM bandwidth at n_p = n_s = 4096
TARGET_DENSE = 4.8  # and is >= 4.8x faster than dense attention (the faster of naive and SDPA) there
TOL_16BIT = 2e-3  # norm-wise relative error vs float64 (tests/kernels/conftest.py TOL for fp16/bf16)
TOL_TPP_VS_PAGED = 1e-2  # bench: TPP and paged outputs on the same cache (both 16-bit rounded)
NEEDS = {"torch": "everything", "triton": "the Triton kernels", "numpy": "the KV cache",
         "tqdm": "the KV cache", "redis": "only the cluster index (no step here needs it)",
         "pytest": "the kernel tests", "hypothesis": "the kernel tests"}


def _write(out: Path, name: str, data: dict[str, Any]) -> None:
    (out / f"{name}.json").write_text(json.dumps(data, indent=1))


def preflight(out: Path) -> int:
    """Exit 0 when torch sees a CUDA device and triton imports; 3-6 name what is missing."""
    info: dict[str, Any] = {"python": sys.executable, "python_version": platform.python_version(), "missing": {}}
    for mod, why in NEEDS.items():
        try:
            m = importlib.import_module(mod)
            info[f"{mod}_version"] = getattr(m, "__version__", "?")
        except Exception as e:  # noqa: BLE001 - a broken install reads the same as a missing one here
            info["missing"][mod] = f"{type(e).__name__}: {e} (needed by {why})"
    code, msg = 0, "ok"
    if "torch" in info["missing"]:
        code, msg = 3, f"torch is not importable from {sys.executable}: {info['missing']['torch']}"
    else:
        import torch

        info["torch_cuda_build"] = torch.version.cuda
        if torch.version.cuda is None:
            code, msg = 4, (f"torch {torch.__version__} at {sys.executable} is a CPU-only build "
                            "(torch.version.cuda is None): use a Python with a CUDA build of torch")
        elif not torch.cuda.is_available():
            code, msg = 5, (f"torch {torch.__version__} is a CUDA {torch.version.cuda} build but sees no device "
                            "(driver missing, CUDA_VISIBLE_DEVICES empty, or a driver older than the build)")
        else:
            info["gpu"] = torch.cuda.get_device_name(0)
            info["capability"] = list(torch.cuda.get_device_capability(0))
            info["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
            if "triton" in info["missing"]:
                code, msg = 6, f"triton is not importable: {info['missing']['triton']}"
    try:
        importlib.import_module("chunkserve.kernels.api")
        info["chunkserve"] = "importable"
    except Exception as e:  # noqa: BLE001
        info["chunkserve"] = f"{type(e).__name__}: {e}"
    info["status"], info["message"] = code, msg
    _write(out, "preflight", info)
    for k, v in info.items():
        print(f"  {k}: {v}")
    print(f"preflight: {msg}")
    return code


def _tree(dtype: Any, gen: Any, device: str) -> tuple[Any, list[int]]:
    """A NaN-poisoned PrefixKVCache at a Llama-3-8B layer shape (Hkv=8, D=128, c=64): 12 rows over a
    3000-token shared prefix (a 2nd-level fork among them), private tails of 0..4000 tokens, 2 unrelated."""
    import torch

    from chunkserve.workers.kvcache import PrefixKVCache

    hkv, d, c, vocab = 8, 128, 64, 512
    cache = PrefixKVCache(1, hkv, d, c, 1200, dtype, device)
    cache.k_pool.fill_(float("nan"))
    cache.v_pool.fill_(float("nan"))
    k_tok, v_tok = torch.randn(vocab, hkv, d, generator=gen), torch.randn(vocab, hkv, d, generator=gen)
    pos = torch.randn(12000, hkv, d, generator=gen) * 0.5

    def add(toks: list[int]) -> int:
        t, p = torch.tensor(toks), torch.arange(len(toks))
        k = (k_tok[t] + pos[p]).to(dtype).unsqueeze(0).to(device)
        v = (v_tok[t] - pos[p]).to(dtype).unsqueeze(0).to(device)
        return cache.add_sequence(toks, k, v)

    def rand(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=gen).tolist()

    shared, fork = rand(3000), rand(700)
    tails = [0, 1, 63, 64, 65, 500, 2000, 4000]
    ids = [add(shared + rand(n)) for n in tails] + [add(shared + fork + rand(n)) for n in (30, 1500)]
    ids += [add(rand(5000)), add(rand(77))]
    return cache, ids


def agree(out: Path, device: str = "cuda", dtypes: tuple[str, ...] = ("bfloat16", "float16")) -> int:
    """Every decode backend against float64 (the reference backend), bf16 and fp16; TPP also with
    kv_split forced to 1 and with the GPU's own choice (flash-decoding engages at this batch)."""
    import torch

    from chunkserve.kernels.api import decode_attention
    from chunkserve.kernels.paged_triton import paged_decode_triton
    from chunkserve.kernels.reference import reference_decode
    from chunkserve.kernels.tpp_triton import tpp_decode_triton

    res: dict[str, Any] = {"tolerance": TOL_16BIT, "errors": {}}
    scale = 128**-0.5
    for dtype in (getattr(torch, name) for name in dtypes):
        gen = torch.Generator().manual_seed(0)
        cache, ids = _tree(dtype, gen, device)
        ctx = cache.context(ids)
        pools = cache.k_pool[0], cache.v_pool[0]
        q = torch.randn(len(ids), 32, 128, generator=gen).to(dtype).to(device)  # [b, Hq, D], tree order
        ref = reference_decode(q, *pools, ctx, scale, out=torch.empty(q.shape, dtype=torch.float64, device=device))
        outs = {b: decode_attention(q, *pools, ctx, scale, backend=b)
                for b in ("torch", "triton", "paged-torch", "paged-triton")}
        for split in (1, 4):
            outs[f"triton kv_split={split}"] = tpp_decode_triton(q, *pools, ctx, scale, kv_split=split)
            outs[f"paged-triton kv_split={split}"] = paged_decode_triton(q, *pools, ctx, scale, kv_split=split)
        errs = {k: float((o.double() - ref).norm() / ref.norm()) if torch.isfinite(o).all() else math.inf
                for k, o in outs.items()}
        res["errors"][str(dtype).removeprefix("torch.")] = errs
        print(f"  {dtype}: " + ", ".join(f"{k} {v:.2e}" for k, v in errs.items()))
        del cache
        if device == "cuda":
            torch.cuda.empty_cache()
    worst = max(v for e in res["errors"].values() for v in e.values())
    res["worst"], res["ok"] = worst, worst <= TOL_16BIT
    _write(out, "agree", res)
    return 0 if res["ok"] else 1


def e2e(out: Path, model: str = "random:llama3-8b", device: str = "cuda", dtype: str = "bfloat16",
        backends: tuple[str, ...] = ("triton", "paged-triton", "torch")) -> int:
    """Random-weight Llama-3-8B in bf16: 16 prompts sharing a 1024-token prefix, 32 greedy tokens, per
    decode backend (one set of weights); decode tokens/s and where the token streams first differ."""
    import torch

    from chunkserve.workers.engine import EngineConfig, EngineCore
    from chunkserve.workers.sampling import SamplingParams
    from chunkserve.workers.weights import load_model

    t0 = time.perf_counter()
    loaded = load_model(model, dtype=dtype, device=device, tokenizer=False, progress=False)
    vocab = loaded.config.vocab_size
    res: dict[str, Any] = {"model": f"{model} {dtype}", "load_s": time.perf_counter() - t0, "backends": {}}
    gen = torch.Generator().manual_seed(1)
    shared = torch.randint(0, vocab, (1024,), generator=gen).tolist()
    prompts = [shared + torch.randint(0, vocab, (64,), generator=gen).tolist() for _ in range(16)]
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, logprobs=True)
    streams: dict[str, list[list[int]]] = {}
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    from chunkserve.workers.warmup import compile_count

    for backend in backends:
        first = backend == backends[0]  # warm-up and sync checks on the first backend (the GPU path)
        eng = EngineCore(EngineConfig(device=device, dtype=dtype, chunk_size=64, attention_backend=backend,
                                      prefill_backend="auto", kv_cache_gb=6, max_num_seqs=64,
                                      max_num_batched_tokens=4096, warmup=first), loaded=loaded)
        built = compile_count()
        for i, p in enumerate(prompts):
            eng.add_request(f"r{i}", p, params)
        done: dict[str, Any] = {}
        steps, t_first = 0, None
        sync_warnings: list[int] = []  # per step: synchronising CUDA calls (torch's sync debug mode)
        sync_sites: set[str] = set()  # where they were made (the Python line that called them)
        t1 = time.perf_counter()
        while len(done) < len(prompts):
            if first and device == "cuda" and 2 <= steps < 8:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    torch.cuda.set_sync_debug_mode("warn")
                    try:
                        outs = eng.step()
                    finally:
                        torch.cuda.set_sync_debug_mode("default")
                # the op warnings only: set_sync_debug_mode's own "Synchronization debug mode is a
                # prototype feature" notice is not a sync
                hits = [w for w in caught if "called a synchronizing" in str(w.message)]
                sync_warnings.append(len(hits))
                sync_sites.update(f"step {steps}: {Path(w.filename).name}:{w.lineno}" for w in hits)
            else:
                outs = eng.step()
            steps += 1
            if t_first is None and any(len(o.req.output) >= 2 for o in outs):
                sync()
                t_first = time.perf_counter()  # prefill and a first decode step done
            done.update({o.req.request_id: o.req for o in outs if o.finish_reason is not None})
        sync()
        t_end = time.perf_counter()
        reqs = [done[f"r{i}"] for i in range(len(prompts))]
        streams[backend] = [list(r.output) for r in reqs]
        lps = [x for r in reqs for x in (r.logprobs or [])]
        finite = all(math.isfinite(float(x)) for x in lps) if lps else None
        decode_tokens = sum(len(r.output) - 2 for r in reqs)  # after the step that made each 2nd token
        res["backends"][backend] = {
            "steps": steps, "wall_s": t_end - t1, "tokens": [len(s) for s in streams[backend]],
            "decode_tok_s": decode_tokens / (t_end - t_first) if t_first else None, "logprobs_finite": finite}
        if first:
            res["backends"][backend].update(warmup=eng.warmup_stats, compiled_after_warmup=compile_count() - built,
                                            syncs_per_step=sync_warnings, sync_sites=sorted(sync_sites))
        print(f"  {backend}: {res['backends'][backend]}")
        del eng
        if device == "cuda":
            torch.cuda.empty_cache()
    base = streams[backends[0]]
    for other in backends[1:]:
        first = [next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), len(x))
                 for x, y in zip(base, streams[other], strict=True)]
        res["backends"][other]["same_prefix_vs_first"] = first
    res["ok"] = all(b["tokens"] == [32] * len(prompts) and b["logprobs_finite"] is not False
                    for b in res["backends"].values())
    _write(out, "e2e", res)
    return 0 if res["ok"] else 1


def _load(out: Path, name: str) -> dict[str, Any] | None:
    p = out / f"{name}.json"
    return json.loads(p.read_text()) if p.exists() else None


def _pytest_counts(out: Path) -> dict[str, int] | None:
    p = out / "pytest.xml"
    if not p.exists():
        return None
    root = ET.parse(p).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    if suite is None:
        return None
    return {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}


def _hbm_peak(gpu: str | None) -> float | None:
    for name, bw in HBM_PEAK:
        if gpu and name in gpu:
            return bw
    return None


def report(out: Path) -> int:
    lines: list[tuple[str, str, str, bool | None]] = []  # target, measured, goal, pass (None: not run)
    pre = _load(out, "preflight") or {}
    counts = _pytest_counts(out)
    if counts is None:
        log = out / "pytest.log"
        why = "timed out" if log.exists() and "TIMEOUT" in log.read_text() else "not run"
        lines.append(("kernel tests on CUDA", f"{why} (see pytest.log)", "all pass", None))
    else:
        bad = counts["failures"] + counts["errors"]
        lines.append(("kernel tests on CUDA", f"{counts['tests'] - bad - counts['skipped']} passed, {bad} failed, "
                      f"{counts['skipped']} skipped", "all pass", bad == 0 and counts["tests"] > 0))
    ag = _load(out, "agree")
    lines.append(("backends agree (Llama-8B layer, NaN pool)",
                  f"worst rel err {ag['worst']:.2e}" if ag else "not run", f"<= {TOL_16BIT:g}",
                  ag["ok"] if ag else None))
    for path in sorted(out.glob("kernel_cuda_triton_*.json")):
        bench = json.loads(path.read_text())
        a = bench["args"]
        tag = f"{a['dtype']} b={a['batch']} Hq={a['heads']} Hkv={a['kv_heads']} d={a['head_dim']} c={a['chunk_size']}"
        rows = bench["rows"]
        diff = max(r.get("tpp_vs_paged_rel_diff", math.nan) for r in rows)
        lines.append((f"TPP vs paged outputs, every row [{tag}]", f"max rel diff {diff:.2e}",
                      f"<= {TOL_TPP_VS_PAGED:g}", diff <= TOL_TPP_VS_PAGED))
        row = next((r for r in rows if r["n_p"] == 4096 and r["n_s"] == 4096), None)
        if row is None:
            lines.append((f"n_p = n_s = 4096 [{tag}]", "row missing", "", False))
            continue
        bw = row["tpp_bytes"] / (row["tpp_us"] * 1e-6)
        peak = _hbm_peak(bench.get("gpu"))
        ref, ref_name = (peak, "HBM peak") if peak else (bench["machine"]["copy_bw"], "measured copy rate")
        lines.append((f"TPP bandwidth @4096/4096 [{tag}]", f"{bw / 1e12:.2f} TB/s = {bw / ref:.0%} of {ref_name} "
                      f"{ref / 1e12:.2f} TB/s ({row['tpp_us']:.1f} µs)", f">= {TARGET_BW:.0%}", bw / ref >= TARGET_BW))
        dense = min(row["naive_us"], row["sdpa_us"])
        lines.append((f"TPP vs dense attention @4096/4096 [{tag}]", f"{dense / row['tpp_us']:.2f}x (dense "
                      f"{dense:.1f} µs; vs paged {row['paged_us'] / row['tpp_us']:.2f}x)", f">= {TARGET_DENSE}x",
                      dense / row["tpp_us"] >= TARGET_DENSE))
    if not list(out.glob("kernel_cuda_triton_*.json")):
        lines.append(("kernel benchmark @4096/4096", "not run (see bench_*.log)", "", None))
    e = _load(out, "e2e")
    if e:
        tps = ", ".join(f"{k} {v['decode_tok_s']:.0f} tok/s" if v.get("decode_tok_s") else f"{k} n/a"
                        for k, v in e["backends"].items())
        same = {k: min(v["same_prefix_vs_first"]) for k, v in e["backends"].items() if "same_prefix_vs_first" in v}
        first = next(iter(e["backends"]))
        lines.append((f"e2e decode, {e['model']}", f"{tps}; greedy tokens equal to {first}'s for at "
                      f"least {same} of 32", "32 finite tokens per prompt, every backend", e["ok"]))
        b0 = e["backends"][first]
        if "compiled_after_warmup" in b0:
            wu = b0.get("warmup", {})
            lines.append((f"kernels compiled after warm-up [{first}]", f"{b0['compiled_after_warmup']} (warm-up "
                          f"{wu.get('seconds', 0):.1f} s, {wu.get('compiled', 0):.0f} built)", "0",
                          b0["compiled_after_warmup"] == 0))
        if b0.get("syncs_per_step"):
            lines.append((f"syncs per prefill/decode step [{first}]", f"{b0['syncs_per_step']} (torch sync debug "
                          "mode)", "<= 1 (the sampled-id copy)", max(b0["syncs_per_step"]) <= 1))
    else:
        lines.append(("e2e decode, random Llama-3-8B bf16", "not run (see e2e.log)", "", None))
    print(f"\nGPU check: {pre.get('gpu', '?')} (sm_{''.join(map(str, pre.get('capability', [])))}), "
          f"torch {pre.get('torch_version', '?')} CUDA {pre.get('torch_cuda_build', '?')}, "
          f"triton {pre.get('triton_version', '?')}")
    w = max(len(t) for t, *_ in lines)
    for target, measured, goal, ok in lines:
        verdict = "PASS" if ok else "FAIL" if ok is False else "FAIL (not run)"
        print(f"{verdict:<14} {target:<{w}}  {measured}  [goal {goal}]" if goal else f"{verdict:<14} {target:<{w}}  {measured}")
    return 0 if all(ok for *_, ok in lines) else 1


def main(argv: list[str]) -> int:
    steps = {"preflight": preflight, "agree": agree, "e2e": e2e, "report": report}
    if len(argv) != 2 or argv[0] not in steps:
        print(__doc__)
        return 2
    out = Path(argv[1])
    out.mkdir(parents=True, exist_ok=True)
    return steps[argv[0]](out)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
