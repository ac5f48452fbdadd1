"""`chunkserve up`: a local cluster in one command.

Starts (or joins, with ``--address``) Ray, starts a real Redis server on a free port unless
``--redis-url`` is given, deploys the Serve app (ingress + prefix-routed workers) with HTTP and
gRPC proxies, prints the endpoints, and shuts everything down cleanly on Ctrl-C or SIGTERM: first a
drain (a flag in Redis makes every ingress answer new requests 503 + Retry-After; then the app is
deleted while the proxies stay up, and the running requests finish within ``--drain-grace`` seconds,
default 30), then Serve and Ray stop. A second
Ctrl-C stops at once.
Engine threads follow `workers.cpu_budget.engine_threads` (a local Ray started with ``--num-cpus N``
budgets N cores per node); ``--engine '{"num_threads": K}'`` fixes them.
The launcher is the one place that ties router/, workers/ and cluster/ together, so it imports
the application lazily. Programmatic use: ``launch(AppConfig(...), LaunchOptions(...))`` (or `start` /
`shutdown` around your own code); ``main(argv)`` only turns the flags into those two objects.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import yaml

from chunkserve.cluster.index import DEFAULT_NAMESPACE
from chunkserve.tools.device_flag import add_device_arg, apply_device

if TYPE_CHECKING:
    from chunkserve.router.app import AppConfig

logger = logging.getLogger("chunkserve.up")

Front = Literal["ray", "haproxy"]  # what takes client connections: Ray Serve's proxy, or HAProxy (`haproxy_env`)
FRONTS: tuple[Front, ...] = ("ray", "haproxy")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="chunkserve up", description=__doc__)
    ap.add_argument("--workers", type=int, default=None, help="worker replicas (default 2)")
    ap.add_argument("--http-port", type=int, default=None, help="default: the --config file's, else 8000")
    ap.add_argument("--grpc-port", type=int, default=None, help="default: the --config file's, else 9000")
    ap.add_argument("--host", default=None, help="bind address of the proxies (default: the file's, else 127.0.0.1)")
    ap.add_argument("--redis-url", default=None, help="use this Redis instead of starting one")
    ap.add_argument("--address", default=None, help="join an existing Ray cluster (e.g. auto)")
    ap.add_argument("--proxy-location", choices=["EveryNode", "HeadOnly"], default=None,
                    help="HTTP/gRPC proxies on every node with a replica (the default, Serve's) or on the head only "
                    "(default: the --config file's)")
    ap.add_argument("--front", choices=FRONTS, default="ray",
                    help="what takes client connections: Ray Serve's proxy (default; clean JSON errors when an "
                    "ingress replica dies or while the app drains) or HAProxy in front of ingress replicas that "
                    "serve HTTP and gRPC themselves (Ray's direct ingress: less CPU per request; see README)")
    ap.add_argument("--model", default=None, help="local HF dir or random:<preset>; default: embedded SmolLM2")
    ap.add_argument("--tenants", default=None, help="tenants YAML (default: open mode, tenant 'public')")
    ap.add_argument("--config", default=None, help="YAML of AppConfig fields (CLI flags win)")
    ap.add_argument("--num-cpus", type=int, default=None, help="CPUs for a local Ray (default: all)")
    ap.add_argument("--engine", default=None, help="JSON of EngineConfig fields, e.g. '{\"chunk_size\": 32}'")
    ap.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: bf16 on CUDA and on CPUs "
                    "with native bf16, else fp32)")
    add_device_arg(ap)
    ap.add_argument("--quantization", default=None, choices=["int8", "int4"],
                    help="int8: Q8_0 linears; int4: Q4_1 layers + Q8_0 lm_head (llama.cpp's block formats, CPU kernel)")
    ap.add_argument("--drain-grace", type=float, default=None,
                    help="seconds in-flight requests may take to finish on Ctrl-C/SIGTERM (default 30)")
    ap.add_argument("--exit-after", type=float, default=None, help=argparse.SUPPRESS)  # tests
    return ap.parse_args(argv)


@dataclass(frozen=True)
class LaunchOptions:
    """Where and how the cluster runs (what is not the application's `AppConfig`)."""

    http_port: int = 8000
    grpc_port: int = 9000
    host: str = "127.0.0.1"  # bind address of the proxies
    address: str | None = None  # join this Ray cluster instead of starting a local one
    proxy_location: Literal["EveryNode", "HeadOnly"] = "EveryNode"
    num_cpus: int | None = None  # CPUs of a local Ray (None: all)
    front: Front = "ray"  # Ray Serve's proxy, or HAProxy before direct-ingress replicas
    exit_after: float | None = None  # tests: stop by itself after this many seconds
    env_vars: dict[str, str] = field(default_factory=dict)  # a Serve config file's app runtime_env env_vars


def launch_options(args: argparse.Namespace) -> LaunchOptions:
    """The flags, else a Serve config file's own settings (``proxy_location``, ``http_options``,
    ``grpc_options``), else the defaults."""
    serve_cfg = _read_config(args.config)[1] if args.config else {}
    http = serve_cfg.get("http_options") or {}
    grpc = serve_cfg.get("grpc_options") or {}
    d = LaunchOptions()

    def pick(flag: Any, from_file: Any, default: Any) -> Any:
        return flag if flag is not None else (from_file if from_file is not None else default)

    return LaunchOptions(http_port=int(pick(args.http_port, http.get("port"), d.http_port)),
                         grpc_port=int(pick(args.grpc_port, grpc.get("port"), d.grpc_port)),
                         host=str(pick(args.host, http.get("host"), d.host)), address=args.address,
                         proxy_location=pick(args.proxy_location, serve_cfg.get("proxy_location"), d.proxy_location),
                         num_cpus=args.num_cpus, exit_after=args.exit_after, front=args.front,
                         env_vars=_app_env_vars(serve_cfg))


def _app_env_vars(serve_cfg: dict[str, Any]) -> dict[str, str]:
    apps = serve_cfg.get("applications") or [{}]
    env = ((apps[0] if isinstance(apps[0], dict) else {}).get("runtime_env") or {}).get("env_vars") or {}
    return {str(k): str(v) for k, v in env.items()} if isinstance(env, dict) else {}


def _read_config(path: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """``--config``: (AppConfig fields, the Serve-level settings of a Serve config file, else {})."""
    try:
        loaded = yaml.safe_load(Path(path).read_text()) or {}
    except yaml.YAMLError as e:
        raise ValueError(f"{path} is not valid YAML: {e}") from None
    serve_cfg: dict[str, Any] = {}
    if isinstance(loaded, dict) and loaded.get("applications"):  # a Serve config file
        serve_cfg = loaded
        apps = loaded["applications"]
        loaded = apps[0] if isinstance(apps, list) and apps else None
    loaded = loaded.get("args", loaded) if isinstance(loaded, dict) else loaded
    if not isinstance(loaded, dict):
        raise ValueError(f"{path}: expected a mapping of AppConfig fields (or a Serve config file)")
    if serve_cfg.get("proxy_location") not in (None, "EveryNode", "HeadOnly"):
        raise ValueError(f"{path}: proxy_location must be EveryNode or HeadOnly, got {serve_cfg['proxy_location']!r}")
    return dict(loaded), serve_cfg


def engine_json(text: str | None, flag: str = "--engine") -> dict[str, Any]:
    """An ``--engine`` flag's JSON object of EngineConfig fields ({} when not given); ValueError otherwise."""
    if not text:
        return {}
    engine = json.loads(text)  # a JSONDecodeError is a ValueError
    if not isinstance(engine, dict):
        raise ValueError(f"{flag}: expected a JSON object of EngineConfig fields, got {text!r}")
    return engine


def app_config(args: argparse.Namespace) -> AppConfig:
    """The `AppConfig` the flags describe: ``--config`` (AppConfig fields, or a Serve config file whose first
    application's args are used), then the flags on top. ``redis_url``: ``--redis-url``, else the file's, else
    None (start one)."""
    from chunkserve.router.app import AppConfig

    base: dict[str, Any] = _read_config(args.config)[0] if args.config else {}
    if not isinstance(base.get("engine", {}), dict):
        raise ValueError("engine: expected a mapping of EngineConfig fields")
    if args.workers is not None:  # the flag wins over the file's workers and autoscaling alike
        base["workers"] = args.workers
        base.pop("autoscaling", None)
    if args.model is not None:
        base["model"] = args.model
    if args.tenants is not None:
        base["tenants"] = args.tenants
    if args.engine:
        base["engine"] = {**base.get("engine", {}), **engine_json(args.engine)}
    for key in ("dtype", "quantization"):
        if getattr(args, key) is not None:
            base["engine"] = {**base.get("engine", {}), key: getattr(args, key)}
    apply_device(getattr(args, "device", None), base)
    if args.drain_grace is not None:
        base["drain_grace_s"] = args.drain_grace
    if args.num_cpus and not args.address:
        base.setdefault("node_cpus", args.num_cpus)  # the local Ray node has that many CPUs: budget those
    if args.redis_url is not None:
        base["redis_url"] = args.redis_url
    cfg = AppConfig(**base)
    cfg.check_tenants_file()
    return cfg


def describe_threads(cfg: AppConfig) -> str:
    """What each worker's engine threads will be on this machine, for the start-up message."""
    from chunkserve.workers.cpu_budget import available_cpus, rule_threads

    rule = cfg.thread_rule()
    if rule is None:
        fixed = cfg.engine.num_threads
        return f"engine threads per worker: {fixed}" if fixed else "engine threads: the device's default"
    cpus = rule.get("node_cpus") or available_cpus()
    n = rule_threads(rule)
    return (f"engine threads per worker: {n} ({cpus} cores - {rule['reserved_cpus']} reserved, "
            f"{rule['workers_per_node']} workers per node)")


@contextmanager
def redis_for(url: str | None) -> Iterator[str]:
    if url:
        yield url
        return
    from chunkserve.cluster.redis_server import RedisServer

    with RedisServer() as server:
        yield server.url


# Ray Serve runs replica code and handle routing on event loops of their own threads by default; every stream
# item then crosses threads twice in a worker and again in the ingress. Our replicas never block their loop (the
# engine has its own thread), so they run on the replica's main loop: a lone int4 stream on 2 cores +7-10 %
# completion tok/s (docs/benchmarks.md, 2026-12-04). A value already in the environment wins.
DRAIN_ANNOUNCE_S = 0.5  # from the drain flag to deleting the app: > the ingress's flag read interval (0.1 s)

SERVE_LOOP_ENV = {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0", "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0"}
# Serve's controller reconciles every 0.1 s by default: 2.6 % of a core on an idle 2-core node (measured), taken
# from the engines under load. Every 0.5 s it takes 1.0 %; replica starts and deaths are seen up to 0.4 s later.
CONTROLLER_ENV = {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5"}


def haproxy_env() -> dict[str, str]:
    """`--front haproxy`: Ray's HAProxy mode (its bundled binary, from ``ray[serve]``) takes the HTTP and gRPC
    ports, and each ingress replica serves its own port behind it (direct ingress): no Python proxy and no
    body fetch from it on a request's path. An ingress replica told to stop stays reachable for 1 s (Ray's
    default: 30 s, for external load balancers), long enough for HAProxy to drop it from its list while the
    replica answers new requests 503 JSON (the drain flag), then closes its listener: HAProxy retries a
    refused connection on another replica, or on Ray's head proxy, kept as HAProxy's fallback, whose guard
    answers 503 JSON while no app is deployed. So the drain takes as long as the running requests (1 s at
    least), and no request meets HAProxy's own plain-text 500 in between; and HAProxy's metrics and stats
    listeners (Ray's fixed 9101 and 8404, on all interfaces) get free ports, so that two clusters can share a
    machine. Defaults: `ray_env_vars` lets a value already in the environment win."""
    from chunkserve.cluster.redis_server import find_free_port

    return {"RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "1",
            "RAY_SERVE_HAPROXY_METRICS_PORT": str(find_free_port()),
            "RAY_SERVE_HAPROXY_STATS_PORT": str(find_free_port())}


def ray_env_vars(redis_url: str, front: Front = "ray") -> dict[str, str]:
    """The environment of every Ray process `chunkserve up` starts: where the index lives, the HTTP proxy's
    `ProxyGuard` (clean 503s and SSE error events when an ingress replica dies or the app is being replaced),
    unless the user gave the proxy a middleware callback of their own, `SERVE_LOOP_ENV`, `CONTROLLER_ENV`, and with
    ``front="haproxy"`` `haproxy_env`; a value of those already in the environment wins."""
    from chunkserve.router.proxy_guard import CALLBACK_ENV, CALLBACK_PATH

    defaults = {**SERVE_LOOP_ENV, **CONTROLLER_ENV, **(haproxy_env() if front == "haproxy" else {}), CALLBACK_ENV: CALLBACK_PATH}
    return {**{k: os.environ.get(k) or v for k, v in defaults.items()}, "CHUNKSERVE_REDIS_URL": redis_url}


def start(cfg: AppConfig, opts: LaunchOptions) -> None:
    """Starts Ray and Serve and deploys the app ``cfg`` (whose ``redis_url`` must be set: see `redis_for`)."""
    import ray
    from ray import serve
    from ray.serve.config import gRPCOptions

    from chunkserve.cluster.drain import clear_draining
    from chunkserve.router.app import APP_NAME, GRPC_SERVICER, build_app

    if not cfg.redis_url:
        raise ValueError("start() needs cfg.redis_url (launch() starts a Redis server when it is None)")
    init: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False,
                            "runtime_env": {"env_vars": {**ray_env_vars(cfg.redis_url, opts.front), **opts.env_vars,
                                                         "CHUNKSERVE_REDIS_URL": cfg.redis_url}}}
    if opts.address:
        init["address"] = opts.address
    elif opts.num_cpus:
        init["num_cpus"] = opts.num_cpus
    ray.init(**init)
    serve.start(proxy_location=opts.proxy_location, http_options={"host": opts.host, "port": opts.http_port},
                grpc_options=gRPCOptions(port=opts.grpc_port, grpc_servicer_functions=[GRPC_SERVICER]))
    clear_draining(cfg.redis_url, cfg.namespace)  # one left by an earlier deployment on a shared Redis
    serve.run(build_app(cfg), name=APP_NAME, route_prefix="/", blocking=False)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args = parse_args(argv)
    try:
        cfg = app_config(args)
    except (ValueError, OSError) as e:  # pydantic's ValidationError is a ValueError; names the bad field
        print(f"chunkserve up: invalid configuration: {e}", file=sys.stderr)
        return 2
    return launch(cfg, launch_options(args))


def launch(cfg: AppConfig, opts: LaunchOptions | None = None) -> int:
    """`chunkserve up` for an `AppConfig`: Redis (unless ``cfg.redis_url``), Ray, Serve and the app, until
    Ctrl-C / SIGTERM (or ``opts.exit_after``), then the drain and the shutdown. -> the exit status."""
    opts = opts or LaunchOptions()
    stop = threading.Event()

    def on_signal(*_: Any) -> None:
        if stop.is_set():  # a second Ctrl-C: no more waiting
            raise KeyboardInterrupt
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    if opts.address and not cfg.redis_url:
        logger.warning("--address without --redis-url: the Redis started here listens on 127.0.0.1 only, so "
                       "workers on other machines cannot publish to the prefix index (routing then falls back to "
                       "rendezvous + load); pass --redis-url redis://<reachable host>:<port>/0 for a multi-machine cluster")
    with redis_for(cfg.redis_url) as redis_url:
        try:
            t0 = time.perf_counter()
            cfg = cfg.model_copy(update={"redis_url": redis_url})
            start(cfg, opts)
            for sig in (signal.SIGINT, signal.SIGTERM):  # ray.init installs its own handlers: take them back
                signal.signal(sig, on_signal)
            mode = f"tenants from {cfg.tenants}" if cfg.tenants else "open mode (single tenant 'public')"
            print(f"chunkserve is up in {time.perf_counter() - t0:.0f} s ({mode})\n"
                  f"  HTTP (OpenAI API): http://{opts.host}:{opts.http_port}/v1\n"
                  f"  gRPC (chunkserve.v1.ChunkServe): {opts.host}:{opts.grpc_port}\n"
                  f"  front: {'HAProxy before the ingress replicas' if opts.front == 'haproxy' else 'Ray Serve proxy'}\n"
                  f"  metrics: http://{opts.host}:{opts.http_port}/metrics\n"
                  f"  Redis prefix index: {redis_url}\n"
                  f"  {describe_threads(cfg)}\n"
                  f"Ctrl-C to stop.", flush=True)
            deadline = None if opts.exit_after is None else time.monotonic() + opts.exit_after
            while not stop.wait(0.5):
                if deadline is not None and time.monotonic() > deadline:
                    break
            drain(cfg.drain_grace_s, redis_url, cfg.namespace)
        finally:
            shutdown(joined=bool(opts.address))
    print("chunkserve stopped.", flush=True)
    return 0


def drain(grace_s: float, redis_url: str | None = None, namespace: str = DEFAULT_NAMESPACE) -> None:
    """Sets the cluster's drain flag (`chunkserve.cluster.drain`: every ingress answers new requests 503 +
    Retry-After from then on), waits `DRAIN_ANNOUNCE_S` so that each ingress has read it and the requests
    admitted just before have reached their worker, then deletes the app while the proxies stay up: each
    replica stops once its running requests are done or ``grace_s`` has passed (its graceful_shutdown_timeout_s)."""
    from ray import serve

    from chunkserve.cluster.drain import mark_draining
    from chunkserve.router.app import APP_NAME

    t0 = time.monotonic()
    flagged = redis_url is not None and mark_draining(redis_url, namespace, ttl_s=grace_s + 60.0)
    print(f"draining: finishing the running requests (at most {grace_s:.0f} s; Ctrl-C again to stop now)",
          flush=True)
    try:
        if flagged:
            time.sleep(DRAIN_ANNOUNCE_S)
        serve.delete(APP_NAME, _blocking=True)
    except Exception as e:  # shutting down must go on
        logger.warning("drain: %s", e)
    print(f"drained in {time.monotonic() - t0:.1f} s", flush=True)


def shutdown(joined: bool = False) -> None:
    """Stops Serve and disconnects from Ray (stopping the Ray started here). ``joined`` (`--address`: a cluster
    that others share): only chunkserve's app is deleted; Serve and the other apps keep running."""
    import ray
    from ray import serve

    try:
        if ray.is_initialized():
            if joined:
                from chunkserve.router.app import APP_NAME

                serve.delete(APP_NAME, _blocking=True)
            else:
                serve.shutdown()
    except Exception as e:  # shutting down must go on
        logger.warning("serve shutdown: %s", e)
    finally:
        if ray.is_initialized():
            ray.shutdown()
