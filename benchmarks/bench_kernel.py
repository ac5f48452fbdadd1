"""Kernel microbenchmark (the paper's table): ``python benchmarks/bench_kernel.py [--quick] ...``.

Same as ``chunkserve bench kernel``; see ``chunkserve.tools.bench_kernel``.
"""

from __future__ import annotations

import sys

from chunkserve.tools.bench_kernel import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
