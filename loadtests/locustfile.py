"""Multi-tenant locust load test for chunkserve: HTTP (OpenAI API, SSE streaming) and gRPC users.

    locust -f loadtests/locustfile.py --host http://127.0.0.1:8000 --headless -u 8 -r 8 -t 60s \\
        --tenants 4 --prompt-tokens 512,2048 --sharing-ratio 1.0 --max-tokens 32 \\
        --api-keys-file keys.json --grpc-target 127.0.0.1:9000

Users belong to tenants (round-robin); each tenant has its own tool-definition system prompt (see
``workload.py``) and users draw questions from the tenant's pool. ``--arrival poisson --rate R`` makes
the users an open-loop Poisson source of R requests/s in total (each user fires at rate R/users and
does not wait for its answers; at most ``--max-inflight`` open requests per user, arrivals beyond
that are recorded as failures named ``arrival_dropped``). ``--arrival closed`` (default) runs each user
in a loop with an exponentially distributed think time (``--think-time`` mean seconds).

Besides the requests themselves, each finished request fires request events of type ``METRIC``:
``time_to_first_token:<proto>`` and ``time_per_output_token:<proto>`` (ms) and
``cached_tokens_pct:<proto>`` (cached prompt tokens in percent, reported in the response-time
columns). ``--request-log`` writes one JSON line per request with exact values. At the end of the
run the open requests are drained (``--drain-timeout``); those still open are recorded as failures.
"""

from __future__ import annotations

import itertools
import json
import random
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import gevent
from gevent.pool import Group
from grpc.experimental import gevent as grpc_gevent
from locust import FastHttpUser, User, events, task
from locust.env import Environment

grpc_gevent.init_gevent()  # before any channel exists: makes grpc's blocking calls cooperative

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workload import (  # noqa: E402
    TenantWorkload,
    Tokenizer,
    WorkloadConfig,
    build_workload,
    load_tokenizer,
    parse_lengths,
    parse_rates,
    read_api_keys,
    user_rate,
)

METRIC = "METRIC"


@events.init_command_line_parser.add_listener
def _options(parser: Any) -> None:
    g = parser.add_argument_group("chunkserve workload")
    g.add_argument("--tenants", type=int, default=None, help="number of tenants (default: keys in the "
                   "API-keys file, else 4)")
    g.add_argument("--prompt-tokens", default="1024", help="system-prompt length(s) in tokens, comma-separated, "
                   "assigned to tenants round-robin (512..4096 is the intended range)")
    g.add_argument("--sharing-ratio", type=float, default=1.0, help="leading fraction of a tenant's system "
                   "prompt shared by all its requests; the rest is per-request session context")
    g.add_argument("--max-tokens", type=int, default=32, help="max_tokens of each request")
    g.add_argument("--temperature", type=float, default=0.7)
    g.add_argument("--api-keys-file", default=None, help="tenant id -> plain API key (JSON object or lines "
                   "'<id> <key>'); none: the server runs in open mode")
    g.add_argument("--questions", type=int, default=32, help="questions per tenant pool (0: no user turn)")
    g.add_argument("--workload-seed", type=int, default=0)
    g.add_argument("--endpoint", choices=("chat", "completions"), default="chat", help="HTTP endpoint")
    g.add_argument("--model", default="smollm2-135m-instruct", help="model name sent in requests")
    g.add_argument("--grpc-target", default=None, help="host:port of the gRPC proxy (for GrpcChatUser)")
    g.add_argument("--tokenizer", default=None, help="tokenizer.json or checkpoint dir: exact prompt lengths")
    g.add_argument("--arrival", choices=("closed", "poisson"), default="closed")
    g.add_argument("--rate", type=float, default=1.0, help="poisson: total requests/s over all users")
    g.add_argument("--tenant-rates", default="", help="poisson: relative request rates per tenant, comma-separated, "
                   "round-robin like --prompt-tokens (e.g. 10,1: a heavy and a light tenant; 0: a tenant that "
                   "sends nothing); default equal")
    g.add_argument("--think-time", type=float, default=1.0, help="closed: mean think time (s), exponential")
    g.add_argument("--max-inflight", type=int, default=8, help="poisson: open requests per user at most")
    g.add_argument("--drain-timeout", type=float, default=60.0, help="seconds to let open requests finish")
    g.add_argument("--request-log", default=None, help="write one JSON line per request here")


@dataclass
class RunState:
    """Everything the users share during one run (built at test start)."""

    tenants: list[TenantWorkload]
    tokenizer: Tokenizer | None
    opts: Any
    rates: tuple[float, ...]  # relative request rate per tenant (poisson)
    user_ids: itertools.count = field(default_factory=itertools.count)
    inflight: Group = field(default_factory=Group)
    log: IO[str] | None = None


@dataclass
class Outcome:
    """What one request measured (times in seconds)."""

    tenant: str
    proto: str
    start: float  # unix time at send
    ok: bool = False
    error: str | None = None
    ttft: float | None = None
    e2e: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    events: int = 0  # streamed chunks with content

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def state_of(environment: Environment) -> RunState:
    st = getattr(environment, "chunkserve_state", None)
    if st is None:
        raise RuntimeError("the chunkserve workload is not built (test_start did not run)")
    return st


@events.test_start.add_listener
def _build(environment: Environment, **_: Any) -> None:
    o = environment.parsed_options
    if o is None:
        raise RuntimeError("locust started the test without parsed options")
    keys = read_api_keys(o.api_keys_file) if o.api_keys_file else {}
    n = o.tenants if o.tenants is not None else (len(keys) or 4)
    cfg = WorkloadConfig(num_tenants=n, prompt_tokens=parse_lengths(o.prompt_tokens),
                         sharing_ratio=o.sharing_ratio, questions_per_tenant=o.questions,
                         seed=o.workload_seed, api_keys=keys)
    if o.max_tokens < 1 or o.rate <= 0 or o.max_inflight < 1 or o.think_time < 0:
        raise ValueError("--max-tokens, --rate and --max-inflight must be positive, --think-time >= 0")
    tok = load_tokenizer(o.tokenizer) if o.tokenizer else None
    log = open(o.request_log, "a", encoding="utf-8") if o.request_log else None  # noqa: SIM115
    rates = parse_rates(o.tenant_rates, n)
    environment.chunkserve_state = RunState(build_workload(cfg, tok), tok, o, rates, log=log)  # type: ignore[attr-defined]


@events.test_stop.add_listener
def _drain(environment: Environment, **_: Any) -> None:
    """Lets the open requests finish (bounded); the rest are killed and recorded as failures."""
    st = getattr(environment, "chunkserve_state", None)
    if st is None:
        return
    st.inflight.join(timeout=st.opts.drain_timeout)
    left = len(st.inflight)
    if left:
        st.inflight.kill(block=True, timeout=5)
        for _n in range(left):
            environment.events.request.fire(request_type=METRIC, name="drain_timeout", response_time=0,
                                            response_length=0, exception=RuntimeError("open at drain timeout"))
            if st.log is not None:  # so that summaries count them as failed requests
                st.log.write(json.dumps({"tenant": "?", "proto": "?", "start": time.time(), "ok": False,
                                         "error": "open at drain timeout", "e2e": 0.0}) + "\n")
    if st.log is not None:
        st.log.close()
        st.log = None


class _TenantMixin:
    """Tenant assignment, prompt drawing and the arrival process shared by the user classes."""

    environment: Environment

    def _setup_tenant(self) -> None:
        st = state_of(self.environment)
        uid = next(st.user_ids)
        self.tenant = st.tenants[uid % len(st.tenants)]
        users = max(1, int(getattr(st.opts, "num_users", None) or 1))
        self.rate = user_rate(st.opts.rate, st.rates, uid % len(st.tenants), users)  # poisson: requests/s
        self.rng = random.Random(st.opts.workload_seed * 7919 + uid)
        self.opts = st.opts
        self.inflight = Group()

    def _draw(self) -> tuple[str, str | None]:
        """(system prompt, question or None) for the next request."""
        st = state_of(self.environment)
        system = self.tenant.system_prompt(self.rng, st.tokenizer)
        question = self.rng.choice(self.tenant.questions) if self.opts.questions else None
        return system, question

    def _messages(self) -> list[dict[str, str]]:
        system, question = self._draw()
        msgs = [{"role": "system", "content": system}]
        if question:
            msgs.append({"role": "user", "content": question})
        return msgs

    def wait_time(self) -> float:
        o = self.opts
        if o.arrival == "poisson":
            return self.rng.expovariate(self.rate) if self.rate > 0 else 3600.0  # a silent tenant's users idle
        return self.rng.expovariate(1.0 / o.think_time) if o.think_time > 0 else 0.0

    def _arrive(self, fn: Any) -> None:
        """Runs one request: in the background (poisson, open loop) or waiting for it (closed loop)."""
        st = state_of(self.environment)
        if self.opts.arrival == "poisson" and self.rate == 0:
            return  # a tenant with rate 0 sends nothing (locust runs a task before the first wait)
        if self.opts.arrival == "poisson" and len(self.inflight) >= self.opts.max_inflight:
            self.environment.events.request.fire(request_type=METRIC, name="arrival_dropped", response_time=0,
                                                 response_length=0, exception=RuntimeError("in-flight cap"))
            if st.log is not None:
                st.log.write(json.dumps({"tenant": self.tenant.tenant_id, "proto": "?", "start": time.time(),
                                         "ok": False, "error": "arrival dropped (in-flight cap)", "e2e": 0.0}) + "\n")
            return
        g = gevent.spawn(fn)
        st.inflight.add(g)  # the run-wide drain waits for it even when this user is stopped
        self.inflight.add(g)
        if self.opts.arrival == "closed":
            g.join()


class HttpChatUser(_TenantMixin, FastHttpUser):
    """OpenAI-API user streaming /v1/chat/completions (or /v1/completions) over SSE."""

    weight = 3
    concurrency = 64
    network_timeout = 600.0
    connection_timeout = 60.0

    def on_start(self) -> None:
        self._setup_tenant()

    @task
    def generate(self) -> None:
        self._arrive(self._one)

    def _body(self) -> tuple[str, dict[str, Any]]:
        o = self.opts
        common = {"model": o.model, "max_tokens": o.max_tokens, "temperature": o.temperature,
                  "seed": self.rng.randrange(2**31), "stream": True, "stream_options": {"include_usage": True}}
        if o.endpoint == "chat":
            return "/v1/chat/completions", {**common, "messages": self._messages()}
        system, question = self._draw()
        prompt = system + (f"\n\nUser: {question}\nAssistant:" if question else "")
        return "/v1/completions", {**common, "prompt": prompt}

    def _one(self) -> None:
        path, body = self._body()
        headers = {"Authorization": f"Bearer {self.tenant.api_key}"} if self.tenant.api_key else {}
        out = Outcome(self.tenant.tenant_id, "http", time.time())
        t0 = time.perf_counter()
        try:
            with self.client.post(path, json=body, headers=headers, stream=True, catch_response=True,
                                  name=path) as resp:
                if resp.status_code != 200:
                    out.error = f"HTTP {resp.status_code}: {(resp.text or '')[:200]}"
                else:
                    _read_sse(resp, out, t0)
                out.e2e = time.perf_counter() - t0
                resp.request_meta["response_time"] = out.e2e * 1e3
                resp.request_meta["response_length"] = out.output_tokens
                if out.ok:
                    resp.success()
                else:
                    resp.failure(out.error or "failed")
        except Exception as e:  # connection errors and the like
            out.e2e, out.error = time.perf_counter() - t0, f"{type(e).__name__}: {e}"
            self.environment.events.request.fire(request_type="POST", name=path, response_time=out.e2e * 1e3,
                                                 response_length=0, exception=e)
        report_metrics(self.environment, out)


def _lines(resp: Any) -> Iterator[str]:
    """The body's lines as they arrive. geventhttpclient's ``readline`` returns each SSE line at once;
    locust's ``iter_content`` would wait for full 4 KB blocks and blur the token timings."""
    raw = getattr(resp, "_response", None)
    if raw is not None and hasattr(raw, "readline"):
        while True:
            line = raw.readline(b"\n")
            if not line:
                return
            yield line.decode("utf-8", "replace")
    buf = ""
    for piece in resp.iter_content(chunk_size=4096):
        buf += piece.decode("utf-8", "replace") if isinstance(piece, bytes) else piece
        while "\n" in buf:
            line, buf = buf.split("\n", 1)
            yield line
    if buf:
        yield buf


def _read_sse(resp: Any, out: Outcome, t0: float) -> None:
    """Consumes an SSE body, filling ``out`` (first content time, usage, errors)."""
    for raw in _lines(resp):
        line = raw.strip()
        if not line.startswith("data:"):
            continue
        payload = line[5:].strip()
        if payload == "[DONE]":
            out.ok = out.error is None and out.output_tokens > 0
            if not out.ok and out.error is None:
                out.error = "stream ended without usage"
            return
        ev = json.loads(payload)
        if "error" in ev:
            out.error = f"stream error: {ev['error'].get('message', '')[:200]}"
            continue
        for ch in ev.get("choices") or ():
            text = ch.get("text") if "text" in ch else (ch.get("delta") or {}).get("content")
            if text:
                out.events += 1
                if out.ttft is None:
                    out.ttft = time.perf_counter() - t0
        usage = ev.get("usage")
        if usage:
            out.prompt_tokens = int(usage.get("prompt_tokens", 0))
            out.output_tokens = int(usage.get("completion_tokens", 0))
            out.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
    out.error = out.error or "stream closed before [DONE]"


def report_metrics(environment: Environment, out: Outcome) -> None:
    """The METRIC events and the log line (the HTTP request event itself is fired by the client)."""
    fire = environment.events.request.fire
    if out.ok:
        for name, value in ((f"time_to_first_token:{out.proto}", out.ttft),
                            (f"time_per_output_token:{out.proto}", out.tpot)):
            if value is not None:
                fire(request_type=METRIC, name=name, response_time=value * 1e3, response_length=0, exception=None)
        if out.prompt_tokens:
            fire(request_type=METRIC, name=f"cached_tokens_pct:{out.proto}",
                 response_time=100.0 * out.cached_tokens / out.prompt_tokens, response_length=0, exception=None)
    st = state_of(environment)
    if st.log is not None:
        st.log.write(json.dumps({**out.__dict__, "tpot": out.tpot}) + "\n")
        st.log.flush()


class GrpcChatUser(_TenantMixin, User):
    """gRPC user: server-streaming ``chunkserve.v1.ChunkServe/GenerateStream`` with chat messages."""

    weight = 1

    def on_start(self) -> None:
        from chunkserve.client import GrpcClient

        self._setup_tenant()
        target = self.opts.grpc_target
        if not target:
            raise ValueError("GrpcChatUser needs --grpc-target host:port")
        self.client = GrpcClient(target, api_key=self.tenant.api_key, timeout=600.0)

    def on_stop(self) -> None:
        client = getattr(self, "client", None)
        if client is not None and not len(self.inflight):
            client.close()

    @task
    def generate(self) -> None:
        self._arrive(self._one)

    def _one(self) -> None:
        o = self.opts
        out = Outcome(self.tenant.tenant_id, "grpc", time.time())
        t0 = time.perf_counter()
        try:
            for item in self.client.generate_stream(messages=self._messages(), model=o.model,
                                                    max_tokens=o.max_tokens, temperature=o.temperature,
                                                    seed=self.rng.randrange(2**31)):
                if (item.text or item.token_ids) and out.ttft is None:
                    out.ttft = time.perf_counter() - t0
                if item.text or item.token_ids:
                    out.events += 1
                if item.finish_reason:
                    out.prompt_tokens = item.usage.prompt_tokens
                    out.output_tokens = item.usage.completion_tokens
                    out.cached_tokens = item.usage.cached_tokens
                    out.ok = item.finish_reason in ("stop", "length")
                    if not out.ok:
                        out.error = f"finish_reason {item.finish_reason}"
            if not out.ok and out.error is None:
                out.error = "stream ended without a finish_reason"
        except Exception as e:
            out.error = f"{type(e).__name__}: {e}"
        out.e2e = time.perf_counter() - t0
        exc = None if out.ok else RuntimeError(out.error)
        self.environment.events.request.fire(request_type="grpc", name="GenerateStream",
                                             response_time=out.e2e * 1e3, response_length=out.output_tokens,
                                             exception=exc)
        report_metrics(self.environment, out)
