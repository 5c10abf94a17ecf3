"""`/v1/batches`: create, retrieve, list (newest first, `after` + `limit` paging) and cancel.
The batch worker (`cortex batch-worker`) does the work; these routes only read and write the
batch objects in Redis."""

from fastapi import APIRouter, Query
from fastapi.responses import JSONResponse

from gateway.batch.store import BatchStore
from gateway.batch.worker import enqueue
from gateway.context import Ctx
from gateway.files import FileStore
from gateway.protocol.openai_batch import CreateBatchRequest
from shared.errors import InvalidRequest

router = APIRouter()


@router.post("/v1/batches")
async def create_batch(body: CreateBatchRequest, ctx: Ctx) -> JSONResponse:
    input_file = await FileStore(ctx.redis, ctx.keys).get(body.input_file_id)
    if input_file.purpose != "batch":
        raise InvalidRequest(f"file {input_file.id} has purpose {input_file.purpose!r}, not 'batch'", param="input_file_id")
    batch = await BatchStore(ctx.redis, ctx.keys).create(body)
    await enqueue(ctx.redis, ctx.keys, batch.id)
    return JSONResponse(batch.model_dump())


@router.get("/v1/batches")
async def list_batches(ctx: Ctx, after: str | None = None, limit: int = Query(20, ge=1, le=100)) -> JSONResponse:
    return JSONResponse((await BatchStore(ctx.redis, ctx.keys).list(after=after, limit=limit)).model_dump())


@router.get("/v1/batches/{batch_id}")
async def retrieve_batch(batch_id: str, ctx: Ctx) -> JSONResponse:
    return JSONResponse((await BatchStore(ctx.redis, ctx.keys).get(batch_id)).model_dump())


@router.post("/v1/batches/{batch_id}/cancel")
async def cancel_batch(batch_id: str, ctx: Ctx) -> JSONResponse:
    """Stops new lines; lines already running finish; the output holds what finished."""
    store = BatchStore(ctx.redis, ctx.keys)
    had = await store.transition(batch_id, "cancelling", from_=("validating", "in_progress"), stamp="cancelling_at")
    if had not in ("validating", "in_progress", "cancelling", "cancelled"):
        raise InvalidRequest(f"batch {batch_id} is {had}; it can no longer be cancelled", param="batch_id")
    return JSONResponse((await store.get(batch_id)).model_dump())
