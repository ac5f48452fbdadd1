"""The `chunkserve` command line: demo, up, bench, tenants, loadtest."""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> (module, help); each module has `main(argv: list[str]) -> int`
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("chunkserve.tools.demo", "offline multi-tenant demo on the embedded model (no Ray, no Redis)"),
    "up": ("chunkserve.tools.launcher", "start a local cluster: Ray, Redis, the Serve app, HTTP and gRPC"),
    "tenants": ("chunkserve.router.tenants", "tenant config helpers (hash an API key)"),
    "loadtest": ("chunkserve.tools.loadtest", "run the locust multi-tenant load test against a cluster"),
}
BENCHES: dict[str, tuple[str, str]] = {
    "kernel": ("chunkserve.tools.bench_kernel", "the paper's microkernel table: naive, SDPA, paged, TPP"),
    "e2e": ("chunkserve.tools.bench_e2e", "the paper's end-to-end table on this machine"),
    "prefill": ("chunkserve.tools.bench_prefill", "prefill over a cached prefix vs dense SDPA"),
    "serve": ("chunkserve.tools.bench_serve", "serving benchmark: OpenAI-compatible endpoints side by side"),
    "cluster": ("chunkserve.tools.bench_cluster", "the paper's end-to-end experiment on a local cluster (rate ladder)"),
}


def _run(module: str, argv: list[str]) -> int:
    mod = importlib.import_module(module)
    return int(mod.main(argv) or 0)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="chunkserve", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("version", help="print the version")
    for name, (_, help_) in COMMANDS.items():
        sub.add_parser(name, help=help_, add_help=False)
    bench = sub.add_parser("bench", help="benchmarks: " + ", ".join(BENCHES))
    bench.add_argument("which", choices=sorted(BENCHES))
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "version":
        from chunkserve import __version__

        print(__version__)
        return 0
    if cmd in COMMANDS:
        return _run(COMMANDS[cmd][0], rest)
    if cmd == "bench":
        if not rest or rest[0] not in BENCHES:
            bench.print_help()
            return 2
        return _run(BENCHES[rest[0]][0], rest[1:])
    parser.parse_args(argv)  # prints the usage error
    return 2


if __name__ == "__main__":
    sys.exit(main())
