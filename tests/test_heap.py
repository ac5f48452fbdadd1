"""`chunkserve.heap`: the serving processes freeze their start-up heap out of the cyclic garbage collector."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from chunkserve.heap import freeze_startup_heap


class _Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the cyclic collector frees it


@pytest.fixture
def unfrozen() -> Iterator[None]:
    gc.unfreeze()
    yield
    gc.unfreeze()  # the test process keeps collecting everything


def test_freezing_collects_garbage_first_then_keeps_live_objects_out_of_every_generation(unfrozen: None) -> None:
    live = [[i] for i in range(10_000)]  # tracked containers alive at the end of start-up
    dead = _Node()  # made last, so no collection triggered by the allocations above frees it
    dead_ref = weakref.ref(dead)
    del dead
    frozen = freeze_startup_heap()
    assert dead_ref() is None  # collected, not frozen
    # (frozen objects can still be freed by reference counting, e.g. by another thread: the count only falls)
    assert frozen >= len(live) and len(live) <= gc.get_freeze_count() <= frozen
    ids = {id(x) for g in range(3) for x in gc.get_objects(generation=g)}
    assert id(live) not in ids and id(live[0]) not in ids  # a full collection no longer walks them


def test_garbage_made_after_the_freeze_is_still_collected(unfrozen: None) -> None:
    freeze_startup_heap()
    later = _Node()
    later_ref = weakref.ref(later)
    del later
    gc.collect()
    assert later_ref() is None
