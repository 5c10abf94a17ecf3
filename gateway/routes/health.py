"""`GET /health`: 200 while Redis answers PING, 503 otherwise."""

import asyncio

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from redis.exceptions import RedisError

from gateway.context import Ctx

router = APIRouter()

PING_TIMEOUT_S = 2.0


@router.get("/health")
async def health(ctx: Ctx) -> JSONResponse:
    try:
        async with asyncio.timeout(PING_TIMEOUT_S):
            await ctx.redis.ping()
    except (RedisError, OSError, TimeoutError) as exc:
        return JSONResponse({"status": "unavailable", "redis": str(exc) or "no answer to PING"}, status_code=503)
    return JSONResponse({"status": "ok"})
