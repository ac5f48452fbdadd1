"""Commands that drive the system from outside (`chunkserve up`, the benchmarks, the load test, the demo).
The serving benchmark, `chunkserve bench serve` (`bench_serve` with `workload`, `client`, `procs` and
`report`), is torch-free: it never imports torch or the model, so it can run beside any server."""
