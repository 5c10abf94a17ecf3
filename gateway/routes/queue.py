"""`GET /v1/queue`: per model, jobs queued by priority class, jobs running, live replicas and
how long the oldest queued job has waited."""

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from gateway import queue
from gateway.context import Ctx

router = APIRouter()


@router.get("/v1/queue")
async def queue_summary(ctx: Ctx) -> JSONResponse:
    return JSONResponse({"object": "list", "data": await queue.summary(ctx)})
