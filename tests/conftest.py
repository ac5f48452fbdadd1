"""Root test configuration: loaded before any test module of any folder.

Without a GPU the Triton kernels must run in the interpreter, and ``TRITON_INTERPRET`` is read when
a ``@triton.jit`` function is defined, so it is set here, before anything imports ``chunkserve.kernels``
(tests/cluster and tests/router import the engine, which imports the kernels, before tests/kernels runs).
"""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _unfreeze_heap() -> Iterator[None]:
    """A test that builds a serving replica in-process (`ServeIngress`) freezes the heap (`chunkserve.heap`); the
    test process keeps collecting everything afterwards."""
    yield
    if gc.get_freeze_count():
        gc.unfreeze()
