"""The Ray Serve application: an ingress deployment (HTTP + gRPC) in front of prefix-routed workers.

    serve run deploy/local.yaml                      # import_path: chunkserve.router.app:app_builder
    chunkserve up --workers 2                        # the same app, with Ray and Redis started for you

`AppConfig` (Pydantic, extra="forbid") holds every option; `build_app(cfg)` returns the bound
application; `app_builder(args)` is the `serve run` / `serve deploy` entry point.

The ingress replica needs a tokenizer, never the model: importing this module and starting `ServeIngress`
load neither torch nor the engine (the tokenizer is read with `tokenizers` through transformers'
`PreTrainedTokenizerFast`; the embedded checkpoint is located, and converted on first use, in a child
process). Engine threads: unless ``engine.num_threads`` is set, each CPU worker takes
``max(1, (cores of its node - reserved_cpus) // workers_per_node)`` (`workers.cpu_budget.engine_threads`).
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from chunkserve import env
from chunkserve.cluster.events import DEFAULT_MAX_DEPTH
from chunkserve.cluster.reader import ReaderConfig
from chunkserve.heap import freeze_startup_heap
from chunkserve.router.engine_client import HandleEngineClient
from chunkserve.router.ingress import Ingress, IngressConfig
from chunkserve.router.policy import PolicyConfig
from chunkserve.router.tenants import load_tenants
from chunkserve.workers.engine_config import EngineConfig

GRPC_SERVICER = "chunkserve.router.grpc_service.add_servicer_raw"  # raw bytes: size checked before parsing
APP_NAME = "chunkserve"


class RouterConfig(BaseModel):
    """`PrefixAwareRouter`'s options (its ``request_router_kwargs``, less the Redis URL and namespace, which are
    `AppConfig` fields shared with the workers and the ingress)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_chunks: int = Field(DEFAULT_MAX_DEPTH, ge=1)  # leading chunk hashes looked up per request
    policy: PolicyConfig = Field(default_factory=PolicyConfig)  # spill / load-cost knobs (router/policy.py)
    reader: ReaderConfig = Field(default_factory=ReaderConfig)  # index-read cache and wait (cluster/reader.py)
    enable_metrics: bool = True  # the router's Ray Serve metrics
    cluster_mode: bool = False  # per-worker lookups on a standalone Redis too (automatic with redis+cluster://)
    predictions: bool = True  # send the routing prediction with each request (scored by the worker)
    cold_claims: bool = True  # place new prefixes through shared claims in Redis (cluster/claims.py)

    def kwargs(self) -> dict[str, Any]:
        """The router's ``initialize_state`` keyword arguments (plain data: they cross to Serve's controller)."""
        return {"max_chunks": self.max_chunks, "policy": dataclasses.asdict(self.policy),
                "reader": dataclasses.asdict(self.reader), "enable_metrics": self.enable_metrics,
                "cluster_mode": self.cluster_mode, "predictions": self.predictions,
                "cold_claims": self.cold_claims}


class AppConfig(BaseModel):
    """Options of the served application (engine options go to every worker replica)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str | None = Field(None, description="None: the embedded SmolLM2; a local HF dir; random:<preset>")
    model_name: str = "smollm2-135m-instruct"
    workers: int = Field(2, ge=1)
    autoscaling: dict[str, Any] | None = None  # Ray Serve autoscaling_config for the workers
    worker_num_cpus: float = 0.0
    worker_num_gpus: float = 0.0
    # Custom Ray resources per worker replica, e.g. {"worker_slot": 1} with one slot per node to spread the
    # workers over nodes, or {"node_a": 1} to pin them (the nodes declare them: `ray start --resources`).
    worker_resources: dict[str, float] | None = None
    # Import path of the workers' RequestRouter; None: Ray Serve's default (power of two choices).
    request_router: str | None = "chunkserve.router.request_router.PrefixAwareRouter"
    # Two ingress replicas: while one restarts, the proxies send new requests to the other.
    ingress_replicas: int = Field(2, ge=1)
    # Drain: a replica being stopped (shutdown, `serve deploy` replacing it) takes no new requests and lets
    # its running ones finish for up to this long (Serve's graceful_shutdown_timeout_s, ingress and workers).
    drain_grace_s: float = Field(30.0, ge=0.0)
    max_failovers: int = Field(2, ge=0)  # resends of a request whose worker died (see router/ingress.py)
    stream_write_timeout_s: float | None = Field(60.0, gt=0)  # a stream whose client reads nothing this long ends
    redis_url: str | None = None  # default: $CHUNKSERVE_REDIS_URL
    lease_ttl_s: float = Field(5.0, gt=0.0, allow_inf_nan=False)
    namespace: str = "chunkserve"  # Redis key namespace of the prefix index and worker stats
    tenants: str | None = None  # a tenants YAML; None: open mode with the single tenant "public"
    # The workers' engine (chunk_size, dtype, ...): the ingress takes chunk_size and max_model_len from it too.
    engine: EngineConfig = Field(default_factory=EngineConfig)
    router: RouterConfig = Field(default_factory=RouterConfig)  # PrefixAwareRouter's options
    max_ongoing_requests: int = 64
    # Stream items: a request's tokens leave the worker coalesced, the first at once, then at most one item
    # per interval of up to this many tokens (0 ms: one item per token).
    stream_interval_ms: float = Field(50.0, ge=0.0, le=1000.0)  # Ray Serve LLM's stream batching default
    stream_max_tokens: int = Field(16, ge=1)
    # a worker's stream-item budget: with more streams in flight than this many per second, each stream's
    # interval stretches (up to stream_max_interval_ms); 0 keeps the interval fixed (workers/streaming.py)
    stream_items_per_s: float = Field(40.0, ge=0.0)
    stream_max_interval_ms: float = Field(200.0, ge=0.0, le=1000.0)
    # Engine threads when engine.num_threads is unset: (node cores - reserved_cpus) // workers_per_node, >= 1.
    # workers_per_node None: all workers on one node (`workers`, or the autoscaling max_replicas).
    workers_per_node: int | None = Field(None, ge=1)
    reserved_cpus: int = Field(1, ge=0)
    node_cpus: int | None = Field(None, ge=1)  # cores per node to budget (None: what each worker's node has)
    # A busy worker also takes the threads of the idle workers on its node (workers/node_cores.py), within
    # `cpu_budget.rule_lend_cap` (nothing on a 2-core node, whose reserved core serves the requests). Only with
    # the thread rule above.
    lend_idle_cores: bool = True
    # Tenant limits shared by all ingress replicas through Redis (when a Redis URL is known); False: each
    # ingress replica enforces them for the traffic it sees.
    shared_rate_limits: bool = True

    @model_validator(mode="before")
    @classmethod
    def _one_index_location(cls, data: Any) -> Any:
        """The workers and the ingress use ``redis_url``/``namespace`` too: a router-only value would split them."""
        router = data.get("router") if isinstance(data, dict) else None
        clash = sorted({"redis_url", "namespace"} & set(router)) if isinstance(router, dict) else []
        if clash:
            raise ValueError(f"set {clash} as top-level AppConfig fields, not in router= (the workers publish "
                             f"to the index and the ingress reads their stats there too)")
        return data

    @field_validator("autoscaling")
    @classmethod
    def _known_autoscaling_keys(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        """Ray's AutoscalingConfig ignores keys it does not know (``max_replica`` left a fleet at one worker)."""
        if v is not None:
            from ray.serve.config import AutoscalingConfig

            unknown = sorted(set(v) - set(AutoscalingConfig.model_fields))
            if unknown:
                raise ValueError(f"unknown autoscaling keys {unknown}; Ray Serve's are "
                                 f"{sorted(AutoscalingConfig.model_fields)}")
            AutoscalingConfig(**v)  # its own value checks (min <= max, ...) at load
        return v

    def check_tenants_file(self) -> None:
        """Raises ValueError unless ``tenants`` (when set) is a file that validates: `app_builder` and
        `chunkserve up` call it at load, on the machine that will read it, rather than leaving the failure to
        every ingress replica's constructor. (Not a field validator: a deploy file naming a path of the
        cluster's must validate elsewhere too.)"""
        if self.tenants is not None:
            try:
                load_tenants(self.tenants)
            except (OSError, ValueError) as e:  # pydantic's ValidationError is a ValueError
                raise ValueError(f"tenants file {self.tenants}: {e}") from None

    @model_validator(mode="after")
    def _one_meaning_each(self) -> AppConfig:
        if "workers" in self.model_fields_set and self.autoscaling is not None:
            raise ValueError("set either workers (a fixed count) or autoscaling (its min/max_replicas), not both: "
                             "with autoscaling, workers was ignored")
        if self.model is not None and self.engine.model is not None and self.model != self.engine.model:
            raise ValueError(f"model {self.model!r} and engine.model {self.engine.model!r} differ: the ingress "
                             f"tokenises for one and the workers run the other; set one of them")
        return self

    def resolved_redis_url(self) -> str | None:
        return self.redis_url or env.redis_url()

    def thread_rule(self) -> dict[str, int] | None:
        """The workers' engine-thread rule, or None when the engine config fixes the threads (or GPUs)."""
        if self.engine.num_threads is not None or self.worker_num_gpus:
            return None
        per_node = self.workers_per_node
        if per_node is None:
            per_node = int((self.autoscaling or {}).get("max_replicas", self.workers))
        rule = {"workers_per_node": max(1, per_node), "reserved_cpus": self.reserved_cpus,
                "lend_idle_cores": int(self.lend_idle_cores)}
        if self.node_cpus is not None:
            rule["node_cpus"] = self.node_cpus
        return rule

    def worker_engine(self) -> EngineConfig:
        """The engine config each worker gets: ``engine`` with the app's ``model`` (unless the engine names its
        own) and, for GPU workers, ``device="cuda"`` unless the engine sets a device other than the default."""
        engine = self.engine
        if self.model is not None and engine.model is None:
            engine = dataclasses.replace(engine, model=self.model)
        if self.worker_num_gpus and engine.device == _ENGINE_DEFAULTS["device"]:
            engine = dataclasses.replace(engine, device="cuda")
        return engine


_ENGINE_DEFAULTS: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(EngineConfig)}


def _embedded_checkpoint_dir() -> Path:
    """The embedded model's cached HF checkpoint, found (or converted once) in a child process, so that the
    ingress never imports torch (`workers.weights` does)."""
    code = "from chunkserve.workers.weights import embedded_checkpoint_dir as d; print(d(progress=False))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=1800, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"could not prepare the embedded model: {out.stderr.strip()[-2000:]}")
    return Path(out.stdout.strip().splitlines()[-1])


def _load_tokenizer(path: Path) -> Any:
    """A fast tokenizer from ``tokenizer.json`` without torch; other checkpoints through AutoTokenizer."""
    if (path / "tokenizer.json").is_file():
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(path), local_files_only=True)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def _context_and_vocab(path: Path) -> tuple[int, int]:
    """(max_model_len, vocab_size) from a checkpoint's config.json, as `ModelConfig.max_model_len` reads it."""
    hf = json.loads((path / "config.json").read_text())
    ctx = int(hf["max_position_embeddings"])
    window = hf.get("sliding_window") if hf.get("model_type") == "mistral" else None
    return (min(ctx, int(window)) if window else ctx), int(hf["vocab_size"])


def _model_info(model: str | None) -> tuple[Any, int, int]:
    """(tokenizer, max_model_len, vocab_size) without loading the weights (nor torch)."""
    from chunkserve.workers.config import preset_config

    if model is None or model.lower() == "smollm2-135m-instruct" or model.startswith("random:"):
        ckpt = _embedded_checkpoint_dir()
        tok = _load_tokenizer(ckpt)
        if model and model.startswith("random:"):
            cfg = preset_config(model.removeprefix("random:"))
            return tok, cfg.max_model_len, cfg.vocab_size
        return (tok, *_context_and_vocab(ckpt))
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        raise ValueError(f"model {model!r} is not a local checkpoint directory")
    return (_load_tokenizer(path), *_context_and_vocab(path))


class ServeIngress(Ingress):
    """The ingress as a Serve replica: builds its tokenizer, tenants and worker client at start."""

    def __init__(self, worker_handle: Any, cfg_json: str) -> None:
        cfg = AppConfig.model_validate_json(cfg_json)
        tokenizer, max_len, vocab = _model_info(cfg.worker_engine().model)  # what the workers load
        engine_max = cfg.engine.max_model_len  # the engine's rule: min(engine setting or model's, model's)
        icfg = IngressConfig(model_name=cfg.model_name, max_model_len=min(max_len, engine_max or max_len),
                             chunk_size=cfg.engine.chunk_size, vocab_size=vocab, max_failovers=cfg.max_failovers,
                             stream_write_timeout_s=cfg.stream_write_timeout_s)
        url = cfg.resolved_redis_url()
        tenants = load_tenants(cfg.tenants)
        stats = limiter = None
        if url:
            from chunkserve.cluster.stats import ClusterStatsReader

            stats = ClusterStatsReader(url, cfg.namespace)
            if cfg.shared_rate_limits:
                from chunkserve.router.ratelimit_redis import ClusterRateLimiter

                limiter = ClusterRateLimiter(tenants.tenants, url, cfg.namespace)
        super().__init__(HandleEngineClient(worker_handle), tokenizer, tenants, icfg, cluster_stats=stats,
                         limiter=limiter)
        if url:
            from chunkserve.cluster.drain import DrainFlag

            self.drain_flag = DrainFlag(url, cfg.namespace)
        freeze_startup_heap()  # the tokenizer and the modules: out of every later garbage collection


def build_app(cfg: AppConfig) -> Any:
    """The bound Serve application for ``cfg``."""
    from ray import serve

    from chunkserve.workers.deployment import build_worker_deployment

    redis_url = cfg.resolved_redis_url()
    router_kwargs = {"redis_url": redis_url, "namespace": cfg.namespace, **cfg.router.kwargs()}
    actor_opts: dict[str, Any] = {"num_cpus": cfg.worker_num_cpus}
    if cfg.worker_num_gpus:
        actor_opts["num_gpus"] = cfg.worker_num_gpus
    if cfg.worker_resources:
        actor_opts["resources"] = dict(cfg.worker_resources)
    engine = cfg.worker_engine()
    worker_cls = build_worker_deployment(num_replicas=cfg.workers, ray_actor_options=actor_opts,
                                         router_kwargs=router_kwargs, autoscaling_config=cfg.autoscaling,
                                         max_ongoing_requests=cfg.max_ongoing_requests,
                                         request_router_class=cfg.request_router,
                                         graceful_shutdown_timeout_s=cfg.drain_grace_s)
    batching = {"interval_s": cfg.stream_interval_ms / 1000.0, "max_tokens": cfg.stream_max_tokens,
                "items_per_s": cfg.stream_items_per_s, "max_interval_s": cfg.stream_max_interval_ms / 1000.0}
    worker = worker_cls.bind(engine, redis_url, cfg.lease_ttl_s, cfg.namespace, batching, cfg.thread_rule())
    ingress_cls = serve.deployment(name="Ingress", num_replicas=cfg.ingress_replicas, max_ongoing_requests=2048,
                                   ray_actor_options={"num_cpus": 0}, graceful_shutdown_timeout_s=cfg.drain_grace_s,
                                   graceful_shutdown_wait_loop_s=0.5)(serve.ingress()(ServeIngress))
    return ingress_cls.bind(worker, cfg.model_dump_json())


def app_builder(args: dict[str, Any]) -> Any:
    """`serve run` / `serve deploy` entry point: ``args`` are `AppConfig` fields, validated here, so a misspelt
    or ill-typed field fails the deploy at once with a `pydantic.ValidationError` naming it (e.g. ``engine.chunk_sise``)."""
    args = dict(args or {})
    for key in ("engine", "router", "autoscaling", "worker_resources"):
        if isinstance(args.get(key), str):
            args[key] = json.loads(args[key])
    cfg = AppConfig(**args)
    cfg.check_tenants_file()
    return build_app(cfg)
