"""Where the engine thread's step time goes: its own CPU, and on Linux the time it was ready to run while
other processes held the cores (the kernel's run-queue wait, ``/proc/thread-self/schedstat``). A step's wall
time less both is time the thread was blocked (the GIL, a lock). Torch-free.

On a node shared with the ingress, the proxies and Ray's own processes, the run-queue wait is what the engine
loses to them: a served decode step costs the same CPU as an offline one, and the difference in wall time is
this wait (docs/benchmarks.md, "Where the served step's extra time goes").
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import time


@dataclasses.dataclass
class StepTimes:
    """Cumulative seconds over the engine's steps (the worker exports them as counters)."""

    busy_s: float = 0.0  # wall time inside steps
    cpu_s: float = 0.0  # the engine thread's CPU time inside steps
    runqueue_s: float = 0.0  # ready to run, waiting for a core (Linux; 0 elsewhere)

    def as_stats(self) -> dict[str, float]:
        return {"step_busy_s": round(self.busy_s, 6), "step_cpu_s": round(self.cpu_s, 6),
                "step_runqueue_s": round(self.runqueue_s, 6)}


class ThreadClock:
    """Reads the CPU time and run-queue wait of the thread that created it; create it on that thread."""

    def __init__(self) -> None:
        self._fd: int | None = None
        if sys.platform.startswith("linux"):
            with contextlib.suppress(OSError):  # a kernel without schedstat: CPU time only
                self._fd = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
        self.times = StepTimes()
        self._start: tuple[float, float, float] | None = None

    @property
    def reads_runqueue(self) -> bool:
        """Whether the run-queue wait is read (Linux with schedstat); else it stays 0."""
        return self._fd is not None

    def _runqueue_s(self) -> float:
        if self._fd is None:
            return 0.0
        try:  # "<ns on cpu> <ns waiting on a run queue> <time slices>"
            return int(os.pread(self._fd, 128, 0).split()[1]) / 1e9
        except (OSError, ValueError, IndexError):
            return 0.0

    def now(self) -> tuple[float, float, float]:
        """(wall, thread CPU, run-queue wait) in seconds, for this clock's thread."""
        return time.monotonic(), time.thread_time(), self._runqueue_s()

    def begin(self) -> None:
        self._start = self.now()

    def end(self) -> float:
        """Close the step opened by `begin` and add it to ``times``. -> the step's wall seconds."""
        if self._start is None:
            return 0.0
        wall, cpu, runq = self.now()
        w0, c0, r0 = self._start
        self._start = None
        t = self.times
        t.busy_s += wall - w0
        t.cpu_s += max(0.0, cpu - c0)
        t.runqueue_s += max(0.0, runq - r0)
        return wall - w0

    def close(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None


__all__ = ["StepTimes", "ThreadClock"]
