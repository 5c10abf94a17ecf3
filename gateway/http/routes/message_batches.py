"""Anthropic's Message Batches API: `POST /v1/messages/batches`, `GET` one or the list, `POST
…/{id}/cancel`, `GET …/{id}/results` (JSONL). A message batch is a Cortex batch of `/v1/messages`
lines: its requests become the batch's input file, and the batch worker runs it as it runs
`/v1/batches`. Each caller sees only its own batches (the admin key sees all)."""

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response

from gateway.dialects.protocol.anthropic_batch import MessageBatchCreateParams, MessageBatchList
from gateway.dialects.protocol.openai_batch import TERMINAL, Batch, CreateBatchRequest
from gateway.dialects.render.message_batches import (
    ENDPOINT,
    custom_ids,
    input_lines,
    message_batch,
    results,
)
from gateway.http.auth import CallerDep
from gateway.http.context import Ctx
from gateway.stores.batches import enqueue
from shared.errors import NotFound

router = APIRouter()


async def _batch(ctx: Ctx, batch_id: str, owner: str | None) -> Batch:
    batch = await ctx.batches.get(batch_id, owner)
    if batch.endpoint != ENDPOINT:
        raise NotFound(f"no message batch with id {batch_id!r}", param="message_batch_id")
    return batch


def _view(request: Request, batch: Batch) -> JSONResponse:
    url = str(request.url_for("message_batch_results", message_batch_id=batch.id))
    return JSONResponse(message_batch(batch, url).model_dump())


@router.post("/v1/messages/batches")
async def create_message_batch(
    body: MessageBatchCreateParams, ctx: Ctx, request: Request, caller: CallerDep
) -> JSONResponse:
    content = input_lines([(r.custom_id, r.params) for r in body.requests])
    file = await ctx.files.create(
        content,
        filename="message_batch.jsonl",
        purpose="batch",
        owner=caller.name,
        quota_bytes=ctx.settings.files_max_total_bytes,
    )
    batch = await ctx.batches.create(
        CreateBatchRequest(input_file_id=file.id, endpoint=ENDPOINT, completion_window="24h"),
        owner=caller.name,
        lines=len(body.requests),
    )
    await enqueue(ctx.batch_queue, ctx.keys, batch.id)
    return _view(request, batch)


@router.get("/v1/messages/batches")
async def list_message_batches(
    ctx: Ctx,
    request: Request,
    caller: CallerDep,
    after_id: str | None = None,
    limit: int = Query(20, ge=1, le=1000),
) -> JSONResponse:
    page = await ctx.batches.list(
        after=after_id, limit=limit, owner=caller.owner, endpoint=ENDPOINT
    )
    views = [
        message_batch(b, str(request.url_for("message_batch_results", message_batch_id=b.id)))
        for b in page.data
    ]
    return JSONResponse(
        MessageBatchList(
            data=views, has_more=page.has_more, first_id=page.first_id, last_id=page.last_id
        ).model_dump()
    )


@router.get("/v1/messages/batches/{message_batch_id}")
async def retrieve_message_batch(
    message_batch_id: str, ctx: Ctx, request: Request, caller: CallerDep
) -> JSONResponse:
    return _view(request, await _batch(ctx, message_batch_id, caller.owner))


@router.post("/v1/messages/batches/{message_batch_id}/cancel")
async def cancel_message_batch(
    message_batch_id: str, ctx: Ctx, request: Request, caller: CallerDep
) -> JSONResponse:
    await _batch(ctx, message_batch_id, caller.owner)
    return _view(request, await ctx.batches.cancel(message_batch_id, caller.owner))


@router.get("/v1/messages/batches/{message_batch_id}/results", name="message_batch_results")
async def message_batch_results(message_batch_id: str, ctx: Ctx, caller: CallerDep) -> Response:
    batch = await _batch(ctx, message_batch_id, caller.owner)
    if batch.status not in TERMINAL:
        raise NotFound(
            f"message batch {message_batch_id} has not ended; its results come when it has"
        )
    files = ctx.files
    output = await files.content(batch.output_file_id) if batch.output_file_id else b""
    errors = await files.content(batch.error_file_id) if batch.error_file_id else b""
    lines = results(batch, custom_ids(await files.content(batch.input_file_id)), output, errors)
    return Response(
        b"".join(line.model_dump_json().encode() + b"\n" for line in lines),
        media_type="application/x-jsonl",
    )
