"""The gateway process: `create_app` builds the FastAPI app, `run` serves it under uvicorn."""

import asyncio
import logging
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial

import redis.asyncio as aioredis
import uvicorn
from fastapi import FastAPI
from uvicorn.main import STARTUP_FAILURE

from gateway.bus.links import pubsub_client
from gateway.bus.router import EventRouter
from gateway.fleet.janitor import Janitor
from gateway.http import errors, openapi, routes
from gateway.http.auth import warn_if_exposed
from gateway.http.body_limit import BodyLimitMiddleware
from gateway.http.context import GatewayContext
from gateway.http.json_body import JsonBodyMiddleware
from gateway.http.middleware import (
    REQUEST_ID_HEADER,
    SESSION_HEADER,
    HeaderVarMiddleware,
    TracingMiddleware,
    latin1,
    request_id,
    session,
)
from gateway.jobs import background, queue
from gateway.jobs.submit import session_header_var
from gateway.tracing import TraceLogFormatter, request_id_var
from shared import __version__, systemd_notify, tracing
from shared.catalog import Catalog
from shared.fleet import Fleet
from shared.fleet_view import FleetView
from shared.keys import Keys
from shared.redis_conn import atomic, connect, redact
from shared.redis_health import warn_if_not_durable
from shared.settings import GatewaySettings

log = logging.getLogger(__name__)

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"
GRACEFUL_SHUTDOWN_S = 5.0  # open streams get this long to finish on SIGTERM/SIGINT


async def publish_catalog(redis: aioredis.Redis, keys: Keys, catalog: Catalog) -> None:
    """`cortex:catalog`: model id → profile JSON, replaced as a whole (one transaction on one Redis)."""
    async with atomic(redis) as pipe:
        pipe.delete(keys.catalog())
        pipe.hset(
            keys.catalog(),
            mapping={id_: p.model_dump_json() for id_, p in catalog.profiles.items()},
        )
        await pipe.execute()


def create_app(
    settings: GatewaySettings, *, redis_factory: Callable[[], aioredis.Redis] | None = None
) -> FastAPI:
    """`redis_factory` (for tests) makes every Redis client; by default commands go through a
    client that retries with backoff and pub/sub through one that reports every failure."""
    catalog = Catalog.load(settings.models_file)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        keys = settings.keys
        redis = redis_factory() if redis_factory else connect(settings.redis_url)
        bus = EventRouter(
            redis_factory or partial(pubsub_client, settings.redis_url),
            on_connect=partial(
                publish_catalog, redis, keys, catalog
            ),  # again after a Redis restart
            outage_wait_s=settings.redis_outage_wait_s,
        )
        queue_url = settings.batch_queue_url  # refuses a cluster: arq needs one Redis
        batch_queue = (
            connect(queue_url) if queue_url != settings.redis_url and not redis_factory else None
        )
        view = FleetView(redis, keys, settings.node_ttl_s)  # no request reads the whole fleet
        app.state.ctx = ctx = GatewayContext(
            settings=settings,
            keys=keys,
            redis=redis,
            catalog=catalog,
            fleet=Fleet(redis, keys, settings.node_ttl_s, view=view),
            bus=bus,
            batch_queue=batch_queue,
        )
        janitor = Janitor(ctx.placer, sweeps=[partial(background.settle_ended, ctx)])
        await bus.start()
        await view.start()
        janitor.start()
        warm_up = asyncio.create_task(ctx.placer.warm_up(), name="estimate-memory")
        metrics = asyncio.create_task(
            ctx.metrics.refresh_forever(ctx.fleet, set(catalog.profiles), ctx.dashboard.sample),
            name="metrics",
        )
        log.info(
            "gateway %s serving %s on Redis %s",
            __version__,
            ", ".join(catalog.profiles),
            redact(settings.redis_url),
        )
        await warn_if_exposed(ctx)
        await warn_if_not_durable(redis, log)
        try:
            yield
        finally:
            warm_up.cancel()
            metrics.cancel()
            ctx.outage.stop()
            await janitor.stop()
            await view.stop()
            await ctx.departures.stop()
            await bus.stop()
            await redis.aclose()
            if batch_queue is not None:
                await batch_queue.aclose()

    app = FastAPI(title="Cortex gateway", version=__version__, lifespan=lifespan)
    app.add_middleware(
        JsonBodyMiddleware
    )  # inside BodyLimitMiddleware: it reads only what that one let through
    app.add_middleware(
        BodyLimitMiddleware,
        max_bytes=settings.max_request_bytes,
        files_max_bytes=settings.files_max_bytes,
    )
    app.add_middleware(
        HeaderVarMiddleware, header=SESSION_HEADER, var=session_header_var, value=session
    )
    app.add_middleware(
        HeaderVarMiddleware, header=queue.TIMEOUT_HEADER, var=queue.timeout_header_var, value=latin1
    )
    app.add_middleware(TracingMiddleware)  # inside the request id's: its span names the request id
    app.add_middleware(
        HeaderVarMiddleware,
        header=REQUEST_ID_HEADER,
        var=request_id_var,
        value=request_id,
        echo=True,
    )
    errors.install(app)
    app.openapi = partial(openapi.document, app)
    app.include_router(routes.router)
    return app


class QuietHealth(logging.Filter):
    """uvicorn logs every request; a load balancer's or compose's healthcheck polling `/health` every
    few seconds would fill the log with nothing. A healthy answer is dropped; a 503 is kept."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        return not (len(args) == 5 and args[2] == "/health" and args[4] == 200)


def setup_logging(level: str) -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(TraceLogFormatter(LOG_FORMAT))
    logging.basicConfig(level=level.upper(), handlers=[handler])
    logging.getLogger("uvicorn.access").addFilter(QuietHealth())


class Server(uvicorn.Server):
    """uvicorn's server, which tells systemd (a `Type=notify` unit) it is ready once its socket
    listens: after the app's start-up, so that a unit ordered after it finds the port open."""

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started:
            config = self.config
            systemd_notify.ready(f"serving on {config.host}:{config.port}")


def run(settings: GatewaySettings) -> None:
    """Serve the gateway in the foreground until SIGINT/SIGTERM."""
    setup_logging(settings.log_level)
    tracing.configure(
        "cortex-gateway", settings.otlp_endpoint, instance=f"{settings.host}:{settings.port}"
    )
    config = uvicorn.Config(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        loop="uvloop",
        http="httptools",
        log_level=settings.log_level.lower(),
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
    )
    server = Server(config)
    server.run()
    if not server.started:  # as uvicorn.run: the app's start-up failed, or the port was taken
        sys.exit(STARTUP_FAILURE)
