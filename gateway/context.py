"""What every route needs, built once per process by the server's lifespan."""

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated

import redis.asyncio as aioredis
from fastapi import Depends, Request

from gateway.dashboard import Dashboard
from gateway.detach import Departures
from gateway.events import EventRouter
from gateway.limits import Limiter
from gateway.metrics import Metrics
from gateway.outage import OutageWait
from shared.api_keys import KeyStore
from shared.catalog import Catalog
from shared.fleet import Fleet
from shared.keys import Keys
from shared.settings import GatewaySettings

if TYPE_CHECKING:
    from gateway.placement import Placer
    from gateway.routing import Routing


@dataclass
class GatewayContext:
    settings: GatewaySettings
    keys: Keys
    redis: aioredis.Redis  # commands (XADD, PUBLISH, heartbeats); pub/sub lives in `router`
    catalog: Catalog
    router: EventRouter
    fleet: Fleet
    metrics: Metrics = field(default_factory=Metrics)
    dashboard: Dashboard = field(default_factory=Dashboard)
    placer: "Placer" = None  # set right after construction: it needs the context
    batch_queue: aioredis.Redis | None = (
        None  # arq's Redis (`batch_redis_url`); None: `redis` itself
    )
    api_keys: KeyStore = field(init=False)
    limiter: Limiter = field(init=False)
    departures: "Departures" = field(init=False)
    routing: "Routing" = field(init=False)
    outage: OutageWait = field(init=False)

    def __post_init__(self) -> None:
        from gateway.placement import Placer
        from gateway.routing import Routing

        self.placer = Placer(self)
        self.batch_queue = self.batch_queue or self.redis
        self.routing = Routing(self)
        self.api_keys = KeyStore(self.redis, self.keys)
        self.limiter = Limiter(self.redis, self.keys, self.metrics)
        self.departures = Departures(self)
        self.outage = OutageWait(
            self.redis, self.settings.redis_outage_wait_s, self.settings.redis_outage_max_waiting
        )


def get_context(request: Request) -> GatewayContext:
    return request.app.state.ctx


Ctx = Annotated[GatewayContext, Depends(get_context)]
