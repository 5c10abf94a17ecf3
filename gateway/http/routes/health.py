"""`GET /health`: 200 while Redis answers PING, 503 otherwise. The body also says how Redis keeps its
data (persistence, eviction policy), its memory used against `maxmemory`, and warns when it would lose
what users store (shared/redis_health.py); a Redis that refuses INFO or CONFIG is still healthy."""

import asyncio

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from redis.exceptions import RedisError

from gateway.http.context import Ctx
from shared.redis_health import inspect

router = APIRouter()

PING_TIMEOUT_S = 2.0


@router.get("/health")
async def health(ctx: Ctx) -> JSONResponse:
    try:
        async with asyncio.timeout(PING_TIMEOUT_S):
            await ctx.redis.ping()
    except (RedisError, OSError, TimeoutError) as exc:
        return JSONResponse(
            {"status": "unavailable", "redis": str(exc) or "no answer to PING"}, status_code=503
        )
    try:
        async with asyncio.timeout(PING_TIMEOUT_S):
            found = await inspect(ctx.redis)
        reading = found.model_dump(exclude={"version"}) | {"persistence": found.persistence}
    except (RedisError, OSError, TimeoutError) as exc:
        reading = {"error": f"could not read INFO and CONFIG: {exc or 'no answer'}"}
    return JSONResponse({"status": "ok", "redis": reading})
