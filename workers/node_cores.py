"""Cores lent between the workers of one node: an idle worker's engine threads go to the busy ones.

The thread rule (`cpu_budget.engine_threads`) gives each worker a fixed share of its node's cores, sized for
when all of them are busy. When only some are, the idle ones' cores sit unused: on a 2-core node with two
workers of one thread each, a lone stream decodes on one core while the other idles. `NodeCores` is a small
table in shared memory (``/dev/shm``, one per user) where each worker of the node keeps one slot: its pid, its
own share, and whether it is busy now (the monotonic time of its last busy step, 0 when idle). Before each
step a busy worker takes

    threads = own share * (shares of the live workers) // (shares of the busy ones, its own included)

at most the cores this process may use: the idle workers' shares are split among the busy ones in
proportion to theirs, so the node's engine threads never sum to more than the shares do. A worker that turns
busy lowers the others at their next step (one step of overlap at most). A slot whose process is gone is
free again; a busy stamp older than ``stale_s`` (a worker that hangs) counts as idle. Torch-free; the
caller applies the count (`AsyncEngine`).
"""

from __future__ import annotations

import fcntl
import mmap
import os
import tempfile
import time

import numpy as np

SLOTS = 64
WORDS = 4  # per slot: pid, share, busy stamp (monotonic ns, 0 = idle), spare
LIVE_CHECK_S = 1.0  # how often the set of live slots is re-read (a pid check each)


def default_path() -> str:
    """One table per user and node: ``/dev/shm`` where it exists (memory), else the temp directory."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return os.path.join(base, f"chunkserve-node-cores-{os.getuid()}")


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


class NodeCores:
    """This worker's slot in its node's table; see the module docstring."""

    def __init__(self, share: int, path: str | None = None, max_threads: int | None = None,
                 stale_s: float = 30.0) -> None:
        if not isinstance(share, int) or share < 1:
            raise ValueError(f"share must be a positive integer, got {share!r}")
        self.share = share
        self.max_threads = max_threads or len(os.sched_getaffinity(0))
        self.path = path or default_path()
        self._stale_ns = int(stale_s * 1e9)
        size = SLOTS * WORDS * 8
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # claim a slot: one process at a time
            if os.fstat(fd).st_size < size:
                os.ftruncate(fd, size)
            self._mm = mmap.mmap(fd, size)
            self._table = np.frombuffer(self._mm, dtype=np.int64).reshape(SLOTS, WORDS)
            free = [i for i in range(SLOTS) if not _alive(int(self._table[i, 0]))]
            if not free:
                raise RuntimeError(f"{self.path}: all {SLOTS} slots are held by live processes")
            self.slot = free[0]
            self._table[self.slot] = (os.getpid(), share, 0, 0)
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
        self._live: np.ndarray = np.zeros(0, dtype=np.int64)
        self._live_at = float("-inf")

    def _live_slots(self) -> np.ndarray:
        now = time.monotonic()
        if now - self._live_at > LIVE_CHECK_S:
            pids = self._table[:, 0]
            self._live = np.array([i for i in range(SLOTS) if i == self.slot or _alive(int(pids[i]))],
                                  dtype=np.int64)
            self._live_at = now
        return self._live

    def busy(self) -> int:
        """Marks this worker busy and returns the engine threads it may use for its next step."""
        now = time.monotonic_ns()
        t = self._table
        t[self.slot, 2] = now
        live = t[self._live_slots()]
        shares = live[:, 1]
        busy = (live[:, 2] > 0) & (now - live[:, 2] < self._stale_ns)
        busy_shares = int(shares[busy].sum()) or self.share
        return max(self.share, min(self.max_threads, self.share * int(shares.sum()) // busy_shares))

    def idle(self) -> None:
        """Marks this worker idle: its share is lent to the busy ones from their next step."""
        self._table[self.slot, 2] = 0

    def close(self) -> None:
        """Frees the slot."""
        if self._mm.closed:
            return
        self._table[self.slot] = 0
        del self._table
        self._live = np.zeros(0, dtype=np.int64)
        self._mm.close()
