"""Chaos harness: steady streaming load against a served app, and the processes to kill.

``StreamLoad`` runs ``clients`` threads that each send streaming completions back to back and record every
request's outcome (status, whether the SSE stream ended with [DONE], error events, the text, timings), so a
test can assert zero failures and zero hangs over a fault, and compare greedy outputs with an undisturbed
run. ``replica_pids`` finds the processes of a Serve deployment's replicas (by Ray's process title
``ray::ServeReplica:<app>:<deployment>``), for SIGKILL. Reusable by other fault tests (e.g. KV pressure).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx2
import psutil


@dataclass
class Outcome:
    """One request as the client saw it."""

    prompt: int  # index into the load's prompts
    t_start: float
    t_end: float = 0.0
    status: int = 0
    done: bool = False  # the SSE stream ended with [DONE]
    finish_reason: str | None = None
    error: Any = None  # an error event, a non-200 body, or the client-side exception
    text: str = ""
    first_token_s: float | None = None
    retry_after: str | None = None  # the Retry-After header of a non-200 answer

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.done and self.error is None and self.finish_reason in ("stop", "length")

    @property
    def clean_error(self) -> bool:
        """Failed in a way a client can act on: a 503 with an OpenAI error JSON and Retry-After, or a stream
        that carries an error event and still ends with [DONE] (not a bare 500, a cut stream or a hang)."""
        if self.status == 503:
            return isinstance(self.error, dict) and "message" in self.error and self.retry_after is not None
        return self.status == 200 and self.done and isinstance(self.error, dict) and "message" in self.error


def stream_completion(base_url: str, body: dict[str, Any], prompt: int, timeout_s: float) -> Outcome:
    """One streaming completion; every failure mode is recorded, never raised."""
    out = Outcome(prompt=prompt, t_start=time.monotonic())
    texts: list[str] = []
    try:
        with httpx2.stream("POST", base_url + "/v1/completions", json={**body, "stream": True},
                           timeout=timeout_s) as r:
            out.status = r.status_code
            if r.status_code != 200:
                out.retry_after = r.headers.get("retry-after")
                text = r.read().decode("utf-8", "replace")
                try:
                    out.error = json.loads(text)["error"]
                except (ValueError, KeyError, TypeError):
                    out.error = text[:500]
                return out
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    out.done = True
                    break
                ev = json.loads(data)
                if "error" in ev:
                    out.error = ev["error"]
                    continue
                choice = ev["choices"][0]
                if choice.get("text"):
                    if out.first_token_s is None:
                        out.first_token_s = time.monotonic() - out.t_start
                    texts.append(choice["text"])
                if choice.get("finish_reason"):
                    out.finish_reason = choice["finish_reason"]
    except Exception as e:  # a cut connection, a timeout (a hang), a malformed event
        out.error = f"{type(e).__name__}: {e}"
    finally:
        out.t_end = time.monotonic()
        out.text = "".join(texts)
    return out


@dataclass
class StreamLoad:
    """``clients`` threads sending streaming completions of ``prompts`` (token-id lists) back to back."""

    base_url: str
    model: str
    prompts: Sequence[Sequence[int]]
    clients: int = 4
    max_tokens: int = 16
    timeout_s: float = 90.0  # a request longer than this counts as a hang
    outcomes: list[Outcome] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _open: dict[int, float] = field(default_factory=dict)  # client -> monotonic start of its unfinished request

    def body(self, i: int) -> dict[str, Any]:
        return {"model": self.model, "prompt": list(self.prompts[i]), "max_tokens": self.max_tokens,
                "temperature": 0.0}

    def _client(self, k: int) -> None:
        i = k
        while not self._stop.is_set():
            p = i % len(self.prompts)
            with self._lock:
                self._open[k] = time.monotonic()
            o = stream_completion(self.base_url, self.body(p), p, self.timeout_s)
            with self._lock:
                self.outcomes.append(o)
                del self._open[k]
            i += 1

    def start(self) -> StreamLoad:
        self._stop.clear()
        self._threads = [threading.Thread(target=self._client, args=(k,), daemon=True) for k in range(self.clients)]
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> list[Outcome]:
        self._stop.set()
        for t in self._threads:
            t.join(self.timeout_s + 10)
        with self._lock:
            return list(self.outcomes)

    def wait_in_flight(self, min_age_s: float, max_age_s: float, timeout_s: float = 60.0) -> None:
        """Block until some unfinished request started between ``min_age_s`` and ``max_age_s`` ago, so that a
        disturbance applied next finds work mid-stream however the clients' rounds line up."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            now = time.monotonic()
            with self._lock:
                if any(min_age_s <= now - t0 <= max_age_s for t0 in self._open.values()):
                    return
            time.sleep(0.02)
        raise TimeoutError(f"no request {min_age_s}-{max_age_s} s into its stream within {timeout_s} s")

    def in_flight_at(self, t: float) -> int:
        """Requests that had started and not ended at monotonic time ``t`` (among those finished now)."""
        with self._lock:
            return sum(1 for o in self.outcomes if o.t_start <= t <= o.t_end)


def failures(outcomes: Sequence[Outcome], reference: dict[int, str] | None = None) -> list[Outcome]:
    """Requests that failed, hung, or (with ``reference``) whose greedy text differs from the undisturbed one."""
    bad = [o for o in outcomes if not o.ok]
    if reference:
        bad += [o for o in outcomes if o.ok and o.prompt in reference and o.text != reference[o.prompt]]
    return bad


def replica_pids(app: str, deployment: str) -> list[int]:
    """PIDs of the live replica processes of ``app``'s ``deployment`` on this machine."""
    title = f"ServeReplica:{app}:{deployment}"
    pids = []
    for p in psutil.process_iter(["pid", "cmdline", "status"]):
        try:
            cmd = " ".join(p.info["cmdline"] or [])
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if title in cmd and p.info["status"] != psutil.STATUS_ZOMBIE:
            pids.append(p.info["pid"])
    return sorted(pids)


def wait_for(cond: Callable[[], bool], timeout_s: float, what: str, poll_s: float = 0.5) -> float:
    """Waits until ``cond()``; -> seconds waited. Raises TimeoutError naming ``what``."""
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout_s:
            raise TimeoutError(f"{what} not reached within {timeout_s} s")
        time.sleep(poll_s)
    return time.monotonic() - t0
