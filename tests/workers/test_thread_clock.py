"""The engine thread's clock: its CPU time and (Linux) run-queue wait inside steps."""

from __future__ import annotations

import sys
import threading
import time

import pytest

from chunkserve.workers.thread_clock import ThreadClock


def _spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_a_busy_step_counts_its_cpu_and_a_sleeping_one_only_its_wall_time() -> None:
    clock = ThreadClock()
    try:
        clock.begin()
        _spin(0.05)
        clock.end()
        t = clock.times
        assert 0.045 <= t.cpu_s <= t.busy_s + 0.005 and t.runqueue_s >= 0
        cpu = t.cpu_s
        clock.begin()
        time.sleep(0.05)
        assert clock.end() >= 0.05
        assert t.busy_s >= cpu + 0.05 and t.cpu_s - cpu < 0.02  # asleep: wall time, almost no CPU
        assert set(t.as_stats()) == {"step_busy_s", "step_cpu_s", "step_runqueue_s"}
    finally:
        clock.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="run-queue wait is read from Linux's schedstat")
def test_a_step_that_shares_its_core_with_a_busy_process_counts_run_queue_wait() -> None:
    import os
    import subprocess

    probe = ThreadClock()
    readable = probe.reads_runqueue
    probe.close()
    if not readable:
        pytest.skip("this kernel has no /proc/thread-self/schedstat")
    cpu = sorted(os.sched_getaffinity(0))[0]
    rival = subprocess.Popen([sys.executable, "-c", "while True: pass"])  # another process: no GIL shared
    waits: list[float] = []

    def step() -> None:
        os.sched_setaffinity(0, {cpu})  # 0: this thread
        clock = ThreadClock()
        try:
            clock.begin()
            _spin(0.1)
            clock.end()
            waits.append(clock.times.runqueue_s)
        finally:
            clock.close()

    try:
        os.sched_setaffinity(rival.pid, {cpu})
        time.sleep(0.05)
        st = threading.Thread(target=step)
        st.start()
        st.join(timeout=30)
    finally:
        rival.kill()
        rival.wait(timeout=10)
    # two runnable threads at the same nice level on one core: the step's 0.1 s of CPU takes about 0.2 s,
    # about half of it waiting in the run queue
    assert waits and waits[0] >= 0.04, waits
