"""The serving benchmark's workload: multi-tenant chats that share a system prompt per tenant, their
arrival times, and a lone streaming request. Torch-free: prompts are sized with the `tokenizers` library
(the embedded model's ``tokenizer.json`` unless another is given)."""

from __future__ import annotations

import dataclasses
import random
import secrets
import subprocess
import sys
from pathlib import Path
from typing import Any

TENANT_NAMES = ("acme", "globex", "initech", "umbrella")
USER_QUESTIONS = ("Where is my order?", "How do I reset my password?", "Can I change my delivery address?",
                  "What is your refund policy?", "Do you ship abroad?", "How long does shipping take?",
                  "Can I pay by invoice?", "How do I close my account?")
STORY = "Write a long and detailed story about a lighthouse keeper who finds a message in a bottle."

Messages = list[dict[str, str]]


@dataclasses.dataclass(frozen=True)
class ChatRequest:
    """One request of a run: who sends it, what, and when (seconds after the run starts)."""

    tenant: str
    messages: Messages
    arrival_s: float


@dataclasses.dataclass(frozen=True)
class WorkloadSpec:
    tenants: int = 4
    requests_per_tenant: int = 8
    system_tokens: int = 1000
    rate: float = float("inf")  # requests per second (Poisson arrivals); inf = all at once
    seed: int = 0
    prompt_salt: str = ""  # prepended to every system prompt so that a run starts cold on a warm server

    def __post_init__(self) -> None:
        if self.tenants < 1 or self.requests_per_tenant < 1:
            raise ValueError("tenants and requests per tenant must be at least 1")
        if self.system_tokens < 0:
            raise ValueError("the system prompt length must be >= 0 tokens")
        if not self.rate > 0:
            raise ValueError("the arrival rate must be > 0 requests/s (inf = all at once)")


def new_salt() -> str:
    return secrets.token_hex(4)


class TokenCounter:
    """Counts tokens of plain text with a ``tokenizer.json`` (no special tokens, no chat template)."""

    def __init__(self, tokenizer_json: Path) -> None:
        from tokenizers import Tokenizer

        self.path = tokenizer_json
        self._tok = Tokenizer.from_file(str(tokenizer_json))

    def __call__(self, text: str) -> int:
        return len(self._tok.encode(text, add_special_tokens=False).ids)


def embedded_tokenizer_json() -> Path:
    """The embedded model's ``tokenizer.json``, found in a child process as the Serve ingress finds it, so
    that this process never imports torch (`workers.weights` does)."""
    code = "from chunkserve.workers.weights import embedded_checkpoint_dir as d; print(d(progress=False))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=1800, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"could not find the embedded model's tokenizer: {out.stderr.strip()[-1000:]}")
    return Path(out.stdout.strip().splitlines()[-1]) / "tokenizer.json"


def load_counter(tokenizer: str | None) -> TokenCounter:
    """``tokenizer``: a ``tokenizer.json`` or a checkpoint folder holding one; None = the embedded model's."""
    if tokenizer is None:
        return TokenCounter(embedded_tokenizer_json())
    path = Path(tokenizer).expanduser()
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise ValueError(f"no tokenizer.json at {tokenizer!r}")
    return TokenCounter(path)


def tenant_names(n: int) -> list[str]:
    return [TENANT_NAMES[i] if i < len(TENANT_NAMES) else f"tenant{i + 1}" for i in range(n)]


def system_prompt(count: TokenCounter, tenant: str, target_tokens: int, salt: str = "") -> str:
    """A tenant's system prompt of about ``target_tokens`` tokens (never more than one policy line over)."""
    head = f"Session {salt}. " if salt else ""
    parts = [f"{head}You are the support assistant of {tenant.title()} Corporation."]
    i = 1
    while count(" ".join(parts)) < target_tokens:
        parts.append(f"Policy {i} of {tenant}: answer politely, cite policy number {i}, never promise a refund "
                     f"before checking order {1000 + 7 * i}, and keep the answer under {40 + i % 9} words.")
        i += 1
    return " ".join(parts) if target_tokens > 0 else ""


def user_question(k: int) -> str:
    q = USER_QUESTIONS[k % len(USER_QUESTIONS)]
    return q if k < len(USER_QUESTIONS) else f"{q} (ticket {k + 1})"


def arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Arrival offsets in seconds: all 0 for an infinite rate, else a Poisson process of ``rate`` per second."""
    if rate == float("inf"):
        return [0.0] * n
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def chat_requests(spec: WorkloadSpec, count: TokenCounter) -> list[ChatRequest]:
    """Every tenant's requests, interleaved round-robin over tenants (``tenants x requests_per_tenant``)."""
    names = tenant_names(spec.tenants)
    systems = {t: system_prompt(count, t, spec.system_tokens, spec.prompt_salt) for t in names}
    order = [(t, k) for k in range(spec.requests_per_tenant) for t in names]
    times = arrivals(len(order), spec.rate, spec.seed)
    out = []
    for (t, k), at in zip(order, times, strict=True):
        msgs = [{"role": "system", "content": systems[t]}] if systems[t] else []
        out.append(ChatRequest(t, [*msgs, {"role": "user", "content": user_question(k)}], at))
    return out


def single_request(salt: str = "") -> ChatRequest:
    """The lone stream: one user asking for a long story (its output length is what is measured)."""
    text = f"{STORY} (Session {salt}.)" if salt else STORY
    return ChatRequest("single", [{"role": "user", "content": text}], 0.0)


def describe(spec: WorkloadSpec, count: TokenCounter, reqs: list[ChatRequest]) -> dict[str, Any]:
    """What the workload is, for the JSON report (system prompt length as the given tokenizer counts it)."""
    sys_tokens = [count(r.messages[0]["content"]) for r in reqs if r.messages[0]["role"] == "system"]
    return {**dataclasses.asdict(spec), "rate": "inf" if spec.rate == float("inf") else spec.rate,
            "requests": len(reqs), "system_prompt_tokens": max(sys_tokens) if sys_tokens else 0,
            "tokenizer": str(count.path)}
