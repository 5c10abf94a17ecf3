"""What the jobs layer is handed: the parts a job uses from its submission to its end. Whoever
runs jobs assembles it once: the server (gateway/http/server.py, whose `GatewayContext` is this
plus what only the HTTP side needs) or a batch worker (gateway/batch/worker.py). The fleet's
parts (placement, routing) are built here from what they read, so that every process builds
them the same way."""

from dataclasses import dataclass, field

import redis.asyncio as aioredis

from gateway.bus.outage import OutageWait
from gateway.bus.router import EventRouter
from gateway.fleet.placement import Placer
from gateway.fleet.routing import Routing
from gateway.jobs.departures import Departures
from gateway.jobs.limits import Limiter
from gateway.metrics import Metrics
from gateway.stores.batches import BatchStore
from gateway.stores.files import FileStore
from gateway.stores.responses import ResponseStore
from shared.api_keys import KeyStore
from shared.catalog import Catalog
from shared.fleet import Fleet
from shared.keys import Keys
from shared.settings import GatewaySettings


@dataclass(kw_only=True)
class JobContext:
    settings: GatewaySettings
    keys: Keys
    redis: aioredis.Redis  # commands (XADD, PUBLISH, Lua); pub/sub lives in `bus`
    catalog: Catalog
    fleet: Fleet
    bus: EventRouter  # the job events' side of Redis (gateway/bus/)
    metrics: Metrics = field(default_factory=Metrics)
    placer: Placer = field(init=False)  # where a model nobody serves goes
    routing: Routing = field(init=False)  # which node's stream a job goes to
    limiter: Limiter = field(init=False)
    departures: Departures = field(init=False)
    outage: OutageWait = field(init=False)
    files: FileStore = field(init=False)  # what users stored (gateway/stores/)
    batches: BatchStore = field(init=False)
    responses: ResponseStore = field(init=False)
    api_keys: KeyStore = field(init=False)

    def __post_init__(self) -> None:
        parts = self.redis, self.keys, self.settings
        self.placer = Placer(*parts, self.catalog, self.fleet)
        self.routing = Routing(*parts, self.fleet)
        self.limiter = Limiter(self.redis, self.keys, self.metrics)
        self.departures = Departures(*parts)
        self.outage = OutageWait(
            self.redis, self.settings.redis_outage_wait_s, self.settings.redis_outage_max_waiting
        )
        self.files = FileStore(self.redis, self.keys)
        self.batches = BatchStore(self.redis, self.keys)
        self.responses = ResponseStore(self.redis, self.keys, self.settings.responses_ttl_s)
        self.api_keys = KeyStore(self.redis, self.keys)
