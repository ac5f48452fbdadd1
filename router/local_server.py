"""Serve an ``Ingress`` over HTTP (uvicorn) and gRPC (``grpc.aio``) without Ray, in a background thread.

For tests and single-process use. The ingress (and so its engine) is built inside the server's own event
loop by ``build``, so the engine's step loop and the request handlers share that loop::

    with LocalServer(lambda: Ingress(...)) as srv:
        OpenAI(base_url=srv.http_url + "/v1", api_key="...")
        GrpcClient(srv.grpc_target, api_key="...")
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import logging
import socket
import threading
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import grpc
import uvicorn

from chunkserve.router.engine_client import LocalEngineClient
from chunkserve.router.grpc_service import add_to_grpc_server
from chunkserve.router.ingress import Ingress, IngressConfig
from chunkserve.router.tenants import TenantRegistry, load_tenants

logger = logging.getLogger(__name__)
T = TypeVar("T")


class LocalServer:
    """HTTP + gRPC frontends of one ingress on loopback ports (0 = any free port)."""

    def __init__(self, build: Callable[[], Ingress | Awaitable[Ingress]], host: str = "127.0.0.1",
                 http_port: int = 0, grpc_port: int | None = 0, start_timeout_s: float = 300.0) -> None:
        self._build = build
        self.host = host
        self._http_port = http_port
        self._grpc_port = grpc_port
        self._timeout = start_timeout_s
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._uvicorn: uvicorn.Server | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.ingress: Ingress | None = None
        self.http_port: int = 0
        self.grpc_port: int | None = None

    @property
    def http_url(self) -> str:
        return f"http://{self.host}:{self.http_port}"

    @property
    def grpc_target(self) -> str:
        if self.grpc_port is None:
            raise RuntimeError("gRPC is off for this server")
        return f"{self.host}:{self.grpc_port}"

    def start(self) -> LocalServer:
        self._thread = threading.Thread(target=self._run, name="chunkserve-local-server", daemon=True)
        self._thread.start()
        if not self._ready.wait(self._timeout):
            raise TimeoutError(f"the server did not start within {self._timeout} s")
        if self._error is not None:
            raise RuntimeError("the server failed to start") from self._error
        return self

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 60.0) -> T:
        """Runs a coroutine on the server's loop (e.g. to read the engine's state) and returns its result."""
        if self.loop is None:
            raise RuntimeError("server not running")
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self, timeout: float = 30.0) -> None:
        if self._uvicorn is not None:
            self._uvicorn.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def __enter__(self) -> LocalServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as e:  # reported to start() when it happens before ready
            if not self._ready.is_set():
                self._error = e
                self._ready.set()
            else:
                logger.exception("local server crashed")

    async def _main(self) -> None:
        self.loop = asyncio.get_running_loop()
        built = self._build()
        self.ingress = await built if inspect.isawaitable(built) else built
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self._http_port))
        self.http_port = sock.getsockname()[1]
        config = uvicorn.Config(self.ingress.__serve_build_asgi_app__(), log_level="warning",
                                timeout_graceful_shutdown=2, lifespan="off", backlog=1024)
        self._uvicorn = uvicorn.Server(config)
        grpc_server = None
        if self._grpc_port is not None:
            # as Ray's proxy, gRPC takes large messages and the ingress refuses those over max_body_bytes
            limit = max(64 << 20, 4 * self.ingress.config.max_body_bytes)
            grpc_server = grpc.aio.server(options=[("grpc.max_receive_message_length", limit)])
            add_to_grpc_server(self.ingress, grpc_server)
            self.grpc_port = grpc_server.add_insecure_port(f"{self.host}:{self._grpc_port}")
            await grpc_server.start()
        serve = asyncio.create_task(self._uvicorn.serve(sockets=[sock]))
        while not self._uvicorn.started and not serve.done():
            await asyncio.sleep(0.01)
        self._ready.set()
        try:
            await serve
        finally:
            if grpc_server is not None:
                await grpc_server.stop(grace=1.0)
            close = getattr(self.ingress.engine, "aclose", None)
            if close is not None:
                await close()
            sock.close()


def local_ingress(engine_config: Any = None, tenants: TenantRegistry | None = None,
                  model_name: str = "chunkserve", stream_batching: Any = None, **ingress_options: Any) -> Ingress:
    """An ingress over an in-process ``AsyncEngine`` (``engine_config``: a ``workers.engine.EngineConfig``;
    None = the embedded default model). ``tenants`` None = open mode. Call it inside the serving loop.

    As in a worker replica, the engine's deltas come coalesced (``stream_batching``: a
    ``workers.streaming.StreamBatching`` or its fields; default 50 ms / 16 tokens; ``{"interval_s": 0}``:
    one per token), and an engine config without ``num_threads`` gets ``cpu_budget.engine_threads`` for
    one worker (the cores minus one for the HTTP/gRPC loop, at least 1)."""
    from chunkserve.workers.async_engine import AsyncEngine
    from chunkserve.workers.cpu_budget import available_cpus, engine_threads
    from chunkserve.workers.engine import EngineConfig
    from chunkserve.workers.streaming import StreamBatching

    cfg = engine_config or EngineConfig()
    if cfg.num_threads is None and cfg.device == "cpu":
        cfg = dataclasses.replace(cfg, num_threads=engine_threads(available_cpus()))
    engine = AsyncEngine(cfg)
    core = engine.core
    config = IngressConfig(model_name=model_name, max_model_len=core.max_model_len,
                           chunk_size=core.cache.chunk_size, vocab_size=core.model_config.vocab_size,
                           **ingress_options)
    client = LocalEngineClient(engine, StreamBatching.from_options(stream_batching))
    return Ingress(client, engine.tokenizer, tenants or load_tenants(None), config)
