"""Cores lent between a node's workers (`workers/node_cores.py`) and an `AsyncEngine` stepping on them."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from chunkserve.workers import async_engine
from chunkserve.workers.async_engine import AsyncEngine
from chunkserve.workers.engine import EngineConfig
from chunkserve.workers.node_cores import SLOTS, WORDS, NodeCores
from chunkserve.workers.protocol import GenerateRequest
from chunkserve.workers.sampling import SamplingParams


def test_a_busy_worker_takes_the_shares_of_idle_peers_and_gives_them_back_when_they_turn_busy(
        tmp_path: Path) -> None:
    table = str(tmp_path / "cores")
    a, b = NodeCores(1, path=table, max_threads=8), NodeCores(1, path=table, max_threads=8)
    try:
        assert a.slot != b.slot
        assert a.busy() == 2  # b idle: its core is lent to a
        assert b.busy() == 1 and a.busy() == 1  # both busy: each its own share
        b.idle()
        assert a.busy() == 2
    finally:
        a.close()
        b.close()


def test_idle_shares_are_split_among_busy_workers_in_proportion_and_capped_at_the_cores(tmp_path: Path) -> None:
    table = str(tmp_path / "cores")
    big, small, idle = (NodeCores(s, path=table, max_threads=16) for s in (4, 2, 6))
    capped = NodeCores(1, path=table, max_threads=3)
    try:  # 13 live shares
        big.busy()
        small.busy()
        assert (big.busy(), small.busy()) == (4 * 13 // 6, 2 * 13 // 6) == (8, 4)  # 6 busy shares
        small.idle()
        big.idle()
        assert capped.busy() == 3  # 13 alone, but this process may use 3 cores
        capped.idle()
        assert big.busy() == 13
    finally:
        for w in (big, small, idle, capped):
            w.close()


def test_a_busy_stamp_older_than_stale_s_counts_as_idle(tmp_path: Path) -> None:
    table = str(tmp_path / "cores")
    a, hung = NodeCores(1, path=table, max_threads=4, stale_s=1.0), NodeCores(1, path=table, max_threads=4)
    try:
        hung.busy()
        assert a.busy() == 1
        time.sleep(1.1)
        assert a.busy() == 2  # the hung worker's share is lent again
    finally:
        a.close()
        hung.close()


def test_the_slot_of_a_dead_process_is_claimed_again_and_its_share_not_counted(tmp_path: Path) -> None:
    table = str(tmp_path / "cores")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    a = NodeCores(1, path=table, max_threads=4)
    try:
        raw = np.memmap(table, dtype=np.int64, mode="r+", shape=(SLOTS, WORDS))
        raw[a.slot + 1] = (dead_pid, 3, time.monotonic_ns(), 0)  # a busy worker that died without closing
        raw.flush()
        del raw
        b = NodeCores(1, path=table, max_threads=4)
        assert b.slot == a.slot + 1  # the dead process's slot
        b.close()
        raw = np.memmap(table, dtype=np.int64, mode="r+", shape=(SLOTS, WORDS))
        raw[a.slot + 1] = (dead_pid, 3, time.monotonic_ns(), 0)
        del raw
        a._live_at = float("-inf")  # re-read the live slots now
        assert a.busy() == 1  # neither its share (3) nor its busy stamp count
    finally:
        a.close()


def test_a_share_that_is_not_a_positive_integer_is_refused(tmp_path: Path) -> None:
    for share in (0, -1, 1.5):
        with pytest.raises(ValueError, match="share"):
            NodeCores(share, path=str(tmp_path / "cores"))  # type: ignore[arg-type]


def _generate(eng: AsyncEngine, rid: str) -> int:
    async def main() -> int:
        req = GenerateRequest(request_id=rid, prompt_token_ids=(1, 2, 3, 4, 5),
                              sampling=SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        return sum([len(d.token_ids) async for d in eng.generate(req)])

    return asyncio.run(main())


def test_an_engine_steps_on_lent_threads_while_its_peer_idles_and_on_its_share_once_the_peer_is_busy(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    table = str(tmp_path / "cores")
    before = torch.get_num_threads()
    peer = NodeCores(1, path=table, max_threads=2)
    eng = AsyncEngine(EngineConfig(model="random:tiny", chunk_size=16, num_kv_chunks=8, num_threads=1),
                      cores=NodeCores(1, path=table, max_threads=2))
    slot = eng._cores.slot if eng._cores is not None else -1
    try:
        assert _generate(eng, "alone") == 4 and eng.step_threads == 2
        peer.busy()
        assert _generate(eng, "shared") == 4 and eng.step_threads == 1
        peer.idle()
        assert _generate(eng, "alone-again") == 4 and eng.step_threads == 2
        monkeypatch.setattr(async_engine, "LEND_MAX_STEP_S", 0.0)  # every step counts as long (a prefill)
        assert _generate(eng, "long-steps") == 4 and eng.step_threads == 1
        eng.shutdown()
        again = NodeCores(1, path=table, max_threads=2)
        assert again.slot == slot  # the engine freed its slot when it stopped
        again.close()
    finally:
        eng.shutdown()
        peer.close()
        torch.set_num_threads(before)
