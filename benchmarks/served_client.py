"""The client side of `bench_served.py`: the workloads, the streaming chat client and per-process CPU
accounting. Torch-free (the tokenizer is read as the Serve ingress reads it), so the load generator, whose
CPU seconds are reported as "client", never maps libtorch.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections import defaultdict
from typing import Any

TENANTS = ("acme", "globex", "initech", "umbrella")
USERS = ("Where is my order?", "How do I reset my password?", "Can I change my delivery address?",
         "What is your refund policy?", "Do you ship abroad?", "How long does shipping take?",
         "Can I pay by invoice?", "How do I close my account?")
STORY = "Write a long and detailed story about a lighthouse keeper who finds a message in a bottle."
MAX_TOKENS = 64


def system_prompt(tokenizer: Any, tenant: str, target_tokens: int = 1000) -> str:
    """A tenant's system prompt of about ``target_tokens`` tokens."""
    parts = [f"You are the support assistant of {tenant.title()} Corporation."]
    i = 1
    while len(tokenizer.encode(" ".join(parts))) < target_tokens:
        parts.append(f"Policy {i} of {tenant}: answer politely, cite policy number {i}, never promise a refund "
                     f"before checking order {1000 + 7 * i}, and keep the answer under {40 + i % 9} words.")
        i += 1
    return " ".join(parts)


def chat_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """Prompt ids exactly as the ingress builds them (template text, then encode without specials)."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer.encode(text, add_special_tokens=False))


def workloads(tokenizer: Any) -> dict[str, list[list[dict[str, str]]]]:
    systems = {t: system_prompt(tokenizer, t) for t in TENANTS}
    chats = [[{"role": "system", "content": systems[t]}, {"role": "user", "content": u}]
             for t in TENANTS for u in USERS]
    return {"single": [[{"role": "user", "content": STORY}]], "chat32": chats}


def summarize(starts: list[float], firsts: list[float], ends: list[float], tokens: list[int],
              events: list[int]) -> dict[str, Any]:
    wall = max(ends) - min(starts)
    ttfts = [f - s for f, s in zip(firsts, starts, strict=True)]
    return {"requests": len(tokens), "completion_tokens": sum(tokens), "wall_s": round(wall, 3),
            "tok_per_s": round(sum(tokens) / wall, 2), "ttft_p50_ms": round(1000 * statistics.median(ttfts), 1),
            "events_per_request": round(sum(events) / len(events), 1),
            "ms_per_token": round(1000 * (ends[0] - firsts[0]) / max(1, tokens[0] - 1), 2)}


def load_tokenizer() -> Any:
    """The embedded model's tokenizer, read without torch exactly as the Serve ingress reads it."""
    from chunkserve.router.app import _model_info

    return _model_info(None)[0]


# -- the client ---------------------------------------------------------------------------------------
async def stream_chat(session: Any, model: str, messages: list[dict[str, str]]) -> dict[str, Any]:
    body = {"model": model, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first, events, usage = None, 0, None
    async with session.post("/v1/chat/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {await resp.text()}")
        async for line in resp.content:
            if not line.startswith(b"data: "):
                continue
            data = line[6:].strip()
            if data == b"[DONE]":
                break
            ev = json.loads(data)
            if ev.get("usage"):
                usage = ev["usage"]
            choices = ev.get("choices")
            if choices and choices[0]["delta"].get("content"):
                events += 1
                if first is None:
                    first = time.perf_counter()
    end = time.perf_counter()
    if usage is None:
        raise RuntimeError("the stream carried no usage chunk")
    return {"start": t0, "first": first or end, "end": end, "tokens": usage["completion_tokens"], "events": events}


async def run_served_once(url: str, model: str, convs: list[list[dict[str, str]]], pid: int) -> dict[str, Any]:
    """One workload through the server: all conversations at once; CPU seconds per process role."""
    import aiohttp

    async with aiohttp.ClientSession(url, connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=900)) as s:
        await stream_chat(s, model, [{"role": "user", "content": "warm up"}])
        cpu0, self0 = cpu_by_process(pid), time.process_time()
        rs = await asyncio.gather(*(stream_chat(s, model, c) for c in convs))
        cpu1, self1 = cpu_by_process(pid), time.process_time()
    res = summarize([r["start"] for r in rs], [r["first"] for r in rs], [r["end"] for r in rs],
                    [r["tokens"] for r in rs], [r["events"] for r in rs])
    cpu = {k: round(cpu1.get(k, 0.0) - cpu0.get(k, 0.0), 2) for k in cpu1}
    res["cpu_s"] = {**{k: v for k, v in sorted(cpu.items()) if v > 0.05}, "client": round(self1 - self0, 2)}
    return res


# -- process accounting ---------------------------------------------------------------------------------
def _group(cmd: list[str], name: str) -> str:
    first = cmd[0] if cmd else name
    for key, label in (("Worker", "worker"), ("Ingress", "ingress"), ("ProxyActor", "proxy"),
                       ("ServeController", "serve_controller"), ("raylet", "raylet"), ("gcs_server", "gcs"),
                       ("redis-server", "redis"), ("bench_served", "local_server"), ("chunkserve", "launcher")):
        if key in first or key in " ".join(cmd[:3]):
            return label
    return "ray_other"


def cpu_by_process(root_pid: int) -> dict[str, float]:
    """CPU seconds (user + system) of a process tree, summed by role."""
    import psutil

    out: dict[str, float] = defaultdict(float)
    try:
        root = psutil.Process(root_pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return {}
    for p in procs:
        try:
            t = p.cpu_times()
            out[_group(p.cmdline(), p.name())] += t.user + t.system
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return dict(out)
