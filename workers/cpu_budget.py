"""How many engine threads a worker gets on a small machine, and their priority (torch-free, shared by workers and
the launcher).

Rule: the engine (torch intra-op) threads of all workers on a node sum to at most the node's cores minus
``reserved_cpus`` (the ingress, the HTTP/gRPC proxies and Ray's own processes), shared evenly, and every
worker gets at least one thread. Oversubscribing cores is what hurts most: an OpenMP step waits for its
slowest thread, so one thread preempted by the ingress stalls the whole step.

Priority: a served engine thread runs ``EngineConfig.thread_nice`` (default 4) nice levels below its process
(`lower_thread_priority`; Ray already runs its workers at nice 15): when the ingress, a proxy or the worker's
event loop wakes for a request or a stream item, it gets a core at once instead of waiting out the engine's
time slice. The engine loses only the CPU those threads use.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Mapping


def available_cpus() -> int:
    """Cores this process may run on (its affinity mask, else the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def engine_threads(node_cpus: int, workers_per_node: int = 1, reserved_cpus: int = 1) -> int:
    """``max(1, (node_cpus - reserved_cpus) // workers_per_node)``: 1 on a 2-core node with one worker,
    7 each for 2 workers on 16 cores."""
    return max(1, (int(node_cpus) - max(0, int(reserved_cpus))) // max(1, int(workers_per_node)))


def rule_threads(rule: Mapping[str, int]) -> int:
    """`engine_threads` for a thread rule (``{"workers_per_node", "reserved_cpus"}``, optionally
    ``"node_cpus"``: the cores to count instead of this process's)."""
    return engine_threads(_rule_cpus(rule), rule["workers_per_node"], rule["reserved_cpus"])


def rule_lend_cap(rule: Mapping[str, int]) -> int:
    """The most engine threads one worker may run with its idle neighbours' shares lent (`workers/node_cores.py`):
    the node's cores less the reserved ones, so lent threads never take the serving path's cores (on a 2-core
    node with one reserved, nothing above a worker's own share)."""
    return _rule_cpus(rule) - max(0, int(rule["reserved_cpus"]))


def _rule_cpus(rule: Mapping[str, int]) -> int:
    return int(rule.get("node_cpus") or available_cpus())


def lower_thread_priority(delta: int) -> int | None:
    """Add ``delta`` to the calling thread's nice value (at most 19): the thread then yields its core at once to
    the latency-bound threads that wake on the node (Linux, where the nice value is per thread). Returns the new
    value, or None when nothing changed (``delta`` <= 0, another OS, or the OS refused)."""
    if delta <= 0 or not sys.platform.startswith("linux"):
        return None
    tid = threading.get_native_id()
    try:
        nice = min(19, os.getpriority(os.PRIO_PROCESS, tid) + int(delta))
        os.setpriority(os.PRIO_PROCESS, tid, nice)
    except OSError:
        return None
    return nice
