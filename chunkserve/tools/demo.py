"""`chunkserve demo`: multi-tenant chats that share a system prompt, on the embedded model, offline."""

from __future__ import annotations

import argparse
import time

from chunkserve.workers.llm import LLM
from chunkserve.workers.sampling import SamplingParams

SYSTEM = (
    "You are the support assistant of Acme Cloud. You can call these tools: "
    "get_invoice(customer_id, month) returns an invoice; list_servers(customer_id) lists servers; "
    "restart_server(server_id) restarts one; open_ticket(summary, priority) files a ticket. "
    "Answer in one or two short sentences, and say which tool you would call."
)
QUESTIONS = [
    ("tenant-a", "My server web-1 is down, what can you do?"),
    ("tenant-a", "How much was my March invoice?"),
    ("tenant-b", "List my servers please."),
    ("tenant-b", "Open a ticket: the dashboard is slow."),
]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="chunkserve demo", description=__doc__)
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    ap.add_argument("--max-tokens", type=int, default=40)
    ap.add_argument("--chunk-size", type=int, default=64)
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    llm = LLM(model=args.model, chunk_size=args.chunk_size, kv_cache_gb=0.5)
    print(f"loaded the model in {time.perf_counter() - t0:.1f} s")
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    # Both tenants opt into one shared cache scope for this public system prompt.
    convs = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}] for _, q in QUESTIONS]
    t0 = time.perf_counter()
    first = llm.chat(convs[:1], params)
    rest = llm.chat(convs[1:], params)
    dt = time.perf_counter() - t0
    for (tenant, q), out in zip(QUESTIONS, first + rest, strict=True):
        print(f"\n[{tenant}] {q}\n  -> {out.text.strip()}\n  ({len(out.prompt_token_ids)} prompt tokens, "
              f"{out.num_cached_tokens} from the prefix cache, finish: {out.finish_reason})")
    st = llm.stats()
    print(f"\n{len(QUESTIONS)} chats in {dt:.1f} s; prefix-cached prompt tokens: {st['prefix_cached_tokens']} of "
          f"{st['prompt_tokens_total']}; KV chunks used/cached/total: {st['kv_chunks_used']}/"
          f"{st['kv_chunks_cached']}/{st['kv_chunks_total']}; peak KV: {st['peak_kv_bytes'] / 2**20:.1f} MiB")
    return 0
