"""Root test configuration: loaded before any test module of any folder.

Without a GPU the Triton kernels must run in the interpreter, and ``TRITON_INTERPRET`` is read when
a ``@triton.jit`` function is defined, so it is set here, before anything imports ``chunkserve.kernels``
(tests/cluster and tests/router import the engine, which imports the kernels, before tests/kernels runs).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
