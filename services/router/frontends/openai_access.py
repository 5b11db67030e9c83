"""The OpenAI-compatible door's gate and what it shows besides the API: the API-key check (services.kit.auth; a
refusal is 401, which the door's error middleware turns into OpenAI's error JSON, with a `WWW-Authenticate`
challenge as RFC 6750 has it) and the router's Prometheus metrics at GET /metrics (the registry its --metrics-port
serves, in the same exposition formats)."""
from __future__ import annotations

from typing import Awaitable, Callable

from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

from services.kit.auth import MISSING, ApiKeys, presented_key

OPEN_PATHS = frozenset({"/health", "/health/live", "/metrics"})  # probes and scrapers: a key only if asked
_REALM = 'Bearer realm="disagg"'
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def require_api_key(keys: ApiKeys) -> Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]:
    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        if keys.guards(is_health=request.path in OPEN_PATHS):
            refusal = keys.refusal(presented_key(request.headers.get("Authorization")))
            if refusal is not None:
                challenge = _REALM if refusal == MISSING else f'{_REALM}, error="invalid_token"'
                raise web.HTTPUnauthorized(text=refusal, headers={"WWW-Authenticate": challenge})
        return await handler(request)

    return check


def metrics_handler(registry: CollectorRegistry) -> Handler:
    """The text format, or OpenMetrics where the scraper's Accept asks for it, as prometheus_client's server does."""
    async def metrics(request: web.Request) -> web.Response:
        encode, content_type = choose_encoder(request.headers.get("Accept", ""))
        return web.Response(body=encode(registry), headers={"Content-Type": content_type})

    return metrics
