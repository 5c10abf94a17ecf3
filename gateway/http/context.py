"""What every route needs, built once per process by the server's lifespan (gateway/http/server.py):
the jobs layer's parts (`JobContext`) and what only the HTTP side uses."""

from dataclasses import dataclass, field
from typing import Annotated

import redis.asyncio as aioredis
from fastapi import Depends, Request

from gateway.http.dashboard import Dashboard
from gateway.jobs.context import JobContext


@dataclass(kw_only=True)
class GatewayContext(JobContext):
    dashboard: Dashboard = field(default_factory=Dashboard)
    batch_queue: aioredis.Redis | None = (
        None  # arq's Redis (`batch_redis_url`); None: `redis` itself
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        self.batch_queue = self.batch_queue or self.redis


def get_context(request: Request) -> GatewayContext:
    return request.app.state.ctx


Ctx = Annotated[GatewayContext, Depends(get_context)]
