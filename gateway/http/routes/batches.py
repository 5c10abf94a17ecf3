"""`/v1/batches`: create, retrieve, list (newest first, `after` + `limit` paging) and cancel; each
caller sees only its own batches (the admin key sees all). The batch worker (`cortex
batch-worker`) does the work; these routes only read and write the batch objects in Redis."""

from fastapi import APIRouter, Query
from fastapi.responses import JSONResponse

from gateway.dialects.protocol.openai_batch import CreateBatchRequest
from gateway.http.auth import CallerDep
from gateway.http.context import Ctx
from gateway.stores.batches import enqueue
from shared.errors import InvalidRequest

router = APIRouter()


@router.post("/v1/batches")
async def create_batch(body: CreateBatchRequest, ctx: Ctx, caller: CallerDep) -> JSONResponse:
    input_file = await ctx.files.get(body.input_file_id, caller.owner)
    if input_file.purpose != "batch":
        raise InvalidRequest(
            f"file {input_file.id} has purpose {input_file.purpose!r}, not 'batch'",
            param="input_file_id",
        )
    batch = await ctx.batches.create(body, owner=caller.name)
    await enqueue(ctx.batch_queue, ctx.keys, batch.id)
    return JSONResponse(batch.model_dump())


@router.get("/v1/batches")
async def list_batches(
    ctx: Ctx, caller: CallerDep, after: str | None = None, limit: int = Query(20, ge=1, le=100)
) -> JSONResponse:
    batches = await ctx.batches.list(after=after, limit=limit, owner=caller.owner)
    return JSONResponse(batches.model_dump())


@router.get("/v1/batches/{batch_id}")
async def retrieve_batch(batch_id: str, ctx: Ctx, caller: CallerDep) -> JSONResponse:
    return JSONResponse((await ctx.batches.get(batch_id, caller.owner)).model_dump())


@router.post("/v1/batches/{batch_id}/cancel")
async def cancel_batch(batch_id: str, ctx: Ctx, caller: CallerDep) -> JSONResponse:
    """Stops new lines; lines already running finish; the output holds what finished."""
    return JSONResponse((await ctx.batches.cancel(batch_id, caller.owner)).model_dump())
