"""`GET /health`: 200 while Redis answers PING, 503 otherwise. For the admin key (or anyone while auth
is off: gateway/http/auth.py `sees_internals`) the body also says how Redis keeps its data
(persistence, eviction policy), its memory used against `maxmemory`, and warns when it would lose
what users store (shared/redis_health.py); a Redis that refuses INFO or CONFIG is still healthy.
Anyone else gets the status alone: Redis's settings and address are the operator's."""

import asyncio

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse
from redis.exceptions import RedisError

from gateway.http.auth import sees_internals
from gateway.http.context import Ctx
from shared.redis_health import inspect

router = APIRouter()

PING_TIMEOUT_S = 2.0


@router.get("/health")
async def health(ctx: Ctx, internals: bool = Depends(sees_internals)) -> JSONResponse:
    try:
        async with asyncio.timeout(PING_TIMEOUT_S):
            await ctx.redis.ping()
    except (RedisError, OSError, TimeoutError) as exc:
        why = (str(exc) or "no answer to PING") if internals else "unavailable"
        return JSONResponse({"status": "unavailable", "redis": why}, status_code=503)
    if not internals:
        return JSONResponse({"status": "ok"})
    try:
        async with asyncio.timeout(PING_TIMEOUT_S):
            found = await inspect(ctx.redis)
        reading = found.model_dump(exclude={"version"}) | {"persistence": found.persistence}
    except (RedisError, OSError, TimeoutError) as exc:
        reading = {"error": f"could not read INFO and CONFIG: {exc or 'no answer'}"}
    return JSONResponse({"status": "ok", "redis": reading})
