"""The pin target of issue 16 with the real model: a 4,096-token prefix pinned with cache_control survives a
flood of another tenant's distinct prompts that fills the KV pool 5x over; without the pin it is evicted.

``--mode worker``: one `EngineCore` (the embedded SmolLM2 unless ``--model``), pins passed as a `PinSpec`.
``--mode up``: ``chunkserve up`` with a tenants file, the OpenAI API with ``cache_control`` on the system
message, usage's ``cached_tokens`` / ``cache_creation_tokens`` read back; the flood is 5x the pools of all
workers. Prints one row per (pinned, unpinned): cached tokens of the follow-up request.

    python benchmarks/bench_pins.py --mode worker|up [--pool-chunks 96] [--workers 2]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PREFIX_TOKENS = 4096


def worker_mode(model: str | None, pool_chunks: int) -> None:
    from chunkserve.workers.cache_control import PinSpec
    from chunkserve.workers.engine import EngineConfig, EngineCore
    from chunkserve.workers.sampling import SamplingParams

    for pinned in (True, False):
        if model == "tiny-8k":  # random:tiny with an 8k context (the 4,096-token prefix plus a question)
            from chunkserve.workers.config import preset_config
            model = dataclasses.replace(preset_config("tiny"), max_position_embeddings=8192)
        core = EngineCore(EngineConfig(model=model, num_kv_chunks=pool_chunks,
                                       max_num_batched_tokens=2048))
        rng = random.Random(0)
        vocab = core.model_config.vocab_size
        prefix = [rng.randrange(100, vocab) for _ in range(PREFIX_TOKENS)]
        params = SamplingParams(max_tokens=1, temperature=0.0)
        pin = PinSpec(PREFIX_TOKENS, 300.0, 8192) if pinned else None
        t0 = time.monotonic()

        def run(rid: str, prompt: list[int], tenant: str, spec=None, core=core, params=params):
            req = core.add_request(rid, prompt, params, tenant.encode(), tenant=tenant, cache_pin=spec)
            while core.has_work():
                core.step()
            return req

        first = run("p0", prefix + [11, 12], "acme", pin)
        flood_tokens = 0
        i = 0
        while flood_tokens < 5 * pool_chunks * core.cache.chunk_size:
            run(f"f{i}", [rng.randrange(100, vocab) for _ in range(2048)], "other")
            flood_tokens += 2048
            i += 1
        again = run("p1", prefix + [13, 14], "acme")
        print(f"worker  pinned={pinned!s:<5} pool {pool_chunks * core.cache.chunk_size} tokens, flood "
              f"{flood_tokens} tokens: first cache_creation {first.cache_creation_tokens}, next request cached "
              f"{again.num_cached} of {len(again.prompt)} ({time.monotonic() - t0:.0f} s)")


def up_mode(pool_chunks: int, workers: int, port: int) -> None:
    import httpx2

    from chunkserve.router.tenants import hash_api_key

    tmp = tempfile.mkdtemp()
    tf = os.path.join(tmp, "tenants.yaml")
    Path(tf).write_text("tenants:\n" + "".join(
        f"  - id: {t}\n    api_key_sha256: [{hash_api_key('key-' + t)}]\n" for t in ("acme", "other")))
    exe = Path(sys.executable).with_name("chunkserve")
    eng = {"num_kv_chunks": pool_chunks, "max_num_batched_tokens": 2048}
    proc = subprocess.Popen([str(exe), "up", "--workers", str(workers), "--tenants", tf, "--http-port", str(port),
                             "--grpc-port", str(port + 1), "--engine", json.dumps(eng)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    rng = random.Random(0)
    words = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel"]

    def text(n_words: int) -> str:
        return " ".join(rng.choice(words) + str(rng.randrange(10000)) for _ in range(n_words))

    def chat(tenant: str, msgs: list[dict]) -> dict:
        r = httpx2.post(url + "/v1/chat/completions", timeout=600, headers={"Authorization": f"Bearer key-{tenant}"},
                        json={"model": model, "messages": msgs, "max_tokens": 1, "temperature": 0})
        r.raise_for_status()
        return r.json()["usage"]

    try:
        model = ""
        t_end = time.monotonic() + 900
        while time.monotonic() < t_end:
            try:
                r = httpx2.get(url + "/v1/models", headers={"Authorization": "Bearer key-acme"}, timeout=5)
                if r.status_code == 200:
                    model = r.json()["data"][0]["id"]
                    chat("other", [{"role": "user", "content": "hi"}])
                    break
            except httpx2.HTTPError:
                pass
            time.sleep(2)
        for pinned in (True, False):
            system = text(770)  # about 4,150 tokens (SmolLM2 splits digits: ~5.4 tokens a word)
            mark = {"cache_control": {"type": "ephemeral", "ttl": "1h"}} if pinned else {}  # the flood outlasts 5 min here
            first = chat("acme", [{"role": "system", "content": system, **mark}, {"role": "user", "content": "q1"}])
            flood = 0
            while flood < 5 * workers * pool_chunks * 64:
                flood += chat("other", [{"role": "user", "content": text(600)}])["prompt_tokens"]
            again = chat("acme", [{"role": "system", "content": system}, {"role": "user", "content": "q2"}])
            print(f"up      pinned={pinned!s:<5} {workers} workers x {pool_chunks * 64} tokens, flood {flood} tokens: "
                  f"first prompt {first['prompt_tokens']} cache_creation "
                  f"{first['prompt_tokens_details'].get('cache_creation_tokens')}, next request cached "
                  f"{again['prompt_tokens_details']['cached_tokens']} of {again['prompt_tokens']}")
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=["worker", "up"], default="worker")
    ap.add_argument("--model", default=None, help="worker mode: default the embedded SmolLM2; tiny-8k: random tiny")
    ap.add_argument("--pool-chunks", type=int, default=128, help="KV chunks of 64 tokens per worker")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--port", type=int, default=18100)
    args = ap.parse_args(argv)
    if args.mode == "worker":
        worker_mode(args.model, args.pool_chunks)
    else:
        up_mode(args.pool_chunks, args.workers, args.port)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
