"""``/dashboard``: the cluster's prefix forests, hit rate, per-tenant tokens, routing accuracy and KV usage.

One page (``router/static/``: HTML, JS and CSS shipped in the package, no CDN) that polls
``/dashboard/api/state`` every few seconds. The JSON endpoint is authenticated like the API's admin
surfaces: with a tenants file only an admin key (``admin_api_key_sha256``) is accepted (a tenant's own key
gets 403, an unknown key 401); in open mode only clients on this host (loopback) are served. It shows cache
scopes, tenant ids, sizes and counts; never token ids or prompt text (the workers' summaries hold none).

Sources: behind Ray the workers' stats snapshots and forest summaries from Redis (`cluster/stats.py`, one
registry read and one pipelined GET each, cached by the reader); with an in-process engine its own stats
and summary (worker ``local``). The cluster hit rate over time is sampled here, at most once a second per
ingress replica, into a bounded history (the page merges the histories of the replicas it reaches);
per-tenant tokens are summed over the workers' snapshots (in-process: the ingress's own counts).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from importlib import resources
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from chunkserve.router.openai_api import error_body
from chunkserve.router.server_metrics import aggregate_routing
from chunkserve.router.tenants import AuthError, one_authorization

if TYPE_CHECKING:
    from chunkserve.router.ingress import Ingress

logger = logging.getLogger(__name__)

REFRESH_S = 3.0
HISTORY_POINTS = 600
_STATIC = {"dashboard.js": "text/javascript", "dashboard.css": "text/css"}
_LOCAL_HOSTS = {"127.0.0.1", "::1", "localhost"}
_WORKER_FIELDS = ("kv_cache_usage_perc", "kv_chunks_used", "kv_chunks_cached", "kv_chunks_total",
                  "num_requests_running", "num_requests_waiting", "prompt_tokens_total", "prefix_cached_tokens")


def _static(name: str) -> bytes:
    return resources.files("chunkserve.router").joinpath("static", name).read_bytes()


class DashboardState:
    """The hit-rate history of one ingress replica: (time, prompt tokens, cached tokens) samples."""

    def __init__(self, min_interval_s: float = 1.0, max_points: int = HISTORY_POINTS) -> None:
        self.min_interval_s = min_interval_s
        self.samples: deque[tuple[float, float, float]] = deque(maxlen=max_points)

    def sample(self, now: float, queries: float, hits: float) -> None:
        if not self.samples or now - self.samples[-1][0] >= self.min_interval_s:
            self.samples.append((now, queries, hits))

    def points(self) -> list[dict[str, float | None]]:
        """Per sample: the cumulative hit rate and the rate since the previous sample (None: no traffic)."""
        out: list[dict[str, float | None]] = []
        prev = None
        for t, q, h in self.samples:
            interval = None
            if prev is not None and q > prev[1]:
                interval = max(0.0, h - prev[2]) / (q - prev[1])
            out.append({"t": round(t, 3), "cumulative": h / q if q > 0 else None, "interval": interval})
            prev = (t, q, h)
        return out


def scope_labels(ingress: Ingress) -> dict[str, str]:
    """Cache salt (as text) -> ``private:<tenant>`` or ``shared:<group>``."""
    out: dict[str, str] = {}
    for t in ingress.tenants.tenants.values():
        out[t.cache_salt.decode("utf-8", "replace")] = (t.cache_scope if t.cache_scope != "private"
                                                        else f"private:{t.id}")
    return out


def _label_forest(summary: dict[str, Any] | None, labels: dict[str, str]) -> dict[str, Any] | None:
    if not isinstance(summary, dict):
        return None
    scopes = []
    for s in summary.get("scopes", []):
        if isinstance(s, dict):
            scopes.append({**s, "scope": labels.get(str(s.get("scope")), "unknown")})
    return {**summary, "scopes": scopes}


class DashboardAuthError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def check_access(ingress: Ingress, request: Request) -> None:
    """Admin key with a tenants file; loopback clients only in open mode. Raises DashboardAuthError."""
    tenants = ingress.tenants
    if tenants.open_mode:
        host = request.client.host if request.client is not None else ""
        if host not in _LOCAL_HOSTS:
            raise DashboardAuthError(403, "open mode: the dashboard is served to local clients only")
        return
    try:
        header = one_authorization(request.headers.getlist("authorization"))
    except AuthError as e:
        raise DashboardAuthError(401, str(e)) from None
    if tenants.is_admin(header):
        return
    try:
        ingress.tenants.authenticate_header(header)
    except Exception:
        raise DashboardAuthError(401, "the dashboard needs an admin API key") from None
    raise DashboardAuthError(403, "this key belongs to a tenant; the dashboard needs an admin API key")


async def _sources(ingress: Ingress) -> tuple[list[dict[str, Any]] | None, dict[str, Any]]:
    """(worker stats snapshots or None when Redis did not answer, worker id -> forest summary)."""
    reader = ingress.cluster_stats
    if reader is not None:
        snaps, forests = await asyncio.gather(reader.snapshots(), reader.forests())
        return snaps, forests or {}
    stats = await ingress.engine_stats()
    if stats is None:
        return [], {}
    engine = getattr(ingress.engine, "engine", None)
    forest = None
    if engine is not None and hasattr(engine, "forest_summary"):
        forest = await engine.forest_summary()
    return [{**stats, "worker_id": "local"}], ({"local": forest} if forest else {})


def _tenant_tokens(ingress: Ingress, snaps: list[dict[str, Any]] | None) -> dict[str, dict[str, int]]:
    """Per tenant: requests, cached, prefilled and decoded tokens, summed over the workers' snapshots (behind
    Ray), else this ingress's own counts (an in-process engine)."""
    keys = ("requests", "cached", "prefilled", "decoded")
    out: dict[str, dict[str, int]] = {}
    if ingress.cluster_stats is not None:
        for s in snaps or []:
            for t, v in (s.get("tenants") or {}).items():
                if isinstance(v, dict):
                    a = out.setdefault(str(t), dict.fromkeys(keys, 0))
                    for k in keys:
                        a[k] += v.get(k, 0) if isinstance(v.get(k), int) else 0
        return out
    for t, v in ingress.metrics.tenant_tokens.items():
        out[t] = {"requests": v["requests"], "cached": v["cached"],
                  "prefilled": max(0, v["prompt"] - v["cached"]), "decoded": v["generated"]}
    return out


async def dashboard_state(ingress: Ingress, state: DashboardState) -> dict[str, Any]:
    """The JSON the page draws."""
    snaps, forests = await _sources(ingress)
    labels = scope_labels(ingress)
    live = snaps or []
    queries = sum(float(s.get("prompt_tokens_total", 0) or 0) for s in live)
    hits = sum(float(s.get("prefix_cached_tokens", 0) or 0) for s in live)
    state.sample(time.time(), queries, hits)
    workers = []
    for s in sorted(live, key=lambda s: str(s.get("worker_id"))):
        wid = str(s.get("worker_id"))
        w: dict[str, Any] = {"worker_id": wid}
        w.update({k: s[k] for k in _WORKER_FIELDS if isinstance(s.get(k), int | float)})
        w["forest"] = _label_forest(forests.get(wid), labels)
        workers.append(w)
    routing = {r: {k: a[k] for k in ("requests", "correct", "accuracy", "predicted_sum", "reused_sum")}
               for r, a in aggregate_routing(live).items()}
    tenants = [{"tenant": t, **v} for t, v in sorted(_tenant_tokens(ingress, snaps).items())]
    return {"model": ingress.config.model_name, "ts": time.time(), "refresh_s": REFRESH_S,
            "cluster_stats_up": snaps is not None, "workers": workers,
            "hit_rate": {"points": state.points(), "cumulative": hits / queries if queries else None},
            "tenants": tenants, "routing": routing}


def dashboard_router(ingress: Ingress) -> APIRouter:
    """``/dashboard``, its static files and ``/dashboard/api/state``."""
    router = APIRouter()
    state = DashboardState()

    @router.get("/dashboard")
    async def page() -> Response:
        return Response(_static("dashboard.html"), media_type="text/html; charset=utf-8",
                        headers={"Cache-Control": "no-cache"})

    @router.get("/dashboard/static/{name}")
    async def static(name: str) -> Response:
        if name not in _STATIC:
            return JSONResponse(error_body(f"no such file: {name}", "not_found_error"), status_code=404)
        return Response(_static(name), media_type=_STATIC[name], headers={"Cache-Control": "max-age=300"})

    @router.get("/dashboard/api/state")
    async def api_state(request: Request) -> Response:
        try:
            check_access(ingress, request)
        except DashboardAuthError as e:
            kind = "authentication_error" if e.status == 401 else "permission_error"
            return JSONResponse(error_body(str(e), kind), status_code=e.status,
                                headers={"WWW-Authenticate": "Bearer"} if e.status == 401 else None)
        try:
            body = await dashboard_state(ingress, state)
        except Exception:  # the dashboard must never take the server down
            logger.exception("dashboard state failed")
            return JSONResponse(error_body("dashboard state unavailable", "server_error"), status_code=503)
        return JSONResponse(body, headers={"Cache-Control": "no-store"})

    return router
