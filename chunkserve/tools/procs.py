"""Servers the benchmark starts and stops itself (``--launch NAME=CMD``), one at a time, and the CPU seconds
their process trees spend. psutil only; torch-free."""

from __future__ import annotations

import contextlib
import http.client
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections import defaultdict
from pathlib import Path
from typing import IO


class LaunchedServer:
    """A server command run in a session of its own, its output in ``log_path``; ready once
    ``GET {url}/ready`` (or, without that route, ``GET {url}/v1/models``) answers 200. Stopped by SIGTERM to the command, then SIGKILL to its group."""

    def __init__(self, name: str, command: str, url: str, log_path: Path) -> None:
        self.name, self.command, self.url, self.log_path = name, command, url.rstrip("/"), log_path
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    def start(self, timeout_s: float = 600.0) -> float:
        """Starts the command and waits until it serves; returns the seconds that took."""
        t0 = time.monotonic()
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(["bash", "-c", "exec " + self.command], stdin=subprocess.DEVNULL,
                                     stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        while time.monotonic() - t0 < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name}: `{self.command}` exited with {self.proc.returncode} before "
                                   f"serving; last output:\n{self.tail()}")
            if self.ready():
                return time.monotonic() - t0
            time.sleep(1.0)
        self.stop()
        raise TimeoutError(f"{self.name}: not serving {self.url}/ready or /v1/models after {timeout_s:.0f} s; last "
                           f"output:\n{self.tail()}")

    def ready(self) -> bool:
        """``GET /ready`` answers 200 (chunkserve: every initial worker is up), or, from a server without
        that route (404), ``GET /v1/models`` does."""
        for path in ("/ready", "/v1/models"):
            try:
                with urllib.request.urlopen(self.url + path, timeout=5) as resp:
                    return resp.status == 200
            except urllib.error.HTTPError as e:
                if e.code != 404:
                    return False  # 503: still starting
            except (OSError, urllib.error.URLError, http.client.HTTPException):  # not (yet) speaking HTTP
                return False
        return False

    def tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self, grace_s: float = 120.0) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(grace_s)
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):  # what the command left in its session
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> LaunchedServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


ROLES = (("Worker", "worker"), ("Ingress", "ingress"), ("HAProxyManager", "haproxy"), ("haproxy", "haproxy"),
         ("ProxyActor", "proxy"), ("ServeController", "serve_controller"),
         ("raylet", "raylet"), ("gcs_server", "gcs"), ("redis-server", "redis"), ("llama-server", "llama-server"),
         ("bench_served", "local_server"), ("chunkserve", "launcher"))


def _role(cmd: list[str], name: str) -> str:
    first = cmd[0] if cmd else name
    for key, label in ROLES:
        if key in first or key in " ".join(cmd[:3]):
            return label
    return "other"


def cpu_by_process(root_pid: int) -> dict[str, float]:
    """CPU seconds (user + system) of a process tree, summed by role (Ray Serve's actors by their class)."""
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
            out[_role(p.cmdline(), p.name())] += t.user + t.system
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return dict(out)


def cpu_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Per-role CPU seconds spent between two `cpu_by_process` readings (roles under 0.05 s left out)."""
    d = {k: round(after.get(k, 0.0) - before.get(k, 0.0), 2) for k in after}
    return {k: v for k, v in sorted(d.items()) if v > 0.05}


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (empty where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""
