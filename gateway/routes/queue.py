"""`GET /v1/queue`: per model, jobs queued by priority class, jobs running, live replicas and
how long the oldest queued job has waited."""

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from gateway.context import Ctx

router = APIRouter()


@router.get("/v1/queue")
async def queue_summary(ctx: Ctx) -> JSONResponse:
    nodes = await ctx.fleet.live_nodes()
    found = await ctx.fleet.queues(set(ctx.catalog.profiles) | {m for node in nodes for m in node.models}, nodes)
    return JSONResponse({"object": "list", "data": [q.model_dump() for q in found]})
