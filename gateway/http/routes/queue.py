"""`GET /v1/queue`: per model the caller's key may use, jobs queued by priority class, jobs running,
live replicas and how long the oldest queued job has waited."""

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from gateway.http.auth import CallerDep
from gateway.http.context import Ctx

router = APIRouter()


@router.get("/v1/queue")
async def queue_summary(ctx: Ctx, caller: CallerDep) -> JSONResponse:
    nodes = await ctx.fleet.live_nodes(fresh=True)
    models = set(ctx.catalog.profiles) | {m for node in nodes for m in node.models}
    found = await ctx.fleet.queues(
        {m for m in models if caller.may_use(ctx.catalog.names(m))}, nodes
    )
    return JSONResponse({"object": "list", "data": [q.model_dump() for q in found]})
